package testenv

import (
	"context"
	"database/sql"
	"testing"

	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
)

// PostgresEffects returns a postgresstore.Effects on db, on tables of its
// own (migrated), dropped when the test ends.
func PostgresEffects(t testing.TB, db *sql.DB, opts ...postgresstore.EffectsOption) *postgresstore.Effects {
	t.Helper()
	table := postgresstore.WithEffectsTable("fx_" + RandomHex(6))
	e, err := postgresstore.NewEffects(db, append([]postgresstore.EffectsOption{table}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		effects, events := e.Tables()
		if _, err := db.ExecContext(context.Background(), `DROP TABLE IF EXISTS `+effects+`, `+events); err != nil {
			t.Errorf("testenv: dropping the effects tables: %v", err)
		}
	})
	return e
}
