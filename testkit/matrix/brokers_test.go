package matrix

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/nats-io/nats.go"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/brokers/kafkatopics"
	"github.com/babelqueue/watermill-idempotency/brokers/natsjetstream"
	"github.com/babelqueue/watermill-idempotency/marshal/amqpmarshal"
	"github.com/babelqueue/watermill-idempotency/marshal/kafkamarshal"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/redrive"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/kafkatest"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// The broker deadlines the matrix sets, short, where each broker's page
// says how, so that a slow handler outlives them within a test.
const (
	redisMaxIdleTime   = 4 * time.Second // MaxIdleTime
	redisClaimInterval = time.Second     // ClaimInterval, as the page sets it
	natsAckWait        = 4 * time.Second // AckWaitTimeout, the durable consumer's AckWait
	sqlAckDeadline     = 4 * time.Second // AckDeadline
	// kafkaSession is the group's session timeout: the page's table says
	// "as short as the cluster allows", and 6 s is Kafka's default
	// group.min.session.timeout.ms.
	kafkaSession = 6 * time.Second
)

// spec is what a consumer process needs to set a broker up as the test
// did: it travels in the environment (MATRIX_*).
type spec struct {
	Broker string // a row's name
	Topic  string
	NS     string // the test's namespace: store prefix or table, ledger keys
	Kafka  string // the kfake cluster's addresses, comma-separated
	// Group is the consumer group: the pages' "payments", but on a Kafka
	// of KAFKA_BROKERS, where a group spans topics, one of the test's own.
	Group string
}

func (s spec) env() []string {
	return []string{"MATRIX_BROKER=" + s.Broker, "MATRIX_TOPIC=" + s.Topic, "MATRIX_NS=" + s.NS, "MATRIX_KAFKA=" + s.Kafka, "MATRIX_GROUP=" + s.Group}
}

func specFromEnv() spec {
	return spec{Broker: os.Getenv("MATRIX_BROKER"), Topic: os.Getenv("MATRIX_TOPIC"), NS: os.Getenv("MATRIX_NS"), Kafka: os.Getenv("MATRIX_KAFKA"), Group: os.Getenv("MATRIX_GROUP")}
}

// conn is one process's wiring of a broker, as its page shows it.
type conn struct {
	pub   message.Publisher
	store stores.Store
	dlq   string // Topic's dead-letter topic
	// subscriber returns a new subscriber of the page's consumer group.
	subscriber func() (message.Subscriber, error)
	// The page's dead-letter options, whether it checks them when the
	// router subscribes, and the guard's options.
	dlqOptions       []deadletter.Option
	checkOnSubscribe bool
	guardOptions     []idempotency.Option
	closers          []func() error
}

// wire adds the page's middleware, dead letters outermost, the guard
// inside, to r; obs is the matrix's observer (it changes nothing).
func (c *conn) wire(r *message.Router, obs idempotency.Observer) error {
	opts := c.dlqOptions
	guardOpts := c.guardOptions
	if os.Getenv("MATRIX_LOG") == "" {
		opts = append(opts[:len(opts):len(opts)], deadletter.WithLogger(watermill.NopLogger{}))
		guardOpts = append(guardOpts[:len(guardOpts):len(guardOpts)], idempotency.WithLogger(watermill.NopLogger{}))
	}
	dlq, err := deadletter.Middleware(c.pub, opts...)
	if err != nil {
		return err
	}
	if c.checkOnSubscribe {
		r.AddSubscriberDecorators(deadletter.CheckOnSubscribe(c.pub, opts...))
	}
	r.AddMiddleware(dlq, idempotency.Middleware(c.store, append(guardOpts, idempotency.WithObserver(obs))...))
	return nil
}

func (c *conn) close() {
	for i := len(c.closers) - 1; i >= 0; i-- {
		_ = c.closers[i]()
	}
}

func logger() watermill.LoggerAdapter {
	if os.Getenv("MATRIX_LOG") != "" {
		return watermill.NewSlogLogger(nil)
	}
	return watermill.NopLogger{}
}

// retries is the README's budget: a failing message runs 4 times in all.
var retries = idempotency.Retries{Max: 3}

// redisStore is the store of the pages that use Redis, under the test's
// prefix.
func redisStore(opts *redis.Options, ns string) stores.Store {
	return redisstore.New(redis.NewClient(opts), redisstore.WithTTL(7*24*time.Hour), redisstore.WithPrefix(ns+":idem:"))
}

func redisOptions() (*redis.Options, error) {
	return redis.ParseURL(testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL))
}

// open sets sp's broker up as its page shows; store, when not nil,
// replaces the page's store (an in-process one shared by the test's
// consumers, where the page's lacks what a scenario needs).
func open(sp spec, store stores.Store) (*conn, error) {
	var c *conn
	var err error
	switch sp.Broker {
	case "redis":
		c, err = openRedis(sp)
	case "rabbitmq":
		c, err = openRabbitMQ(sp)
	case "nats":
		c, err = openNATS(sp)
	case "kafka", "kafka-noauto":
		c, err = openKafka(sp)
	case "sql":
		c, err = openSQL(sp)
	default:
		return nil, fmt.Errorf("no broker %q in this process", sp.Broker)
	}
	if err != nil {
		return nil, err
	}
	if store != nil {
		c.store = store
	}
	return c, nil
}

// openRedis: docs/brokers/redis-streams.md.
func openRedis(sp spec) (*conn, error) {
	opts, err := redisOptions()
	if err != nil {
		return nil, err
	}
	// redisstream closes the client it is given: one each.
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: redis.NewClient(opts)}, logger())
	if err != nil {
		return nil, err
	}
	return &conn{
		pub: pub, store: redisStore(opts, sp.NS), dlq: sp.Topic + ".dlq",
		subscriber: func() (message.Subscriber, error) {
			return redisstream.NewSubscriber(redisstream.SubscriberConfig{
				Client:          redis.NewClient(opts),
				ConsumerGroup:   sp.Group,
				MaxIdleTime:     redisMaxIdleTime,
				ClaimInterval:   redisClaimInterval,
				NackResendSleep: time.Second,
			}, logger())
		},
		guardOptions: []idempotency.Option{idempotency.WithRetries(retries), idempotency.WithDeliveryLimit(redisMaxIdleTime)},
		closers:      []func() error{pub.Close},
	}, nil
}

// openRabbitMQ: docs/brokers/rabbitmq.md.
func openRabbitMQ(sp spec) (*conn, error) {
	config := amqpmarshal.NewConfig(testenv.Getenv("AMQP_URL", testenv.DefaultAMQPURL))
	pub, err := amqpmarshal.NewPublisher(config, logger())
	if err != nil {
		return nil, err
	}
	opts, err := redisOptions()
	if err != nil {
		return nil, err
	}
	return &conn{
		pub: pub, store: redisStore(opts, sp.NS), dlq: sp.Topic + ".dlq",
		subscriber:       func() (message.Subscriber, error) { return wamqp.NewSubscriber(config, logger()) },
		checkOnSubscribe: true,
		guardOptions:     []idempotency.Option{idempotency.WithRetries(retries)},
		closers:          []func() error{pub.Close},
	}, nil
}

// natsJetStreamConfig is the page's JetStream configuration.
func natsJetStreamConfig(group string) wnats.JetStreamConfig {
	return wnats.JetStreamConfig{
		AutoProvision:     true,
		SubscribeOptions:  []nats.SubOpt{nats.DeliverAll(), nats.AckExplicit(), nats.ManualAck()},
		DurablePrefix:     group,
		DurableCalculator: func(prefix, topic string) string { return prefix + "_" + topic },
	}
}

// openNATS: docs/brokers/nats-jetstream.md.
func openNATS(sp spec) (*conn, error) {
	url := testenv.Getenv("NATS_URL", testenv.DefaultNATSURL)
	nc, err := nats.Connect(url)
	if err != nil {
		return nil, err
	}
	js, err := nc.JetStream()
	if err != nil {
		nc.Close()
		return nil, err
	}
	jsConfig := natsJetStreamConfig(sp.Group)
	subConfig := wnats.SubscriberConfig{
		URL:              url,
		QueueGroupPrefix: sp.Group,
		SubscribersCount: 4,
		AckWaitTimeout:   natsAckWait,
		NakDelay:         wnats.NewStaticDelay(time.Second),
		JetStream:        jsConfig,
	}
	pub, err := wnats.NewPublisher(wnats.PublisherConfig{URL: url, JetStream: jsConfig}, logger())
	if err != nil {
		nc.Close()
		return nil, err
	}
	opts, err := redisOptions()
	if err != nil {
		return nil, err
	}
	return &conn{
		pub: pub, store: redisStore(opts, sp.NS), dlq: natsjetstream.DeadLetterTopic(sp.Topic),
		subscriber: func() (message.Subscriber, error) {
			sub, err := wnats.NewSubscriber(subConfig, logger())
			if err != nil {
				return nil, err
			}
			return natsjetstream.WithDurableConsumers(sub, js, subConfig.GetSubscriberSubscriptionConfig(),
				natsjetstream.Consumer{MaxAckPending: 4 * 3}), nil
		},
		dlqOptions: []deadletter.Option{
			deadletter.WithTopic(natsjetstream.DeadLetterTopic),
			deadletter.WithTopicCheck(natsjetstream.NewStreams(js, jsConfig, nil)),
		},
		checkOnSubscribe: true,
		guardOptions:     []idempotency.Option{idempotency.WithRetries(retries), idempotency.WithDeliveryLimit(natsAckWait)},
		closers:          []func() error{func() error { nc.Close(); return nil }, pub.Close},
	}, nil
}

// kafkaConfig is the page's sarama configuration, with the session
// timeout its table recommends.
func kafkaConfig() *sarama.Config {
	c := kafka.DefaultSaramaSubscriberConfig()
	c.Version = sarama.V2_1_0_0
	c.Producer.Return.Successes = true
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	c.Consumer.Group.Session.Timeout = kafkaSession
	c.Consumer.Group.Rebalance.Timeout = 60 * time.Second
	return c
}

// openKafka: docs/brokers/kafka.md.
func openKafka(sp spec) (*conn, error) {
	brokers := strings.Split(sp.Kafka, ",")
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers: brokers, Marshaler: kafkamarshal.Marshaler{}, OverwriteSaramaConfig: kafkaConfig(),
	}, logger())
	if err != nil {
		return nil, err
	}
	client, err := sarama.NewClient(brokers, kafkaConfig())
	if err != nil {
		_ = pub.Close()
		return nil, err
	}
	opts, err := redisOptions()
	if err != nil {
		return nil, err
	}
	return &conn{
		pub: pub, store: redisStore(opts, sp.NS), dlq: sp.Topic + ".dlq",
		subscriber: func() (message.Subscriber, error) {
			return kafka.NewSubscriber(kafka.SubscriberConfig{
				Brokers: brokers, ConsumerGroup: sp.Group, Unmarshaler: kafkamarshal.Marshaler{},
				OverwriteSaramaConfig: kafkaConfig(), NackResendSleep: time.Second,
			}, logger())
		},
		dlqOptions: []deadletter.Option{deadletter.WithTopicCheck(kafkatopics.NewTopics(client,
			kafkatopics.WithCreate(sarama.TopicDetail{NumPartitions: 3, ReplicationFactor: 3})))},
		checkOnSubscribe: true,
		guardOptions:     []idempotency.Option{idempotency.WithRetries(retries), idempotency.WithDeliveryLimit(30 * time.Second)},
		closers:          []func() error{client.Close, pub.Close},
	}, nil
}

// openSQL: docs/brokers/watermill-sql.md, on the PostgreSQL of the
// watermill-sql subscriber's own (POSTGRES_SUBSCRIBER_DSN).
func openSQL(sp spec) (*conn, error) {
	dsn, _ := testenv.LookupPostgresSubscriberDSN()
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return nil, err
	}
	ackDeadline := sqlAckDeadline
	pub, err := wsql.NewPublisher(wsql.BeginnerFromStdSQL(db), wsql.PublisherConfig{
		SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, AutoInitializeSchema: true,
	}, logger())
	if err != nil {
		_ = db.Close()
		return nil, err
	}
	store, err := postgresstore.New(db, postgresstore.WithTable(sp.NS))
	if err != nil {
		_ = db.Close()
		return nil, err
	}
	if err := store.Migrate(context.Background()); err != nil {
		_ = db.Close()
		return nil, err
	}
	return &conn{
		pub: pub, store: store, dlq: sp.Topic + ".dlq",
		subscriber: func() (message.Subscriber, error) {
			return wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db), wsql.SubscriberConfig{
				ConsumerGroup:    sp.Group,
				AckDeadline:      &ackDeadline,
				SchemaAdapter:    wsql.DefaultPostgreSQLSchema{SubscribeBatchSize: 10},
				OffsetsAdapter:   wsql.DefaultPostgreSQLOffsetsAdapter{},
				InitializeSchema: true,
			}, logger())
		},
		guardOptions: []idempotency.Option{idempotency.WithRetries(retries)},
		closers:      []func() error{db.Close, store.Close, pub.Close},
	}, nil
}

// openGoChannel: docs/brokers/gochannel.md; one process only.
func openGoChannel(sp spec) *conn {
	pubSub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, logger())
	return &conn{
		pub: pubSub, store: memstore.New(), dlq: sp.Topic + ".dlq",
		// The router closes its subscribers: this one is the publisher too.
		subscriber:   func() (message.Subscriber, error) { return keepOpen{pubSub}, nil },
		guardOptions: []idempotency.Option{idempotency.WithRetries(retries)},
		closers:      []func() error{pubSub.Close},
	}
}

// row is one broker of the matrix.
type row struct {
	name string // the subtest's name, and spec.Broker
	page string // its page under docs/brokers
	// deadline says which deadline the matrix set short, and to what.
	deadline string
	// takeoverWithin bounds the takeover after a SIGKILL; takeoverBy says
	// what it is made of.
	takeoverWithin time.Duration
	takeoverBy     string
	// notRestart, notSlow say why the restart scenario or the slow
	// handler's does not apply ("": it does).
	notRestart, notSlow string
	// cancels says, where the broker cancels the handler's context at its
	// deadline, why (the slow handler then fails for good: expected).
	cancels string
	// cli is the redrive command's --broker (empty: redrive.Run in the
	// process).
	cli string
	// setup makes the test's namespace on the broker (sp.Topic, sp.NS
	// are set) and removes it when t ends.
	setup func(t testing.TB, sp *spec) *world
}

// world is one test's view of its broker, beyond what a consumer has.
type world struct {
	// deadLetters returns the messages on the dead-letter topic, without
	// consuming them.
	deadLetters func(t testing.TB) []*message.Message
	// backlog returns how many messages of the topic the group has not
	// acked (for RabbitMQ: ready, not held by a consumer).
	backlog func(t testing.TB) int
	// cliEnv is the redrive command's environment (beside the test's).
	cliEnv []string
	// redriveConsumes: the redrive takes the dead letters off their
	// topic (RabbitMQ's queue), so they are not counted afterwards.
	redriveConsumes bool
	// inProcess is the GoChannel's connection: every consumer of the test
	// shares it.
	inProcess *conn
}

const never = "bq-matrix-count" // a group that never reads: browsing with it reads everything

// browse reads a topic through a redrive.Browser.
func browse(b redrive.Browser, topic string) func(t testing.TB) []*message.Message {
	return func(t testing.TB) []*message.Message {
		var msgs []*message.Message
		err := b.Browse(context.Background(), topic, func(m *message.Message) bool { msgs = append(msgs, m); return true })
		if err != nil && !errors.Is(err, redrive.ErrTopicNotFound) {
			t.Fatalf("browse %s: %v", topic, err)
		}
		return msgs
	}
}

var rows = []row{
	{
		name: "redis", page: "redis-streams.md", deadline: fmt.Sprintf("MaxIdleTime %v", redisMaxIdleTime),
		takeoverWithin: 10 * time.Second, cli: "redis",
		takeoverBy: fmt.Sprintf("MaxIdleTime %v, then the claim loop, every %v", redisMaxIdleTime, redisClaimInterval),
		setup: func(t testing.TB, sp *spec) *world {
			rdb := testenv.Redis(t)
			sp.Topic = "bqmatrix-" + testenv.RandomHex(5) + "-payments"
			dlq := sp.Topic + ".dlq"
			// The streams, and what a redrive run keeps beside them (its lock).
			t.Cleanup(func() {
				if err := testenv.DropKeys(context.Background(), rdb, sp.Topic+"*"); err != nil {
					t.Errorf("drop %s*: %v", sp.Topic, err)
				}
			})
			return &world{
				deadLetters: browse(redrive.RedisStreamBrowser(rdb, never), dlq),
				backlog: func(t testing.TB) int {
					groups, err := rdb.XInfoGroups(context.Background(), sp.Topic).Result()
					if err != nil {
						t.Fatalf("XINFO GROUPS %s: %v", sp.Topic, err)
					}
					for _, g := range groups {
						if g.Name == sp.Group {
							return int(g.Pending + g.Lag)
						}
					}
					return int(rdb.XLen(context.Background(), sp.Topic).Val())
				},
			}
		},
	},
	{
		name: "rabbitmq", page: "rabbitmq.md", deadline: "consumer_timeout (30 min, not set)",
		takeoverWithin: 10 * time.Second, cli: "amqp",
		takeoverBy: "requeued at once; the dead holder's claim lapses within its 5 s lease",
		notSlow: "RabbitMQ 3.10 has no per-queue consumer timeout (x-consumer-timeout is 3.12+) and checks the server-wide " +
			"consumer_timeout about once a minute: no deadline a test can set short",
		setup: func(t testing.TB, sp *spec) *world {
			conn := testenv.AMQP(t)
			sp.Topic = "bqmatrix-" + testenv.RandomHex(5) + "-payments"
			dlq := sp.Topic + ".dlq"
			t.Cleanup(func() {
				ch, err := conn.Channel()
				if err != nil {
					t.Errorf("delete the queues: %v", err)
					return
				}
				defer ch.Close()
				for _, q := range []string{sp.Topic, dlq} {
					if _, err := ch.QueueDelete(q, false, false, false); err != nil {
						t.Errorf("delete queue %s: %v", q, err)
					}
				}
			})
			return &world{
				deadLetters: func(t testing.TB) []*message.Message {
					return testenv.BrowseAMQP(t, conn, dlq, amqpmarshal.Marshaler{}.Unmarshal)
				},
				backlog:         func(t testing.TB) int { return testenv.AMQPReady(t, conn, sp.Topic) },
				redriveConsumes: true,
			}
		},
	},
	{
		name: "nats", page: "nats-jetstream.md", deadline: fmt.Sprintf("AckWait %v", natsAckWait),
		takeoverWithin: 10 * time.Second, cli: "nats",
		takeoverBy: fmt.Sprintf("AckWait %v", natsAckWait),
		cancels:    "watermill-nats cancels the context at AckWaitTimeout",
		setup: func(t testing.TB, sp *spec) *world {
			sp.Topic = "bqmatrix_" + testenv.RandomHex(5) + "_payments"
			dlq := natsjetstream.DeadLetterTopic(sp.Topic)
			_, js := testenv.JetStream(t, sp.Topic, dlq)
			return &world{
				deadLetters: browse(redrive.NATSBrowser(js, never, nil), dlq),
				backlog: func(t testing.TB) int {
					info, err := js.ConsumerInfo(sp.Topic, sp.Group+"_"+sp.Topic)
					if errors.Is(err, nats.ErrConsumerNotFound) {
						return -1
					}
					if err != nil {
						t.Fatalf("consumer of %s: %v", sp.Topic, err)
					}
					if os.Getenv("MATRIX_DEBUG") != "" {
						t.Logf("consumer %s: delivered %+v, ack floor %+v, pending %d, ack pending %d, redelivered %d, waiting %d",
							info.Name, info.Delivered, info.AckFloor, info.NumPending, info.NumAckPending, info.NumRedelivered, info.NumWaiting)
					}
					return int(info.NumPending) + info.NumAckPending
				},
			}
		},
	},
	kafkaRow("kafka"),
	kafkaRow("kafka-noauto"),
	{
		name: "sql", page: "watermill-sql.md", deadline: fmt.Sprintf("AckDeadline %v", sqlAckDeadline),
		takeoverWithin: 10 * time.Second, cli: "postgres",
		takeoverBy: "the dead consumer's transaction ends at once; its claim lapses within its 5 s lease",
		cancels:    "watermill-sql's AckDeadline is the context's deadline",
		setup: func(t testing.TB, sp *spec) *world {
			// The slow scenarios' handlers hold the subscriber's
			// transactions open for seconds: they have the server alone,
			// not to stall the other tests' subscribers.
			forSubscriber := testenv.PostgresForSubscriber
			if strings.Contains(t.Name(), "/slow") {
				forSubscriber = testenv.PostgresForSubscriberAlone
			}
			db := forSubscriber(t)
			sp.Topic = "bqmatrix_" + testenv.RandomHex(5) + "_payments"
			dlq := sp.Topic + ".dlq"
			// Each process migrates the store's table, as the page does.
			t.Cleanup(func() {
				tables := []string{`"` + sp.NS + `"`}
				for _, tp := range []string{sp.Topic, dlq} {
					tables = append(tables, `"watermill_`+tp+`"`, `"watermill_offsets_`+tp+`"`)
				}
				if _, err := db.Exec(`DROP TABLE IF EXISTS ` + strings.Join(tables, ", ")); err != nil {
					t.Errorf("drop the tables: %v", err)
				}
			})
			return &world{
				deadLetters: browse(redrive.PostgresBrowser(db, never), dlq),
				backlog: func(t testing.TB) int {
					var n int
					err := db.QueryRow(`SELECT count(*) FROM "watermill_`+sp.Topic+`" WHERE "offset" > coalesce((SELECT offset_acked FROM "watermill_offsets_`+
						sp.Topic+`" WHERE consumer_group = $1), 0)`, sp.Group).Scan(&n)
					if err != nil {
						t.Fatalf("backlog of %s: %v", sp.Topic, err)
					}
					return n
				},
				cliEnv: []string{"POSTGRES_DSN=" + testenv.PostgresSubscriberDSN(t)},
			}
		},
	},
	{
		name: "gochannel", page: "gochannel.md", deadline: "none",
		notRestart: "GoChannel's messages live in the process: nothing outlives a restart",
		notSlow:    "GoChannel has no deadline",
		setup: func(t testing.TB, sp *spec) *world {
			sp.Topic = "payments-" + testenv.RandomHex(4)
			c := openGoChannel(*sp)
			t.Cleanup(c.close)
			return &world{
				inProcess:   c,
				deadLetters: func(t testing.TB) []*message.Message { return readGoChannel(t, c.pub.(*gochannel.GoChannel), c.dlq) },
				backlog:     func(testing.TB) int { return 0 },
			}
		},
	},
}

// kafkaRow is Kafka on kfake, its brokers creating topics on first use
// ("kafka") or not ("kafka-noauto", as managed clusters run).
func kafkaRow(name string) row {
	return row{
		name: name, page: "kafka.md", deadline: fmt.Sprintf("a rebalance (a consumer joins mid-run); session timeout %v", kafkaSession),
		takeoverWithin: 10 * time.Second, cli: "kafka",
		takeoverBy: fmt.Sprintf("the session timeout, %v, then a rebalance", kafkaSession),
		setup: func(t testing.TB, sp *spec) *world {
			var opts []kafkatest.StartOption
			if name == "kafka-noauto" {
				opts = append(opts, kafkatest.WithoutTopicAutoCreation())
			}
			k := kafkatest.Start(t, opts...)
			sp.Kafka = strings.Join(k.Brokers, ",")
			if !k.Fake {
				sp.Group = k.Group(t, "payments")
			}
			sp.Topic = "bqmatrix-" + testenv.RandomHex(5) + "-payments"
			dlq := sp.Topic + ".dlq"
			k.Topic(t, sp.Topic, 3)
			k.DeleteTopicAtEnd(t, dlq)
			t.Cleanup(func() {
				// The page's group, deleted once the consumers are gone
				// (k.Group names groups of its own).
				admin, err := sarama.NewClusterAdmin(k.Brokers, kafkatest.Config())
				if err != nil {
					return
				}
				defer admin.Close()
				for _, g := range []string{sp.Group, "bq-redrive"} {
					_ = admin.DeleteConsumerGroup(g)
				}
			})
			client, err := sarama.NewClient(k.Brokers, kafkatest.Config())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = client.Close() })
			return &world{
				deadLetters: func(t testing.TB) []*message.Message {
					return browse(redrive.KafkaBrowser(client, never, kafkamarshal.Marshaler{}), dlq)(t)
				},
				backlog: func(t testing.TB) int { return k.Backlog(t, sp.Group, sp.Topic) },
				cliEnv:  []string{kafkatest.EnvBrokers + "=" + sp.Kafka},
			}
		},
	}
}

// readGoChannel reads every message a persistent GoChannel keeps on topic,
// through a subscription of its own (each new one is handed them all).
func readGoChannel(t testing.TB, pubSub *gochannel.GoChannel, topic string) []*message.Message {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := pubSub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	var out []*message.Message
	for {
		select {
		case m := <-msgs:
			m.Ack()
			out = append(out, m)
		case <-time.After(200 * time.Millisecond):
			return out
		}
	}
}

// keepOpen is a subscriber whose Close does nothing (its subscriptions end
// with their contexts).
type keepOpen struct{ message.Subscriber }

func (keepOpen) Close() error { return nil }
