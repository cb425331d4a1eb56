package postgresstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/babelqueue/watermill-idempotency/internal/sqlstate"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestBeginRacingDuplicatesRecordOnce: copies of one message racing to
// begin with its record, on every way of beginning, are recorded by
// exactly one of them, whether the key is new, has an expired record or
// another holder's lapsed claim; the winner's fingerprint (the lowest
// int64) is kept.
func TestBeginRacingDuplicatesRecordOnce(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	s := newStore(t, db, postgresstore.WithTTL(time.Hour))
	short := newStoreOnTable(t, db, s.Table(), postgresstore.WithTTL(time.Millisecond))
	for name, begin := range beginners(t, s) {
		for _, row := range []string{"none", "expired", "lapsed claim"} {
			t.Run(name+"/"+row, func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				key := name + "/" + row
				switch row {
				case "expired":
					if err := short.Remember(ctx, key, 7, nil); err != nil {
						t.Fatal(err)
					}
				case "lapsed claim":
					if claimed, _, err := s.Claim(stores.WithClaimToken(ctx, "another delivery"), key, time.Millisecond); err != nil || !claimed {
						t.Fatalf("Claim = %v, %v", claimed, err)
					}
				}
				time.Sleep(5 * time.Millisecond)
				const racers = 6
				var recorded, failed atomic.Int32
				var wg sync.WaitGroup
				for range racers {
					wg.Add(1)
					go func() {
						defer wg.Done()
						b, err := begin(t, key, 1<<63, []byte("v"))
						if err != nil {
							failed.Add(1)
							t.Error(err)
							return
						}
						end := b.rollback
						if b.recorded {
							recorded.Add(1)
							time.Sleep(10 * time.Millisecond) // the others wait on the record
							end = b.commit
						}
						if err := end(); err != nil {
							t.Error(err)
						}
					}()
				}
				wg.Wait()
				if recorded.Load() != 1 || failed.Load() != 0 {
					t.Fatalf("%d of %d racers recorded the key (%d failed), want exactly one", recorded.Load(), racers, failed.Load())
				}
				if r, err := s.Lookup(ctx, key); err != nil || !r.Remembered() || r.Fingerprint != 1<<63 {
					t.Fatalf("Lookup = %+v, %v; want the winner's record", r, err)
				}
			})
		}
	}
}

// TestBeginPgxBeginQueryEndingInACommentStillRecords: a BeginQuery of the
// caller's ending in a -- comment must not swallow the record appended
// after it: the key is recorded (and found by its second copy), not
// reported recorded while nothing was written.
func TestBeginPgxBeginQueryEndingInACommentStillRecords(t *testing.T) {
	t.Parallel()
	s := newStore(t, testenv.Postgres(t))
	pool := testenv.PgxPool(t, 1)
	ctx := context.Background()
	conn := acquire(t, pool)
	opts := pgx.TxOptions{BeginQuery: "BEGIN ISOLATION LEVEL REPEATABLE READ -- pinned by the application"}
	for i, want := range []bool{true, false} {
		if recorded := recordPgx(t, s, conn.Conn(), opts, "commented", 0); recorded != want {
			t.Fatalf("copy %d: recorded = %v, want %v (the record went into the comment)", i+1, recorded, want)
		}
	}
	if r, err := s.Lookup(ctx, "commented"); err != nil || !r.Remembered() {
		t.Fatalf("Lookup = %+v, %v; want the record", r, err)
	}
}

// TestBeginPgxStatementAlreadyPreparedInTheSession: a server session that
// already holds the record's statement under its name, which pgx did not
// prepare (a pooler in transaction mode hands out a server connection on
// which another client prepared it), must not fail every message on that
// connection with "prepared statement already exists" (42P05).
func TestBeginPgxStatementAlreadyPreparedInTheSession(t *testing.T) {
	t.Parallel()
	s := newStore(t, testenv.Postgres(t))
	pool := testenv.PgxPool(t, 2)
	ctx := context.Background()
	first := acquire(t, pool)
	recordPgx(t, s, first.Conn(), pgx.TxOptions{}, "first", 0)
	var name, statement string
	if err := first.QueryRow(ctx, "SELECT name, statement FROM pg_prepared_statements WHERE name LIKE 'bq_idempotency_record_%'").Scan(&name, &statement); err != nil {
		t.Fatal(err)
	}
	second := acquire(t, pool)
	// Prepared by someone else on this session: pgx does not know it.
	if _, err := second.Conn().PgConn().Exec(ctx, "PREPARE "+name+" AS "+statement).ReadAll(); err != nil {
		t.Fatal(err)
	}
	for i, key := range []string{"second", "third", "second"} {
		// On a session holding the statement already.
		if recorded := recordPgx(t, s, second.Conn(), pgx.TxOptions{}, key, 0); recorded != (i < 2) {
			t.Fatalf("BeginPgx(%q) recorded = %v, want %v", key, recorded, i < 2)
		}
	}
}

// acquire takes a connection of pool, released when the test ends.
func acquire(t *testing.T, pool *pgxpool.Pool) *pgxpool.Conn {
	t.Helper()
	conn, err := pool.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(conn.Release)
	return conn
}

// recordPgx begins key's transaction on conn with BeginPgx and commits it,
// failing the test on error (with the SQLSTATE), and reports whether it
// recorded the key.
func recordPgx(t *testing.T, s *postgresstore.Store, conn *pgx.Conn, opts pgx.TxOptions, key string, fingerprint uint64) bool {
	t.Helper()
	ctx := context.Background()
	tx, recorded, _, err := s.BeginPgx(ctx, conn, opts, key, fingerprint, nil)
	if err != nil {
		t.Fatalf("BeginPgx(%q): %v (SQLSTATE %v)", key, err, sqlstateOf(err))
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	return recorded
}

func sqlstateOf(err error) string {
	code, _ := sqlstate.Of(err)
	return code
}

// lostStatements counts the queries that failed because the session had
// lost a prepared statement (SQLSTATE 26000).
type lostStatements struct{ n atomic.Int32 }

func (l *lostStatements) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (l *lostStatements) TraceQueryEnd(_ context.Context, _ *pgx.Conn, data pgx.TraceQueryEndData) {
	if sqlstateOf(data.Err) == "26000" {
		l.n.Add(1)
	}
}

// TestBeginPgxStatementsLostOnEveryRelease: a pool whose AfterRelease runs
// DISCARD ALL (with QueryExecModeExec, so pgx's own queries do not mind)
// drops the record's prepared statement whenever a connection goes back to
// it. Every message would then first fail its EXECUTE (an ERROR in the
// server's log, a ROLLBACK, a Close and a Parse more: five round trips
// instead of one): the store must stop preparing a statement that never
// survives, after a few messages, not pay for it on every one.
func TestBeginPgxStatementsLostOnEveryRelease(t *testing.T) {
	t.Parallel()
	s := newStore(t, testenv.Postgres(t))
	cfg, err := pgxpool.ParseConfig(testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN))
	if err != nil {
		t.Fatal(err)
	}
	lost := &lostStatements{}
	cfg.MaxConns = 1
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
	cfg.ConnConfig.Tracer = lost
	cfg.AfterRelease = func(c *pgx.Conn) bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := c.Exec(ctx, "DISCARD ALL")
		return err == nil
	}
	ctx := context.Background()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	const messages = 20
	for i := range messages {
		conn, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		key := "discarded-" + string(rune('a'+i))
		tx, recorded, _, err := s.BeginPgx(ctx, conn.Conn(), pgx.TxOptions{}, key, 0, nil)
		if err != nil || !recorded {
			conn.Release()
			t.Fatalf("BeginPgx(%q) = %v, %v; want recorded", key, recorded, err)
		}
		err = tx.Commit(ctx)
		conn.Release()
		if err != nil {
			t.Fatal(err)
		}
	}
	if n := lost.n.Load(); n > messages/4 {
		t.Fatalf("%d of %d messages failed an EXECUTE of a statement DISCARD ALL had dropped, want the store to give the statement up after a few", n, messages)
	}
}

// TestBeginGivenUpLeavesNothingOpen: a caller whose deadline passes while
// its begin waits on another transaction's uncommitted record gets its
// context's error, and leaves no connection in use and no transaction open
// (database/sql through pgx and lib/pq, and a pgx pool).
func TestBeginGivenUpLeavesNothingOpen(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	pool := testenv.PgxPool(t, 2)
	for _, way := range []string{"pgx", "postgres", "BeginPgx"} {
		t.Run(way, func(t *testing.T) {
			t.Parallel()
			s := newStore(t, db) // a table of its own: the check below looks for sessions on it
			ctx := context.Background()
			key := "held-" + way
			holder, recorded, _, err := s.BeginTx(ctx, testenv.Postgres(t), nil, key, 0, nil)
			if err != nil || !recorded {
				t.Fatalf("BeginTx = %v, %v", recorded, err)
			}
			defer func() { _ = holder.Rollback() }()
			driver := "pgx"
			if way == "postgres" {
				driver = "postgres" // lib/pq
			}
			waiter := testenv.PostgresWithDriver(t, driver)
			cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
			defer cancel()
			if way == "BeginPgx" {
				conn, aerr := pool.Acquire(ctx)
				if aerr != nil {
					t.Fatal(aerr)
				}
				_, _, _, err = s.BeginPgx(cctx, conn.Conn(), pgx.TxOptions{}, key, 0, nil)
				if status := conn.Conn().PgConn().TxStatus(); !conn.Conn().IsClosed() && status != 'I' {
					t.Errorf("the connection went back in status %q", status)
				}
				conn.Release()
			} else {
				_, _, _, err = s.BeginTx(cctx, waiter, nil, key, 0, nil)
				// database/sql ends a transaction whose context is done in a
				// goroutine of its own: wait for it (a loaded machine may
				// take a while), up to 10 s.
				inUse := waiter.Stats().InUse
				for start := time.Now(); inUse != 0 && time.Since(start) < 10*time.Second; inUse = waiter.Stats().InUse {
					time.Sleep(10 * time.Millisecond)
				}
				if inUse != 0 {
					t.Errorf("%d connections still in use 10 s after the begin gave up", inUse)
				}
			}
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("begin past its deadline = %v, want context.DeadlineExceeded", err)
			}
			if err := holder.Rollback(); err != nil {
				t.Fatal(err)
			}
			// The waiter's statement was cancelled and its transaction
			// ends: the driver rolls it back, or closes the connection, in
			// a goroutine of its own, so the server may still show the
			// session idle in its transaction for a moment (up to half a
			// second seen under load). Wait, up to 10 s, for no session to
			// be left in a transaction on the table; then nothing can
			// commit the key the holder gave up.
			open := sessionsInTransaction(t, db, s.Table())
			for start := time.Now(); len(open) > 0 && time.Since(start) < 10*time.Second; open = sessionsInTransaction(t, db, s.Table()) {
				time.Sleep(10 * time.Millisecond)
			}
			if len(open) > 0 {
				t.Fatalf("%d sessions still in a transaction on the store's table 10 s after the begin gave up: %q", len(open), open)
			}
			if r, err := s.Lookup(ctx, key); err != nil || r.Remembered() {
				t.Fatalf("Lookup = %+v, %v; want nothing recorded", r, err)
			}
		})
	}
}

// TestBeginPgxStoresShareAConnection: stores on one table with different
// TTLs, and on different tables, record through the same connection each
// with its own statement (their names differ), each with its own expiry.
func TestBeginPgxStoresShareAConnection(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	hour := newStore(t, db, postgresstore.WithTTL(time.Hour))
	minute := newStoreOnTable(t, db, hour.Table(), postgresstore.WithTTL(time.Minute))
	other := newStore(t, db, postgresstore.WithTTL(time.Hour))
	pool := testenv.PgxPool(t, 1)
	ctx := context.Background()
	conn := acquire(t, pool)
	for i, c := range []struct {
		s    *postgresstore.Store
		want time.Duration
	}{{hour, time.Hour}, {minute, time.Minute}, {other, time.Hour}, {hour, time.Hour}, {minute, time.Minute}} {
		key := fmt.Sprintf("shared-%d", i)
		if !recordPgx(t, c.s, conn.Conn(), pgx.TxOptions{}, key, 0) {
			t.Fatalf("BeginPgx(%q) did not record", key)
		}
		r, err := c.s.Lookup(ctx, key)
		if until := time.Until(r.ExpiresAt); err != nil || until < c.want-time.Minute/2 || until > c.want {
			t.Fatalf("record %d expires in %v (%v), want %v", i, until, err, c.want)
		}
	}
	var prepared int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'bq_idempotency_record_%'").Scan(&prepared); err != nil {
		t.Fatal(err)
	}
	if prepared != 3 {
		t.Fatalf("%d record statements prepared, want 3 (one per table and TTL)", prepared)
	}
}

// sessionsInTransaction describes the sessions in a transaction (idle in
// it, or running a statement) whose last statement named table.
func sessionsInTransaction(t *testing.T, db *sql.DB, table string) []string {
	t.Helper()
	rows, err := db.QueryContext(context.Background(), `SELECT pid, state, coalesce(application_name, ''), now() - xact_start, query
		FROM pg_stat_activity WHERE xact_start IS NOT NULL AND pid <> pg_backend_pid() AND position($1 in query) > 0`, table)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var pid int
		var state, app, age, query string
		if err := rows.Scan(&pid, &state, &app, &age, &query); err != nil {
			t.Fatal(err)
		}
		out = append(out, fmt.Sprintf("pid %d %s (app %q, transaction open %s): %s", pid, state, app, age, query))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}
