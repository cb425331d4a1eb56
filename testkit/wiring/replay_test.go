package wiring_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/redrive"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestOldMessageReplayedDeliberately follows what ErrTooOld tells an
// operator to do: a message older than the store's TTL is dead-lettered as
// too old; the operator forgets its record and redrives it with the replay
// marker; it then runs, once, as a replay.
func TestOldMessageReplayedDeliberately(t *testing.T) {
	t.Parallel()
	broker := testenv.Redis(t)
	ctx := context.Background()
	run := "bq-replay-" + testenv.RandomHex(4)
	topic, dlqTopic, prefix := run, run+".dlq", run+":"
	t.Cleanup(func() {
		broker.Del(ctx, topic, dlqTopic)
		_ = testenv.DropKeys(ctx, broker, prefix+"*")
	})
	store := redisstore.New(broker, redisstore.WithPrefix(prefix), redisstore.WithTTL(time.Hour))
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: redis.NewClient(broker.Options())}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	subscriber := func(group string) message.Subscriber {
		sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
			Client: redis.NewClient(broker.Options()), ConsumerGroup: group, Consumer: "c", OldestId: "0",
			NackResendSleep: 20 * time.Millisecond, BlockTime: 50 * time.Millisecond, DisableIndefiniteInitialBlock: true,
		}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		return sub
	}

	var runs, replays atomic.Int32
	dlq, err := deadletter.Middleware(pub)
	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(dlq, retry(), deadletter.CountAttempts, idempotency.Middleware(store))
	r.AddConsumerHandler("charge", topic, subscriber("orders"), func(msg *message.Message) error {
		runs.Add(1)
		if idempotency.IsReplay(msg.Context()) {
			replays.Add(1)
		}
		return nil
	})
	testenv.RunRouter(t, r)

	e, err := envelope.New("urn:babel:orders:charge", map[string]any{"amount": 10},
		envelope.WithQueue(topic), envelope.WithCreatedAt(time.Now().Add(-3*time.Hour)))
	if err != nil {
		t.Fatal(err)
	}
	payload, _ := e.Marshal()
	if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the too-old message dead-lettered", func() bool { return broker.XLen(ctx, dlqTopic).Val() == 1 })
	if runs.Load() != 0 {
		t.Fatalf("a message older than the horizon ran %d times", runs.Load())
	}

	// The operator's replay: forget, then redrive with the marker.
	if err := store.Forget(ctx, idempotency.Key("charge", e.Meta.ID)); err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	report, err := redrive.Run(rctx, subscriber("redrive"), pub, dlqTopic, redrive.WithReplayBypass(), redrive.WithMax(1), redrive.WithIdleTimeout(500*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	if report.Moved != 1 {
		t.Fatalf("redrive moved %d messages, want 1: %+v", report.Moved, report)
	}
	waitFor(t, "the replay to run", func() bool { return runs.Load() == 1 || broker.XLen(ctx, dlqTopic).Val() > 1 })
	if runs.Load() != 1 || replays.Load() != 1 {
		t.Fatalf("the replay ran %d times (%d as a replay), want once; dead letters: %d", runs.Load(), replays.Load(), broker.XLen(ctx, dlqTopic).Val())
	}
	if n := broker.XLen(ctx, dlqTopic).Val(); n != 1 {
		t.Fatalf("the replay was dead-lettered again (%d dead letters)", n)
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
