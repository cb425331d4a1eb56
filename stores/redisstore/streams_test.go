package redisstore_test

import (
	"bytes"
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/conformance"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// worker is one consumer-group member: a router on a Redis Streams
// subscriber.
func startWorker(t *testing.T, client redis.UniversalClient, group, consumer, topic string,
	mws []message.HandlerMiddleware, h message.NoPublishHandlerFunc) {
	t.Helper()
	logger := watermill.NopLogger{}
	sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
		Client: client, ConsumerGroup: group, Consumer: consumer, OldestId: "0",
		NackResendSleep: 20 * time.Millisecond, BlockTime: 100 * time.Millisecond,
		DisableIndefiniteInitialBlock: true,
	}, logger)
	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(mws...)
	r.AddConsumerHandler("charge", topic, sub, h)
	testenv.RunRouter(t, r)
}

func uniqueName(prefix string) string { return prefix + testPrefix()[1:9] }

// TestTwoWorkersOnRedisStreams: two consumer-group members share one
// redisstore with WithClaim. 2,000 payments (400 under -short), each
// published 1 to 3 times, give exactly one charge each, and every stream
// entry is acked.
func TestTwoWorkersOnRedisStreams(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	topic, group := uniqueName("bq-test-payments-"), uniqueName("workers-")
	t.Cleanup(func() { client.Del(context.Background(), topic) })
	store := redisstore.New(client, redisstore.WithPrefix(testPrefix()), redisstore.WithTTL(10*time.Minute))

	var charges testenv.Effects
	var handled, parked atomic.Int64
	observer := idempotency.ObserverFunc(func(_ context.Context, e idempotency.Event) {
		if e.Outcome == idempotency.OutcomePark {
			parked.Add(1)
		}
	})
	for _, consumer := range []string{"worker-1", "worker-2"} {
		startWorker(t, client, group, consumer, topic,
			[]message.HandlerMiddleware{idempotency.Middleware(store, idempotency.WithClaim(10*time.Second), idempotency.WithObserver(observer))},
			func(msg *message.Message) error {
				id, _ := envelope.ReadIdentity(msg.Payload)
				time.Sleep(200 * time.Microsecond) // the charge
				charges.Add(id.ID)
				handled.Add(1)
				return nil
			})
	}

	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: client}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	payments := 2000
	if testing.Short() {
		payments = 400
	}
	// 1, 2 or 3 copies, interleaved with other payments.
	ids, entries := testenv.PublishCopies(t, pub, topic, "urn:babel:payments:requested", payments, func(i int) int { return 1 + i%3 })

	// Done when every entry was delivered to the group and none is pending
	// (read but not acked).
	deadline := time.Now().Add(90 * time.Second)
	for !testenv.StreamDrained(context.Background(), client, topic, group, entries) {
		if time.Now().After(deadline) {
			t.Fatalf("not drained: %d entries, %d charges", entries, handled.Load())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := charges.ExactlyOnce(ids); err != nil {
		t.Fatalf("payments: %v", err)
	}
	t.Logf("%d entries for %d payments: %d charges, %d deliveries parked and redelivered", entries, payments, handled.Load(), parked.Load())
}

// TestPayloadIdentityOnRedisStreams is the conformance suite's
// redis.payload_identity block: the fixture goes through the broker and the
// middleware and reaches the handler byte for byte.
func TestPayloadIdentityOnRedisStreams(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	topic := uniqueName("bq-test-identity-")
	t.Cleanup(func() { client.Del(context.Background(), topic) })
	fixture := conformance.Fixture(t, "order-created.json")
	got := make(chan []byte, 1)
	startWorker(t, client, uniqueName("g-"), "c", topic,
		[]message.HandlerMiddleware{idempotency.Middleware(redisstore.New(client, redisstore.WithPrefix(testPrefix())))},
		func(msg *message.Message) error {
			got <- append([]byte(nil), msg.Payload...)
			return nil
		})
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: client}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), fixture)); err != nil {
		t.Fatal(err)
	}
	select {
	case payload := <-got:
		if !bytes.Equal(payload, fixture) {
			t.Fatalf("payload changed on the way:\n got %q\nwant %q", payload, fixture)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the fixture never reached the handler")
	}
}
