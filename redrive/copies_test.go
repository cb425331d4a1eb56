package redrive_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/redrive"
)

// TestExactCopiesDoNotHideWhatFollows: two identical dead letters (one
// message dead-lettered twice) that the filters leave where they are,
// followed by one that the filters select. The second copy is not the first
// come round (the run knows its own put-backs by their mark), so the run
// goes on and moves the selected dead letter behind them.
func TestExactCopiesDoNotHideWhatFollows(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	if err := w.pub.Publish(w.dlq, verbatimDeadLetter(w.topic, "copy", "failed"), verbatimDeadLetter(w.topic, "copy", "failed"), verbatimDeadLetter(w.topic, "other", "poison")); err != nil {
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

// droppingPublisher publishes through pub without the put-back mark, as a
// pub/sub that does not carry metadata would deliver it.
type droppingPublisher struct{ message.Publisher }

func (d droppingPublisher) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		delete(m.Metadata, redrive.MetadataPutBack)
	}
	return d.Publisher.Publish(topic, msgs...)
}

// TestRunEndsWhenTheMarkIsLost: on a pub/sub that loses the put-back mark a
// run cannot tell its own put-backs from copies; it still ends, after a
// bounded number of put-backs, with nothing moved that was not selected.
func TestRunEndsWhenTheMarkIsLost(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	if err := w.pub.Publish(w.dlq, verbatimDeadLetter(w.topic, "copy", "failed"), verbatimDeadLetter(w.topic, "copy", "failed")); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	sub := w.subscriber("redrive")
	defer func() {
		time.Sleep(100 * time.Millisecond)
		sub.Close()
	}()
	report, err := redrive.Run(ctx, sub, droppingPublisher{w.pub}, w.dlq,
		redrive.WithIdleTimeout(time.Second), redrive.WithVerbatim(), redrive.WithReasons("poison"))
	if err != nil {
		t.Fatal(err)
	}
	if report.Moved != 0 || report.PutBack == 0 || report.PutBack > 16*1+64+1 {
		t.Fatalf("moved %d, put back %d: want 0 moved and a bounded number put back", report.Moved, report.PutBack)
	}
	t.Logf("put back %d times before stopping", report.PutBack)
}

// TestWithoutPutBackMarkLeavesPutBacksAsTheyWere: without the mark a
// put-back dead letter keeps exactly the metadata it had, and the run still
// ends at its own put-back (known by body and dead-letter metadata).
func TestWithoutPutBackMarkLeavesPutBacksAsTheyWere(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	if err := w.pub.Publish(w.dlq, verbatimDeadLetter(w.topic, "left", "failed")); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	report, err := w.redrive(ctx, redrive.WithVerbatim(), redrive.WithReasons("poison"), redrive.WithoutPutBackMark())
	if err != nil {
		t.Fatal(err)
	}
	if report.Moved != 0 || report.PutBack != 1 {
		t.Fatalf("moved %d, put back %d: want 0 and 1", report.Moved, report.PutBack)
	}
	entries, err := w.client.XRange(ctx, w.dlq, "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if meta, _ := e.Values["metadata"].(string); strings.Contains(meta, redrive.MetadataPutBack) {
			t.Fatalf("a put-back entry carries the mark: %v", e.Values)
		}
	}
}

// verbatimDeadLetter is body as the dead-letter middleware leaves a body
// that is not an envelope: verbatim, with its reason and original topic in
// the metadata.
func verbatimDeadLetter(topic, body, reason string) *message.Message {
	m := message.NewMessage(watermill.NewUUID(), []byte(body))
	m.Metadata.Set(deadletter.MetadataReason, reason)
	m.Metadata.Set(deadletter.MetadataOriginalTopic, topic)
	m.Metadata.Set(deadletter.MetadataVerbatim, "1")
	return m
}
