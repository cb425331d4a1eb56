package deadletter_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

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

// TestTimeoutThatFiresDeadLetters: the fix for Timeout inside the dead-letter
// middleware is tested only with a handler that fails quickly, under a
// Timeout that never fires. A Timeout is there to cut a handler that hangs
// (an upstream that never answers); such a handler must end up
// dead-lettered after Retry's runs, not be redelivered for ever. Tried in
// the orderings the package doc allows: Timeout outside Retry, and inside
// it with ResetContextOnRetry. (Inside Retry without ResetContextOnRetry,
// Watermill runs the later attempts on the context the first attempt's
// Timeout cancelled: they cannot run, and the message comes back; the
// package documentation says to set ResetContextOnRetry there.)
func TestTimeoutThatFiresDeadLetters(t *testing.T) {
	t.Parallel()
	retry := middleware.Retry{MaxRetries: 2, InitialInterval: time.Millisecond,
		ShouldRetry: func(p middleware.RetryParams) bool { return idempotency.Retryable(p.Err) }}
	resetting := retry
	resetting.ResetContextOnRetry = true
	timeout := middleware.Timeout(50 * time.Millisecond)
	for name, inner := range map[string][]message.HandlerMiddleware{
		"Timeout outside Retry":                     {timeout, retry.Middleware},
		"Timeout inside Retry, ResetContextOnRetry": {resetting.Middleware, timeout},
	} {
		for _, hang := range []bool{true, false} {
			name := name + map[bool]string{true: ", handler hangs", false: ", handler fails at once"}[hang]
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
				r.AddMiddleware(mw)
				r.AddMiddleware(inner...)
				r.AddMiddleware(deadletter.CountAttempts, idempotency.Middleware(memstore.New()))
				var runs atomic.Int32
				r.AddConsumerHandler("charge", "orders", ps, func(msg *message.Message) error {
					runs.Add(1)
					if !hang {
						return errors.New("payment gateway: card declined")
					}
					<-msg.Context().Done() // the upstream never answers
					return msg.Context().Err()
				})
				testenv.RunRouter(t, r)
				if err := ps.Publish("orders", message.NewMessage(watermill.NewUUID(), conformance.Fixture(t, "order-created.json"))); err != nil {
					t.Fatal(err)
				}
				select {
				case dead := <-dlq:
					dead.Ack()
					e, err := envelope.Parse(dead.Payload)
					if err != nil || e.DeadLetter == nil {
						t.Fatalf("dead letter %s (parse: %v)", dead.Payload, err)
					}
				case <-time.After(5 * time.Second):
					t.Fatalf("nothing dead-lettered in 5 s; the handler ran %d times (redelivered for ever)", runs.Load())
				}
			})
		}
	}
}

// TestErrorBoundEdges: error texts at and around the header and
// body bounds, with a multi-byte character straddling the cut, NULs and
// line breaks, invalid UTF-8: the headers stay within MaxHeaderErrorBytes,
// valid UTF-8 on one line, the body's error within MaxBodyErrorBytes, and a
// text exactly at a bound is kept whole.
func TestErrorBoundEdges(t *testing.T) {
	t.Parallel()
	h, b := deadletter.MaxHeaderErrorBytes, deadletter.MaxBodyErrorBytes
	for name, text := range map[string]string{
		"header bound exactly":      strings.Repeat("a", h),
		"header bound plus one":     strings.Repeat("a", h+1),
		"euro straddling the cut":   strings.Repeat("a", h-30) + strings.Repeat("€", 40),
		"emoji straddling body cut": strings.Repeat("b", b-25) + strings.Repeat("😀", 20),
		"body bound exactly":        strings.Repeat("c", b),
		"NULs and line breaks":      strings.Repeat("x\x00\r\n\u2028\u0085", h),
		"invalid UTF-8":             strings.Repeat("\xff\xfeok", h),
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 8, Persistent: true}, watermill.NopLogger{})
			t.Cleanup(func() { _ = ps.Close() })
			dlq, err := ps.Subscribe(context.Background(), "orders.dlq")
			if err != nil {
				t.Fatal(err)
			}
			mw, err := deadletter.Middleware(ps, deadletter.WithTopic(func(string) string { return "orders.dlq" }))
			if err != nil {
				t.Fatal(err)
			}
			msg := message.NewMessage(watermill.NewUUID(), conformance.Fixture(t, "order-created.json"))
			if _, err := mw(func(*message.Message) ([]*message.Message, error) { return nil, errors.New(text) })(msg); err != nil {
				t.Fatalf("dead-lettering: %v", err)
			}
			var dead *message.Message
			select {
			case dead = <-dlq:
				dead.Ack()
			case <-time.After(5 * time.Second):
				t.Fatal("no dead letter")
			}
			for _, k := range []string{deadletter.MetadataError, middleware.ReasonForPoisonedKey} {
				v := dead.Metadata.Get(k)
				if len(v) > h || !utf8.ValidString(v) || strings.ContainsAny(v, "\x00\r\n\u0085") {
					t.Errorf("header %s: %d bytes (bound %d), valid UTF-8 %v, %.60q…%.60q", k, len(v), h, utf8.ValidString(v), v, v[max(len(v)-60, 0):])
				}
				if len(text) <= h && utf8.ValidString(text) && !strings.ContainsAny(text, "\x00\r\n") && v != text {
					t.Errorf("header %s: a text of %d bytes (within the bound) was changed to %d bytes", k, len(text), len(v))
				}
			}
			e, err := envelope.Parse(dead.Payload)
			if err != nil || e.DeadLetter == nil || e.DeadLetter.Error == nil {
				t.Fatalf("dead letter %.200s (parse %v)", dead.Payload, err)
			}
			got := *e.DeadLetter.Error
			if len(got) > b || !utf8.ValidString(got) {
				t.Errorf("body error: %d bytes (bound %d), valid UTF-8 %v", len(got), b, utf8.ValidString(got))
			}
			if len(text) <= b && utf8.ValidString(text) && got != text {
				t.Errorf("body error: a text of %d bytes (within the bound) was changed to %d bytes", len(text), len(got))
			}
		})
	}
}
