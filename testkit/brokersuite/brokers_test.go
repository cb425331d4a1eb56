package brokersuite

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/marshal/amqpmarshal"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/pubsub/redislist"
	"github.com/babelqueue/watermill-idempotency/redrive"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// group is the consumer group of the suite's subscribers, where the
// broker has groups.
const group = "bq_suite"

// TestRedisStreams and the NATS tests run before the parallel tests: a
// closed redisstream subscriber's reader sleeps half a second after its last
// read error, and a drained NATS connection flushes in the background, longer
// than goleak waits at the end of the package.
func TestRedisStreams(t *testing.T) { Run(t, redisStreams) }
func TestPostgreSQL(t *testing.T)   { t.Parallel(); Run(t, postgreSQL) }
func TestRedisList(t *testing.T)    { t.Parallel(); Run(t, redisList(redislist.LayoutReliableList)) }
func TestRedisLaravel(t *testing.T) { t.Parallel(); Run(t, redisList(redislist.LayoutLaravel)) }
func TestRabbitMQ(t *testing.T)     { t.Parallel(); Run(t, rabbitMQ) }
func TestNATSJetStream(t *testing.T) {
	Run(t, natsJetStream)
}

// redisStreams: watermill-redisstream, one consumer group.
var redisStreams = Broker{
	Name:       "Redis Streams",
	Redelivers: true,
	Setup: func(t testing.TB) *Env {
		admin := testenv.Redis(t)
		opts := admin.Options()
		topic := "bqsuite-" + testenv.RandomHex(6) + "-payments"
		dlq := topic + ".dlq"
		t.Cleanup(func() {
			// Cleanups run last to first: every subscriber is closed by now.
			if err := admin.Del(context.Background(), topic, dlq).Err(); err != nil {
				t.Errorf("delete the streams: %v", err)
			}
		})
		return &Env{
			Topic: topic, DeadLetterTopic: dlq,
			// redisstream closes the client it is given: one each.
			NewPublisher: func(t testing.TB) message.Publisher {
				pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: redis.NewClient(opts)}, watermill.NopLogger{})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = pub.Close() })
				return pub
			},
			NewSubscriber: func(t testing.TB) message.Subscriber {
				sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
					Client: redis.NewClient(opts), ConsumerGroup: group, Consumer: "c-" + testenv.RandomHex(4), OldestId: "0",
					BlockTime: 100 * time.Millisecond, DisableIndefiniteInitialBlock: true,
				}, watermill.NopLogger{})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = sub.Close() })
				return sub
			},
			Backlog: func(t testing.TB, topic string) int {
				ctx := context.Background()
				groups, err := admin.XInfoGroups(ctx, topic).Result()
				if err != nil {
					t.Fatalf("XINFO GROUPS %s: %v", topic, err)
				}
				for _, g := range groups {
					if g.Name == group {
						return int(g.Pending + g.Lag)
					}
				}
				return int(admin.XLen(ctx, topic).Val())
			},
			Browse: browser(redrive.RedisStreamBrowser(admin, group)),
		}
	},
}

// browser reads a topic through a redrive.Browser.
func browser(b redrive.Browser) func(t testing.TB, topic string) []*message.Message {
	return func(t testing.TB, topic string) []*message.Message {
		var msgs []*message.Message
		err := b.Browse(context.Background(), topic, func(m *message.Message) bool { msgs = append(msgs, m); return true })
		if err != nil && !errors.Is(err, redrive.ErrTopicNotFound) {
			t.Fatalf("browse %s: %v", topic, err)
		}
		return msgs
	}
}

// postgreSQL: watermill-sql on PostgreSQL, default schema and offsets
// adapter, one consumer group.
var postgreSQL = Broker{
	Name:       "PostgreSQL (watermill-sql)",
	Redelivers: true,
	Setup: func(t testing.TB) *Env {
		db := testenv.PostgresForSubscriber(t)
		db.SetMaxOpenConns(8)
		topic := "bqsuite_" + testenv.RandomHex(6) + "_payments"
		dlq := topic + ".dlq"
		t.Cleanup(func() {
			for _, tp := range []string{topic, dlq} {
				for _, table := range []string{`"watermill_` + tp + `"`, `"watermill_offsets_` + tp + `"`} {
					if _, err := db.Exec(`DROP TABLE IF EXISTS ` + table); err != nil {
						t.Errorf("drop %s: %v", table, err)
					}
				}
			}
		})
		beginner := wsql.BeginnerFromStdSQL(db)
		return &Env{
			Topic: topic, DeadLetterTopic: dlq,
			NewPublisher: func(t testing.TB) message.Publisher {
				pub, err := wsql.NewPublisher(beginner, wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, AutoInitializeSchema: true}, watermill.NopLogger{})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = pub.Close() })
				return pub
			},
			NewSubscriber: func(t testing.TB) message.Subscriber {
				sub, err := wsql.NewSubscriber(beginner, wsql.SubscriberConfig{
					ConsumerGroup: group, PollInterval: 50 * time.Millisecond, ResendInterval: 50 * time.Millisecond,
					SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{}, InitializeSchema: true,
				}, watermill.NopLogger{})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = sub.Close() })
				return sub
			},
			// The rows after the group's acked offset.
			Backlog: func(t testing.TB, topic string) int {
				var n int
				err := db.QueryRow(`SELECT count(*) FROM "watermill_`+topic+`" WHERE "offset" > coalesce((SELECT offset_acked FROM "watermill_offsets_`+
					topic+`" WHERE consumer_group = $1), 0)`, group).Scan(&n)
				if err != nil {
					t.Fatalf("backlog of %s: %v", topic, err)
				}
				if browsed := len(browser(redrive.PostgresBrowser(db, group))(t, topic)); browsed != n {
					var acked, tx sql.NullString
					_ = db.QueryRow(`SELECT offset_acked::text, last_processed_transaction_id::text FROM "watermill_offsets_`+topic+`" WHERE consumer_group = $1`, group).Scan(&acked, &tx)
					t.Logf("%s: %d rows after the acked offset, but redrive.PostgresBrowser reads %d (offset_acked %v, last_processed_transaction_id %v)", topic, n, browsed, acked, tx)
				}
				return n
			},
			Browse: browser(redrive.PostgresBrowser(db, group)),
		}
	},
}

// redisList: the BabelQueue SDKs' reliable list, or Laravel's queue.
func redisList(layout redislist.Layout) Broker {
	name := "Redis list (SDK reliable list)"
	if layout == redislist.LayoutLaravel {
		name = "Redis list (Laravel)"
	}
	return Broker{
		Name:       name,
		Redelivers: true,
		Setup: func(t testing.TB) *Env {
			client := testenv.Redis(t)
			prefix := "bqsuite:" + testenv.RandomHex(6) + ":"
			t.Cleanup(func() {
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				if err := testenv.DropKeys(ctx, client, prefix+"*"); err != nil {
					t.Errorf("drop %s*: %v", prefix, err)
				}
			})
			opts := []redislist.Option{redislist.WithLayout(layout), redislist.WithBlockTime(100 * time.Millisecond), redislist.WithCloseTimeout(5 * time.Second)}
			topic := prefix + "payments"
			keys := func(topic string) (ready string, others []string) {
				if layout == redislist.LayoutLaravel {
					q := prefix + "queues:" + topic
					return q, []string{q + ":reserved", q + ":delayed"}
				}
				return topic, []string{topic + ":processing"}
			}
			if layout == redislist.LayoutLaravel {
				opts = append(opts, redislist.WithKeyPrefix(prefix))
				topic = "payments"
			}
			browse, err := redislist.NewSubscriber(client, opts...)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = browse.Close() })
			return &Env{
				Topic: topic, DeadLetterTopic: topic + ".dlq",
				NewPublisher: func(t testing.TB) message.Publisher {
					pub, err := redislist.NewPublisher(client, opts...)
					if err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() { _ = pub.Close() })
					return pub
				},
				NewSubscriber: func(t testing.TB) message.Subscriber {
					sub, err := redislist.NewSubscriber(client, opts...)
					if err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() { _ = sub.Close() })
					return sub
				},
				Backlog: func(t testing.TB, topic string) int {
					ctx := context.Background()
					ready, others := keys(topic)
					n := client.LLen(ctx, ready).Val()
					for _, k := range others {
						if layout == redislist.LayoutLaravel {
							n += client.ZCard(ctx, k).Val()
						} else {
							n += client.LLen(ctx, k).Val()
						}
					}
					return int(n)
				},
				Browse: browser(browse),
			}
		},
	}
}

// rabbitMQ: watermill-amqp with the BabelQueue SDKs' topology and wire
// format (amqpmarshal): one durable queue per topic, competing consumers.
var rabbitMQ = Broker{
	Name:       "RabbitMQ (watermill-amqp)",
	Redelivers: true,
	Setup: func(t testing.TB) *Env {
		url := testenv.AMQPURL(t)
		conn := testenv.AMQP(t)
		topic := "bqsuite-" + testenv.RandomHex(6) + "-payments"
		dlq := topic + ".dlq"
		t.Cleanup(func() {
			ch, err := conn.Channel()
			if err != nil {
				t.Errorf("delete the queues: %v", err)
				return
			}
			defer ch.Close()
			for _, q := range []string{topic, dlq} {
				if _, err := ch.QueueDelete(q, false, false, false); err != nil {
					t.Errorf("delete queue %s: %v", q, err)
				}
			}
		})
		config := amqpmarshal.NewConfig(url)
		return &Env{
			Topic: topic, DeadLetterTopic: dlq,
			NewPublisher: func(t testing.TB) message.Publisher {
				pub, err := amqpmarshal.NewPublisher(config, watermill.NopLogger{})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = pub.Close() })
				return pub
			},
			NewSubscriber: func(t testing.TB) message.Subscriber {
				sub, err := wamqp.NewSubscriber(config, watermill.NopLogger{})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = sub.Close() })
				return sub
			},
			// Once the consumers are closed, what they did not ack is
			// back among the queue's ready messages.
			Backlog: func(t testing.TB, topic string) int { return testenv.AMQPReady(t, conn, topic) },
			Browse: func(t testing.TB, topic string) []*message.Message {
				return testenv.BrowseAMQP(t, conn, topic, amqpmarshal.Marshaler{}.Unmarshal)
			},
		}
	},
}

// natsJetStream: watermill-nats with JetStream, a stream per topic and a
// durable push consumer per topic shared by the subscribers through a
// queue group, explicit acks. A JetStream stream name cannot hold a dot:
// the dead-letter topic is <topic>_dlq.
var natsJetStream = Broker{
	Name:       "NATS JetStream (watermill-nats)",
	Redelivers: true,
	MaxMessage: 1 << 20, // the server's default max_payload
	Setup: func(t testing.TB) *Env {
		url := testenv.NATSURL(t)
		nc, err := nats.Connect(url)
		if err != nil {
			t.Fatal(err)
		}
		js, err := nc.JetStream()
		if err != nil {
			t.Fatal(err)
		}
		topic := "bqsuite_" + testenv.RandomHex(6) + "_payments"
		dlq := topic + "_dlq"
		t.Cleanup(func() {
			defer nc.Close()
			for _, stream := range []string{topic, dlq} {
				if err := js.DeleteStream(stream); err != nil && !errors.Is(err, nats.ErrStreamNotFound) {
					t.Errorf("delete stream %s: %v", stream, err)
				}
			}
		})
		durable := func(prefix, topic string) string { return prefix + "_" + topic }
		// The streams and durable consumers exist before any subscriber:
		// a consumer the library creates itself is deleted when its
		// subscriber closes (nats.go deletes what it created on
		// Unsubscribe), and the next subscriber would read the stream
		// from the start again.
		for _, stream := range []string{topic, dlq} {
			testenv.AddStream(t, js, &nats.StreamConfig{Name: stream, Subjects: []string{stream}})
			_, err := js.AddConsumer(stream, &nats.ConsumerConfig{
				Durable: durable(group, stream), DeliverSubject: nats.NewInbox(), DeliverGroup: group,
				DeliverPolicy: nats.DeliverAllPolicy, AckPolicy: nats.AckExplicitPolicy, AckWait: 30 * time.Second,
				FilterSubject: stream,
			})
			if err != nil {
				t.Fatalf("create the consumer of %s: %v", stream, err)
			}
		}
		jsConfig := wnats.JetStreamConfig{
			AutoProvision:     true,
			SubscribeOptions:  []nats.SubOpt{nats.DeliverAll(), nats.AckExplicit()},
			DurablePrefix:     group,
			DurableCalculator: durable,
		}
		return &Env{
			Topic: topic, DeadLetterTopic: dlq,
			NewPublisher: func(t testing.TB) message.Publisher {
				pub, err := wnats.NewPublisher(wnats.PublisherConfig{URL: url, Marshaler: &wnats.NATSMarshaler{}, JetStream: jsConfig}, watermill.NopLogger{})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = pub.Close() })
				return pub
			},
			NewSubscriber: func(t testing.TB) message.Subscriber {
				return testenv.NATSSubscriber(t, url, wnats.SubscriberConfig{
					QueueGroupPrefix: group, SubscribersCount: 1, CloseTimeout: 5 * time.Second,
					AckWaitTimeout: 30 * time.Second, Unmarshaler: &wnats.NATSMarshaler{}, JetStream: jsConfig,
				})
			},
			Backlog: func(t testing.TB, topic string) int {
				info, err := js.ConsumerInfo(topic, durable(group, topic))
				if err != nil {
					t.Fatalf("consumer of %s: %v", topic, err)
				}
				return int(info.NumPending) + info.NumAckPending
			},
			// The stream's messages, read by sequence: no consumer.
			Browse: func(t testing.TB, topic string) []*message.Message {
				s, err := js.StreamInfo(topic)
				if errors.Is(err, nats.ErrStreamNotFound) {
					return nil
				}
				if err != nil {
					t.Fatalf("stream %s: %v", topic, err)
				}
				var msgs []*message.Message
				for seq := s.State.FirstSeq; s.State.Msgs > 0 && seq <= s.State.LastSeq; seq++ {
					raw, err := js.GetMsg(topic, seq)
					if errors.Is(err, nats.ErrMsgNotFound) {
						continue
					}
					if err != nil {
						t.Fatalf("message %d of %s: %v", seq, topic, err)
					}
					msg, err := (&wnats.NATSMarshaler{}).Unmarshal(&nats.Msg{Subject: raw.Subject, Header: raw.Header, Data: raw.Data})
					if err != nil {
						t.Fatal(err)
					}
					msgs = append(msgs, msg)
				}
				return msgs
			},
		}
	},
}

// TestParkedCopiesDoNotStormRabbitMQ: six payments published twice, a
// handler that takes a second (as long as the default park wait), four
// routers with the kit and nothing in front of it (the README's sdkstore
// wiring). RabbitMQ hands a nacked delivery straight back, so a copy parked
// behind the other's claim used to come back thousands of times a second
// (20,007 deliveries for these 12 copies with WithParkWait(0)); a parked
// copy now waits for the claim to end before it goes back, and the broker
// delivers each copy a few times at most.
func TestParkedCopiesDoNotStormRabbitMQ(t *testing.T) {
	t.Parallel()
	env := rabbitMQ.Setup(t)
	const payments, routers = 6, 4
	store := memstore.New()
	var charges testenv.Effects
	d := newDeliveries(t)
	for range routers {
		r := newRouter(t)
		r.AddMiddleware(d.middleware, idempotency.Middleware(store))
		r.AddConsumerHandler("charge", env.Topic, env.NewSubscriber(t), func(msg *message.Message) error {
			time.Sleep(time.Second) // the charge
			charges.Add(idOf(msg))
			return nil
		})
		testenv.RunRouter(t, r)
	}
	ids, copies := testenv.PublishCopies(t, env.NewPublisher(t), env.Topic, job, payments, func(int) int { return 2 })
	deadline := time.Now().Add(time.Minute)
	for charges.Total() < payments || d.acked.Load() < int64(copies) {
		if time.Now().After(deadline) {
			t.Fatalf("%d charges, %d of %d copies acked, %d deliveries", charges.Total(), d.acked.Load(), copies, d.started.Load())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := charges.ExactlyOnce(ids); err != nil {
		t.Fatal(err)
	}
	// Each copy: its first delivery, and a redelivery for each park wait
	// it outlasted (a second each, against a second of handler).
	if started := d.started.Load(); started > int64(copies)+30 {
		t.Fatalf("%d deliveries for %d copies: parked copies were handed back again and again", started, copies)
	}
	t.Logf("%d deliveries for %d copies of %d payments, %d nacked", d.started.Load(), copies, payments, d.nacked.Load())
}
