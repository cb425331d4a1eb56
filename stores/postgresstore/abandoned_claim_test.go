package postgresstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/internal/testenv"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
)

// TestAbandonedGroupedClaimDoesNotParkTheRedelivery: under load a claim
// queues behind a statement in flight (here one waiting on another
// transaction's uncommitted row). Its delivery gives up at the store
// timeout (ErrStore: the broker redelivers). The grouped statement that
// carries it still runs afterwards; the claim it takes belongs to a
// delivery that is gone, so it must not stand: the redelivery runs at once
// instead of being parked (ErrInFlight) for the whole claim lease behind
// a claim no one holds (on the ungrouped path the claim would not even have
// waited: its key is free).
func TestAbandonedGroupedClaimDoesNotParkTheRedelivery(t *testing.T) {
	db := testenv.Postgres(t)
	db.SetMaxOpenConns(8)
	// One claim statement at a time, so that the slow one holds the slot.
	s := newStore(t, db, postgresstore.WithStatementsInFlight(1))
	bg := context.Background()

	// Another transaction inserts a row and keeps it uncommitted: a claim
	// of that key waits for it, holding the claims' statement slot.
	blocker, err := db.BeginTx(bg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer blocker.Rollback() //nolint:errcheck
	if _, err := blocker.ExecContext(bg, `INSERT INTO `+s.Table()+` (key, expires_at, claim) VALUES ($1, NULL, 'other')`,
		postgresstore.RowKey("busy")); err != nil {
		t.Fatal(err)
	}
	slow := make(chan error, 1)
	go func() {
		_, _, err := s.Claim(bg, "busy", time.Minute)
		slow <- err
	}()
	time.Sleep(200 * time.Millisecond) // the slow claim holds the slot

	runs := 0
	h := idempotency.Middleware(s, idempotency.WithClaim(time.Minute), idempotency.WithStoreTimeout(300*time.Millisecond))(
		func(*message.Message) ([]*message.Message, error) { runs++; return nil, nil })
	e, err := envelope.New("urn:babel:orders:created", map[string]any{"order": 1})
	if err != nil {
		t.Fatal(err)
	}
	payload, err := e.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h(message.NewMessage(watermill.NewUUID(), payload)); !errors.Is(err, idempotency.ErrStore) {
		t.Fatalf("first delivery: %v, want ErrStore at the store timeout", err)
	}
	if err := blocker.Rollback(); err != nil { // the slot frees; the queued claim runs now
		t.Fatal(err)
	}
	if err := <-slow; err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)

	// The redelivery.
	if _, err := h(message.NewMessage(watermill.NewUUID(), payload)); err != nil {
		t.Fatalf("redelivery after the first gave up: %v; want it to run, not to wait for the abandoned claim's lease", err)
	}
	if runs != 1 {
		t.Fatalf("handler ran %d times, want 1", runs)
	}
}
