package sdkstore_test

import (
	"context"
	"database/sql"
	"testing"

	"github.com/babelqueue/watermill-idempotency/stores/sdkstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestConcurrentMigrations: replicas starting together all migrate fresh
// tables, on every SQL layout (before: CREATE TABLE IF NOT EXISTS raced on
// PostgreSQL and one of them failed with SQLSTATE 23505).
func TestConcurrentMigrations(t *testing.T) {
	t.Parallel()
	rounds := 4
	if testing.Short() {
		rounds = 2
	}
	for name, c := range map[string]struct {
		db      func(t testing.TB) *sql.DB
		migrate func(db *sql.DB, table string) func(context.Context) error
	}{
		"PHPPDO/PostgreSQL": {testenv.Postgres, func(db *sql.DB, table string) func(context.Context) error {
			s, err := sdkstore.NewPHPPDO(db, sdkstore.PostgreSQL, sdkstore.WithTable(table))
			return migrateOf(s, err)
		}},
		"PHPPDO/MariaDB": {testenv.MariaDB, func(db *sql.DB, table string) func(context.Context) error {
			s, err := sdkstore.NewPHPPDO(db, sdkstore.MariaDB, sdkstore.WithTable(table))
			return migrateOf(s, err)
		}},
		"GoPostgres": {testenv.Postgres, func(db *sql.DB, table string) func(context.Context) error {
			s, err := sdkstore.NewGoPostgres(db, sdkstore.WithTable(table), sdkstore.WithClaimTable(table+"_claims"))
			return migrateOf(s, err)
		}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := c.db(t)
			testenv.RequireConcurrentMigrations(t, rounds, func(t *testing.T) func(context.Context, int) error {
				table := sqlTable(t, db, "mig")
				return func(ctx context.Context, _ int) error { return c.migrate(db, table)(ctx) }
			})
		})
	}
}

func migrateOf(s interface{ Migrate(context.Context) error }, err error) func(context.Context) error {
	if err != nil {
		return func(context.Context) error { return err }
	}
	return s.Migrate
}
