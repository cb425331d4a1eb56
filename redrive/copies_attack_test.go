//go:build attack

package redrive_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/redrive"
)

// TestExactCopiesDoNotHideWhatFollows (defect, open): two identical dead
// letters (one message dead-lettered twice) that the filters leave where
// they are, followed by one that the filters select. The run puts the
// first copy back, meets the second, takes it for the first come round
// and stops: the selected dead letter behind it is never moved, and the
// report does not say so.
func TestExactCopiesDoNotHideWhatFollows(t *testing.T) {
	w := newWorld(t)
	deadLetter := func(body, reason string) *message.Message {
		m := message.NewMessage(watermill.NewUUID(), []byte(body))
		m.Metadata.Set(deadletter.MetadataReason, reason)
		m.Metadata.Set(deadletter.MetadataOriginalTopic, w.topic)
		m.Metadata.Set(deadletter.MetadataVerbatim, "1")
		return m
	}
	if err := w.pub.Publish(w.dlq, deadLetter("copy", "failed"), deadLetter("copy", "failed"), deadLetter("other", "poison")); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	report, err := w.redrive(ctx, redrive.WithVerbatim(), redrive.WithReasons("poison"))
	if err != nil {
		t.Fatal(err)
	}
	if report.Moved != 1 {
		t.Fatalf("moved %d, want the 1 dead letter with reason poison (put back %d)", report.Moved, report.PutBack)
	}
}
