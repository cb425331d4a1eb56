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
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/conformance"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestTimeoutInsideIsNotAShutdown: Watermill's Timeout middleware between
// the dead-letter middleware and the guard cancels the context it installed
// when it returns. That cancellation is not the consumer shutting down: a
// final failure is dead-lettered once, after Retry's runs, and never runs
// again (before: nothing dead-lettered, the message redelivered for ever).
// Timeout is tried outside Retry and inside it (there with Retry's
// ResetContextOnRetry, without which Watermill runs the later attempts on
// the context the first attempt's Timeout cancelled).
func TestTimeoutInsideIsNotAShutdown(t *testing.T) {
	t.Parallel()
	retry := middleware.Retry{MaxRetries: 2, InitialInterval: time.Millisecond,
		ShouldRetry: func(p middleware.RetryParams) bool { return idempotency.Retryable(p.Err) }}
	resetting := retry
	resetting.ResetContextOnRetry = true
	timeout := middleware.Timeout(10 * time.Second)
	for name, c := range map[string]struct {
		outer, inner []message.HandlerMiddleware
		handler      func(*message.Message) error
		runs         int32
	}{
		"Timeout outside Retry": {inner: []message.HandlerMiddleware{timeout, retry.Middleware}, runs: 3},
		"Timeout inside Retry":  {inner: []message.HandlerMiddleware{resetting.Middleware, timeout}, runs: 3},
		// A Timeout outside everything: the handler outlives it, Retry
		// gives up on the context, and the delivery failed (not a
		// shutdown): dead-lettered after its one run.
		"Timeout outside the dead-letter middleware": {outer: []message.HandlerMiddleware{middleware.Timeout(50 * time.Millisecond)},
			inner: []message.HandlerMiddleware{retry.Middleware}, runs: 1, handler: func(m *message.Message) error {
				<-m.Context().Done()
				return fmt.Errorf("payment gateway: %w", m.Context().Err())
			}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			logger := watermill.NopLogger{}
			ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64, Persistent: true}, logger)
			t.Cleanup(func() { _ = ps.Close() })
			dlq, err := ps.Subscribe(context.Background(), "orders.dlq")
			if err != nil {
				t.Fatal(err)
			}
			mw, err := deadletter.Middleware(ps)
			if err != nil {
				t.Fatal(err)
			}
			r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
			if err != nil {
				t.Fatal(err)
			}
			r.AddMiddleware(c.outer...)
			r.AddMiddleware(mw)
			r.AddMiddleware(c.inner...)
			r.AddMiddleware(deadletter.CountAttempts, idempotency.Middleware(memstore.New()))
			var runs atomic.Int32
			r.AddConsumerHandler("charge", "orders", ps, func(m *message.Message) error {
				runs.Add(1)
				if c.handler != nil {
					return c.handler(m)
				}
				return errors.New("payment gateway: card declined")
			})
			testenv.RunRouter(t, r)
			if err := ps.Publish("orders", message.NewMessage(watermill.NewUUID(), conformance.Fixture(t, "order-created.json"))); err != nil {
				t.Fatal(err)
			}
			var dead *message.Message
			select {
			case dead = <-dlq:
				dead.Ack()
			case <-time.After(5 * time.Second):
				t.Fatalf("nothing dead-lettered in 5 s; the handler ran %d times (want %d, then a dead letter)", runs.Load(), c.runs)
			}
			e, err := envelope.Parse(dead.Payload)
			if err != nil || e.DeadLetter == nil || e.DeadLetter.Reason != envelope.ReasonFailed || e.DeadLetter.Attempts != int(c.runs) {
				t.Fatalf("dead letter %s (parse: %v), want reason failed after %d attempts", dead.Payload, err, c.runs)
			}
			// The original was acked: nothing comes back. The router is
			// closed to be sure no delivery is still running before the count.
			if err := r.Close(); err != nil {
				t.Fatal(err)
			}
			if n := runs.Load(); n != c.runs {
				t.Fatalf("the handler ran %d times, want %d (Retry's runs, then the dead letter)", n, c.runs)
			}
		})
	}
}
