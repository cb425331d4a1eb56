package kafkatopics_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.uber.org/goleak"

	"github.com/babelqueue/watermill-idempotency/brokers/kafkatopics"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/kafkatest"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// A router whose Run failed to subscribe leaves the goroutine that waits
// for its handlers to stop, for ever (Watermill 1.5): a process exits
// then.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, append(kafkatest.IgnoreGoroutines(),
		goleak.IgnoreAnyFunction("github.com/ThreeDotsLabs/watermill/message.(*Router).watchAllHandlersStopped.func1"))...)
}

// client is a sarama client of k, closed when t ends.
func client(t *testing.T, k *kafkatest.Cluster) sarama.Client {
	t.Helper()
	c, err := sarama.NewClient(k.Brokers, kafkatest.Config())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// deadLetterRouter runs the README's wiring (the dead-letter middleware in
// front of the guard) on topic with a handler that always fails, checking
// dead-letter topics with checker at Subscribe and before the first
// message. It returns the router and its handler's runs.
func deadLetterRouter(t *testing.T, k *kafkatest.Cluster, topic string, checker deadletter.TopicChecker) (*message.Router, *atomic.Int32) {
	t.Helper()
	pub := k.Publisher(t)
	opts := []deadletter.Option{deadletter.WithTopicCheck(checker)}
	dlq, err := deadletter.Middleware(pub, opts...)
	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(dlq, idempotency.Middleware(memstore.New()))
	r.AddSubscriberDecorators(deadletter.CheckOnSubscribe(pub, opts...))
	runs := new(atomic.Int32)
	r.AddConsumerHandler("charge", topic, k.Subscriber(t, k.Group(t, "bq-topics")), func(*message.Message) error {
		runs.Add(1)
		return fmt.Errorf("card declined: %w", idempotency.ErrPermanent)
	})
	return r, runs
}

// TestMissingDeadLetterTopicIsRefusedBeforeAnyRun: on brokers that do not
// create topics on first use (as managed clusters run), a missing
// "<topic>.dlq" made every dead letter fail after the producer's retries:
// the issue counted 345 runs of one failing message in 41 s, no dead
// letter, its partition stalled. Topics without WithCreate makes
// Router.Run fail before any run, with ErrNoTopic naming the topic and the
// fix; with WithCreate, the check creates the topic and the failure is
// dead-lettered once.
func TestMissingDeadLetterTopicIsRefusedBeforeAnyRun(t *testing.T) {
	t.Parallel()
	k := kafkatest.Start(t, kafkatest.WithoutTopicAutoCreation())
	topic := "bq-topics-" + testenv.RandomHex(6)
	k.Topic(t, topic, 1)
	if err := k.Publisher(t).Publish(topic, message.NewMessage(watermill.NewUUID(), []byte(`{}`))); err != nil {
		t.Fatal(err)
	}
	c := client(t, k)

	r, runs := deadLetterRouter(t, k, topic, kafkatopics.NewTopics(c))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := r.Run(ctx)
	if !errors.Is(err, deadletter.ErrTopicUnusable) || !errors.Is(err, kafkatopics.ErrNoTopic) ||
		!strings.Contains(err.Error(), topic+".dlq") || !strings.Contains(err.Error(), "kafkatopics.WithCreate") {
		t.Fatalf("Router.Run = %v\nwant ErrTopicUnusable and ErrNoTopic naming %s.dlq and the fix", err, topic)
	}
	if runs.Load() != 0 {
		t.Fatalf("%d runs before the check failed the router", runs.Load())
	}

	k.DeleteTopicAtEnd(t, topic+".dlq")
	r, runs = deadLetterRouter(t, k, topic, kafkatopics.NewTopics(c, kafkatopics.WithCreate(sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1})))
	stop := testenv.RunRouter(t, r)
	testenv.Eventually(t, "the dead letter on "+topic+".dlq", func() bool { return len(k.Browse(t, "bq-topics-none", topic+".dlq")) == 1 })
	stop()
	if runs.Load() != 1 {
		t.Fatalf("%d runs of a message rejected for good, want 1", runs.Load())
	}
}

// TestAutoCreatedDeadLetterTopicPassesTheCheck: where brokers create
// topics on first use (Kafka's default), the check creates the missing
// dead-letter topic by asking for it, as a producer would, and passes.
func TestAutoCreatedDeadLetterTopicPassesTheCheck(t *testing.T) {
	t.Parallel()
	k := kafkatest.Start(t)
	dlq := "bq-topics-" + testenv.RandomHex(6) + ".dlq"
	k.DeleteTopicAtEnd(t, dlq)
	c := client(t, k)
	if err := kafkatopics.NewTopics(c).CheckTopic(context.Background(), dlq); err != nil {
		t.Fatalf("CheckTopic(%s) with auto-creation on: %v", dlq, err)
	}
	partitions, err := c.Partitions(dlq)
	if err != nil || len(partitions) == 0 {
		t.Fatalf("after the check, %s has partitions %v (%v)", dlq, partitions, err)
	}
}

// TestCheckHonoursItsContext: a check whose context ends first returns by
// it, with the context's error.
func TestCheckHonoursItsContext(t *testing.T) {
	t.Parallel()
	k := kafkatest.Start(t, kafkatest.WithoutTopicAutoCreation())
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := kafkatopics.NewTopics(client(t, k)).CheckTopic(ctx, "bq-topics-"+testenv.RandomHex(6))
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
}
