package redislist_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// startWorker runs one router consuming queue through its own Subscriber.
func startWorker(t *testing.T, client redis.UniversalClient, queue string, mws []message.HandlerMiddleware, h message.NoPublishHandlerFunc) {
	t.Helper()
	_, sub := newPubSub(t, client)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(mws...)
	r.AddConsumerHandler("charge", queue, sub, h)
	testenv.RunRouter(t, r)
}

// drained reports that the queue and its processing list are empty: every
// delivery was acked.
func drained(client redis.UniversalClient, queue string) bool {
	n, err := client.Exists(context.Background(), queue, queue+":processing", queue+":processing:leases").Result()
	return err == nil && n == 0
}

// allAcked waits until every payment is charged and every copy acked,
// for as long as the router makes progress: it fails after 10 s in which
// neither the charges nor the queue moved (a loaded machine takes longer
// than any fixed time for 600 copies, one round trip after another), and
// says what it saw.
func allAcked(t *testing.T, client redis.UniversalClient, queue string, charges *testenv.Effects, payments int) {
	t.Helper()
	ctx := context.Background()
	state := func() [3]int64 {
		return [3]int64{int64(charges.Total()), client.LLen(ctx, queue).Val(), client.LLen(ctx, queue+":processing").Val()}
	}
	last, moved := state(), time.Now()
	for !(charges.Total() >= payments && drained(client, queue)) {
		if now := state(); now != last {
			last, moved = now, time.Now()
		} else if time.Since(moved) > 10*time.Second {
			t.Fatalf("no progress for 10 s: %d of %d payments charged, %d copies ready, %d in processing", last[0], payments, last[1], last[2])
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func newStore(t *testing.T, client redis.UniversalClient) *redisstore.Store {
	prefix := keyPrefix(t, client)
	return redisstore.New(client, redisstore.WithPrefix(prefix+"idem:"), redisstore.WithTTL(10*time.Minute))
}

// TestRouterSkipsDuplicatesAndAcksThem: each payment published 1 to 3
// times is charged once, and every copy is acked.
func TestRouterSkipsDuplicatesAndAcksThem(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	queue := keyPrefix(t, client) + "payments"
	store := newStore(t, client)
	var charges testenv.Effects
	startWorker(t, client, queue, []message.HandlerMiddleware{idempotency.Middleware(store)}, func(msg *message.Message) error {
		charges.Add(msg.UUID)
		return nil
	})
	pub, _ := newPubSub(t, client)
	ids, entries := testenv.PublishCopies(t, pub, queue, "urn:babel:payments:requested", 300, func(i int) int { return 1 + i%3 })
	allAcked(t, client, queue, &charges, len(ids))
	if err := charges.ExactlyOnce(ids); err != nil {
		t.Fatalf("%d copies of %d payments: %v", entries, len(ids), err)
	}
}

// TestRouterRedeliversAFailure: a handler that fails is nacked, the
// message comes back with attempts one higher and then runs once.
func TestRouterRedeliversAFailure(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	queue := keyPrefix(t, client) + "payments"
	store := newStore(t, client)
	var charges testenv.Effects
	var mu sync.Mutex
	attempts := map[string][]int{}
	startWorker(t, client, queue, []message.HandlerMiddleware{idempotency.Middleware(store)}, func(msg *message.Message) error {
		e, err := envelope.Parse(msg.Payload)
		if err != nil {
			return err
		}
		mu.Lock()
		attempts[e.Meta.ID] = append(attempts[e.Meta.ID], e.Attempts)
		first := len(attempts[e.Meta.ID]) == 1
		mu.Unlock()
		if first {
			return errors.New("gateway timeout")
		}
		charges.Add(e.Meta.ID)
		return nil
	})
	pub, _ := newPubSub(t, client)
	ids, _ := testenv.PublishCopies(t, pub, queue, "urn:babel:payments:requested", 50, func(int) int { return 1 })
	allAcked(t, client, queue, &charges, len(ids))
	if err := charges.ExactlyOnce(ids); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, id := range ids {
		if got := attempts[id]; len(got) != 2 || got[0] != 0 || got[1] != 1 {
			t.Fatalf("payment %s ran with attempts %v, want [0 1]", id, got)
		}
	}
}

// TestRouterConcurrentCopiesUnderClaim: two workers share the queue and a
// store with WithClaim; copies arriving together give one charge each, a
// copy parked while the first runs is nacked, comes back and is skipped.
func TestRouterConcurrentCopiesUnderClaim(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	queue := keyPrefix(t, client) + "payments"
	store := newStore(t, client)
	var charges testenv.Effects
	var parked atomic.Int64
	observer := idempotency.ObserverFunc(func(_ context.Context, e idempotency.Event) {
		if e.Outcome == idempotency.OutcomePark {
			parked.Add(1)
		}
	})
	for range 2 {
		startWorker(t, client, queue, []message.HandlerMiddleware{
			idempotency.Middleware(store, idempotency.WithClaim(10*time.Second), idempotency.WithObserver(observer)),
		}, func(msg *message.Message) error {
			time.Sleep(2 * time.Millisecond) // the charge
			charges.Add(msg.UUID)
			return nil
		})
	}
	pub, _ := newPubSub(t, client)
	ids, entries := testenv.PublishCopies(t, pub, queue, "urn:babel:payments:requested", 300, func(i int) int { return 2 + i%2 })
	allAcked(t, client, queue, &charges, len(ids))
	if err := charges.ExactlyOnce(ids); err != nil {
		t.Fatalf("%d copies of %d payments: %v", entries, len(ids), err)
	}
	t.Logf("%d copies of %d payments: %d parked and redelivered", entries, len(ids), parked.Load())
}
