package redrive_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/redrive"
)

// TestRunMovesAMessageOnceWhenItFailsAgain: a redrive run while the fault
// is still there (the payment gateway still down). Each message the run
// sends back runs with a fresh budget, fails and is dead-lettered again
// while the run still reads the topic. The run leaves those new dead
// letters on the topic instead of sending them back again: it moves each
// message once and ends (before, it sent them round for as long as the
// fault lasted, the handler running again each time).
func TestRunMovesAMessageOnceWhenItFailsAgain(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	w.startConsumer()
	w.down.Store(true)
	ids := w.publishOrders(2)
	w.waitFor("2 dead letters", func() bool { return w.dlqBacklog() == 2 })

	// An idle timeout long enough for the copies sent back to fail and
	// be dead-lettered again while the run reads.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	report, err := w.redrive(ctx, redrive.WithIdleTimeout(5*time.Second))
	if err != nil {
		t.Fatalf("the run did not end: %v (moved %d times, put back %d)", err, report.Moved, report.PutBack)
	}
	if report.Moved != 2 {
		t.Fatalf("moved %d, want each of the 2 messages once (put back %d)", report.Moved, report.PutBack)
	}
	t.Logf("read %d, moved %d, put back %d", len(report.Entries), report.Moved, report.PutBack)
	for _, e := range report.Entries {
		if !e.Moved && (!e.Selected || !strings.Contains(e.Note, "failed again")) {
			t.Fatalf("entry %+v: a dead letter left by the run is one that failed again, selected and noted", e)
		}
	}
	// Both messages failed again and their dead letters are on the topic,
	// for the next run once the fault is fixed.
	w.waitFor("the 2 new dead letters", func() bool { return w.dlqBacklog() == 2 })
	w.down.Store(false)
	report, err = w.redrive(context.Background())
	if err != nil || report.Moved != 2 {
		t.Fatalf("the run after the fix: moved %d, err %v; want 2", report.Moved, err)
	}
	w.waitFor("both orders charged", func() bool { return w.count(w.charges, ids[0]) == 1 && w.count(w.charges, ids[1]) == 1 })
}

// TestRunMovesTheDeadLetterOfEachHandler: two handlers of one topic
// dead-letter one message once each. Both dead letters are sent back in
// one run: each is its handler's, not the message failing again.
func TestRunMovesTheDeadLetterOfEachHandler(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	e, _ := envelope.New("urn:babel:orders:created", map[string]int{"order": 1}, envelope.WithQueue(w.topic))
	for _, handler := range []string{"charge", "ship"} {
		failure := handler + ": gateway unavailable" // two dead letters, not copies of one
		e.DeadLetter = &envelope.DeadLetter{Reason: envelope.ReasonFailed, Error: &failure, OriginalQueue: w.topic, FailedAt: time.Now().UnixMilli(), Lang: "go"}
		body, _ := e.Marshal()
		dead := message.NewMessage(e.Meta.ID, body)
		dead.Metadata.Set(middleware.PoisonedHandlerKey, handler)
		if err := w.pub.Publish(w.dlq, dead); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	report, err := w.redrive(ctx)
	if err != nil || report.Moved != 2 {
		t.Fatalf("moved %d, put back %d, err %v: want both handlers' dead letters moved", report.Moved, report.PutBack, err)
	}
}
