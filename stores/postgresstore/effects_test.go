package postgresstore_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/storetest"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
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

func TestEffectsResultTTL(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	db.SetMaxOpenConns(4)
	storetest.RunEffects(t, func(t *testing.T) stores.EffectStore { return newEffects(t, db) },
		storetest.WithEffectsResultTTLStore(func(t *testing.T, resultTTL, ttl time.Duration) storetest.PurgeableEffects {
			return newEffects(t, db, postgresstore.WithEffectsTTL(ttl), postgresstore.WithResultTTL(resultTTL))
		}))
}

// TestEffectResultCleared: a result past its lifetime reads as gone at
// once, and Purge clears the column (the bytes), keeping the row and its
// state; a result within its lifetime is left.
func TestEffectResultCleared(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	e := newEffects(t, db, postgresstore.WithEffectsTTL(time.Hour), postgresstore.WithResultTTL(100*time.Millisecond))
	ctx := context.Background()
	for _, key := range []string{"old", "young"} {
		if _, _, err := e.Begin(ctx, stores.EffectIntent{Key: key}, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, err := e.Transition(ctx, "old", stores.EffectTransition{To: stores.EffectSucceeded, Result: []byte("ch_old")}); err != nil {
		t.Fatal(err)
	}
	table, _ := e.Tables()
	held := func(key string) (n int) {
		t.Helper()
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM `+table+` WHERE key = $1 AND result IS NOT NULL`, []byte(key)).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	deadline := time.Now().Add(5 * time.Second)
	for got, _ := e.Lookup(ctx, "old"); !got.ResultDropped; got, _ = e.Lookup(ctx, "old") {
		if time.Now().After(deadline) {
			t.Fatalf("the result outlived its lifetime by 5s: %+v", got)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, _, err := e.Transition(ctx, "young", stores.EffectTransition{To: stores.EffectSucceeded, Result: []byte("ch_young")}); err != nil {
		t.Fatal(err)
	}
	if held("old") != 1 {
		t.Fatal("the dropped result was cleared before any purge: the test cannot tell Purge did it")
	}
	if n, err := e.Purge(ctx, time.Now().Add(-time.Hour)); err != nil || n != 0 {
		t.Fatalf("Purge: %d, %v; want no row removed", n, err)
	}
	if held("old") != 0 {
		t.Fatal("Purge left the dropped result's bytes")
	}
	if got, err := e.Lookup(ctx, "old"); err != nil || got.State != stores.EffectSucceeded || !got.ResultDropped {
		t.Fatalf("after Purge: %+v, %v; want succeeded, result dropped", got, err)
	}
	if got, err := e.Lookup(ctx, "young"); err != nil || held("young") != 1 || (string(got.Result) != "ch_young" && !got.ResultDropped) {
		t.Fatalf("a result within its lifetime after Purge: %+v, %v", got, err)
	}
}

func TestEffectsResultTTLRefused(t *testing.T) {
	t.Parallel()
	_, err := postgresstore.NewEffects(testenv.Postgres(t), postgresstore.WithEffectsTTL(time.Hour), postgresstore.WithResultTTL(2*time.Hour))
	if !errors.Is(err, postgresstore.ErrInvalidOption) {
		t.Fatalf("a result TTL longer than the effects TTL: %v, want ErrInvalidOption", err)
	}
}

// TestEffectsMigrateAddsTheResultColumn: a table of an earlier release,
// without the result lifetime's column, gets it from Migrate.
func TestEffectsMigrateAddsTheResultColumn(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	e := newEffects(t, db)
	table, _ := e.Tables()
	ctx := context.Background()
	if _, err := db.ExecContext(ctx, `ALTER TABLE `+table+` DROP COLUMN result_expires_at`); err != nil {
		t.Fatal(err)
	}
	if err := e.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Begin(ctx, stores.EffectIntent{Key: "k"}, time.Minute); err != nil {
		t.Fatalf("Begin after migrating an earlier table: %v", err)
	}
}
