package redrive_test

import (
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/redrive"
)

// TestRefusedMoveIsSkippedNotFatal: on watermill-sql (PostgreSQL), one
// dead letter's original queue is no watermill-sql topic name (an SDK on
// another broker dead-lettered it), so its move is refused for good
// (ErrInvalidTopicName). Named in WithSkipErrors, the refusal skips that
// dead letter: it is put back, counted, and the run moves the others. Not
// named, it ends the run with the error, as any publish error does.
// Serial: the run's 1 s idle timeout counts the watermill-sql subscriber's
// start, which other tests' load can delay past it.
func TestRefusedMoveIsSkippedNotFatal(t *testing.T) {
	s := newSQLTopics(t, "bq_test_skip_")
	topic, dlq, db := s.topic, s.dlq, s.db
	for i, queue := range []string{topic, "orders/eu west", topic, topic} {
		e, _ := envelope.New("urn:babel:orders:created", map[string]int{"order": i}, envelope.WithQueue(queue))
		e.DeadLetter = &envelope.DeadLetter{Reason: "failed", OriginalQueue: queue, FailedAt: time.Now().UnixMilli(), Lang: "php"}
		body, _ := e.Marshal()
		if err := s.pub.Publish(dlq, message.NewMessage(watermill.NewUUID(), body)); err != nil {
			t.Fatal(err)
		}
	}
	// Not named: the refusal ends the run after the first move.
	r, err := s.run()
	if !errors.Is(err, wsql.ErrInvalidTopicName) || r.Moved != 1 || r.Skipped != 0 {
		t.Fatalf("without WithSkipErrors: moved %d skipped %d, %v; want the run stopped by the refusal after 1", r.Moved, r.Skipped, err)
	}
	// Named: skipped, put back, and the run goes on.
	r, err = s.run(redrive.WithSkipErrors(wsql.ErrInvalidTopicName))
	if err != nil || r.Moved != 2 || r.Skipped != 1 || r.PutBack != 1 {
		t.Fatalf("moved %d skipped %d put back %d (%v); want 2, 1, 1", r.Moved, r.Skipped, r.PutBack, err)
	}
	var note string
	for _, e := range r.Entries {
		if !e.Selected {
			t.Errorf("entry %+v: not Selected, but the run had no filter", e)
		}
		if !e.Moved {
			note = e.Note
		}
	}
	if note == "" {
		t.Fatal("the skipped entry has no note")
	}
	t.Logf("note: %s", note)
	var left int
	if err := db.QueryRow(`SELECT count(*) FROM "watermill_` + dlq + `" WHERE payload::text LIKE '%orders/eu west%'`).Scan(&left); err != nil || left < 2 {
		t.Fatalf("%d copies of the refused dead letter on %s (%v): want it put back", left, dlq, err)
	}
	var moved int
	if err := db.QueryRow(`SELECT count(*) FROM "watermill_` + topic + `"`).Scan(&moved); err != nil || moved != 3 {
		t.Fatalf("%d on %s (%v), want 3", moved, topic, err)
	}
}
