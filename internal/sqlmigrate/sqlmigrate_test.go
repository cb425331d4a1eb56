package sqlmigrate_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	_ "github.com/go-sql-driver/mysql" // the "mysql" driver, for MariaDB

	"github.com/babelqueue/watermill-idempotency/internal/sqlmigrate"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestWaitEndsWithTheContext: while one migration holds the lock of a
// table (for a second), another
// waits for it and returns by its context's deadline, with an error; once
// the first is over the lock is free again.
func TestWaitEndsWithTheContext(t *testing.T) {
	for name, c := range map[string]struct {
		db      func(testing.TB) *sql.DB
		migrate func(ctx context.Context, db *sql.DB, stmt string) error
		held    string
	}{
		"PostgreSQL": {testenv.Postgres, func(ctx context.Context, db *sql.DB, stmt string) error {
			return sqlmigrate.Postgres(ctx, db, "sqlmigrate_test", stmt)
		}, `SELECT count(*) > 0 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE l.locktype = 'advisory' AND l.granted AND a.query LIKE '%pg_sleep(1)%'`},
		"MariaDB": {testenv.MariaDB, func(ctx context.Context, db *sql.DB, stmt string) error {
			return sqlmigrate.MariaDB(ctx, db, "sqlmigrate_test", func(ctx context.Context, conn *sql.Conn) error {
				_, err := conn.ExecContext(ctx, stmt)
				return err
			})
		}, `SELECT IS_USED_LOCK('` + sqlmigrate.LockName("sqlmigrate_test") + `') IS NOT NULL`},
	} {
		t.Run(name, func(t *testing.T) {
			db := c.db(t)
			sleep := "SELECT pg_sleep(1)"
			if name == "MariaDB" {
				sleep = "DO SLEEP(1)"
			}
			holder := make(chan error, 1)
			go func() { holder <- c.migrate(context.Background(), db, sleep) }()
			deadline := time.Now().Add(10 * time.Second)
			for held := false; !held; {
				if err := db.QueryRow(c.held).Scan(&held); err != nil {
					t.Fatal(err)
				}
				if !held && time.Now().After(deadline) {
					t.Fatal("the first migration never held the lock")
				}
				time.Sleep(10 * time.Millisecond)
			}
			testenv.RequireDeadlines(t, 2, 1, 300*time.Millisecond, func(ctx context.Context, _, _ int) error {
				return c.migrate(ctx, db, "SELECT 1")
			})
			if err := <-holder; err != nil {
				t.Fatalf("the migration holding the lock: %v", err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if err := c.migrate(ctx, db, "SELECT 1"); err != nil {
				t.Fatalf("after the holder ended: %v", err)
			}
		})
	}
}
