package redrive_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/redrive"
)

// TestRateSlowerThanIdleDoesNotEndTheRun: a rate whose interval (1s) is
// longer than the idle timeout (400ms, so that a loaded machine's pause in
// handing over the next message does not end the run by itself). The idle timeout counts only
// the time spent waiting for a message, never the rate's wait, so the run
// moves every dead letter instead of stopping early and reporting success.
func TestRateSlowerThanIdleDoesNotEndTheRun(t *testing.T) {
	t.Parallel()
	d := newDeadLetters(t)
	const n = 4
	for range n {
		d.add(watermill.NewUUID(), envelope.ReasonFailed, time.Now().UnixMilli())
	}
	report := d.run(redrive.WithRate(1), redrive.WithIdleTimeout(400*time.Millisecond))
	if report.Moved != n {
		t.Fatalf("moved %d of %d dead letters: the run ended while it waited for the rate, as if the topic were idle", report.Moved, n)
	}
}
