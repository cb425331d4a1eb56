package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// acks counts how deliveries ended. Added as the outermost middleware, it
// sees every delivery the router hands out and waits for the router's ack
// or nack of it.
type acks struct {
	acked, nacked atomic.Int64
	wg            sync.WaitGroup
}

func (a *acks) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		a.wg.Add(1)
		go func() {
			defer a.wg.Done()
			select {
			case <-msg.Acked():
				a.acked.Add(1)
			case <-msg.Nacked():
				a.nacked.Add(1)
			case <-time.After(10 * time.Second):
			}
		}()
		return h(msg)
	}
}

func newRouter(t *testing.T) *message.Router {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func newPubSub() *gochannel.GoChannel {
	return gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{})
}

// eventually waits for cond.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func idOf(msg *message.Message) string {
	id, _ := envelope.ReadIdentity(msg.Payload)
	return id.ID
}

func publish(t *testing.T, pub message.Publisher, topic string, payload []byte) {
	t.Helper()
	if err := pub.Publish(topic, msgOf(payload)); err != nil {
		t.Fatal(err)
	}
}

func TestRouterSkipsRedeliveriesAndAcksThem(t *testing.T) {
	t.Parallel()
	ps := newPubSub()
	var a acks
	var fx testenv.Effects
	r := newRouter(t)
	// Copies published back to back can be handled at the same moment:
	// WithClaim is what promises one run then.
	r.AddMiddleware(a.middleware, idempotency.Middleware(memstore.New(), idempotency.WithClaim(10*time.Second)))
	r.AddConsumerHandler("charge", "payments", ps, func(msg *message.Message) error {
		fx.Add(idOf(msg))
		return nil
	})
	testenv.RunRouter(t, r)

	dup, other := envelopeWithID(t, "pay-1"), envelopeWithID(t, "pay-2")
	for range 5 {
		publish(t, ps, "payments", dup)
	}
	publish(t, ps, "payments", other)
	eventually(t, "6 deliveries acked", func() bool { return a.acked.Load() == 6 })
	a.wg.Wait()
	if fx.Count("pay-1") != 1 || fx.Count("pay-2") != 1 {
		t.Fatalf("effects: dup=%d other=%d, want 1 each", fx.Count("pay-1"), fx.Count("pay-2"))
	}
	// A copy that met the first one in flight was parked (nacked) and came
	// back; every delivery ended acked.
}

func TestRouterRedeliversAFailedHandlerThenRunsIt(t *testing.T) {
	t.Parallel()
	ps := newPubSub()
	var a acks
	var attempts atomic.Int64
	r := newRouter(t)
	r.AddMiddleware(a.middleware, idempotency.Middleware(memstore.New()))
	r.AddConsumerHandler("charge", "payments", ps, func(msg *message.Message) error {
		if attempts.Add(1) == 1 {
			return errors.New("gateway timeout")
		}
		return nil
	})
	testenv.RunRouter(t, r)

	payload := envelopeWithID(t, "pay-1")
	publish(t, ps, "payments", payload)
	eventually(t, "the redelivery to succeed", func() bool { return a.acked.Load() == 1 })
	publish(t, ps, "payments", payload)
	eventually(t, "the duplicate to be acked", func() bool { return a.acked.Load() == 2 })
	a.wg.Wait()
	if attempts.Load() != 2 || a.nacked.Load() != 1 {
		t.Fatalf("attempts=%d nacked=%d, want 2 attempts (fail, succeed) and 1 nack", attempts.Load(), a.nacked.Load())
	}
}

func TestRouterTwoHandlersOnOneTopicEachRunOnce(t *testing.T) {
	t.Parallel()
	ps := newPubSub()
	store := memstore.New()
	var a acks
	var charge, email testenv.Effects
	r := newRouter(t)
	r.AddMiddleware(a.middleware, idempotency.Middleware(store, idempotency.WithClaim(10*time.Second)))
	r.AddConsumerHandler("charge", "orders", ps, func(msg *message.Message) error {
		charge.Add(idOf(msg))
		return nil
	})
	r.AddConsumerHandler("email", "orders", ps, func(msg *message.Message) error {
		email.Add(idOf(msg))
		return nil
	})
	testenv.RunRouter(t, r)

	payload := envelopeWithID(t, "order-1")
	for range 3 {
		publish(t, ps, "orders", payload)
	}
	eventually(t, "6 deliveries acked", func() bool { return a.acked.Load() == 6 })
	if charge.Total() != 1 || email.Total() != 1 {
		t.Fatalf("charge ran %d times, email %d; want each once", charge.Total(), email.Total())
	}
	// Records are scoped by handler name.
	for _, scope := range []string{"charge", "email"} {
		if seen, _ := stores.Seen(context.Background(), store, idempotency.Key(scope, "order-1")); !seen {
			t.Fatalf("no record under scope %q", scope)
		}
	}
}

// flakyPublisher fails its first publishes, like a broker that is briefly
// unreachable.
type flakyPublisher struct {
	message.Publisher
	failures atomic.Int64
}

func (f *flakyPublisher) Publish(topic string, msgs ...*message.Message) error {
	if f.failures.Add(-1) >= 0 {
		return errors.New("publish: broker unreachable")
	}
	return f.Publisher.Publish(topic, msgs...)
}

func TestRouterRemembersOnlyAfterProducedMessagesArePublished(t *testing.T) {
	t.Parallel()
	ps := newPubSub()
	store := memstore.New()
	out := &flakyPublisher{Publisher: ps}
	out.failures.Store(1)
	var a acks
	var runs atomic.Int64
	r := newRouter(t)
	r.AddMiddleware(a.middleware, idempotency.Middleware(store))
	r.AddHandler("invoice", "orders", ps, "invoices", out, func(msg *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		return []*message.Message{msgOf(envelopeWithID(t, "invoice-for-order-1"))}, nil
	})
	invoices, err := ps.Subscribe(context.Background(), "invoices")
	if err != nil {
		t.Fatal(err)
	}
	testenv.RunRouter(t, r)

	payload := envelopeWithID(t, "order-1")
	publish(t, ps, "orders", payload)
	select {
	case inv := <-invoices:
		inv.Ack()
	case <-time.After(10 * time.Second):
		t.Fatal("the invoice was never published: the message was lost")
	}
	// The first run's publication failed: the delivery was nacked, the
	// message not remembered, and the redelivery ran the handler again.
	eventually(t, "the order to be remembered after its ack", func() bool {
		seen, _ := stores.Seen(context.Background(), store, idempotency.Key("invoice", "order-1"))
		return seen
	})
	if runs.Load() != 2 || a.nacked.Load() != 1 {
		t.Fatalf("runs=%d nacked=%d, want 2 runs and 1 nack", runs.Load(), a.nacked.Load())
	}
	publish(t, ps, "orders", payload)
	eventually(t, "the duplicate to be acked", func() bool { return a.acked.Load() == 2 })
	if runs.Load() != 2 {
		t.Fatalf("a duplicate of a remembered message ran: runs=%d", runs.Load())
	}
	select {
	case inv := <-invoices:
		t.Fatalf("a second invoice was published: %s", inv.Payload)
	case <-time.After(50 * time.Millisecond):
	}
}

func TestRouterWithClaimConcurrentDeliveriesGiveOneEffect(t *testing.T) {
	t.Parallel()
	ps := newPubSub()
	store := memstore.New()
	var a acks
	var fx testenv.Effects
	var inFlight, maxInFlight atomic.Int64
	handler := func(msg *message.Message) error {
		n := inFlight.Add(1)
		defer inFlight.Add(-1)
		for {
			m := maxInFlight.Load()
			if n <= m || maxInFlight.CompareAndSwap(m, n) {
				break
			}
		}
		time.Sleep(20 * time.Millisecond) // a slow charge widens the race
		fx.Add(idOf(msg))
		return nil
	}
	// Two routers (two workers) with the same handler name, fed the same
	// messages: every message is delivered to both at the same time.
	for range 2 {
		r := newRouter(t)
		r.AddMiddleware(a.middleware, idempotency.Middleware(store, idempotency.WithClaim(5*time.Second), idempotency.WithParkWait(0)))
		r.AddConsumerHandler("charge", "payments", ps, handler)
		testenv.RunRouter(t, r)
	}
	const ids, copies = 20, 3
	var wg sync.WaitGroup
	for i := range ids {
		payload := envelopeWithID(t, fmt.Sprintf("pay-%d", i))
		for range copies {
			wg.Add(1)
			go func() {
				defer wg.Done()
				publish(t, ps, "payments", payload)
			}()
		}
	}
	wg.Wait()
	// Every copy reaches both workers; each delivery is eventually acked
	// (run or skipped), the parked ones after their redelivery.
	eventually(t, "every delivery acked", func() bool { return a.acked.Load() == ids*copies*2 })
	if fx.Total() != ids {
		t.Fatalf("%d effects for %d messages", fx.Total(), ids)
	}
	for i := range ids {
		if n := fx.Count(fmt.Sprintf("pay-%d", i)); n != 1 {
			t.Fatalf("pay-%d charged %d times", i, n)
		}
	}
	if maxInFlight.Load() < 2 {
		t.Fatalf("deliveries never overlapped (max in flight %d): the test did not race", maxInFlight.Load())
	}
	if a.nacked.Load() == 0 {
		t.Fatal("no delivery was parked: the test did not race")
	}
}
