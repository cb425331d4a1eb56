// Package reliability tries hard to break the kit's promises against the
// real servers: load with concurrent duplicates, store outages, a handler
// that outlives its lease. Sizes are small enough for CI; the environment
// variables below give the documented full sizes (docs/guarantees.md).
package reliability

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// envInt reads a size from the environment, or def.
func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

func randomName(prefix string) string { return prefix + testenv.RandomHex(4) }

// publishWithDuplicates publishes n envelopes to topic, 30% of them two or
// three times, interleaved; it returns their ids and the number of entries.
func publishWithDuplicates(t *testing.T, pub message.Publisher, topic string, n int) ([]string, int) {
	return testenv.PublishCopies(t, pub, topic, "urn:babel:load:item", n, func(i int) int {
		if i%10 < 3 { // 30%
			return 2 + i%2
		}
		return 1
	})
}

// consumer is a router on a Redis Streams subscriber with a client of its
// own (the subscriber closes it).
func startConsumer(t *testing.T, opts *redis.Options, topic, group, name string, mw message.HandlerMiddleware, h message.NoPublishHandlerFunc) (stop func()) {
	t.Helper()
	logger := watermill.NopLogger{}
	sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
		Client: redis.NewClient(opts), ConsumerGroup: group, Consumer: name, OldestId: "0",
		NackResendSleep: 20 * time.Millisecond, BlockTime: 100 * time.Millisecond, DisableIndefiniteInitialBlock: true,
		ClaimInterval: 200 * time.Millisecond, MaxIdleTime: 2 * time.Second,
	}, logger)
	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(mw)
	r.AddConsumerHandler("load", topic, sub, h)
	return testenv.RunRouter(t, r)
}

// TestLoadConcurrentConsumers: 8 consumers in one group share a redisstore
// with WithClaim; 30% of the messages are published two or three times.
// Every message runs exactly once, every entry is acked, and no goroutine is
// left once the routers are closed. LOAD_MESSAGES sets the size (CI: 10,000;
// full: 50,000).
func TestLoadConcurrentConsumers(t *testing.T) {
	if testing.Short() {
		t.Skip("load test")
	}
	client := testenv.Redis(t)
	leaks := goleak.IgnoreCurrent()
	ctx := context.Background()
	n := envInt("LOAD_MESSAGES", 10000)
	topic, group := randomName("bq-load-"), "workers"
	defer client.Del(ctx, topic)

	storeClient := redis.NewClient(client.Options())
	prefix := randomName("l")[:9] + ":"
	t.Cleanup(func() { _ = testenv.DropKeys(context.Background(), client, prefix+"*") })
	store := redisstore.New(storeClient, redisstore.WithPrefix(prefix), redisstore.WithTTL(10*time.Minute))
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: redis.NewClient(client.Options())}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	ids, entries := publishWithDuplicates(t, pub, topic, n)

	var fx testenv.Effects
	mw := idempotency.Middleware(store, idempotency.WithClaim(30*time.Second))
	start := time.Now()
	var stops []func()
	for i := range 8 {
		stops = append(stops, startConsumer(t, client.Options(), topic, group, fmt.Sprintf("c%d", i), mw, func(msg *message.Message) error {
			id, _ := envelope.ReadIdentity(msg.Payload)
			fx.Add(id.ID)
			return nil
		}))
	}
	deadline := time.Now().Add(10 * time.Minute)
	for !testenv.StreamDrained(ctx, client, topic, group, entries) {
		if time.Now().After(deadline) {
			t.Fatalf("not drained in time")
		}
		time.Sleep(50 * time.Millisecond)
	}
	elapsed := time.Since(start)
	for _, stop := range stops {
		stop()
	}
	_ = pub.Close()
	_ = storeClient.Close()
	if err := fx.ExactlyOnce(ids); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d messages as %d entries through 8 consumers in %v (%.0f deliveries/s)", n, entries, elapsed.Round(time.Millisecond),
		float64(entries)/elapsed.Seconds())
	goleak.VerifyNone(t, leaks)
}
