package main

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/internal/testenv"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
)

// hostileRig is the README's wire on Redis Streams with one consumer, and an
// outermost middleware of the test's own that times every delivery as the
// router sees it.
type hostileRig struct {
	topic     string
	store     *redisstore.Store
	publisher message.Publisher

	mu         sync.Mutex
	deliveries []timedDelivery
}

type timedDelivery struct {
	took time.Duration
	err  error
}

func newHostileRig(t *testing.T, handler message.NoPublishHandlerFunc) *hostileRig {
	t.Helper()
	redisClient := testenv.Redis(t)
	run := testenv.RandomHex(4)
	r := &hostileRig{topic: "bq-hostile-" + run}
	prefix := "bq-hostile-" + run + ":"
	t.Cleanup(func() { cleanup(context.Background(), redisClient, r.topic, prefix) })
	r.store = redisstore.New(redisClient, redisstore.WithPrefix(prefix), redisstore.WithTTL(time.Hour))
	brokerClient := redis.NewClient(redisClient.Options())
	logger := watermill.NopLogger{}
	var err error
	if r.publisher, err = redisstream.NewPublisher(redisstream.PublisherConfig{Client: brokerClient}, logger); err != nil {
		t.Fatal(err)
	}
	subscriber, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
		Client: brokerClient, ConsumerGroup: "payments", OldestId: "0"}, logger)
	if err != nil {
		t.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc { // outermost: the router's view
		return func(msg *message.Message) ([]*message.Message, error) {
			start := time.Now()
			out, err := h(msg)
			r.mu.Lock()
			r.deliveries = append(r.deliveries, timedDelivery{took: time.Since(start), err: err})
			r.mu.Unlock()
			return out, err
		}
	})
	if err := wire(router, r.publisher, r.store); err != nil {
		t.Fatal(err)
	}
	router.AddConsumerHandler("charge", r.topic, subscriber, handler)
	testenv.RunRouter(t, router)
	return r
}

func (r *hostileRig) first(t *testing.T, within time.Duration) timedDelivery {
	t.Helper()
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		r.mu.Lock()
		if len(r.deliveries) > 0 {
			d := r.deliveries[0]
			r.mu.Unlock()
			return d
		}
		r.mu.Unlock()
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("no delivery came back from the chain within %v", within)
	return timedDelivery{}
}

// TestWireParkedCopyWaitsOneParkWait: a copy whose message is in flight in
// another worker for longer than the park wait goes back to the broker
// after about one park wait (the README: "waits for it (a second at most,
// WithParkWait) ... or goes back to the broker if the first is still
// running"). In the README's wire, Retry sits around the middleware and
// retried ErrInFlight, each retry waiting a whole park wait again: the
// consumer slot was held 4.7 s per parked copy.
func TestWireParkedCopyWaitsOneParkWait(t *testing.T) {
	t.Parallel()
	runs := 0
	var mu sync.Mutex
	r := newHostileRig(t, func(*message.Message) error {
		mu.Lock()
		runs++
		mu.Unlock()
		return nil
	})
	// Another worker holds the claim, for longer than the test.
	other := stores.WithClaimToken(context.Background(), "another-worker")
	key := idempotency.Key("charge", "payment-held")
	if ok, _, err := r.store.Claim(other, key, time.Minute); err != nil || !ok {
		t.Fatal(ok, err)
	}
	if err := send(r.publisher, r.topic, payment{"held", 100, "EUR"}); err != nil {
		t.Fatal(err)
	}
	d := r.first(t, 30*time.Second)
	if !errors.Is(d.err, idempotency.ErrInFlight) {
		t.Fatalf("the copy returned %v, want ErrInFlight (back to the broker)", d.err)
	}
	if d.took > idempotency.DefaultParkWait+500*time.Millisecond {
		t.Fatalf("the parked copy held its consumer %v before going back to the broker, want about one park wait (%v)",
			d.took.Round(10*time.Millisecond), idempotency.DefaultParkWait)
	}
	mu.Lock()
	defer mu.Unlock()
	if runs != 0 {
		t.Fatalf("the handler ran %d times while another worker held the claim", runs)
	}
}
