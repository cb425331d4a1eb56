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

// A message handed back under the deadline of its first delivery, as
// watermill-sql resends a nacked message in the same transaction, does
// not start a run that cannot end before that deadline: the run before it
// took longer than is left, so the delivery is held and handed back
// (ErrRetryLater) without running, and the message runs again in the next
// delivery, which has the time. Before, the resend ran it with a fraction
// of its time left: the run was cut by the deadline and counted, and a
// message that would have succeeded on its second run was dead-lettered.
func TestAResendUnderTheSameDeadlineDoesNotStartARunThatCannotEnd(t *testing.T) {
	t.Parallel()
	const run, window = 300 * time.Millisecond, 550 * time.Millisecond
	var runs, cut atomic.Int64
	h := idempotency.Middleware(memstore.New(),
		idempotency.WithRetries(idempotency.Retries{Max: 3, Backoff: time.Millisecond, MaxBackoff: time.Millisecond}),
		idempotency.WithLogger(watermill.NopLogger{}),
	)(func(msg *message.Message) ([]*message.Message, error) {
		n := runs.Add(1)
		select {
		case <-time.After(run):
		case <-msg.Context().Done():
			cut.Add(1)
			return nil, msg.Context().Err()
		}
		if n == 1 {
			return nil, errors.New("gateway timeout") // the first run fails; the second would succeed
		}
		return nil, nil
	})
	body := envelopeWithID(t, "pay-resent")
	deliver := func(ctx context.Context) error {
		msg := message.NewMessage(watermill.NewUUID(), body)
		msg.SetContext(ctx)
		_, err := h(msg)
		return err
	}
	// The first delivery: its window fits one run and not another.
	first, cancel := context.WithTimeout(context.Background(), window)
	defer cancel()
	late := time.Now().Add(window - run/2) // the resend comes with less than a run left
	if err := deliver(first); !idempotency.IsTransient(err) {
		t.Fatalf("the first delivery = %v; want it handed back (a second run does not fit)", err)
	}
	time.Sleep(time.Until(late))
	began := time.Now()
	if err := deliver(first); !errors.Is(err, idempotency.ErrRetryLater) {
		t.Fatalf("the resend under the same deadline = %v after %v; want ErrRetryLater without a run", err, time.Since(began))
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("%d runs after the resend with %v left; want 1 (the run before it took %v)", n, window-run/2, run)
	}
	// The next delivery has its whole window: the message runs, and succeeds.
	next, cancelNext := context.WithTimeout(context.Background(), window)
	defer cancelNext()
	if err := deliver(next); err != nil {
		t.Fatalf("the next delivery = %v; want the second run to succeed", err)
	}
	if runs.Load() != 2 || cut.Load() != 0 {
		t.Fatalf("%d runs, %d cut by the deadline; want 2 runs, none cut", runs.Load(), cut.Load())
	}
}
