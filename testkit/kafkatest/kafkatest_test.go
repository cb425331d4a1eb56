package kafkatest_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.uber.org/goleak"

	"github.com/babelqueue/watermill-idempotency/testkit/kafkatest"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, kafkatest.IgnoreGoroutines()...)
}

// TestRoundTrip: a record published to a topic of the cluster reaches a
// subscriber of a group; once it is acked the group's backlog is empty.
func TestRoundTrip(t *testing.T) {
	t.Parallel()
	k := kafkatest.Start(t)
	topic := "kafkatest-" + testenv.RandomHex(4)
	k.Topic(t, topic, 3)
	group := k.Group(t, "kafkatest")
	sub := k.Subscriber(t, group)
	ids, _ := testenv.PublishCopies(t, k.Publisher(t), topic, "urn:babel:test:ping", 5, func(int) int { return 1 })
	seen := kafkatest.Ack(context.Background(), t, sub, topic, len(ids))
	for _, id := range ids {
		if !seen[id] {
			t.Fatalf("message %s not received (the UUID is meta.id): %v", id, seen)
		}
	}
	deadline := time.Now().Add(20 * time.Second)
	for n := k.Backlog(t, group, topic); n != 0; n = k.Backlog(t, group, topic) {
		if time.Now().After(deadline) {
			t.Fatalf("backlog %d after every message was acked", n)
		}
		time.Sleep(20 * time.Millisecond)
	}
	_ = sub.Close()
	var _ message.Subscriber = sub
	t.Logf("%s: %d messages through group %s", k.Name, len(ids), group)
}
