package redrive_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/redrive"
)

// lostReplyPublisher publishes to topic, then reports an error, as a
// publish whose reply was lost (or a run that crashed between its publish
// and its ack): the copy is out, the dead letter is not acked.
type lostReplyPublisher struct {
	message.Publisher
	topic string
}

func (p lostReplyPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := p.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	if topic == p.topic {
		return errors.New("connection reset before the reply")
	}
	return nil
}

// TestRunAfterACrashMovesTheNewerDeadLetter: a run sent a message back and
// crashed before its ack, while the fault was still there. Its copy failed
// again: the dead-letter topic holds two dead letters of the message, the
// one the crashed run read (still unacked) and the one of its copy. Once
// the fault is fixed, the next run must get the message to run: the older
// dead letter's copy is the same redrive as the crashed run's (the consumer
// skips it, that redrive ended), so the newer one has to be moved too. It
// was dead-lettered before this run sent anything: it did not fail again
// after this run sent it back.
func TestRunAfterACrashMovesTheNewerDeadLetter(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	w.startConsumer()
	w.down.Store(true)
	ids := w.publishOrders(1)
	w.waitFor("the dead letter", func() bool { return w.dlqBacklog() == 1 })

	// The crashed run: its copy is out, the dead letter still pending.
	sub := w.subscriber("redrive")
	_, err := redrive.Run(context.Background(), sub, lostReplyPublisher{w.pub, w.topic}, w.dlq, redrive.WithIdleTimeout(time.Second))
	sub.Close()
	if err == nil {
		t.Fatal("the crashed run reported success")
	}
	w.waitFor("the copy's dead letter beside the unacked one", func() bool { return w.dlqBacklog() == 2 })
	// Both dead letters were there before the next run started, by more
	// than any clock skew the run allows for.
	time.Sleep(1500 * time.Millisecond)

	w.down.Store(false)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	report, err := w.redrive(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range report.Entries {
		t.Logf("entry moved=%v selected=%v note=%q", e.Moved, e.Selected, e.Note)
		if strings.Contains(e.Note, "failed again") {
			t.Errorf("a dead letter from before the run is reported as failed again after this run sent it back")
		}
	}
	if report.Moved != 2 {
		t.Errorf("moved %d, put back %d: want both dead letters moved", report.Moved, report.PutBack)
	}
	deadline := time.Now().Add(5 * time.Second)
	for w.count(w.charges, ids[0]) == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := w.count(w.charges, ids[0]); n != 1 {
		t.Fatalf("the order was charged %d times after the fix and a run that reported success: want 1", n)
	}
}

// TestRunMovesAMessageWithoutIdentityOnce: a message with neither a
// meta.id nor a Watermill UUID (a producer that sets neither) fails again
// after the run sends it back, while the fault lasts. The run still moves
// it once and ends (it sent it round 3,115 times in 15 s, never ending:
// the run knew a message it sent back only by meta.id or UUID).
func TestRunMovesAMessageWithoutIdentityOnce(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	w.startConsumer()
	w.down.Store(true)
	e, err := envelope.New("urn:babel:orders:created", map[string]any{"order": 1}, envelope.WithQueue(w.topic))
	if err != nil {
		t.Fatal(err)
	}
	e.Meta.ID = ""
	body, _ := e.Marshal()
	if err := w.pub.Publish(w.topic, message.NewMessage("", body)); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the dead letter", func() bool { return w.dlqBacklog() == 1 })
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	report, err := w.redrive(ctx, redrive.WithIdleTimeout(3*time.Second))
	if err != nil || report.Moved != 1 {
		t.Fatalf("moved %d, put back %d, err %v: want the message moved once, the run ended by itself", report.Moved, report.PutBack, err)
	}
	w.waitFor("its new dead letter, left", func() bool { return w.dlqBacklog() == 1 })
}

// slowPublisher publishes to topic, then returns only once ctx is done
// and the subscriber had time to notice it.
type slowPublisher struct {
	message.Publisher
	topic string
	ctx   context.Context
}

func (p slowPublisher) Publish(topic string, msgs ...*message.Message) error {
	err := p.Publisher.Publish(topic, msgs...)
	if topic == p.topic {
		<-p.ctx.Done()
		time.Sleep(100 * time.Millisecond)
	}
	return err
}

// TestRunCutShortReportsIt: a run whose context ends while it publishes
// returns the context's error, never success, whichever it notices first
// (watermill-redisstream closes its channel when the context ends; the run
// took that for the end of the topic and reported success in about half
// the runs).
func TestRunCutShortReportsIt(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	sub := w.subscriber("redrive")
	defer sub.Close()
	succeeded := 0
	for range 10 {
		if err := w.pub.Publish(w.dlq, verbatimDeadLetter(w.topic, "order", "failed")); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		_, err := redrive.Run(ctx, sub, slowPublisher{w.pub, w.topic, ctx}, w.dlq, redrive.WithIdleTimeout(time.Minute), redrive.WithVerbatim())
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) {
			succeeded++
		}
	}
	if succeeded > 0 {
		t.Fatalf("%d of 10 runs cut short by their deadline reported success", succeeded)
	}
}
