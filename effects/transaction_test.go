package effects_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/effects"
	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// txStores returns a transactional record store and an effect store on db,
// on tables of their own, dropped when the test ends.
func txStores(t *testing.T, db *sql.DB, suffix string) (*postgresstore.Store, *postgresstore.Effects) {
	t.Helper()
	records, err := postgresstore.New(db, postgresstore.WithTable("fxtx_idem_"+suffix))
	if err != nil {
		t.Fatal(err)
	}
	if err := records.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = db.Exec(`DROP TABLE IF EXISTS fxtx_idem_` + suffix) })
	return records, testenv.PostgresEffects(t, db)
}

// TestTransactionalModeCommitsTheIntentFirst: under WithTransaction the
// handler runs in an open transaction, but the effect's intent commits on
// its own before the call (another connection sees it pending during the
// call), and its outcome too. The handler then fails after the charge: its
// transaction rolls back, the redelivery finds the charge succeeded and
// does not call again, and the handler's write commits once.
func TestTransactionalModeCommitsTheIntentFirst(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	ctx := context.Background()
	suffix := testenv.RandomHex(4)
	records, fxStore := txStores(t, db, suffix)
	if _, err := db.ExecContext(ctx, `CREATE TABLE fxtx_orders_`+suffix+` (id text PRIMARY KEY, charge text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = db.Exec(`DROP TABLE IF EXISTS fxtx_orders_` + suffix) })

	f := newFixture(t, fxStore)
	p := newProvider()
	charge := f.fx.Effect("charge", effects.WithResolver(p.status))
	var seenDuringCall stores.Effect
	failAfterCharge := true
	handler := func(msg *message.Message) ([]*message.Message, error) {
		tx, ok := stores.TxFromContext(msg.Context())
		if !ok {
			return nil, errors.New("no transaction")
		}
		id, err := charge.Do(msg.Context(), nil, func(ctx context.Context, key string) (effects.Outcome, error) {
			// Another connection, outside the handler's transaction; a
			// lookup that fails (a connection refused under load) is
			// asked again: the state cannot change during the call.
			deadline := time.Now().Add(20 * time.Second)
			for {
				var err error
				if seenDuringCall, err = fxStore.Lookup(context.WithoutCancel(ctx), key); err == nil {
					break
				} else if time.Now().After(deadline) {
					return effects.Outcome{}, fmt.Errorf("looking the effect up during the call: %w", err)
				}
				time.Sleep(50 * time.Millisecond)
			}
			return p.charge("ok")(ctx, key)
		})
		if err != nil {
			return nil, err
		}
		if _, err := tx.ExecContext(msg.Context(), `INSERT INTO fxtx_orders_`+suffix+` VALUES ('order-1', $1)`, string(id)); err != nil {
			return nil, err
		}
		if failAfterCharge {
			failAfterCharge = false
			return nil, errors.New("the handler failed after the charge")
		}
		return nil, nil
	}
	h := idempotency.Middleware(records, idempotency.WithTransaction(db))(handler)
	e, err := envelope.New("urn:babel:orders:charge", map[string]string{"order": "1"})
	if err != nil {
		t.Fatal(err)
	}
	payload, _ := e.Marshal()
	if _, err := h(message.NewMessage(watermill.NewUUID(), payload)); err == nil {
		t.Fatal("the first delivery should fail")
	}
	if seenDuringCall.State != stores.EffectPending {
		t.Fatalf("during the call another connection saw the effect as %q; want pending, committed before the call", seenDuringCall.State)
	}
	if _, err := h(message.NewMessage(watermill.NewUUID(), payload)); err != nil {
		t.Fatalf("the redelivery: %v", err)
	}
	wantCalls(t, p, 1, 1)
	var rows int
	if err := db.QueryRow(`SELECT count(*) FROM fxtx_orders_` + suffix).Scan(&rows); err != nil || rows != 1 {
		t.Fatalf("%d order rows (%v), want 1", rows, err)
	}
}

// TestDeliberateReplayDoesNotChargeAgain: an operator forgets a handled
// message and redrives it with the replay marker; the handler's core runs
// again, the charge is replayed from its record without a call, under the
// same provider key.
func TestDeliberateReplayDoesNotChargeAgain(t *testing.T) {
	t.Parallel()
	records := memstore.New()
	f := newFixture(t, nil)
	p := newProvider()
	charge := f.fx.Effect("charge")
	runs := 0
	h := idempotency.Middleware(records, idempotency.WithScope("billing"))(func(msg *message.Message) ([]*message.Message, error) {
		runs++
		_, err := charge.Do(msg.Context(), map[string]int{"amount": 1299}, p.charge("ok"))
		return nil, err
	})
	e, err := envelope.New("urn:babel:orders:charge", map[string]int{"amount": 1299})
	if err != nil {
		t.Fatal(err)
	}
	payload, _ := e.Marshal()
	if _, err := h(message.NewMessage(watermill.NewUUID(), payload)); err != nil {
		t.Fatal(err)
	}
	if err := records.Forget(context.Background(), idempotency.Key("billing", e.Meta.ID)); err != nil {
		t.Fatal(err)
	}
	replay := message.NewMessage(watermill.NewUUID(), payload)
	replay.Metadata.Set(envelope.MetadataReplayBypass, "1")
	if _, err := h(replay); err != nil {
		t.Fatal(err)
	}
	if runs != 2 {
		t.Fatalf("the handler ran %d times, want 2 (the replay runs it)", runs)
	}
	wantCalls(t, p, 1, 1)
}

// TestTransactionalModeOnAOneConnectionPool: the handler's transaction holds
// the only connection, so the intent cannot be written on a connection of
// its own: the delivery fails with the transient ErrStore at the store
// timeout, nothing is sent, nothing hangs. (Give the effect store a
// connection beyond the handlers' transactions.)
func TestTransactionalModeOnAOneConnectionPool(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	records, fxStore := txStores(t, db, testenv.RandomHex(4))
	t.Cleanup(func() { db.SetMaxOpenConns(0) }) // runs first: the tables are dropped on a free pool
	db.SetMaxOpenConns(1)
	f := newFixture(t, fxStore, effects.WithStoreTimeout(300*time.Millisecond))
	p := newProvider()
	charge := f.fx.Effect("charge")
	h := idempotency.Middleware(records, idempotency.WithTransaction(db))(func(msg *message.Message) ([]*message.Message, error) {
		_, err := charge.Do(msg.Context(), nil, p.charge("ok"))
		return nil, err
	})
	e, _ := envelope.New("urn:babel:orders:charge", map[string]int{"amount": 1})
	payload, _ := e.Marshal()
	start := time.Now()
	_, err := h(message.NewMessage(watermill.NewUUID(), payload))
	if !errors.Is(err, idempotency.ErrStore) || time.Since(start) > 5*time.Second {
		t.Fatalf("after %v: %v; want ErrStore at the store timeout", time.Since(start), err)
	}
	wantCalls(t, p, 0, 0)
}
