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
	var runs atomic.Int64
	h := idempotency.Middleware(memstore.New(),
		idempotency.WithRetries(idempotency.Retries{Max: 2, Backoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond}),
		idempotency.WithDeliveryLimit(limit), idempotency.WithLogger(watermill.NopLogger{}),
		idempotency.WithAckTimeout(50*time.Millisecond),
	)(func(msg *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		<-msg.Context().Done() // a charge that outlasts the deadline, and honours its context
		return nil, msg.Context().Err()
	})
	body := envelopeWithID(t, "pay-cut")
	var final error
	for delivery := 1; delivery <= 8 && final == nil; delivery++ {
		ctx, cancel := context.WithCancel(context.Background())
		cut := time.AfterFunc(limit, cancel) // the broker's clock starts here
		time.Sleep(10 * time.Millisecond)    // the router and the middleware outside the guard
		msg := message.NewMessage(watermill.NewUUID(), body)
		msg.SetContext(ctx)
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
