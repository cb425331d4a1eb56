package postgresstore_test

import (
	"context"
	"database/sql"
	"testing"

	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestConcurrentMigrations: replicas starting together all migrate a
// fresh table (before: CREATE TABLE IF NOT EXISTS raced and one of them
// failed with SQLSTATE 23505 on pg_type_typname_nsp_index).
func TestConcurrentMigrations(t *testing.T) {
	t.Parallel()
	rounds := 4
	if testing.Short() {
		rounds = 2
	}
	t.Run("Store", func(t *testing.T) {
		t.Parallel()
		db := testenv.Postgres(t)
		testenv.RequireConcurrentMigrations(t, rounds, func(t *testing.T) func(context.Context, int) error {
			table := "mig_" + testenv.RandomHex(6)
			dropAfter(t, db, table)
			return func(ctx context.Context, _ int) error {
				s, err := postgresstore.New(db, postgresstore.WithTable(table))
				if err != nil {
					return err
				}
				return s.Migrate(ctx)
			}
		})
	})
	t.Run("Effects", func(t *testing.T) {
		t.Parallel()
		db := testenv.Postgres(t)
		testenv.RequireConcurrentMigrations(t, rounds, func(t *testing.T) func(context.Context, int) error {
			table := "migfx_" + testenv.RandomHex(6)
			dropAfter(t, db, table, table+"_events")
			return func(ctx context.Context, _ int) error {
				e, err := postgresstore.NewEffects(db, postgresstore.WithEffectsTable(table))
				if err != nil {
					return err
				}
				return e.Migrate(ctx)
			}
		})
	})
}

// dropAfter drops tables when the test ends.
func dropAfter(t *testing.T, db *sql.DB, tables ...string) {
	t.Cleanup(func() {
		for _, table := range tables {
			if _, err := db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+table); err != nil {
				t.Errorf("drop %s: %v", table, err)
			}
		}
	})
}
