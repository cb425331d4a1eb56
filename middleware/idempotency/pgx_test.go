package idempotency_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// TestPgxTransactionDuplicatesUnderLoad: 200 messages, each delivered twice
// at once by 32 concurrent deliveries: every message takes effect exactly
// once, and exactly one of its two copies is skipped.
func TestPgxTransactionDuplicatesUnderLoad(t *testing.T) {
	t.Parallel()
	l := newLedgerDB(t)
	const messages, workers = 200, 32
	rec := &recorder{}
	h := idempotency.Middleware(l.store, idempotency.WithPgxTransaction(l.pool), idempotency.WithObserver(rec))(noProduce(l.credit))
	copies := make(chan []byte, 2*messages)
	for i := range messages {
		p := envelopeWithID(t, fmt.Sprintf("pay-%d", i))
		copies <- p
		copies <- p
	}
	close(copies)
	var wg sync.WaitGroup
	errs := make(chan error, 2*messages)
	for range workers {
		wg.Go(func() {
			for p := range copies {
				if _, err := h(msgOf(p)); err != nil {
					errs <- err
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("delivery failed: %v", err)
	}
	skips := 0
	for _, o := range rec.outcomes() {
		if o == idempotency.OutcomeSkip {
			skips++
		}
	}
	if got := l.balance(t, "alice"); got != 10*messages || skips != messages {
		t.Fatalf("balance %d, %d skipped; want %d (each message credited once) and %d skipped", got, skips, 10*messages, messages)
	}
}

// TestPgxTransactionRetriesSerializationFailures: under SERIALIZABLE,
// handlers that read and write the same row conflict; the loser is retried
// with a fresh transaction and every message takes effect exactly once.
func TestPgxTransactionRetriesSerializationFailures(t *testing.T) {
	t.Parallel()
	l := newLedgerDB(t)
	var runs atomic.Int32
	h := idempotency.Middleware(l.store, idempotency.WithPgxTransaction(l.pool),
		idempotency.WithPgxTxOptions(pgx.TxOptions{IsoLevel: pgx.Serializable}), idempotency.WithTxRetries(20),
	)(noProduce(func(msg *message.Message) error {
		runs.Add(1)
		tx, _ := idempotency.PgxTxFromContext(msg.Context())
		var b int64
		if err := tx.QueryRow(msg.Context(), `SELECT balance FROM `+l.ledger+` WHERE account = 'bob'`).Scan(&b); err != nil {
			return err
		}
		time.Sleep(5 * time.Millisecond)
		_, err := tx.Exec(msg.Context(), `UPDATE `+l.ledger+` SET balance = $1 WHERE account = 'bob'`, b+1)
		return err
	}))
	const messages = 8
	var wg sync.WaitGroup
	errs := make(chan error, messages)
	for i := range messages {
		wg.Go(func() {
			if _, err := h(msgOf(envelopeWithID(t, fmt.Sprintf("pay-%d", i)))); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("delivery failed: %v", err)
	}
	if l.balance(t, "bob") != messages {
		t.Fatalf("balance = %d, want %d", l.balance(t, "bob"), messages)
	}
	if runs.Load() <= messages {
		t.Fatalf("%d runs for %d messages: no serialization failure happened, the test did not race", runs.Load(), messages)
	}
}

// TestPgxTransactionStoreOutage: a pool whose server is gone fails the
// delivery with ErrStore (transient), and the handler does not run.
func TestPgxTransactionStoreOutage(t *testing.T) {
	t.Parallel()
	l := newLedgerDB(t)
	cfg := l.pool.Config()
	cfg.ConnConfig.Port = 1 // nothing listens there
	cfg.ConnConfig.ConnectTimeout = time.Second
	gone, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer gone.Close()
	ran := false
	h := idempotency.Middleware(l.store, idempotency.WithPgxTransaction(gone))(noProduce(func(*message.Message) error {
		ran = true
		return nil
	}))
	if _, err := h(msgOf(envelopeWithID(t, "pay-1"))); !errors.Is(err, idempotency.ErrStore) || ran {
		t.Fatalf("err = %v, ran = %v; want ErrStore and no run", err, ran)
	}
}

func TestPgxTransactionOptionsAreValidated(t *testing.T) {
	t.Parallel()
	l := newLedgerDB(t)
	if _, err := idempotency.New(memstore.New(), idempotency.WithPgxTransaction(l.pool)); !errors.Is(err, idempotency.ErrNotTxStore) {
		t.Fatalf("memstore with WithPgxTransaction: %v", err)
	}
	for name, opt := range map[string]idempotency.Option{
		"WithTransaction":  idempotency.WithTransaction(l.db),
		"WithClaim":        idempotency.WithClaim(time.Second),
		"WithoutClaim":     idempotency.WithoutClaim(),
		"WithSubscriberTx": idempotency.WithSubscriberTx(func(context.Context) (*sql.Tx, bool) { return nil, false }),
		"WithOutbox":       idempotency.WithOutbox(recordingOutbox(l, nil)),
		"WithParkWait":     idempotency.WithParkWait(time.Second),
		"WithTxOptions":    idempotency.WithTxOptions(&sql.TxOptions{Isolation: sql.LevelSerializable}),
	} {
		if _, err := idempotency.New(l.store, idempotency.WithPgxTransaction(l.pool), opt); err == nil {
			t.Fatalf("WithPgxTransaction with %s accepted", name)
		}
	}
	if _, err := idempotency.New(l.store, idempotency.WithPgxTxOptions(pgx.TxOptions{IsoLevel: pgx.Serializable})); err == nil {
		t.Fatal("WithPgxTxOptions without WithPgxTransaction accepted")
	}
	// A handler that returns messages has nowhere to put them.
	h := idempotency.Middleware(l.store, idempotency.WithPgxTransaction(l.pool))(func(msg *message.Message) ([]*message.Message, error) {
		if err := l.credit(msg); err != nil {
			return nil, err
		}
		return []*message.Message{msgOf([]byte("{}"))}, nil
	})
	if _, err := h(msgOf(envelopeWithID(t, "pay-1"))); !errors.Is(err, idempotency.ErrNoOutbox) {
		t.Fatalf("produced messages: %v, want ErrNoOutbox", err)
	}
	if l.balance(t, "alice") != 0 || l.remembered(t, "pay-1") {
		t.Fatal("a delivery failed for its produced messages left its effect or record behind")
	}
}
