package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// letters collects the dead letters published to it; fail makes the next
// publications fail.
type letters struct {
	mu   sync.Mutex
	msgs []*message.Message
	fail atomic.Int32 // publications left to fail
}

func (l *letters) Publish(_ string, msgs ...*message.Message) error {
	if l.fail.Load() > 0 {
		l.fail.Add(-1)
		return errors.New("broker refused the dead letter")
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.msgs = append(l.msgs, msgs...)
	return nil
}

func (*letters) Close() error { return nil }

func (l *letters) len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.msgs)
}

func (l *letters) get(i int) *message.Message {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.msgs[i]
}

// production is the production wiring: the dead-letter middleware
// outermost, the guard with a retry budget innermost.
func production(t *testing.T, r *message.Router, dlq message.Publisher, store stores.Store, opts ...idempotency.Option) {
	t.Helper()
	mw, err := deadletter.Middleware(dlq)
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(mw, idempotency.Middleware(store, opts...))
}

func fastRetries(max int) idempotency.Option {
	return idempotency.WithRetries(idempotency.Retries{Max: max, Backoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond})
}

// TestABudgetIsOnePerMessage: a message that always fails runs 1+Max times
// in all and is dead-lettered once, however often the broker hands it out
// again (here five copies, as after lost acks and restarts); the copies
// that come after its end are acked without running.
func TestABudgetIsOnePerMessage(t *testing.T) {
	t.Parallel()
	ps := newPubSub()
	var a acks
	var dl letters
	var runs atomic.Int64
	var o outcomes
	r := newRouter(t)
	r.AddMiddleware(a.middleware)
	production(t, r, &dl, memstore.New(), fastRetries(2), idempotency.WithObserver(&o))
	r.AddConsumerHandler("charge", "payments", ps, func(*message.Message) error {
		runs.Add(1)
		return errors.New("card service down")
	})
	testenv.RunRouter(t, r)

	payload := envelopeWithID(t, "pay-1")
	publish(t, ps, "payments", payload)
	eventually(t, "the dead letter", func() bool { return dl.len() == 1 })
	for range 4 {
		publish(t, ps, "payments", payload)
	}
	eventually(t, "5 copies acked", func() bool { return a.acked.Load() == 5 })
	a.wg.Wait()
	if n := runs.Load(); n != 3 {
		t.Fatalf("the handler ran %d times, want 3 (1+Max) across every delivery; outcomes %s", n, o.String())
	}
	if n := dl.len(); n != 1 {
		t.Fatalf("%d dead letters, want 1", n)
	}
	e, err := envelope.Parse(dl.get(0).Payload)
	if err != nil {
		t.Fatal(err)
	}
	if e.DeadLetter == nil || e.DeadLetter.Attempts != 3 || e.DeadLetter.Reason != envelope.ReasonFailed {
		t.Fatalf("dead_letter %+v, want reason failed after 3 attempts", e.DeadLetter)
	}
	if n := o.count(idempotency.OutcomeEnded); n != 4 {
		t.Fatalf("%d deliveries skipped as ended, want 4; outcomes %s", n, o.String())
	}
}

// TestAnEndIsRememberedOnlyOnceItsDeadLetterIsOut: when the dead letter
// cannot be published the delivery is nacked and nothing ends; the next
// delivery finds the budget spent, runs nothing, and dead-letters it then.
func TestAnEndIsRememberedOnlyOnceItsDeadLetterIsOut(t *testing.T) {
	t.Parallel()
	ps := newPubSub()
	var a acks
	var dl letters
	dl.fail.Store(2)
	var runs atomic.Int64
	store := memstore.New()
	r := newRouter(t)
	r.AddMiddleware(a.middleware)
	production(t, r, &dl, store, fastRetries(1))
	r.AddConsumerHandler("charge", "payments", ps, func(*message.Message) error {
		runs.Add(1)
		return errors.New("declined by the bank's fraud check")
	})
	testenv.RunRouter(t, r)

	publish(t, ps, "payments", envelopeWithID(t, "pay-2"))
	eventually(t, "the dead letter once the broker takes it", func() bool { return dl.len() == 1 })
	eventually(t, "the delivery acked", func() bool { return a.acked.Load() == 1 })
	if n := a.nacked.Load(); n < 1 {
		t.Fatalf("%d nacks, want the deliveries whose dead letter failed nacked", n)
	}
	if n := runs.Load(); n != 2 {
		t.Fatalf("the handler ran %d times, want 2: the deliveries after the refused dead letter run nothing", n)
	}
	eventually(t, "the end in the store", func() bool {
		rec, err := store.Lookup(context.Background(), idempotency.Key("charge", "pay-2"))
		return err == nil && rec.Ended() && rec.Failure.End.Topic == "payments.dlq" && rec.Failure.Attempts == 2
	})
	if n := dl.len(); n != 1 {
		t.Fatalf("%d dead letters, want 1", n)
	}
}

// TestARedriveRunsTheMessageAgain: a copy carrying a redrive mark other
// than the end's runs again with a fresh budget; a copy without one, or
// with the mark of the copy that ended, is skipped.
func TestARedriveRunsTheMessageAgain(t *testing.T) {
	t.Parallel()
	ps := newPubSub()
	var a acks
	var dl letters
	var runs atomic.Int64
	var healthy atomic.Bool
	r := newRouter(t)
	r.AddMiddleware(a.middleware)
	production(t, r, &dl, memstore.New(), fastRetries(1))
	r.AddConsumerHandler("charge", "payments", ps, func(*message.Message) error {
		runs.Add(1)
		if healthy.Load() {
			return nil
		}
		return errors.New("card service down")
	})
	testenv.RunRouter(t, r)

	payload := envelopeWithID(t, "pay-3")
	redriven := func(mark string) *message.Message {
		m := msgOf(payload)
		m.Metadata.Set(envelope.MetadataRedrive, mark)
		return m
	}
	publish(t, ps, "payments", payload)
	eventually(t, "the first dead letter", func() bool { return dl.len() == 1 })

	// The operator redrives it while the card service is still down: it
	// runs 1+Max times again and ends again, marked.
	if err := ps.Publish("payments", redriven("r1")); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the second dead letter", func() bool { return dl.len() == 2 })
	eventually(t, "2 deliveries acked", func() bool { return a.acked.Load() == 2 })
	if n := runs.Load(); n != 4 {
		t.Fatalf("the handler ran %d times, want 4 (2 per budget)", n)
	}
	// A redelivery of the redriven copy, and one of the original, stay
	// ended.
	if err := ps.Publish("payments", redriven("r1")); err != nil {
		t.Fatal(err)
	}
	publish(t, ps, "payments", payload)
	eventually(t, "4 deliveries acked", func() bool { return a.acked.Load() == 4 })
	if n := runs.Load(); n != 4 {
		t.Fatalf("the handler ran %d times after redeliveries of ended copies, want still 4", n)
	}
	// The service is back; a second redrive runs and succeeds, and is
	// remembered: a later copy is a duplicate.
	healthy.Store(true)
	if err := ps.Publish("payments", redriven("r2")); err != nil {
		t.Fatal(err)
	}
	publish(t, ps, "payments", payload)
	eventually(t, "6 deliveries acked", func() bool { return a.acked.Load() == 6 })
	a.wg.Wait()
	if n := runs.Load(); n != 5 {
		t.Fatalf("the handler ran %d times, want 5: the second redrive once, its duplicate not", n)
	}
	if n := dl.len(); n != 2 {
		t.Fatalf("%d dead letters, want 2", n)
	}
}

// TestAPanicIsAFailedRun: under WithRetries a panic counts like an error,
// without Watermill's Recoverer, and the dead letter says so.
func TestAPanicIsAFailedRun(t *testing.T) {
	t.Parallel()
	ps := newPubSub()
	var a acks
	var dl letters
	var runs atomic.Int64
	r := newRouter(t)
	r.AddMiddleware(a.middleware)
	production(t, r, &dl, memstore.New(), fastRetries(2))
	r.AddConsumerHandler("charge", "payments", ps, func(*message.Message) error {
		runs.Add(1)
		panic("nil map in the charge handler")
	})
	testenv.RunRouter(t, r)

	publish(t, ps, "payments", envelopeWithID(t, "pay-4"))
	eventually(t, "the dead letter", func() bool { return dl.len() == 1 })
	eventually(t, "the delivery acked", func() bool { return a.acked.Load() == 1 })
	if n := runs.Load(); n != 3 {
		t.Fatalf("the handler ran %d times, want 3", n)
	}
	if got := dl.get(0).Metadata.Get(deadletter.MetadataError); !strings.Contains(got, "nil map in the charge handler") {
		t.Fatalf("the dead letter's error %q does not name the panic", got)
	}
}

// TestAPermanentFailureEndsAtOnce: a run that fails with a permanent error
// is not retried; the message is dead-lettered as rejected once.
func TestAPermanentFailureEndsAtOnce(t *testing.T) {
	t.Parallel()
	ps := newPubSub()
	var a acks
	var dl letters
	var runs atomic.Int64
	r := newRouter(t)
	r.AddMiddleware(a.middleware)
	production(t, r, &dl, memstore.New(), fastRetries(5))
	r.AddConsumerHandler("charge", "payments", ps, func(*message.Message) error {
		runs.Add(1)
		return fmt.Errorf("unknown currency XTS: %w", idempotency.ErrPermanent)
	})
	testenv.RunRouter(t, r)

	payload := envelopeWithID(t, "pay-5")
	publish(t, ps, "payments", payload)
	eventually(t, "the dead letter", func() bool { return dl.len() == 1 })
	publish(t, ps, "payments", payload)
	eventually(t, "2 deliveries acked", func() bool { return a.acked.Load() == 2 })
	a.wg.Wait()
	if n := runs.Load(); n != 1 {
		t.Fatalf("the handler ran %d times, want 1", n)
	}
	if got := dl.get(0).Metadata.Get(deadletter.MetadataReason); got != envelope.ReasonRejected || dl.len() != 1 {
		t.Fatalf("%d dead letters, reason %q; want 1, rejected", dl.len(), got)
	}
}

// TestADeliveryEndsBeforeTheBrokersDeadline: runs that would not fit in
// the delivery limit are left to later deliveries (ErrRetryLater, never a
// dead letter); the message still runs 1+Max times in all and is
// dead-lettered once.
func TestADeliveryEndsBeforeTheBrokersDeadline(t *testing.T) {
	t.Parallel()
	ps := newPubSub()
	var a acks
	var dl letters
	var runs atomic.Int64
	var o outcomes
	r := newRouter(t)
	r.AddMiddleware(a.middleware)
	production(t, r, &dl, memstore.New(), fastRetries(4), idempotency.WithDeliveryLimit(500*time.Millisecond),
		idempotency.WithObserver(&o))
	r.AddConsumerHandler("charge", "payments", ps, func(*message.Message) error {
		runs.Add(1)
		time.Sleep(150 * time.Millisecond)
		return errors.New("slow and failing")
	})
	testenv.RunRouter(t, r)

	publish(t, ps, "payments", envelopeWithID(t, "pay-6"))
	eventually(t, "the dead letter", func() bool { return dl.len() == 1 })
	eventually(t, "the last delivery acked", func() bool { return a.acked.Load() == 1 })
	if n := runs.Load(); n != 5 {
		t.Fatalf("the handler ran %d times, want 5 (1+Max)", n)
	}
	if o.count(idempotency.OutcomeRetryLater) == 0 || a.nacked.Load() == 0 {
		t.Fatalf("no delivery was handed back before its limit (outcomes %s, %d nacks)", o.String(), a.nacked.Load())
	}
	if n := dl.len(); n != 1 {
		t.Fatalf("%d dead letters, want 1", n)
	}
}

// TestARedeliveryOfAConflictIsNotDeadLetteredTwice: a meta.id reused for
// other content is dead-lettered as a conflict once; the same conflicting
// copy again is skipped.
func TestARedeliveryOfAConflictIsNotDeadLetteredTwice(t *testing.T) {
	t.Parallel()
	ps := newPubSub()
	var a acks
	var dl letters
	r := newRouter(t)
	r.AddMiddleware(a.middleware)
	production(t, r, &dl, memstore.New(), fastRetries(2))
	r.AddConsumerHandler("charge", "payments", ps, func(*message.Message) error { return nil })
	testenv.RunRouter(t, r)

	publish(t, ps, "payments", envelopeWithID(t, "pay-7"))
	eventually(t, "the first copy acked", func() bool { return a.acked.Load() == 1 })
	other, err := envelope.New("urn:babel:payments:requested", map[string]any{"amount_cents": 99}, envelope.WithID("pay-7"))
	if err != nil {
		t.Fatal(err)
	}
	body, err := other.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	publish(t, ps, "payments", body)
	eventually(t, "the conflict's dead letter", func() bool { return dl.len() == 1 })
	eventually(t, "the conflict acked (its end is written then)", func() bool { return a.acked.Load() == 2 })
	publish(t, ps, "payments", body)
	eventually(t, "3 deliveries acked", func() bool { return a.acked.Load() == 3 })
	a.wg.Wait()
	if n := dl.len(); n != 1 {
		t.Fatalf("%d dead letters, want 1 (the conflict's, once)", n)
	}
	if got := dl.get(0).Metadata.Get(deadletter.MetadataReason); got != envelope.ReasonConflict {
		t.Fatalf("reason %q, want conflict", got)
	}
}

// TestAClaimLostBeforeTheReturnPublishesNothing: a delivery whose claim
// another holder took while the handler ran returns an error matching
// ErrClaimLost (transient) and not its produced messages; one whose claim
// lapsed while nobody took it takes it back and goes on.
func TestAClaimLostBeforeTheReturnPublishesNothing(t *testing.T) {
	t.Parallel()
	for _, taken := range []bool{true, false} {
		t.Run(fmt.Sprintf("taken=%v", taken), func(t *testing.T) {
			t.Parallel()
			store := newShared()
			g, err := idempotency.New(store, idempotency.WithClaim(90*time.Millisecond))
			if err != nil {
				t.Fatal(err)
			}
			key := idempotency.Key("", "order-1")
			h := g.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				ctx := context.Background()
				_ = store.Forget(ctx, key) // the claim is gone…
				if taken {                 // …and another delivery took it
					if ok, _, err := store.Claim(stores.WithClaimToken(ctx, "other"), key, time.Minute); err != nil || !ok {
						return nil, fmt.Errorf("the other holder's claim: %v, %v", ok, err)
					}
				}
				<-msg.Context().Done() // the renewal finds out
				time.Sleep(50 * time.Millisecond)
				return []*message.Message{msgOf([]byte(`{"child":1}`))}, nil
			})
			produced, err := h(msgOf(envelopeWithID(t, "order-1")))
			if taken {
				if !errors.Is(err, idempotency.ErrClaimLost) || !idempotency.IsTransient(err) || produced != nil {
					t.Fatalf("a delivery whose claim was taken returned %d messages, %v; want none and a transient ErrClaimLost", len(produced), err)
				}
				return
			}
			if err != nil || len(produced) != 1 {
				t.Fatalf("a delivery whose lapsed claim nobody took returned %d messages, %v; want 1, nil", len(produced), err)
			}
		})
	}
}

// TestTheRetryWiringEndsOnceToo: with Watermill's Retry around the guard
// (the wiring before budgets) a message dead-lettered and acked is
// remembered as ended as well: its redeliveries are not run and not
// dead-lettered again. (In this wiring the guard lets the claim go when a
// run fails, and writes the end once the router acks the dead-lettered
// delivery: a copy that arrives between the two runs. The copies here
// come after the end, as redeliveries do.)
func TestTheRetryWiringEndsOnceToo(t *testing.T) {
	t.Parallel()
	ps := newPubSub()
	var a acks
	var dl letters
	var runs atomic.Int64
	r := newRouter(t)
	dlq, err := deadletter.Middleware(&dl)
	if err != nil {
		t.Fatal(err)
	}
	store := memstore.New()
	r.AddMiddleware(a.middleware, dlq,
		middleware.Retry{MaxRetries: 2, InitialInterval: time.Millisecond,
			ShouldRetry: func(p middleware.RetryParams) bool { return idempotency.Retryable(p.Err) }}.Middleware,
		deadletter.CountAttempts, idempotency.Middleware(store))
	r.AddConsumerHandler("charge", "payments", ps, func(*message.Message) error {
		runs.Add(1)
		return errors.New("card service down")
	})
	testenv.RunRouter(t, r)

	payload := envelopeWithID(t, "pay-8")
	publish(t, ps, "payments", payload)
	eventually(t, "the dead letter, and the end remembered once it was acked", func() bool {
		rec, err := store.Lookup(context.Background(), idempotency.Key("charge", "pay-8"))
		return dl.len() == 1 && err == nil && rec.Ended()
	})
	if n := runs.Load(); n != 3 {
		t.Fatalf("%d runs before the dead letter, want 3", n)
	}
	for range 3 {
		publish(t, ps, "payments", payload)
	}
	eventually(t, "4 deliveries acked", func() bool { return a.acked.Load() == 4 })
	a.wg.Wait()
	if n, d := runs.Load(), dl.len(); n != 3 || d != 1 {
		t.Fatalf("%d runs and %d dead letters, want 3 and 1: the redeliveries after the end run nothing", n, d)
	}
}
