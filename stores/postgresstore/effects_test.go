package postgresstore_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/internal/testenv"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/storetest"
)

// newEffects returns an Effects store on db, on tables of its own, migrated
// twice (Migrate is safe on every boot), dropped when the test ends.
func newEffects(t *testing.T, db *sql.DB, opts ...postgresstore.EffectsOption) *postgresstore.Effects {
	t.Helper()
	e := testenv.PostgresEffects(t, db, opts...)
	if err := e.Migrate(context.Background()); err != nil {
		t.Fatalf("a second Migrate: %v", err)
	}
	return e
}

func TestEffectsContract(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	db.SetMaxOpenConns(8) // the subtests share a few connections: the server's are shared too
	storetest.RunEffects(t, func(t *testing.T) stores.EffectStore { return newEffects(t, db) },
		storetest.WithEffectsTTLStore(func(t *testing.T, ttl time.Duration) stores.EffectStore {
			return newEffects(t, db, postgresstore.WithEffectsTTL(ttl))
		}))
}

// TestEffectsDeleteExpired: lapsed final effects and events are removed;
// unknown ones stay.
func TestEffectsDeleteExpired(t *testing.T) {
	t.Parallel()
	e := newEffects(t, testenv.Postgres(t), postgresstore.WithEffectsTTL(50*time.Millisecond))
	ctx := context.Background()
	for _, key := range []string{"done", "open"} {
		if _, _, err := e.Begin(ctx, stores.EffectIntent{Key: key}, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, err := e.Transition(ctx, "done", stores.EffectTransition{To: stores.EffectSucceeded}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Transition(ctx, "open", stores.EffectTransition{To: stores.EffectUnknown}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.ApplyEvent(ctx, "evt", "open", stores.EffectTransition{To: stores.EffectUnknown}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	n, err := e.DeleteExpired(ctx)
	if err != nil || n != 2 {
		t.Fatalf("DeleteExpired = %d, %v; want the succeeded effect and the event", n, err)
	}
	if got, _ := e.Lookup(ctx, "open"); got.State != stores.EffectUnknown {
		t.Fatalf("the unknown effect: %s", got.State)
	}
}

// TestEffectsTableNames: the default names are effects.sql's; a bad name is
// refused.
func TestEffectsTableNames(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	e, err := postgresstore.NewEffects(db)
	if err != nil {
		t.Fatal(err)
	}
	effects, events := e.Tables()
	if effects != `"watermill_idempotency_effects"` || events != `"watermill_idempotency_effects_events"` {
		t.Fatalf("default tables %s, %s", effects, events)
	}
	if e, err := postgresstore.NewEffects(db, postgresstore.WithEffectsTable("billing.fx")); err != nil {
		t.Fatal(err)
	} else if effects, events := e.Tables(); effects != `"billing"."fx"` || events != `"billing"."fx_events"` {
		t.Fatalf("qualified tables %s, %s", effects, events)
	}
	if _, err := postgresstore.NewEffects(db, postgresstore.WithEffectsTable("a b")); err == nil {
		t.Fatal("a table name with a space was accepted")
	}
}

func TestEffectsPurge(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	storetest.RunEffectsPurge(t, func(t *testing.T) storetest.PurgeableEffects { return newEffects(t, db) })
}
