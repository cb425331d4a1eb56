package sqlmigrate_test

import (
	"context"
	"database/sql"
	"errors"
	"hash/fnv"
	"testing"
	"time"

	_ "github.com/lib/pq" // the "postgres" database/sql driver

	"github.com/babelqueue/watermill-idempotency/internal/sqlmigrate"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestWaitCutShortSaysWhy: a migration waiting for the lock another
// replica holds, whose context is cancelled (the process is stopping) or
// whose deadline passes, returns an error that matches the context's
// (errors.Is context.Canceled / context.DeadlineExceeded), as every other
// call of the kit does, on every driver: a caller that tells "we are
// shutting down" from "the database refused" must be able to.
func TestWaitCutShortSaysWhy(t *testing.T) {
	t.Parallel()
	const name = "attack29_sqlmigrate"
	h := fnv.New64a()
	h.Write([]byte(sqlmigrate.LockPrefix + name))
	key := int64(h.Sum64())
	for driver, open := range map[string]func(testing.TB) *sql.DB{
		"pgx":     testenv.Postgres,
		"lib/pq":  func(t testing.TB) *sql.DB { return testenv.PostgresWithDriver(t, "postgres") },
		"MariaDB": testenv.MariaDB,
	} {
		for _, cut := range []string{"cancelled", "deadline"} {
			t.Run(driver+"/"+cut, func(t *testing.T) {
				db := open(t)
				mariadb := driver == "MariaDB"
				// Another replica holds the lock for as long as the test needs.
				holder, err := db.Conn(context.Background())
				if err != nil {
					t.Fatal(err)
				}
				defer holder.Close()
				if mariadb {
					var got int
					if err := holder.QueryRowContext(context.Background(), `SELECT GET_LOCK(?, 5)`, sqlmigrate.LockName(name)).Scan(&got); err != nil || got != 1 {
						t.Fatalf("GET_LOCK: %d, %v", got, err)
					}
					defer holder.ExecContext(context.Background(), `DO RELEASE_LOCK(?)`, sqlmigrate.LockName(name)) //nolint:errcheck
				} else {
					tx, err := holder.BeginTx(context.Background(), nil)
					if err != nil {
						t.Fatal(err)
					}
					defer tx.Rollback() //nolint:errcheck
					if _, err := tx.Exec(`SELECT pg_advisory_xact_lock($1)`, key); err != nil {
						t.Fatal(err)
					}
				}
				ctx, cancel := context.WithTimeout(context.Background(), 400*time.Millisecond)
				defer cancel()
				if cut == "cancelled" {
					ctx, cancel = context.WithCancel(context.Background())
					defer cancel()
					time.AfterFunc(400*time.Millisecond, cancel)
				}
				start := time.Now()
				if mariadb {
					err = sqlmigrate.MariaDB(ctx, db, name, func(context.Context, *sql.Conn) error { return nil })
				} else {
					err = sqlmigrate.Postgres(ctx, db, name, `SELECT 1`)
				}
				took := time.Since(start)
				want := context.DeadlineExceeded
				if cut == "cancelled" {
					want = context.Canceled
				}
				if err == nil || !errors.Is(err, want) {
					t.Errorf("a wait for the lock cut short (%s) after %v returned %v; want an error matching %v", cut, took.Round(time.Millisecond), err, want)
				}
				if took > 2*time.Second {
					t.Errorf("a wait for the lock cut short at 400 ms returned after %v", took.Round(time.Millisecond))
				}
			})
		}
	}
}
