package redrive_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/marshal/kafkamarshal"
	"github.com/babelqueue/watermill-idempotency/redrive"
	"github.com/babelqueue/watermill-idempotency/testkit/kafkatest"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestKafkaBrowserStartsAtTheGroupsOffsets: on a topic of two partitions
// with six records, a group that acked some reads the rest, a group that
// never read reads all six, and a topic that does not exist is
// ErrTopicNotFound; the browse commits nothing.
func TestKafkaBrowserStartsAtTheGroupsOffsets(t *testing.T) {
	t.Parallel()
	k := kafkatest.Start(t)
	topic := "bq-browse-" + testenv.RandomHex(4)
	k.Topic(t, topic, 2)
	group := k.Group(t, "bq-browse")
	ids, _ := testenv.PublishCopies(t, k.Publisher(t), topic, "urn:babel:orders:created", 6, func(int) int { return 1 })

	// The group acks two messages, then stops.
	sub := k.Subscriber(t, group)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	acked := kafkatest.Ack(ctx, t, sub, topic, 2)
	for k.Backlog(t, group, topic) != 4 {
		if ctx.Err() != nil {
			t.Fatalf("backlog %d, want 4 once two acks are committed", k.Backlog(t, group, topic))
		}
		time.Sleep(20 * time.Millisecond)
	}
	_ = sub.Close()

	client, err := sarama.NewClient(k.Brokers, kafkatest.Config())
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	browse := func(group, topic string) ([]string, error) {
		var got []string
		err := redrive.KafkaBrowser(client, group, kafkamarshal.Marshaler{}).Browse(ctx, topic,
			func(m *message.Message) bool { got = append(got, m.UUID); return true })
		return got, err
	}
	rest, err := browse(group, topic)
	if err != nil {
		t.Fatal(err)
	}
	if len(rest) != 4 {
		t.Fatalf("group %s browses %d messages, want the 4 it has not acked", group, len(rest))
	}
	for _, id := range rest {
		if acked[id] {
			t.Fatalf("browse shows %s, which the group acked", id)
		}
	}
	all, err := browse("bq-browse-never", topic)
	if err != nil || len(all) != len(ids) {
		t.Fatalf("a new group browses %d of %d messages (%v)", len(all), len(ids), err)
	}
	if n := k.Backlog(t, group, topic); n != 4 {
		t.Fatalf("backlog %d after browsing, want 4: the browse committed", n)
	}
	if _, err := browse(group, topic+"-missing"); !errors.Is(err, redrive.ErrTopicNotFound) {
		t.Fatalf("browse of a missing topic: %v, want ErrTopicNotFound", err)
	}
}

// TestKafkaRoundReadsEveryPartitionWhole: a dead-letter topic of three
// partitions holding twelve dead letters, eight of them selected. Run
// through KafkaRound reads all twelve in one run, whatever partitions its
// put-backs land on, moves the eight, puts the four back; a second run
// reads only those four.
func TestKafkaRoundReadsEveryPartitionWhole(t *testing.T) {
	t.Parallel()
	k := kafkatest.Start(t)
	topic := "bq-round-" + testenv.RandomHex(4)
	dlq := topic + ".dlq"
	k.Topic(t, topic, 1)
	k.Topic(t, dlq, 3)
	group := k.Group(t, "bq-redrive")
	pub := k.Publisher(t)
	var dead []*message.Message
	for i := range 12 {
		reason := envelope.ReasonPoison
		if i%3 == 0 {
			reason = envelope.ReasonFailed
		}
		e, err := envelope.New("urn:babel:orders:created", map[string]int{"order": i}, envelope.WithQueue(topic))
		if err != nil {
			t.Fatal(err)
		}
		e.DeadLetter = &envelope.DeadLetter{Reason: reason, OriginalQueue: topic, Attempts: 3, Lang: "go", FailedAt: 1}
		body, _ := e.Marshal()
		dead = append(dead, message.NewMessage(e.Meta.ID, body))
	}
	if err := pub.Publish(dlq, dead...); err != nil {
		t.Fatal(err)
	}
	client, err := sarama.NewClient(k.Brokers, kafkatest.Config())
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	run := func() redrive.Report {
		t.Helper()
		sub := redrive.KafkaRound(k.Subscriber(t, group), client, group)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		report, err := redrive.Run(ctx, sub, pub, dlq, redrive.WithReasons(envelope.ReasonPoison), redrive.WithIdleTimeout(10*time.Second))
		time.Sleep(200 * time.Millisecond) // let the last ack reach the broker
		_ = sub.Close()
		if err != nil {
			t.Fatal(err)
		}
		return report
	}
	if r := run(); len(r.Entries) != 12 || r.Moved != 8 || r.PutBack != 4 {
		t.Fatalf("first run: %d read, %d moved, %d put back; want 12, 8, 4", len(r.Entries), r.Moved, r.PutBack)
	}
	if r := run(); len(r.Entries) != 4 || r.Moved != 0 || r.PutBack != 4 {
		t.Fatalf("second run: %d read, %d moved, %d put back; want 4, 0, 4", len(r.Entries), r.Moved, r.PutBack)
	}
}
