package redislist_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/pubsub/redislist"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// BenchmarkRouter drains b.N envelopes, published beforehand, through one
// router with the idempotency middleware on redisstore and the same
// handler, from this package's reliable list and from watermill-redisstream
// (a consumer group on a stream), with 1 and 4 consumers. msgs/s is the
// figure to compare; publishing is not timed. Run it in interleaved rounds
// (a shell loop over -count 1) on a loaded machine: see docs/benchmarks.md.
func BenchmarkRouter(b *testing.B) {
	client := testenv.Redis(b)
	for _, consumers := range []int{1, 4} {
		b.Run(fmt.Sprintf("consumers=%d/redislist", consumers), func(b *testing.B) {
			queue := keyPrefix(b, client) + "payments"
			pub, err := redislist.NewPublisher(client)
			if err != nil {
				b.Fatal(err)
			}
			subs := make([]message.Subscriber, consumers)
			for i := range subs {
				if subs[i], err = redislist.NewSubscriber(client); err != nil {
					b.Fatal(err)
				}
			}
			benchRouter(b, client, pub, subs, queue)
		})
		b.Run(fmt.Sprintf("consumers=%d/redisstream", consumers), func(b *testing.B) {
			stream := keyPrefix(b, client) + "payments"
			group := "workers"
			// redisstream closes its client on Close: one of its own.
			own := redis.NewClient(client.Options())
			b.Cleanup(func() { _ = own.Close() })
			pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: own}, watermill.NopLogger{})
			if err != nil {
				b.Fatal(err)
			}
			subs := make([]message.Subscriber, consumers)
			for i := range subs {
				subs[i], err = redisstream.NewSubscriber(redisstream.SubscriberConfig{
					Client: own, ConsumerGroup: group, Consumer: fmt.Sprintf("c%d", i), OldestId: "0",
					DisableIndefiniteInitialBlock: true, BlockTime: 100 * time.Millisecond,
				}, watermill.NopLogger{})
				if err != nil {
					b.Fatal(err)
				}
			}
			benchRouter(b, client, pub, subs, stream)
		})
	}
}

func benchRouter(b *testing.B, client redis.UniversalClient, pub message.Publisher, subs []message.Subscriber, topic string) {
	b.Helper()
	prefix := keyPrefix(b, client)
	testenv.PublishCopies(b, pub, topic, "urn:babel:payments:requested", b.N, func(int) int { return 1 })
	store := redisstore.New(client, redisstore.WithPrefix(prefix+"idem:"), redisstore.WithTTL(time.Hour))
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		b.Fatal(err)
	}
	r.AddMiddleware(idempotency.Middleware(store))
	var handled atomic.Int64
	done := make(chan struct{})
	for i, sub := range subs {
		r.AddConsumerHandler(fmt.Sprintf("charge-%d", i), topic, sub, func(*message.Message) error {
			if handled.Add(1) == int64(b.N) {
				close(done)
			}
			return nil
		})
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b.ResetTimer()
	start := time.Now()
	go func() { _ = r.Run(ctx) }()
	select {
	case <-done:
	case <-time.After(5 * time.Minute):
		b.Fatalf("%d of %d handled", handled.Load(), b.N)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
	cancel()
	_ = r.Close()
}
