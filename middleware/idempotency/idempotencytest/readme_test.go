package idempotencytest_test

import (
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency/idempotencytest"
)

// TestChargeOnce is the README's test of a handler, whole: the test a user
// copies.
func TestChargeOnce(t *testing.T) {
	var charged atomic.Int32
	h := idempotencytest.New(t, func(msg *message.Message) error {
		if _, err := envelope.Parse(msg.Payload); err != nil {
			return err // retried, then dead-lettered
		}
		charged.Add(1)
		return nil
	})
	payment := idempotencytest.MustEnvelope("urn:babel:payments:requested",
		map[string]any{"order_id": "1042"}, envelope.WithID("payment-1042"))

	first, again := h.Deliver(payment), h.Deliver(payment) // the broker delivers it twice
	unreadable := h.Deliver([]byte("not an envelope"))

	if first.Outcome != idempotencytest.Ran || again.Outcome != idempotencytest.Skipped || charged.Load() != 1 {
		t.Errorf("first: %v; again: %v; charged %d times; want ran, skipped, once", first, again, charged.Load())
	}
	if unreadable.Outcome != idempotencytest.DeadLettered || unreadable.Runs != 4 {
		t.Errorf("unreadable body: %v; want dead-lettered after 4 runs", unreadable)
	}
}
