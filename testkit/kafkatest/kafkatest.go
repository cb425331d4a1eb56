// Package kafkatest gives tests a Kafka protocol server and the
// watermill-kafka publishers and subscribers (with marshal/kafkamarshal) the
// kit's Kafka tests use.
//
// Start returns the Kafka of KAFKA_BROKERS when it is set (a comma-separated
// list of bootstrap addresses: docker compose's kafka service is
// localhost:9092), and otherwise starts an in-process cluster of three
// brokers (franz-go's kfake) for the test, closed when it ends: the Kafka
// tests need no server of their own. Topics and consumer groups a test
// creates through a Cluster are deleted when it ends, on either.
//
// It is its own package, apart from testkit/testenv, so that only the
// test binaries that use Kafka link the in-process cluster.
package kafkatest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kfake"
	"go.uber.org/goleak"

	"github.com/babelqueue/watermill-idempotency/internal/kafkasession"
	"github.com/babelqueue/watermill-idempotency/marshal/kafkamarshal"
	"github.com/babelqueue/watermill-idempotency/redrive"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// EnvBrokers names the variable that points the tests at a real Kafka.
const EnvBrokers = "KAFKA_BROKERS"

// SessionTimeout is the consumer group session timeout of Config: how long
// the group waits for a member that stopped heartbeating (a killed
// process) before its partitions go to the others. A real Kafka must allow
// it (group.min.session.timeout.ms, 6 s by default; docker compose's kafka
// service lowers it to 500 ms).
const SessionTimeout = 3 * time.Second

// Cluster is one test's Kafka.
type Cluster struct {
	// Brokers are the bootstrap addresses.
	Brokers []string
	// Fake reports an in-process kfake cluster rather than KAFKA_BROKERS.
	Fake bool
	// Name says what the tests ran against, for their logs.
	Name  string
	admin sarama.ClusterAdmin
}

// StartOption configures Start.
type StartOption func(*startConfig)

type startConfig struct{ noAutoCreate bool }

// WithoutTopicAutoCreation starts a cluster whose brokers do not create a
// topic on first use (auto.create.topics.enable=false, as most managed
// clusters run). Only a kfake cluster can be so configured: with
// KAFKA_BROKERS set, the test is skipped.
func WithoutTopicAutoCreation() StartOption {
	return func(c *startConfig) { c.noAutoCreate = true }
}

// Start returns a Kafka for t: KAFKA_BROKERS, or a kfake cluster of three
// brokers closed when t ends. A KAFKA_BROKERS that does not answer fails
// the test: it was set on purpose.
func Start(t testing.TB, opts ...StartOption) *Cluster {
	t.Helper()
	var sc startConfig
	for _, opt := range opts {
		opt(&sc)
	}
	c := &Cluster{}
	if v := os.Getenv(EnvBrokers); v != "" {
		if sc.noAutoCreate {
			t.Skipf("%s=%s: the test needs brokers that do not create topics on first use, which only the in-process cluster can be told", EnvBrokers, v)
		}
		c.Brokers = strings.Split(v, ",")
		c.Name = "Kafka at " + v
	} else {
		kopts := []kfake.Opt{kfake.NumBrokers(3), kfake.GroupMinSessionTimeout(500 * time.Millisecond)}
		if !sc.noAutoCreate {
			kopts = append(kopts, kfake.AllowAutoTopicCreation()) // as a Kafka's auto.create.topics.enable default
		}
		fake, err := kfake.NewCluster(kopts...)
		if err != nil {
			t.Fatalf("start kfake: %v", err)
		}
		t.Cleanup(fake.Close)
		c.Brokers, c.Fake, c.Name = fake.ListenAddrs(), true, "kfake (franz-go's in-process Kafka)"
	}
	admin, err := sarama.NewClusterAdmin(c.Brokers, Config())
	if err != nil {
		t.Fatalf("%s: %v", c.Name, err)
	}
	t.Cleanup(func() { _ = admin.Close() })
	c.admin = admin
	return c
}

// Config is the sarama configuration of the tests' clients: the protocol of
// Kafka 2.1 (the oldest Kafka 4 still speaks), a new group reads from the
// oldest record, offsets are committed every 100 ms, and a group notices a
// member joining, leaving or dying within SessionTimeout.
func Config() *sarama.Config {
	c := sarama.NewConfig()
	c.Version = sarama.V2_1_0_0
	c.ClientID = "bq-kafkatest"
	c.Producer.Return.Successes = true // watermill-kafka's SyncProducer
	c.Producer.Retry.Max = 10
	c.Producer.Retry.Backoff = 50 * time.Millisecond
	c.Metadata.Retry.Backoff = 50 * time.Millisecond
	c.Consumer.Return.Errors = true
	c.Consumer.MaxWaitTime = 100 * time.Millisecond
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	c.Consumer.Offsets.AutoCommit.Interval = 100 * time.Millisecond
	c.Consumer.Group.Session.Timeout = SessionTimeout
	c.Consumer.Group.Heartbeat.Interval = 200 * time.Millisecond
	c.Consumer.Group.Rebalance.Timeout = 20 * time.Second
	c.Consumer.Group.Rebalance.Retry.Backoff = 100 * time.Millisecond
	return c
}

// Topic creates topic with partitions partitions; it is deleted when t
// ends (after what t opened later is closed).
func (c *Cluster) Topic(t testing.TB, topic string, partitions int32) {
	t.Helper()
	err := c.admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: 1}, false)
	if err != nil {
		t.Fatalf("create topic %s: %v", topic, err)
	}
	t.Cleanup(func() {
		if err := c.admin.DeleteTopic(topic); err != nil && !errors.Is(err, sarama.ErrUnknownTopicOrPartition) {
			t.Errorf("delete topic %s: %v", topic, err)
		}
	})
}

// DeleteTopicAtEnd deletes topic, created by a producer, when t ends.
func (c *Cluster) DeleteTopicAtEnd(t testing.TB, topic string) {
	t.Helper()
	t.Cleanup(func() {
		if err := c.admin.DeleteTopic(topic); err != nil && !errors.Is(err, sarama.ErrUnknownTopicOrPartition) {
			t.Errorf("delete topic %s: %v", topic, err)
		}
	})
}

// Group returns a consumer group name unique to t, deleted when t ends
// (after the subscribers t opened later are closed).
func (c *Cluster) Group(t testing.TB, prefix string) string {
	t.Helper()
	group := prefix + "-" + testenv.RandomHex(6)
	t.Cleanup(func() {
		err := c.admin.DeleteConsumerGroup(group)
		// A group that never committed may not exist.
		if err != nil && !errors.Is(err, sarama.ErrGroupIDNotFound) {
			t.Errorf("delete consumer group %s: %v", group, err)
		}
	})
	return group
}

// Publisher returns a watermill-kafka publisher with kafkamarshal, closed
// when t ends.
func (c *Cluster) Publisher(t testing.TB) *kafka.Publisher {
	t.Helper()
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers: c.Brokers, Marshaler: kafkamarshal.Marshaler{}, OverwriteSaramaConfig: Config(),
	}, watermill.NopLogger{})
	if err != nil {
		t.Fatalf("kafka publisher: %v", err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

// Subscriber returns a watermill-kafka subscriber of group with
// kafkamarshal, closed when t ends (or earlier, by its router).
func (c *Cluster) Subscriber(t testing.TB, group string) *kafka.Subscriber {
	t.Helper()
	sub, err := kafka.NewSubscriber(SubscriberConfig(c.Brokers, group), watermill.NopLogger{})
	if err != nil {
		t.Fatalf("kafka subscriber: %v", err)
	}
	t.Cleanup(func() { _ = sub.Close() })
	return sub
}

// JoiningSubscriber returns a subscriber of group (as Subscriber does)
// whose Subscribe returns once the group gave it its partitions
// (kafkasession.Joining), at most 30 s later: for a caller that counts idle
// time from Subscribe, such as redrive.Run.
func (c *Cluster) JoiningSubscriber(t testing.TB, group string) message.Subscriber {
	t.Helper()
	w := kafkasession.New()
	config := SubscriberConfig(c.Brokers, group)
	config.Tracer = w
	sub, err := kafka.NewSubscriber(config, watermill.NopLogger{})
	if err != nil {
		t.Fatalf("kafka subscriber: %v", err)
	}
	t.Cleanup(func() { _ = sub.Close() })
	return kafkasession.Joining(sub, w, 30*time.Second)
}

// SubscriberConfig is the watermill-kafka configuration of a subscriber of
// group, with kafkamarshal and Config; a nacked message comes back after
// 10 ms.
func SubscriberConfig(brokers []string, group string) kafka.SubscriberConfig {
	return kafka.SubscriberConfig{
		Brokers: brokers, ConsumerGroup: group, Unmarshaler: kafkamarshal.Marshaler{},
		OverwriteSaramaConfig: Config(), NackResendSleep: 10 * time.Millisecond,
		ReconnectRetrySleep: 100 * time.Millisecond,
	}
}

// Backlog returns how many records of topic group has not committed: over
// every partition, the end offset less the group's committed offset (the
// partition's oldest offset where the group has none).
func (c *Cluster) Backlog(t testing.TB, group, topic string) int {
	t.Helper()
	n, err := c.backlog(group, topic)
	if err != nil {
		t.Fatalf("backlog of %s for %s: %v", topic, group, err)
	}
	return n
}

func (c *Cluster) backlog(group, topic string) (int, error) {
	client, err := sarama.NewClient(c.Brokers, Config())
	if err != nil {
		return 0, err
	}
	defer client.Close()
	partitions, err := client.Partitions(topic)
	if err != nil {
		return 0, err
	}
	sort.Slice(partitions, func(i, j int) bool { return partitions[i] < partitions[j] })
	committed, err := c.admin.ListConsumerGroupOffsets(group, map[string][]int32{topic: partitions})
	if err != nil {
		return 0, err
	}
	total := 0
	for _, p := range partitions {
		newest, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return 0, err
		}
		oldest, err := client.GetOffset(topic, p, sarama.OffsetOldest)
		if err != nil {
			return 0, err
		}
		from := oldest
		if b := committed.GetBlock(topic, p); b != nil && !errors.Is(b.Err, sarama.ErrGroupIDNotFound) {
			if !errors.Is(b.Err, sarama.ErrNoError) {
				return 0, fmt.Errorf("committed offset of partition %d: %w", p, b.Err)
			}
			if b.Offset > from {
				from = b.Offset
			}
		}
		total += int(newest - from)
	}
	return total, nil
}

// IgnoreGoroutines are the goleak options of a package that uses Kafka:
// sarama's metrics library (go-metrics) runs one ticker for the life of
// the process, whatever client started it.
func IgnoreGoroutines() []goleak.Option {
	return []goleak.Option{goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick")}
}

// Ack subscribes sub to topic and acks n messages, within 30 s; it returns
// their UUIDs. The subscription lasts until ctx ends or sub is closed.
func Ack(ctx context.Context, t testing.TB, sub message.Subscriber, topic string, n int) map[string]bool {
	t.Helper()
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatalf("subscribe to %s: %v", topic, err)
	}
	timeout := time.NewTimer(30 * time.Second)
	defer timeout.Stop()
	acked := map[string]bool{}
	for len(acked) < n {
		select {
		case m := <-msgs:
			acked[m.UUID] = true
			m.Ack()
		case <-timeout.C:
			t.Fatalf("%d of %d messages received from %s", len(acked), n, topic)
		}
	}
	return acked
}

// Browse returns the messages of topic that group has not committed, read
// with redrive.KafkaBrowser and kafkamarshal (nothing committed, no group
// joined).
func (c *Cluster) Browse(t testing.TB, group, topic string) []*message.Message {
	t.Helper()
	client, err := sarama.NewClient(c.Brokers, Config())
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	var msgs []*message.Message
	err = redrive.KafkaBrowser(client, group, kafkamarshal.Marshaler{}).Browse(context.Background(), topic,
		func(m *message.Message) bool { msgs = append(msgs, m); return true })
	if err != nil && !errors.Is(err, redrive.ErrTopicNotFound) {
		t.Fatalf("browse %s: %v", topic, err)
	}
	return msgs
}
