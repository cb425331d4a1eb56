package redrive_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/redrive"
)

// TestSameBodyDifferentPlanIsNotTheEndOfTheTopic: two dead letters with the
// same body but different dead-letter metadata (here two undecodable
// bodies, dead-lettered for different reasons; Watermill's PoisonQueue
// likewise keeps the reason and topic only in metadata). The run puts the
// first back (not selected) and must still move the second, and what
// comes after it: meeting a body it put back is not proof that it went
// round the whole topic when the plan also reads the metadata.
func TestSameBodyDifferentPlanIsNotTheEndOfTheTopic(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	deadLetter := func(reason string) *message.Message { return verbatimDeadLetter(w.topic, "not an envelope", reason) }
	if err := w.pub.Publish(w.dlq, deadLetter("failed"), deadLetter("poison"), deadLetter("poison")); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	report, err := w.redrive(ctx, redrive.WithVerbatim(), redrive.WithReasons("poison"))
	if err != nil {
		t.Fatal(err)
	}
	if report.Moved != 2 {
		t.Fatalf("moved %d of the 2 dead letters with reason poison (put back %d): the run stopped at a body it had put back", report.Moved, report.PutBack)
	}
	if n := w.client.XLen(ctx, w.topic).Val(); n != 2 {
		t.Fatalf("the original topic holds %d messages, want the 2 moved", n)
	}
}
