package postgresstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestTxPathsPgxFaults: BeginPgx of a key the caller claimed, in every
// claim mode, then its transaction's context cancelled before the commit,
// the commit's reply lost past the deadline, or its session killed: the
// effect and the record commit together or not at all, the redelivery
// finds the key free at once or remembered with the effect once, and the
// conn is left in no transaction.
func TestTxPathsPgxFaults(t *testing.T) {
	t.Parallel()
	for _, mode := range tpModes {
		for _, fault := range []string{"cancelled", "commitlost", "killed"} {
			t.Run(mode.name+"/"+fault, func(t *testing.T) {
				t.Parallel()
				s, db, direct, _, effects := tpStore(t, mode.opt)
				dsn, proxy := testenv.PostgresProxyDSN(t)
				conn, err := pgx.Connect(context.Background(), dsn)
				if err != nil {
					t.Fatal(err)
				}
				defer func() { _ = conn.Close(context.Background()) }()
				tok := stores.WithClaimToken(context.Background(), "first")
				if claimed, _, err := s.Claim(tok, "k", time.Minute); err != nil || !claimed {
					t.Fatalf("claim: %v, %v", claimed, err)
				}
				ctx, cancel := context.WithTimeout(tok, 2*time.Second)
				defer cancel()
				tx, recorded, found, err := s.BeginPgx(ctx, conn, pgx.TxOptions{}, "k", 0, nil)
				if err != nil || !recorded {
					t.Fatalf("begin: %v, %v, %v", recorded, found.State, err)
				}
				if _, err := tx.Exec(ctx, `INSERT INTO `+effects+` VALUES ('k')`); err != nil {
					t.Fatal(err)
				}
				switch fault {
				case "cancelled":
					cancel()
				case "commitlost":
					dl, _ := ctx.Deadline()
					proxy.Delay.Store(int64(time.Until(dl) + 500*time.Millisecond))
				case "killed":
					if _, err := direct.Exec(`SELECT pg_terminate_backend($1)`, conn.PgConn().PID()); err != nil {
						t.Fatal(err)
					}
				}
				err = tx.Commit(ctx)
				proxy.Delay.Store(0)
				t.Logf("commit: %v", err)
				if !conn.IsClosed() && conn.PgConn().TxStatus() != 'I' {
					t.Errorf("the conn is left in a transaction (%c)", conn.PgConn().TxStatus())
				}
				tpAfter(t, s, db, direct, effects, "k")
			})
		}
	}
}

// TestTxPathsMakingWayLeaksNoGoroutine: the claim's end left going on when
// RememberTx's caller leaves at its deadline (transaction and session
// claims, replies 300ms late, a 100ms deadline) ends once PostgreSQL
// answers: with the store closed and its pool, no goroutine of it is left.
func TestTxPathsMakingWayLeaksNoGoroutine(t *testing.T) {
	for _, mode := range tpModes[:2] {
		t.Run(mode.name, func(t *testing.T) {
			ignore := goleak.IgnoreCurrent()
			func() {
				s, db, direct, proxy, effects := tpStore(t, mode.opt)
				tok := stores.WithClaimToken(context.Background(), "first")
				if claimed, _, err := s.Claim(tok, "k", time.Minute); err != nil || !claimed {
					t.Fatalf("claim: %v, %v", claimed, err)
				}
				tx, err := db.BeginTx(context.Background(), nil)
				if err != nil {
					t.Fatal(err)
				}
				proxy.Delay.Store(int64(300 * time.Millisecond))
				ctx, cancel := context.WithTimeout(tok, 100*time.Millisecond)
				_, _, err = s.RememberTx(ctx, tx, "k", 0, nil)
				cancel()
				proxy.Delay.Store(0)
				_ = tx.Rollback()
				t.Logf("RememberTx: %v", err)
				tpAfter(t, s, db, direct, effects, "k")
				if err := s.Close(); err != nil {
					t.Fatal(err)
				}
				_ = db.Close()
			}()
			if err := goleak.Find(ignore, goleak.IgnoreAnyFunction("github.com/babelqueue/watermill-idempotency/testkit/testenv.(*FaultProxy).serve"),
				// the pool straight to the server, closed when the test ends
				goleak.IgnoreTopFunction("database/sql.(*DB).connectionOpener")); err != nil {
				t.Fatal(err)
			}
		})
	}
}
