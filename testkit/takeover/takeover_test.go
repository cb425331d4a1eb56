// Package takeover measures, on each broker's real server, how long a
// message held by a consumer that was SIGKILLed takes to reach another
// consumer of the same group: the takeover time docs/brokers gives for the
// production settings of each broker.
//
// The test binary is also the holder: the parent runs it again with
// TAKEOVER_ROLE=holder, which subscribes, receives the one message
// published, says so and blocks without acking; the parent kills it with
// SIGKILL, starts a consumer of its own at once and times the message's
// arrival there.
package takeover

import (
	"bufio"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/nats-io/nats.go"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/brokers/natsjetstream"
	"github.com/babelqueue/watermill-idempotency/marshal/amqpmarshal"
	"github.com/babelqueue/watermill-idempotency/testkit/kafkatest"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// The settings docs/brokers recommends, measured here.
const (
	redisMaxIdleTime   = 5 * time.Second
	redisClaimInterval = time.Second
	natsAckWait        = 5 * time.Second
	sqlPollInterval    = 100 * time.Millisecond
)

const group = "bq_takeover"

func TestMain(m *testing.M) {
	if os.Getenv("TAKEOVER_ROLE") == "holder" {
		if err := hold(); err != nil {
			fmt.Fprintln(os.Stderr, "holder:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// broker makes the subscribers and the publisher of one broker from the
// environment (TAKEOVER_* and the usual server addresses), so that the
// holder process makes the same.
type broker struct {
	name string
	// within is the longest takeover the settings allow, with a margin.
	within     time.Duration
	subscriber func(consumer string) (message.Subscriber, error)
	publisher  func() (message.Publisher, error)
}

func brokerNamed(name string, kafkaBrokers []string) (broker, error) {
	switch name {
	case "redis":
		opts, err := redis.ParseURL(testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL))
		if err != nil {
			return broker{}, err
		}
		return broker{name: name, within: redisMaxIdleTime + redisClaimInterval + 3*time.Second,
			subscriber: func(consumer string) (message.Subscriber, error) {
				return redisstream.NewSubscriber(redisstream.SubscriberConfig{
					Client: redis.NewClient(opts), ConsumerGroup: group, Consumer: consumer, OldestId: "0",
					MaxIdleTime: redisMaxIdleTime, ClaimInterval: redisClaimInterval,
					BlockTime: 100 * time.Millisecond, DisableIndefiniteInitialBlock: true,
				}, watermill.NopLogger{})
			},
			publisher: func() (message.Publisher, error) {
				return redisstream.NewPublisher(redisstream.PublisherConfig{Client: redis.NewClient(opts)}, watermill.NopLogger{})
			}}, nil
	case "amqp":
		config := amqpmarshal.NewConfig(testenv.Getenv("AMQP_URL", testenv.DefaultAMQPURL))
		return broker{name: name, within: 5 * time.Second,
			subscriber: func(string) (message.Subscriber, error) { return wamqp.NewSubscriber(config, watermill.NopLogger{}) },
			publisher:  func() (message.Publisher, error) { return amqpmarshal.NewPublisher(config, watermill.NopLogger{}) }}, nil
	case "nats":
		url := testenv.Getenv("NATS_URL", testenv.DefaultNATSURL)
		js := wnats.JetStreamConfig{
			AutoProvision: true, SubscribeOptions: []nats.SubOpt{nats.DeliverAll(), nats.AckExplicit()},
			DurablePrefix: group, DurableCalculator: func(prefix, topic string) string { return prefix + "_" + topic },
		}
		subConfig := wnats.SubscriberConfig{URL: url, QueueGroupPrefix: group, SubscribersCount: 1,
			AckWaitTimeout: natsAckWait, CloseTimeout: 5 * time.Second, JetStream: js}
		return broker{name: name, within: natsAckWait + 3*time.Second,
			subscriber: func(string) (message.Subscriber, error) {
				nc, err := nats.Connect(url)
				if err != nil {
					return nil, err
				}
				jsm, err := nc.JetStream()
				if err != nil {
					return nil, err
				}
				sub, err := wnats.NewSubscriberWithNatsConn(nc, subConfig.GetSubscriberSubscriptionConfig(), watermill.NopLogger{})
				if err != nil {
					return nil, err
				}
				return natsjetstream.WithDurableConsumers(sub, jsm, subConfig.GetSubscriberSubscriptionConfig(), natsjetstream.Consumer{MaxAckPending: 1}), nil
			},
			publisher: func() (message.Publisher, error) {
				return wnats.NewPublisher(wnats.PublisherConfig{URL: url, JetStream: js}, watermill.NopLogger{})
			}}, nil
	case "kafka":
		brokers := kafkaBrokers
		return broker{name: name, within: 3*kafkatest.SessionTimeout + 5*time.Second,
			subscriber: func(string) (message.Subscriber, error) {
				return kafka.NewSubscriber(kafkatest.SubscriberConfig(brokers, group), watermill.NopLogger{})
			},
			publisher: func() (message.Publisher, error) {
				return kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers, Marshaler: kafka.DefaultMarshaler{},
					OverwriteSaramaConfig: kafkatest.Config()}, watermill.NopLogger{})
			}}, nil
	case "postgres":
		db, err := sql.Open("pgx", testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN))
		if err != nil {
			return broker{}, err
		}
		beginner := wsql.BeginnerFromStdSQL(db)
		return broker{name: name, within: 5 * time.Second,
			subscriber: func(string) (message.Subscriber, error) {
				return wsql.NewSubscriber(beginner, wsql.SubscriberConfig{
					ConsumerGroup: group, PollInterval: sqlPollInterval, InitializeSchema: true,
					SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{},
				}, watermill.NopLogger{})
			},
			publisher: func() (message.Publisher, error) {
				return wsql.NewPublisher(beginner, wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, AutoInitializeSchema: true}, watermill.NopLogger{})
			}}, nil
	}
	return broker{}, fmt.Errorf("no broker %q", name)
}

// hold is the holder process: it receives a message of TAKEOVER_TOPIC,
// prints "holding <uuid>" and blocks until killed.
func hold() error {
	topic := os.Getenv("TAKEOVER_TOPIC")
	b, err := brokerNamed(os.Getenv("TAKEOVER_BROKER"), strings.Split(os.Getenv("TAKEOVER_KAFKA"), ","))
	if err != nil {
		return err
	}
	sub, err := b.subscriber("holder")
	if err != nil {
		return err
	}
	msgs, err := sub.Subscribe(context.Background(), topic)
	if err != nil {
		return err
	}
	msg := <-msgs
	fmt.Printf("holding %s\n", msg.UUID)
	select {} // never acked: the kill ends it
}

func TestTakeoverRedisStreams(t *testing.T) {
	t.Parallel()
	admin := testenv.Redis(t)
	topic := "bqtakeover-" + testenv.RandomHex(6)
	t.Cleanup(func() { _ = admin.Del(context.Background(), topic).Err() })
	takeover(t, "redis", topic, nil)
}

func TestTakeoverRabbitMQ(t *testing.T) {
	t.Parallel()
	testenv.AMQPURL(t)
	ch, err := testenv.AMQP(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	topic := "bqtakeover-" + testenv.RandomHex(6)
	t.Cleanup(func() { _, _ = ch.QueueDelete(topic, false, false, false) })
	takeover(t, "amqp", topic, nil)
}

func TestTakeoverNATSJetStream(t *testing.T) {
	t.Parallel()
	url := testenv.NATSURL(t)
	topic := "bqtakeover_" + testenv.RandomHex(6)
	t.Cleanup(func() {
		nc, err := nats.Connect(url)
		if err != nil {
			t.Errorf("cleanup: %v", err)
			return
		}
		defer nc.Close()
		if js, err := nc.JetStream(); err == nil {
			if err := js.DeleteStream(topic); err != nil && !errors.Is(err, nats.ErrStreamNotFound) {
				t.Errorf("delete stream %s: %v", topic, err)
			}
		}
	})
	takeover(t, "nats", topic, nil)
}

func TestTakeoverKafka(t *testing.T) {
	t.Parallel()
	k := kafkatest.Start(t)
	topic := "bqtakeover-" + testenv.RandomHex(6)
	k.Topic(t, topic, 1)
	k.Group(t, group) // deleted at the end (the name is fixed: the test's cluster is its own)
	takeover(t, "kafka", topic, k.Brokers)
}

func TestTakeoverWatermillSQL(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	topic := "bqtakeover_" + testenv.RandomHex(6)
	t.Cleanup(func() {
		for _, table := range []string{`"watermill_` + topic + `"`, `"watermill_offsets_` + topic + `"`} {
			if _, err := db.Exec("DROP TABLE IF EXISTS " + table); err != nil {
				t.Errorf("drop %s: %v", table, err)
			}
		}
	})
	takeover(t, "postgres", topic, nil)
}

// takeover publishes a message to topic, has a holder process receive it,
// SIGKILLs the holder and times the message's arrival at a consumer the
// test starts right after the kill.
func takeover(t *testing.T, name, topic string, kafkaBrokers []string) {
	t.Helper()
	if testing.Short() && name == "redis" {
		t.Skip("-short: the Redis Streams takeover waits out MaxIdleTime")
	}
	b, err := brokerNamed(name, kafkaBrokers)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := b.publisher()
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	sent := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
	if err := pub.Publish(topic, sent); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "TAKEOVER_ROLE=holder", "TAKEOVER_BROKER="+name, "TAKEOVER_TOPIC="+topic, "TAKEOVER_KAFKA="+strings.Join(kafkaBrokers, ","))
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	held := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(out).ReadString('\n')
		held <- strings.TrimSpace(line)
	}()
	select {
	case line := <-held:
		if line != "holding "+sent.UUID {
			t.Fatalf("holder said %q, want holding %s; stderr:\n%s", line, sent.UUID, stderr.String())
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("the holder did not receive the message within a minute; stderr:\n%s", stderr.String())
	}
	if err := cmd.Process.Kill(); err != nil { // SIGKILL
		t.Fatal(err)
	}
	killed := time.Now()
	sub, err := b.subscriber("taker")
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case msg := <-msgs:
		took := time.Since(killed)
		msg.Ack()
		if msg.UUID != sent.UUID {
			t.Fatalf("got %s, want %s", msg.UUID, sent.UUID)
		}
		t.Logf("%s: the killed holder's message reached another consumer %.1f s after the SIGKILL", name, took.Seconds())
		if took > b.within {
			t.Errorf("takeover took %v, over the %v its settings allow", took, b.within)
		}
	case <-time.After(2 * time.Minute):
		t.Fatalf("the killed holder's message never reached another consumer (2 minutes)")
	}
}
