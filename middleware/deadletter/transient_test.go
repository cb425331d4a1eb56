package deadletter_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/testkit/conformance"
)

// TestTransientFailuresAreNeverDeadLettered: a store outage or a parked
// duplicate that outlasts Retry propagates (the broker redelivers) instead
// of being dead-lettered and acked, with the default filter and with one
// that takes everything; once the fault passes the message runs.
func TestTransientFailuresAreNeverDeadLettered(t *testing.T) {
	for _, transient := range []error{idempotency.ErrStore, idempotency.ErrInFlight} {
		for name, opts := range map[string][]deadletter.Option{
			"default":    nil,
			"any filter": {deadletter.WithFilter(func(error) bool { return true })},
		} {
			t.Run(fmt.Sprintf("%v/%s", transient, name), func(t *testing.T) {
				var calls, ran atomic.Int32
				h := newHarness(t, func(*message.Message) error {
					if calls.Add(1) <= 6 { // outlasts Retry's 3 runs: comes back twice
						return fmt.Errorf("idempotency: check message %q: %w", "m", transient)
					}
					ran.Add(1)
					return nil
				}, opts...)
				if err := h.pubSub.Publish("orders", message.NewMessage(watermill.NewUUID(), conformance.Fixture(t, "order-created.json"))); err != nil {
					t.Fatal(err)
				}
				deadline := time.Now().Add(5 * time.Second)
				for ran.Load() == 0 && time.Now().Before(deadline) {
					time.Sleep(5 * time.Millisecond)
				}
				select {
				case m := <-h.dlq:
					t.Fatalf("a transient failure was dead-lettered: %s", m.Metadata.Get(deadletter.MetadataError))
				case <-time.After(100 * time.Millisecond):
				}
				if ran.Load() != 1 {
					t.Fatalf("after the fault the message ran %d times, want 1 (%d calls)", ran.Load(), calls.Load())
				}
			})
		}
	}
}

func TestIsTransient(t *testing.T) {
	for err, want := range map[error]bool{
		fmt.Errorf("x: %w", idempotency.ErrStore):    true,
		fmt.Errorf("x: %w", idempotency.ErrInFlight): true,
		idempotency.ErrConflict:                      false,
		idempotency.ErrTooOld:                        false,
		fmt.Errorf("payment gateway timeout"):        false,
	} {
		if got := idempotency.IsTransient(err); got != want {
			t.Errorf("IsTransient(%v) = %v, want %v", err, got, want)
		}
		if idempotency.IsTransient(err) && idempotency.IsPermanent(err) {
			t.Errorf("%v is both transient and permanent", err)
		}
	}
}

// TestShutdownIsNotAFinalFailure: at shutdown the message context is
// cancelled; Retry then gives up with context.Canceled, and a store check
// fails. The delivery was interrupted, not failed for good: it propagates.
func TestShutdownIsNotAFinalFailure(t *testing.T) {
	ps := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	dlq, err := ps.Subscribe(context.Background(), ".dlq") // no subscribe topic in the context: "" + ".dlq"
	if err != nil {
		t.Fatal(err)
	}
	mw, err := deadletter.Middleware(ps)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // the consumer is shutting down
	msg := message.NewMessage(watermill.NewUUID(), conformance.Fixture(t, "order-created.json"))
	msg.SetContext(ctx)
	_, err = mw(func(m *message.Message) ([]*message.Message, error) { return nil, m.Context().Err() })(msg)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled to propagate", err)
	}
	select {
	case m := <-dlq:
		t.Fatalf("an interrupted delivery was dead-lettered: %s", m.Metadata.Get(deadletter.MetadataError))
	case <-time.After(100 * time.Millisecond):
	}
}
