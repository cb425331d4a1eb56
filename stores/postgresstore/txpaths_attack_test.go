package postgresstore_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// tpModes are the claim modes the caller's-transaction paths are attacked
// in, and the partitioned layout (claims of rows, daily partitions).
var tpModes = []struct {
	name string
	opt  postgresstore.Option
}{
	{"transaction", postgresstore.WithTransactionClaims()},
	{"session", postgresstore.WithSessionClaims()},
	{"row", postgresstore.WithRowClaims()},
	{"partitioned", func(s *postgresstore.Store) {
		postgresstore.WithPartitions(0)(s)
		postgresstore.WithTTL(time.Hour)(s)
	}},
}

// tpStore returns a migrated store made with opt on a pgx pool through a
// fault proxy (proxiedStore), the pool (db), a pool straight to the server
// (direct), the proxy, and a table of the caller's effects (effects); the
// test's tables are dropped when it ends.
func tpStore(t *testing.T, opt postgresstore.Option) (s *postgresstore.Store, db, direct *sql.DB, proxy *testenv.FaultProxy, effects string) {
	t.Helper()
	s, db, direct, proxy = proxiedStore(t, "idem_tp_", opt)
	effects = s.Table() + "_fx"
	if _, err := direct.Exec(`CREATE TABLE ` + effects + ` (k text)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = direct.Exec(`DROP TABLE IF EXISTS ` + effects) })
	return s, db, direct, proxy, effects
}

// tpBegin begins the caller's transaction with the record of key, by
// BeginTx or by BeginTx of database/sql and RememberTx.
func tpBegin(ctx context.Context, s *postgresstore.Store, db *sql.DB, entry, key string) (*sql.Tx, bool, stores.Record, error) {
	if entry == "BeginTx" {
		return s.BeginTx(ctx, db, nil, key, 0, nil)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return nil, false, stores.Record{}, err
	}
	recorded, found, err := s.RememberTx(ctx, tx, key, 0, nil)
	if err != nil {
		_ = tx.Rollback()
		return nil, false, stores.Record{}, err
	}
	return tx, recorded, found, nil
}

// tpClaimAndWrite claims "k" for the holder ctx names, begins the
// caller's transaction with its record (by entry, see tpBegin) under ctx,
// and writes the effect in it: the transaction, to be committed.
func tpClaimAndWrite(ctx context.Context, t *testing.T, s *postgresstore.Store, db *sql.DB, entry, effects string) *sql.Tx {
	t.Helper()
	if claimed, _, err := s.Claim(context.WithoutCancel(ctx), "k", time.Minute); err != nil || !claimed {
		t.Fatalf("claim: %v, %v", claimed, err)
	}
	tx, recorded, found, err := tpBegin(ctx, s, db, entry, "k")
	if err != nil || !recorded {
		t.Fatalf("begin: %v, %v, %v", recorded, found.State, err)
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+effects+` VALUES ('k')`); err != nil {
		t.Fatal(err)
	}
	return tx
}

// tpAfter has the first holder release its claim, as the middleware does
// after a failed delivery, then checks what a redelivery finds: the key claimed at
// once (within 2s, not parked for the lease of a minute) with no effect
// written, or remembered with exactly one; then no session idle in a
// transaction and no connection in use.
func tpAfter(t *testing.T, s *postgresstore.Store, db, direct *sql.DB, effects, key string) {
	t.Helper()
	tpAfterKey(t, s, db, direct, effects, key)
}

// tpAfterKey is tpAfter.
func tpAfterKey(t *testing.T, s *postgresstore.Store, db, direct *sql.DB, effects, key string) {
	t.Helper()
	rctx, cancel := context.WithTimeout(stores.WithClaimToken(context.Background(), "first"), 2*time.Second)
	err := s.Release(rctx, key)
	cancel()
	t.Logf("the first holder's release: %v", err)
	redelivery := stores.WithClaimToken(context.Background(), "redelivery")
	start := time.Now()
	for {
		cctx, cancel := context.WithTimeout(redelivery, time.Second)
		claimed, found, err := s.Claim(cctx, key, time.Minute)
		cancel()
		var n int
		if err := direct.QueryRow(`SELECT count(*) FROM ` + effects).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if err == nil && claimed {
			if n != 0 {
				t.Fatalf("the redelivery claimed the key, with the effect written %d times", n)
			}
			if err := s.Release(redelivery, key); err != nil {
				t.Fatal(err)
			}
			break
		}
		if err == nil && found.Remembered() {
			if n != 1 {
				t.Fatalf("the key is remembered, with the effect written %d times", n)
			}
			break
		}
		if time.Since(start) > 3*time.Second {
			t.Fatalf("3s on, the redelivery still finds %v (%v), effect written %d times", found.State, err, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("the redelivery's answer after %v", time.Since(start).Round(time.Millisecond))
	deadline := time.Now().Add(5 * time.Second)
	for {
		var inTx int
		if err := direct.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE state LIKE 'idle in transaction%' AND pid <> pg_backend_pid() AND query LIKE '%` + s.Table() + `%'`).Scan(&inTx); err != nil {
			t.Fatal(err)
		}
		if inTx == 0 && db.Stats().InUse == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("5s on, %d sessions idle in a transaction, %d connections in use", inTx, db.Stats().InUse)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestTxPathsFaults(t *testing.T) {
	t.Parallel()
	for _, mode := range tpModes {
		for _, entry := range []string{"BeginTx", "RememberTx"} {
			t.Run(mode.name+"/"+entry+"/cancelled", func(t *testing.T) {
				t.Parallel()
				s, db, direct, _, effects := tpStore(t, mode.opt)
				ctx, cancel := context.WithCancel(stores.WithClaimToken(context.Background(), "first"))
				defer cancel()
				tx := tpClaimAndWrite(ctx, t, s, db, entry, effects)
				cancel()
				err := tx.Commit()
				t.Logf("commit after the cancel: %v", err)
				tpAfter(t, s, db, direct, effects, "k")
			})
			t.Run(mode.name+"/"+entry+"/slow", func(t *testing.T) {
				t.Parallel()
				s, db, direct, proxy, effects := tpStore(t, mode.opt)
				tok := stores.WithClaimToken(context.Background(), "first")
				if claimed, _, err := s.Claim(tok, "k", time.Minute); err != nil || !claimed {
					t.Fatalf("claim: %v, %v", claimed, err)
				}
				proxy.Delay.Store(int64(300 * time.Millisecond))
				ctx, cancel := context.WithTimeout(tok, 100*time.Millisecond)
				start := time.Now()
				tx, _, _, err := tpBegin(ctx, s, db, entry, "k")
				took := time.Since(start)
				cancel()
				proxy.Delay.Store(0)
				if err == nil {
					_ = tx.Rollback()
					t.Fatalf("began under a 100ms deadline with replies 300ms late")
				}
				if !errors.Is(err, context.DeadlineExceeded) || took > 250*time.Millisecond {
					t.Fatalf("under a 100ms deadline: %v after %v", err, took)
				}
				tpAfter(t, s, db, direct, effects, "k")
			})
			t.Run(mode.name+"/"+entry+"/commitlost", func(t *testing.T) {
				t.Parallel()
				s, db, direct, proxy, effects := tpStore(t, mode.opt)
				ctx, cancel := context.WithTimeout(stores.WithClaimToken(context.Background(), "first"), 2*time.Second)
				defer cancel()
				tx := tpClaimAndWrite(ctx, t, s, db, entry, effects)
				dl, _ := ctx.Deadline()
				proxy.Delay.Store(int64(time.Until(dl) + 500*time.Millisecond))
				start := time.Now()
				err := tx.Commit()
				took := time.Since(start)
				proxy.Delay.Store(0)
				t.Logf("commit past the deadline: %v after %v", err, took)
				if time.Now().After(dl.Add(200 * time.Millisecond)) {
					t.Fatalf("commit returned %v after the deadline", time.Since(dl))
				}
				tpAfter(t, s, db, direct, effects, "k")
			})
			t.Run(mode.name+"/"+entry+"/killed", func(t *testing.T) {
				t.Parallel()
				s, db, direct, _, effects := tpStore(t, mode.opt)
				ctx, cancel := context.WithTimeout(stores.WithClaimToken(context.Background(), "first"), 5*time.Second)
				defer cancel()
				tx := tpClaimAndWrite(ctx, t, s, db, entry, effects)
				var pid int
				if err := tx.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
					t.Fatal(err)
				}
				if _, err := direct.Exec(`SELECT pg_terminate_backend($1)`, pid); err != nil {
					t.Fatal(err)
				}
				err := tx.Commit()
				t.Logf("commit on a killed session: %v", err)
				if err == nil {
					t.Fatal("commit on a killed session succeeded")
				}
				tpAfter(t, s, db, direct, effects, "k")
			})
		}
	}
}

// TestTxPathsDeadlineSweep: with every reply 60ms late, BeginTx, RememberTx
// and BeginPgx of a key the caller claimed, under deadlines from 20ms to
// 500ms, each return by the deadline (and a margin) with the context's
// error or succeed; the transaction rolled back, the redelivery finds the
// key free at once, and no session stays idle in a transaction.
func TestTxPathsDeadlineSweep(t *testing.T) {
	if testing.Short() {
		t.Skip("a sweep of deadlines: seconds")
	}
	t.Parallel()
	for _, mode := range tpModes {
		for _, entry := range []string{"BeginTx", "RememberTx", "BeginPgx"} {
			t.Run(mode.name+"/"+entry, func(t *testing.T) {
				t.Parallel()
				s, db, direct, proxy, effects := tpStore(t, mode.opt)
				dsn, pproxy := testenv.PostgresProxyDSN(t)
				for d := 20 * time.Millisecond; d <= 500*time.Millisecond; d += 40 * time.Millisecond {
					key := "k" + d.String()
					tok := stores.WithClaimToken(context.Background(), "first")
					if claimed, _, err := s.Claim(tok, key, time.Minute); err != nil || !claimed {
						t.Fatalf("claim: %v, %v", claimed, err)
					}
					var conn *pgx.Conn
					if entry == "BeginPgx" {
						var err error
						if conn, err = pgx.Connect(context.Background(), dsn); err != nil {
							t.Fatal(err)
						}
					}
					proxy.Delay.Store(int64(60 * time.Millisecond))
					pproxy.Delay.Store(int64(60 * time.Millisecond))
					ctx, cancel := context.WithTimeout(tok, d)
					start := time.Now()
					var err error
					var took time.Duration
					if entry == "BeginPgx" {
						var tx pgx.Tx
						tx, _, _, err = s.BeginPgx(ctx, conn, pgx.TxOptions{}, key, 0, nil)
						took = time.Since(start)
						proxy.Delay.Store(0)
						pproxy.Delay.Store(0)
						if err == nil {
							_ = tx.Rollback(context.Background())
						}
					} else {
						var tx *sql.Tx
						tx, _, _, err = tpBegin(ctx, s, db, entry, key)
						took = time.Since(start)
						proxy.Delay.Store(0)
						pproxy.Delay.Store(0)
						if err == nil {
							_ = tx.Rollback()
						}
					}
					cancel()
					if err != nil && !errors.Is(err, context.DeadlineExceeded) {
						t.Errorf("deadline %v: %v after %v", d, err, took)
					}
					if took > d+50*time.Millisecond {
						t.Errorf("deadline %v: returned %v after %v", d, err, took)
					}
					if conn != nil {
						if !conn.IsClosed() && conn.PgConn().TxStatus() != 'I' {
							t.Errorf("deadline %v: the pgx conn is left in a transaction (%c)", d, conn.PgConn().TxStatus())
						}
						_ = conn.Close(context.Background())
					}
					tpAfterKey(t, s, db, direct, effects, key)
				}
			})
		}
	}
}

// TestSessionClaimRememberTxMakingWayByItsDeadline: with session claims,
// RememberTx of a key the caller claimed gives the claim's lock back
// before it records; with PostgreSQL's replies 300ms late and a deadline
// of 100ms it returns the context's error by then (the lock's giving back
// goes on), and the redelivery then finds the key free at once.
func TestSessionClaimRememberTxMakingWayByItsDeadline(t *testing.T) {
	t.Parallel()
	s, db, direct, proxy, effects := tpStore(t, postgresstore.WithSessionClaims())
	tok := stores.WithClaimToken(context.Background(), "first")
	if claimed, _, err := s.Claim(tok, "k", time.Minute); err != nil || !claimed {
		t.Fatalf("claim: %v, %v", claimed, err)
	}
	tx, err := db.BeginTx(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	proxy.Delay.Store(int64(300 * time.Millisecond))
	ctx, cancel := context.WithTimeout(tok, 100*time.Millisecond)
	start := time.Now()
	_, _, err = s.RememberTx(ctx, tx, "k", 0, nil)
	took := time.Since(start)
	cancel()
	proxy.Delay.Store(0)
	if !errors.Is(err, context.DeadlineExceeded) || took > 200*time.Millisecond {
		t.Fatalf("RememberTx under a 100ms deadline returned %v after %v", err, took)
	}
	_ = tx.Rollback()
	tpAfter(t, s, db, direct, effects, "k")
}
