package postgresstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// begun is a transaction a begin-with-the-record call left open.
type begun struct {
	commit, rollback func() error
	recorded         bool
	found            stores.Record
}

// beginner begins a transaction holding key's record, one of the ways the
// store offers, and checks that the transaction is open whatever the
// result.
type beginner func(t *testing.T, key string, fp uint64, value []byte) (begun, error)

// mustBegin is begin, failing the test on error.
func mustBegin(t *testing.T, begin beginner, key string, fp uint64, value []byte) begun {
	t.Helper()
	b, err := begin(t, key, fp, value)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// beginners are the store's ways of beginning with the record: BeginPgx on
// a pgx pool, BeginTx on database/sql through pgx and through lib/pq. A
// connection of the pgx pool goes back once its transaction is committed
// or rolled back, or when the test ends: parallel subtests that each held
// theirs to the end would share the pool's eight out, and wait for ever
// for the rest (one hung a whole package run).
func beginners(t *testing.T, s *postgresstore.Store) map[string]beginner {
	t.Helper()
	ctx := context.Background()
	pool := testenv.PgxPool(t, 8)
	pgxBegin := func(t *testing.T, key string, fp uint64, value []byte) (begun, error) {
		conn, err := pool.Acquire(ctx)
		if err != nil {
			return begun{}, err
		}
		release := sync.OnceFunc(conn.Release)
		t.Cleanup(release)
		tx, recorded, found, err := s.BeginPgx(ctx, conn.Conn(), pgx.TxOptions{}, key, fp, value)
		if err != nil {
			return begun{}, fmt.Errorf("BeginPgx(%q): %w", key, err)
		}
		if status := conn.Conn().PgConn().TxStatus(); status != 'T' {
			return begun{}, fmt.Errorf("BeginPgx(%q) left the connection in status %q, want an open transaction", key, status)
		}
		end := func(f func(context.Context) error) func() error {
			return func() error {
				defer release()
				return f(ctx)
			}
		}
		return begun{end(tx.Commit), end(tx.Rollback), recorded, found}, nil
	}
	sqlBegin := func(db *sql.DB) beginner {
		return func(t *testing.T, key string, fp uint64, value []byte) (begun, error) {
			tx, recorded, found, err := s.BeginTx(ctx, db, nil, key, fp, value)
			if err != nil {
				return begun{}, fmt.Errorf("BeginTx(%q): %w", key, err)
			}
			t.Cleanup(func() { _ = tx.Rollback() })
			if _, err := tx.ExecContext(ctx, "SELECT 1"); err != nil {
				return begun{}, fmt.Errorf("BeginTx(%q) left no usable transaction: %w", key, err)
			}
			return begun{tx.Commit, tx.Rollback, recorded, found}, nil
		}
	}
	return map[string]beginner{
		"BeginPgx":       pgxBegin,
		"BeginTx/pgx":    sqlBegin(testenv.Postgres(t)),
		"BeginTx/lib/pq": sqlBegin(testenv.PostgresWithDriver(t, "postgres")),
	}
}

// TestBeginWithTheRecord: BEGIN and the record together (BeginPgx, one
// round trip; BeginTx, a plain INSERT) record a key never seen with its
// fingerprint (all 64 bits) and value, visible once committed; a
// remembered key is a duplicate with what was kept; another holder's live
// claim is in flight, the caller's own replaced; a lapsed claim and an
// expired record are taken over.
func TestBeginWithTheRecord(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	for layout, opts := range layouts {
		s := newStore(t, db, append(opts, postgresstore.WithTTL(time.Hour))...)
		for name, begin := range beginners(t, s) {
			t.Run(layout+"/"+name, func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				key := func(k string) string { return name + ":" + k }
				const fp = 0xfedcba9876543210 // the high bit set: kept as a negative bigint
				b := mustBegin(t, begin, key("k1"), fp, []byte("saved 'answer'\x00"))
				if !b.recorded {
					t.Fatal("a key never seen was not recorded")
				}
				if r, err := s.Lookup(ctx, key("k1")); err != nil || r.State != stores.StateUnknown {
					t.Fatalf("Lookup before the commit = %v, %v; want nothing visible", r, err)
				}
				if err := b.commit(); err != nil {
					t.Fatal(err)
				}
				r, err := s.Lookup(ctx, key("k1"))
				if err != nil || !r.Remembered() || r.Fingerprint != fp || string(r.Value) != "saved 'answer'\x00" {
					t.Fatalf("Lookup after the commit = %+v, %v", r, err)
				}
				if until := time.Until(r.ExpiresAt); until < 59*time.Minute || until > 61*time.Minute {
					t.Fatalf("expires in %v, want the store's TTL of an hour", until)
				}

				b = mustBegin(t, begin, key("k1"), 1, nil)
				if b.recorded || !b.found.Remembered() || b.found.Fingerprint != fp || string(b.found.Value) != "saved 'answer'\x00" {
					t.Fatalf("begin with a remembered key = %v, %+v; want a duplicate with the kept fingerprint and value", b.recorded, b.found)
				}
				if err := b.rollback(); err != nil {
					t.Fatal(err)
				}

				// Another holder's live claim (a delivery of the claim mode) is
				// in flight: left alone.
				if claimed, _, err := s.Claim(stores.WithClaimToken(ctx, "another delivery"), key("claimed"), time.Minute); err != nil || !claimed {
					t.Fatalf("Claim = %v, %v", claimed, err)
				}
				b = mustBegin(t, begin, key("claimed"), 9, nil)
				if b.recorded || b.found.State != stores.StateInFlight {
					t.Fatalf("begin with another holder's live claim = %v, %+v; want it left alone, in flight", b.recorded, b.found)
				}
				if err := b.rollback(); err != nil {
					t.Fatal(err)
				}
				// The caller's own claim (the same holder: here the Store's, ctx
				// naming none) is replaced by the record, as RememberTx does.
				if claimed, _, err := s.Claim(ctx, key("mine"), time.Minute); err != nil || !claimed {
					t.Fatalf("Claim = %v, %v", claimed, err)
				}
				if b = mustBegin(t, begin, key("mine"), 9, nil); !b.recorded {
					t.Fatal("the caller's own claim was not replaced")
				}
				if err := b.commit(); err != nil {
					t.Fatal(err)
				}
				// A lapsed claim and a record whose retention passed are taken
				// over.
				if claimed, _, err := s.Claim(ctx, key("lapsed"), time.Millisecond); err != nil || !claimed {
					t.Fatalf("Claim = %v, %v", claimed, err)
				}
				short := newStoreOnTable(t, db, s.Table(), append(opts, postgresstore.WithTTL(time.Millisecond))...)
				if err := short.Remember(ctx, key("expired"), 7, nil); err != nil {
					t.Fatal(err)
				}
				time.Sleep(5 * time.Millisecond)
				for _, k := range []string{key("lapsed"), key("expired")} {
					if b = mustBegin(t, begin, k, 9, nil); !b.recorded {
						t.Fatalf("begin(%q) did not take the row over", k)
					}
					if err := b.commit(); err != nil {
						t.Fatal(err)
					}
					if r, err := s.Lookup(ctx, k); err != nil || !r.Remembered() || r.Fingerprint != 9 {
						t.Fatalf("Lookup(%q) after the takeover = %+v, %v", k, r, err)
					}
				}
			})
		}
	}
}

// layouts are the table layouts the transactional tests run on.
var layouts = map[string][]postgresstore.Option{
	"plain":       nil,
	"partitioned": {postgresstore.WithPartitions(0)},
}

// TestBeginWaitsForAnUncommittedRecord: a second transaction recording a
// key another one holds uncommitted waits for it, and is a duplicate if it
// commits, the recorder if it rolls back.
func TestBeginWaitsForAnUncommittedRecord(t *testing.T) {
	t.Parallel()
	for layout, opts := range layouts {
		s := newStore(t, testenv.Postgres(t), append(opts, postgresstore.WithTTL(time.Hour))...)
		for name, begin := range beginners(t, s) {
			t.Run(layout+"/"+name, func(t *testing.T) {
				t.Parallel()
				for _, commit := range []bool{true, false} {
					key := name + map[bool]string{true: ":first-commits", false: ":first-rolls-back"}[commit]
					first := mustBegin(t, begin, key, 0, nil)
					if !first.recorded {
						t.Fatal("first transaction did not record")
					}
					type result struct {
						begun
						err error
					}
					done := make(chan result, 1)
					go func() {
						b, err := begin(t, key, 0, nil)
						done <- result{b, err}
					}()
					select {
					case r := <-done:
						t.Fatalf("%s: the second transaction returned %+v while the first held the key, want it to wait", key, r)
					case <-time.After(200 * time.Millisecond):
					}
					end := first.rollback
					if commit {
						end = first.commit
					}
					if err := end(); err != nil {
						t.Fatal(err)
					}
					b := <-done
					if b.err != nil {
						t.Fatal(b.err)
					}
					if b.recorded == commit {
						t.Fatalf("%s: the second transaction recorded %v, want %v", key, b.recorded, !commit)
					}
					if err := b.rollback(); err != nil {
						t.Fatal(err)
					}
				}
			})
		}
	}
}

// TestBeginPgxFailureLeavesNoTransaction: a record that cannot be written
// (its table is gone) fails and leaves the connection idle, not in an
// aborted transaction that its pool would have to throw away.
func TestBeginPgxFailureLeavesNoTransaction(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	pool := testenv.PgxPool(t, 0)
	s, err := postgresstore.New(db, postgresstore.WithTable("idem_missing_"+testenv.RandomHex(4)))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	conn := acquire(t, pool)
	if _, _, _, err := s.BeginPgx(ctx, conn.Conn(), pgx.TxOptions{}, "k", 0, nil); err == nil {
		t.Fatal("BeginPgx on a missing table succeeded")
	}
	if status := conn.Conn().PgConn().TxStatus(); status != 'I' || conn.Conn().IsClosed() {
		t.Fatalf("connection in status %q (closed %v) after the failure, want idle and open", status, conn.Conn().IsClosed())
	}
	if _, _, _, err := s.BeginPgx(ctx, conn.Conn(), pgx.TxOptions{}, "k", 0, make([]byte, postgresstore.MaxValue+1)); !errors.Is(err, stores.ErrValueTooLarge) {
		t.Fatalf("BeginPgx with a value over MaxValue = %v, want ErrValueTooLarge", err)
	}
	// BeginTx likewise: no transaction left holding a connection.
	if _, _, _, err := s.BeginTx(ctx, db, nil, "k", 0, nil); err == nil {
		t.Fatal("BeginTx on a missing table succeeded")
	}
	if _, _, _, err := s.BeginTx(ctx, db, nil, "k", 0, make([]byte, postgresstore.MaxValue+1)); !errors.Is(err, stores.ErrValueTooLarge) {
		t.Fatalf("BeginTx with a value over MaxValue = %v, want ErrValueTooLarge", err)
	}
	if inUse := db.Stats().InUse; inUse != 0 {
		t.Fatalf("%d connections of database/sql still in use after BeginTx failed, want 0", inUse)
	}
}

// TestBeginPgxSurvivesDroppedStatements: the record's INSERT is prepared on
// each connection once; a connection whose prepared statements the server
// dropped behind pgx's back (a DEALLOCATE sent as plain SQL) has it
// prepared again, and still records every key and finds a duplicate.
func TestBeginPgxSurvivesDroppedStatements(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	pool := testenv.PgxPool(t, 2)
	s := newStore(t, db)
	ctx := context.Background()
	conn := acquire(t, pool)
	for i, drop := range []bool{false, true, false, true} {
		if drop {
			// The simple protocol, so pgx's own cache is left as it was.
			if _, err := conn.Conn().PgConn().Exec(ctx, "DO $$ DECLARE n text; BEGIN FOR n IN SELECT name FROM pg_prepared_statements WHERE name LIKE 'bq_idempotency_record_%' LOOP EXECUTE 'DEALLOCATE ' || quote_ident(n); END LOOP; END $$").ReadAll(); err != nil {
				t.Fatal(err)
			}
		}
		key := "dropped-" + string(rune('a'+i))
		if !recordPgx(t, s, conn.Conn(), pgx.TxOptions{}, key, 7) {
			t.Fatalf("BeginPgx(%q) (statement dropped: %v) did not record", key, drop)
		}
		tx, recorded, found, err := s.BeginPgx(ctx, conn.Conn(), pgx.TxOptions{}, key, 8, nil)
		if err != nil || recorded || found.Fingerprint != 7 {
			t.Fatalf("second BeginPgx(%q) = %v, %+v, %v; want the duplicate with fingerprint 7", key, recorded, found, err)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
	}
	var prepared int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'bq_idempotency_record_%'").Scan(&prepared); err != nil {
		t.Fatal(err)
	}
	if prepared != 1 {
		t.Fatalf("%d record statements prepared on the connection, want 1", prepared)
	}
}
