package effects_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/effects"
	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/internal/testenv"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
)

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
	records, err := postgresstore.New(db, postgresstore.WithTable("fxtx_idem_"+suffix))
	if err != nil {
		t.Fatal(err)
	}
	fxStore, err := postgresstore.NewEffects(db, postgresstore.WithEffectsTable("fxtx_"+suffix))
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range []func(context.Context) error{records.Migrate, fxStore.Migrate} {
		if err := m(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := db.Exec(`CREATE TABLE fxtx_orders_` + suffix + ` (id text PRIMARY KEY, charge text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		fx, ev := fxStore.Tables()
		_, _ = db.Exec(`DROP TABLE IF EXISTS fxtx_orders_` + suffix + `, fxtx_idem_` + suffix + `, ` + fx + `, ` + ev)
	})

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
			// Another connection, outside the handler's transaction.
			var err error
			seenDuringCall, err = fxStore.Lookup(ctx, key)
			if err != nil {
				return effects.Outcome{}, err
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
