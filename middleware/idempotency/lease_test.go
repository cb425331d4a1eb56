package idempotency_test

import (
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// TestHandlerOutlivingItsLease pins down the documented behaviour of a run
// longer than the claim lease: the claim lapses, a redelivery arriving after
// that takes it and runs too (two effects), and the middleware logs the slow
// run at error level so the lease can be raised.
func TestHandlerOutlivingItsLease(t *testing.T) {
	logger := watermill.NewCaptureLogger()
	var runs atomic.Int32
	h := idempotency.Middleware(memstore.New(), idempotency.WithClaim(50*time.Millisecond), idempotency.WithLogger(logger))(
		func(*message.Message) ([]*message.Message, error) {
			if runs.Add(1) == 1 {
				time.Sleep(200 * time.Millisecond) // far longer than the lease
			}
			return nil, nil
		})
	payload := envelopeWithID(t, "slow-1")
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		if _, err := h(msgOf(payload)); err != nil {
			t.Error(err)
		}
	}()
	time.Sleep(120 * time.Millisecond) // the first run is still going; its lease has passed
	if _, err := h(msgOf(payload)); err != nil {
		t.Fatalf("redelivery after the lease lapsed: %v", err)
	}
	wg.Wait()
	if runs.Load() != 2 {
		t.Fatalf("runs = %d: a redelivery after the lease lapsed takes the claim and runs", runs.Load())
	}
	var warned bool
	for _, m := range logger.Captured()[watermill.ErrorLogLevel] {
		if strings.Contains(m.Msg, "outlived its idempotency claim lease") && m.Fields["message_id"] == "slow-1" {
			warned = true
		}
	}
	if !warned {
		t.Fatalf("no warning about the run outliving its lease: %v", logger.Captured())
	}
	// Within the lease, a concurrent copy is parked instead.
	if _, err := h(msgOf(payload)); err != nil {
		t.Fatalf("a copy after both runs finished must be skipped: %v", err)
	}
	if runs.Load() != 2 {
		t.Fatalf("runs = %d after a duplicate of a remembered message", runs.Load())
	}
}
