package idempotency_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// TestABrokerCutAtItsDeadlineCountsAsARun: a broker that cancels the
// message's context at its deadline (watermill-nats at AckWaitTimeout)
// starts that clock when it hands the message out, a little before the
// guard sees it. A run cut there is the broker's, not a shutdown: it
// counts against the budget, so a handler that always outlasts the
// deadline runs 1+Max times and fails for good. Found by testkit/matrix on
// NATS JetStream: counted from the guard's own start, every cut looked
// like a shutdown (a few milliseconds short of the limit) and went
// uncounted: 5 runs for Max 3, and runs without end where each cut was.
func TestABrokerCutAtItsDeadlineCountsAsARun(t *testing.T) {
	t.Parallel()
	const limit = 300 * time.Millisecond
	cutAtDeadline(t, limit, false, idempotency.WithDeliveryLimit(limit))
}

// TestACancelAtTheContextsDeadlineCountsAsARun: watermill-sql gives the
// message a context with its AckDeadline, and cancels a child of it when
// the deadline passes: the handler's context may then end cancelled rather
// than past its deadline (the two race). That cut is the broker's too, and
// counts. Found by testkit/matrix on watermill-sql under load: one cut in
// five went uncounted, 5 runs for Max 3.
func TestACancelAtTheContextsDeadlineCountsAsARun(t *testing.T) {
	t.Parallel()
	const limit = 300 * time.Millisecond
	cutAtDeadline(t, limit, true)
}

// deadlineOnly reports a deadline and nothing else: the context of a
// message whose broker cancels it (context.Canceled) at that deadline.
type deadlineOnly struct {
	context.Context
	deadline time.Time
}

func (c deadlineOnly) Deadline() (time.Time, bool) { return c.deadline, true }

// cutAtDeadline delivers a message whose handler outlasts the broker's
// deadline, again and again, each delivery's context cancelled
// (context.Canceled) limit after the broker handed it out, a deadline
// there reported by the context when withDeadline. The message must run
// 1+Max times and fail for good.
func cutAtDeadline(t *testing.T, limit time.Duration, withDeadline bool, opts ...idempotency.Option) {
	t.Helper()
	var runs atomic.Int64
	h := idempotency.Middleware(memstore.New(), append([]idempotency.Option{
		idempotency.WithRetries(idempotency.Retries{Max: 2, Backoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond}),
		idempotency.WithLogger(watermill.NopLogger{}), idempotency.WithAckTimeout(50 * time.Millisecond),
	}, opts...)...)(func(msg *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		<-msg.Context().Done() // a charge that outlasts the deadline, and honours its context
		return nil, msg.Context().Err()
	})
	body := envelopeWithID(t, "pay-cut")
	var final error
	for delivery := 1; delivery <= 8 && final == nil; delivery++ {
		// The broker's clock started handedOut before the guard's: the
		// router and the middleware outside the guard. The cut is set
		// from the guard's side, just before the call, so that a loaded
		// machine oversleeping a pause here cannot move the broker's
		// start further back than a real router would.
		const handedOut = 10 * time.Millisecond
		ctx, cancel := context.WithCancel(context.Background())
		msg := message.NewMessage(watermill.NewUUID(), body)
		if withDeadline {
			ctx = deadlineOnly{Context: ctx, deadline: time.Now().Add(limit - handedOut)}
		}
		msg.SetContext(ctx)
		cut := time.AfterFunc(limit-handedOut, cancel)
		_, err := h(msg)
		cut.Stop()
		cancel()
		if errors.Is(err, idempotency.ErrExhausted) {
			final = err
		}
	}
	if final == nil {
		t.Fatalf("not exhausted after 8 deliveries, each cut at the broker's deadline: %d runs", runs.Load())
	}
	if n := runs.Load(); n != 3 {
		t.Fatalf("%d runs, want 3 (1+Max): %v", n, final)
	}
}
