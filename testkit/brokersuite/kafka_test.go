package brokersuite

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/internal/kafkasession"
	"github.com/babelqueue/watermill-idempotency/marshal/kafkamarshal"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/redrive"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/kafkatest"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func TestKafka(t *testing.T) { t.Parallel(); Run(t, kafkaBroker) }

// kafkaBroker: watermill-kafka (sarama consumer groups) with the BabelQueue
// Kafka binding (kafkamarshal), on KAFKA_BROKERS or an in-process kfake
// cluster of three brokers. The topic has four partitions and the
// dead-letter topic two, so that copies of a message are handed out in
// parallel; each test has a consumer group of its own.
var kafkaBroker = Broker{
	Name:       "Kafka (watermill-kafka, kafkamarshal)",
	Redelivers: true,
	Setup: func(t testing.TB) *Env {
		k := kafkatest.Start(t)
		topic := "bqsuite-" + testenv.RandomHex(6) + "-payments"
		dlq := topic + ".dlq"
		k.Topic(t, topic, 4)
		k.Topic(t, dlq, 2)
		g := k.Group(t, group)
		client, err := sarama.NewClient(k.Brokers, kafkatest.Config())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = client.Close() })
		t.Logf("on %s", k.Name)
		return &Env{
			Topic: topic, DeadLetterTopic: dlq,
			NewPublisher: func(t testing.TB) message.Publisher { return k.Publisher(t) },
			// Subscribe returns once the group gave the subscriber its
			// partitions: the redrive case counts a second of idle time
			// from there, and a rebalance may take longer (under -race).
			NewSubscriber: func(t testing.TB) message.Subscriber { return k.JoiningSubscriber(t, g) },
			Backlog:       func(t testing.TB, topic string) int { return k.Backlog(t, g, topic) },
			Browse:        browser(redrive.KafkaBrowser(client, g, kafkamarshal.Marshaler{})),
		}
	},
}

// kafkaWorker is a router with sub, the deliveries counted, guard (the
// kit's middleware, or nothing) and a charge that takes a few
// milliseconds; after charging, the handler calls then (when not nil)
// before it returns.
func kafkaWorker(t testing.TB, topic string, sub message.Subscriber, guard []message.HandlerMiddleware, d *deliveries, charges *testenv.Effects, then func()) (stop func()) {
	t.Helper()
	r := newRouter(t)
	r.AddMiddleware(d.middleware)
	r.AddMiddleware(guard...)
	r.AddConsumerHandler("charge", topic, sub, func(msg *message.Message) error {
		time.Sleep(5 * time.Millisecond)
		charges.Add(idOf(msg))
		if then != nil {
			then()
		}
		return nil
	})
	return testenv.RunRouter(t, r)
}

// TestKafkaRebalanceWhileInFlight: two consumers in one group, the second
// joining while the first holds charged payments it has not acked yet,
// then the first leaving mid-stream. The first consumer's session ends
// with the rebalance; it acks the held deliveries after that, and
// watermill-kafka does not commit what a consumer acks once its session
// ended, so the partitions' new owners get those payments again. With the
// kit every payment is charged once; the meta-test below shows the same
// rebalance repeats charges without it.
func TestKafkaRebalanceWhileInFlight(t *testing.T) {
	t.Parallel()
	if err := rebalanceWhileInFlight(t, false); err != nil {
		t.Fatal(err)
	}
}

// TestKafkaRebalanceWithoutTheKitRepeatsCharges: the same rebalances
// without the kit charge the held payments twice.
func TestKafkaRebalanceWithoutTheKitRepeatsCharges(t *testing.T) {
	if testing.Short() {
		t.Skip("the meta-test of the rebalance test")
	}
	t.Parallel()
	if err := rebalanceWhileInFlight(t, true); err == nil {
		t.Fatal("every payment was charged once without the kit: the rebalance test does not prove the kit")
	} else {
		t.Logf("without the kit: %v", err)
	}
}

// rebalanceWhileInFlight runs the scenario; it fails t when the scenario
// did not happen as planned, and returns whether a payment was charged
// other than once.
func rebalanceWhileInFlight(t *testing.T, withoutKit bool) error {
	k := kafkatest.Start(t)
	topic := "bqsuite-" + testenv.RandomHex(6) + "-rebalance"
	k.Topic(t, topic, 6)
	g := k.Group(t, group)
	s := settings{wait: 60 * time.Second, withoutKit: withoutKit}
	var skipped atomic.Int64
	guard := s.guard(memstore.New(), idempotency.WithClaim(30*time.Second), idempotency.WithObserver(idempotency.ObserverFunc(
		func(_ context.Context, e idempotency.Event) {
			if e.Outcome == idempotency.OutcomeSkip {
				skipped.Add(1)
			}
		})))
	var charges testenv.Effects
	d := newDeliveries(t)
	const n = 300
	report := func() string {
		return fmt.Sprintf("%d charges for %d payments, %d deliveries, %d acked", charges.Total(), n, d.started.Load(), d.acked.Load())
	}

	// The first consumer: from the 60th charge on, it holds each payment
	// it charged until released (one a partition: watermill-kafka hands a
	// partition's records out one at a time).
	sessions := kafkasession.New()
	config := kafkatest.SubscriberConfig(k.Brokers, g)
	config.Tracer = sessions
	first, err := kafka.NewSubscriber(config, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = first.Close() })
	var released atomic.Bool
	var held atomic.Int64
	release := make(chan struct{})
	stopFirst := kafkaWorker(t, topic, first, guard, d, &charges, func() {
		if !released.Load() && charges.Total() >= 60 {
			held.Add(1)
			<-release
		}
	})
	ids, _ := testenv.PublishCopies(t, k.Publisher(t), topic, job, n, func(int) int { return 1 })
	s.eventually(t, "the first consumer to hold a charged payment", func() bool { return held.Load() > 0 }, report)

	kafkaWorker(t, topic, k.Subscriber(t, g), guard, d, &charges, nil) // joins: a rebalance
	select {
	case <-sessions.FirstEnded():
	case <-time.After(s.wait):
		t.Fatalf("the first consumer's session did not end when the second joined: %s", report())
	}
	released.Store(true)
	close(release) // acked after its session ended: not committed
	inFlight := held.Load()

	s.eventually(t, "200 payments charged", func() bool { return charges.Total() >= 200 }, report)
	stopFirst() // leaves mid-stream: a rebalance
	s.eventually(t, "every payment charged and the backlog empty", func() bool {
		return charges.Total() >= n && k.Backlog(t, g, topic) == 0
	}, report)
	redelivered := d.started.Load() - n
	if redelivered < inFlight {
		t.Fatalf("%d deliveries came again, but %d were acked after the first consumer's session ended: %s", redelivered, inFlight, report())
	}
	t.Logf("%s: %d payments, two consumers (one joined while the other held %d charged payments, then the other left), %d deliveries of which %d came again, %d skipped by the kit, %d charges",
		k.Name, n, inFlight, d.started.Load(), redelivered, skipped.Load(), charges.Total())
	return charges.ExactlyOnce(ids)
}

// TestKafkaDuplicateProduce: every payment produced twice, as a producer
// that did not get its acknowledgement sends again (Kafka's idempotent
// producer drops only the retries of one producer session): once as the
// binding's record (the bq- headers), once as a bare value with no
// headers, each copy on another partition, consumed by two consumers of
// one group. One charge each, every copy acked.
func TestKafkaDuplicateProduce(t *testing.T) {
	t.Parallel()
	k := kafkatest.Start(t)
	topic := "bqsuite-" + testenv.RandomHex(6) + "-produce"
	const partitions = 4
	k.Topic(t, topic, partitions)
	g := k.Group(t, group)
	s := settings{wait: 45 * time.Second}
	guard := s.guard(memstore.New(), idempotency.WithClaim(30*time.Second))
	var charges testenv.Effects
	d := newDeliveries(t)
	kafkaWorker(t, topic, k.Subscriber(t, g), guard, d, &charges, nil)
	kafkaWorker(t, topic, k.Subscriber(t, g), guard, d, &charges, nil)

	config := kafkatest.Config()
	config.Producer.Partitioner = sarama.NewManualPartitioner
	producer, err := sarama.NewSyncProducer(k.Brokers, config)
	if err != nil {
		t.Fatal(err)
	}
	defer producer.Close()
	const n = 40
	ids := make([]string, n)
	var records []*sarama.ProducerMessage
	for i := range n {
		e, err := envelope.New(job, map[string]any{"i": i}, envelope.WithQueue(topic))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := e.Marshal()
		ids[i] = e.Meta.ID
		binding, err := kafkamarshal.Marshaler{}.Marshal(topic, message.NewMessage(e.Meta.ID, body))
		if err != nil {
			t.Fatal(err)
		}
		binding.Partition = int32(i % partitions)
		bare := &sarama.ProducerMessage{Topic: topic, Partition: int32((i + 1) % partitions), Value: sarama.ByteEncoder(body)}
		records = append(records, binding, bare)
	}
	if err := producer.SendMessages(records); err != nil {
		t.Fatal(err)
	}
	s.eventually(t, "every copy acked", func() bool { return d.acked.Load() >= int64(len(records)) },
		func() string {
			return fmt.Sprintf("%d of %d copies acked, %d charges for %d payments", d.acked.Load(), len(records), charges.Total(), n)
		})
	s.drained(t, &Env{Backlog: func(t testing.TB, topic string) int { return k.Backlog(t, g, topic) }}, topic)
	if err := charges.ExactlyOnce(ids); err != nil {
		t.Fatalf("%d payments produced twice: %v", n, err)
	}
	t.Logf("%s: %d payments produced twice (binding record and bare value, on two partitions), %d deliveries, %d charges",
		k.Name, n, d.started.Load(), charges.Total())
}
