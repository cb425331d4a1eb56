package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// dlqCapture stands for the dead-letter topic.
type dlqCapture struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (p *dlqCapture) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.msgs = append(p.msgs, msgs...)
	return nil
}

func (*dlqCapture) Close() error { return nil }

func (p *dlqCapture) len() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.msgs)
}

// TestTransactionStoreLostAtCommitIsTransient: under WithTransaction the
// database is the store. When the connection to it is lost at COMMIT (the
// server terminated the session: the database restarting, a failover), the
// delivery did not happen (the transaction rolled back) and the failure is
// the store's, exactly as when BEGIN fails: it must be transient, so the
// README's dead-letter middleware leaves it to the broker to redeliver
// instead of dead-lettering and acking it. A deferred constraint violated by
// the handler's own writes stays a failure of the handler's.
func TestTransactionStoreLostAtCommitIsTransient(t *testing.T) {
	t.Parallel()
	forEachTxMode(t, storeLostAtCommitIsTransient)
}

func storeLostAtCommitIsTransient(t *testing.T, l *ledgerDB, store stores.Store, mode idempotency.Option) {
	ctx := context.Background()
	// A deferred trigger that terminates its own session at COMMIT the
	// first time, as a database that goes away at that moment.
	fn := l.ledger + "_kill"
	for _, q := range []string{
		fmt.Sprintf(`CREATE SEQUENCE %s_seq`, fn),
		fmt.Sprintf(`CREATE FUNCTION %[1]s() RETURNS trigger LANGUAGE plpgsql AS $$
			BEGIN IF nextval('%[1]s_seq') = 1 THEN PERFORM pg_terminate_backend(pg_backend_pid()); PERFORM pg_sleep(1); END IF; RETURN NULL; END $$`, fn),
		fmt.Sprintf(`CREATE CONSTRAINT TRIGGER %[1]s_ct AFTER UPDATE ON %[2]s DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION %[1]s()`, fn, l.ledger),
	} {
		if _, err := l.db.ExecContext(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		_, _ = l.db.ExecContext(context.Background(), fmt.Sprintf(`DROP FUNCTION IF EXISTS %[1]s() CASCADE; DROP SEQUENCE IF EXISTS %[1]s_seq`, fn))
	})

	dlq := &dlqCapture{}
	dl, err := deadletter.Middleware(dlq)
	if err != nil {
		t.Fatal(err)
	}
	runs := 0
	h := dl(idempotency.Middleware(store, mode)(noProduce(func(msg *message.Message) error {
		runs++
		return l.credit(msg)
	})))
	payload := envelopeWithID(t, "pay-lost-commit")

	_, err = h(msgOf(payload))
	if dlq.len() != 0 || err == nil {
		for _, m := range dlq.msgs {
			t.Logf("dead-lettered: reason %q, error %q", m.Metadata.Get(deadletter.MetadataReason), m.Metadata.Get(deadletter.MetadataError))
		}
		t.Fatalf("store lost at COMMIT: %d dead letter(s), error %v; want none dead-lettered and the error returned for a redelivery (IsTransient %v)",
			dlq.len(), err, idempotency.IsTransient(err))
	}
	if !idempotency.IsTransient(err) || !errors.Is(err, idempotency.ErrStore) {
		t.Fatalf("store lost at COMMIT: err = %v, want it to match ErrStore", err)
	}
	if l.balance(t, "alice") != 0 || l.remembered(t, "pay-lost-commit") {
		t.Fatal("the failed commit left the effect or the record behind")
	}
	// The redelivery runs once, and the message is remembered.
	for range 2 {
		if _, err := h(msgOf(payload)); err != nil {
			t.Fatal(err)
		}
	}
	if runs != 2 || l.balance(t, "alice") != 10 || !l.remembered(t, "pay-lost-commit") {
		t.Fatalf("runs=%d balance=%d: want the lost commit's run, one more, one credit", runs, l.balance(t, "alice"))
	}
}

// TestTransactionCancelledMidDeliveryIsTransient: the message context is
// cancelled while the handler runs (the subscriber shutting down, the
// router's close timeout passing). database/sql rolls the transaction
// back (pgx's COMMIT fails with the context), so nothing committed: the failure is transient, never a dead
// letter, and the redelivery runs.
func TestTransactionCancelledMidDeliveryIsTransient(t *testing.T) {
	t.Parallel()
	forEachTxMode(t, cancelledMidDeliveryIsTransient)
}

func cancelledMidDeliveryIsTransient(t *testing.T, l *ledgerDB, store stores.Store, mode idempotency.Option) {
	dlq := &dlqCapture{}
	dl, err := deadletter.Middleware(dlq)
	if err != nil {
		t.Fatal(err)
	}
	runs := 0
	var cancel context.CancelFunc
	h := dl(idempotency.Middleware(store, mode)(noProduce(func(msg *message.Message) error {
		runs++
		if err := l.credit(msg); err != nil {
			return err
		}
		if runs == 1 {
			cancel() // shutdown while the handler finishes its work
			time.Sleep(50 * time.Millisecond)
		}
		return nil
	})))
	payload := envelopeWithID(t, "pay-cancelled")
	msg := msgOf(payload)
	ctx, c := context.WithCancel(context.Background())
	cancel = c
	msg.SetContext(ctx)
	_, err = h(msg)
	for _, m := range dlq.msgs {
		t.Logf("dead-lettered: reason %q, error %q", m.Metadata.Get(deadletter.MetadataReason), m.Metadata.Get(deadletter.MetadataError))
	}
	if dlq.len() != 0 || !idempotency.IsTransient(err) {
		t.Fatalf("cancelled mid-delivery: %d dead letter(s), error %v; want none, and a transient error", dlq.len(), err)
	}
	if _, err := h(msgOf(payload)); err != nil {
		t.Fatal(err)
	}
	if runs != 2 || l.balance(t, "alice") != 10 || !l.remembered(t, "pay-cancelled") {
		t.Fatalf("runs=%d balance=%d: want the cancelled run, one more, one credit", runs, l.balance(t, "alice"))
	}
}

// forEachTxMode runs test on a ledger of its own for each way the
// transactional modes record a message, with the store and the mode option
// to build the middleware from: WithTransaction on postgresstore (which
// begins with the record, BeginTx), WithTransaction on a stores.TxStore
// that cannot (RememberTx after the middleware's own BEGIN), and
// WithPgxTransaction (BeginPgx).
func forEachTxMode(t *testing.T, test func(t *testing.T, l *ledgerDB, store stores.Store, mode idempotency.Option)) {
	t.Run("WithTransaction", func(t *testing.T) {
		t.Parallel() // each on a ledger of its own
		l := newLedgerDB(t)
		test(t, l, l.store, idempotency.WithTransaction(l.db))
	})
	t.Run("WithTransaction-RememberTx", func(t *testing.T) {
		t.Parallel()
		l := newLedgerDB(t)
		test(t, l, struct{ stores.TxStore }{l.store}, idempotency.WithTransaction(l.db))
	})
	t.Run("WithPgxTransaction", func(t *testing.T) {
		t.Parallel()
		l := newLedgerDB(t)
		test(t, l, l.store, idempotency.WithPgxTransaction(l.pool))
	})
}
