package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
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

// newHostileRig starts the rig; storeClient, when not nil, is the store's
// Redis client (through a fault proxy, say), the broker's being direct.
func newHostileRig(t *testing.T, storeClient *redis.Client, handler message.NoPublishHandlerFunc) *hostileRig {
	t.Helper()
	redisClient := testenv.Redis(t)
	run := testenv.RandomHex(4)
	r := &hostileRig{topic: "bq-hostile-" + run}
	prefix := "bq-hostile-" + run + ":"
	t.Cleanup(func() { cleanup(context.Background(), redisClient, r.topic, prefix) })
	if storeClient == nil {
		storeClient = redisClient
	}
	r.store = redisstore.New(storeClient, redisstore.WithPrefix(prefix), redisstore.WithTTL(time.Hour))
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
	r := newHostileRig(t, nil, func(*message.Message) error {
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

// TestWireRidesOutAStoreOutage: the README's wire on Redis Streams while
// the store's Redis is unreachable (a fault proxy cut for 3 s, the broker
// reachable): the deliveries meeting the outage go back to the broker,
// none is dead-lettered or acked unrun, and once the store is back every
// payment is charged exactly once.
func TestWireRidesOutAStoreOutage(t *testing.T) {
	if testing.Short() {
		t.Skip("slow: a 3 s store outage")
	}
	t.Parallel()
	direct := testenv.Redis(t)
	proxy := testenv.NewFaultProxy(t, direct.Options().Addr)
	opts := *direct.Options()
	opts.Addr = proxy.Addr()
	storeClient := redis.NewClient(&opts)
	t.Cleanup(func() { _ = storeClient.Close() })
	var mu sync.Mutex
	charged := map[string]int{}
	r := newHostileRig(t, storeClient, func(msg *message.Message) error {
		mu.Lock()
		charged[msg.UUID]++
		mu.Unlock()
		return nil
	})
	proxy.Cut()
	const payments = 20
	for i := range payments {
		if err := send(r.publisher, r.topic, payment{fmt.Sprint(5000 + i), 100, "EUR"}); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(3 * time.Second)
	mu.Lock()
	during := len(charged)
	mu.Unlock()
	proxy.Restore()
	deadline := time.Now().Add(45 * time.Second)
	for {
		mu.Lock()
		n := len(charged)
		mu.Unlock()
		if n == payments || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond) // a late second run would show now
	mu.Lock()
	defer mu.Unlock()
	if during != 0 {
		t.Errorf("%d payments charged while the store was unreachable, want 0", during)
	}
	if len(charged) != payments {
		t.Fatalf("%d of %d payments charged after the outage", len(charged), payments)
	}
	for id, n := range charged {
		if n != 1 {
			t.Errorf("payment %s charged %d times", id, n)
		}
	}
	if n, err := direct.XLen(context.Background(), r.topic+".dlq").Result(); err != nil && !errors.Is(err, redis.Nil) || n != 0 {
		t.Fatalf("%d dead letters (%v) after a store outage, want none", n, err)
	}
}

// TestWirePanickingHandler: a handler that panics is a failure like any
// other in the README's wire: its claim is released at the panic, so that
// Retry's next attempt runs at once (not parked behind its own claim); a
// payment whose handler panics once is charged once, and one whose handler
// always panics is dead-lettered after four runs, its claim released and
// its end remembered (a redelivery of it is acked without running).
func TestWirePanickingHandler(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	runs := map[string]int{}
	r := newHostileRig(t, nil, func(msg *message.Message) error {
		mu.Lock()
		runs[msg.UUID]++
		n := runs[msg.UUID]
		mu.Unlock()
		if msg.UUID == "payment-always" || n == 1 {
			panic("bug in the handler")
		}
		return nil
	})
	for _, id := range []string{"once", "always"} {
		if err := send(r.publisher, r.topic, payment{id, 100, "EUR"}); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		mu.Lock()
		done := runs["payment-once"] >= 2 && runs["payment-always"] >= 4
		mu.Unlock()
		if done || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond)
	mu.Lock()
	once, always := runs["payment-once"], runs["payment-always"]
	mu.Unlock()
	if once != 2 || always != 4 {
		t.Fatalf("runs: %d of the payment panicking once (want 2), %d of the one always panicking (want 4)", once, always)
	}
	for id, want := range map[string]stores.State{"payment-once": stores.StateRemembered, "payment-always": stores.StateEnded} {
		rec, err := r.store.Lookup(context.Background(), idempotency.Key("charge", id))
		if err != nil || rec.State != want {
			t.Fatalf("%s is %v (%v), want %v", id, rec.State, err, want)
		}
	}
	direct := testenv.Redis(t)
	if n, err := direct.XLen(context.Background(), r.topic+".dlq").Result(); err != nil || n != 1 {
		t.Fatalf("%d dead letters (%v), want the one always panicking", n, err)
	}
}
