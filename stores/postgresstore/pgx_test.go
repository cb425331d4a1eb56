package postgresstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/babelqueue/watermill-idempotency/internal/testenv"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
)

// beginPgx acquires a connection of pool and begins the record's
// transaction on it; the connection is released when the test ends.
func beginPgx(t *testing.T, pool *pgxpool.Pool, s *postgresstore.Store, key string, fp uint64, value []byte) (*pgxpool.Conn, pgx.Tx, bool, stores.Record) {
	t.Helper()
	ctx := context.Background()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(conn.Release)
	tx, recorded, found, err := s.BeginPgx(ctx, conn.Conn(), pgx.TxOptions{}, key, fp, value)
	if err != nil {
		t.Fatalf("BeginPgx(%q): %v", key, err)
	}
	if status := conn.Conn().PgConn().TxStatus(); status != 'T' {
		t.Fatalf("BeginPgx(%q) left the connection in status %q, want an open transaction", key, status)
	}
	return conn, tx, recorded, found
}

// TestBeginPgx: BEGIN and the record in one round trip record a key never
// seen with its fingerprint (all 64 bits) and value, visible once committed;
// a remembered key is a duplicate with what was kept; another holder's
// live claim is in flight, the caller's own replaced; a lapsed claim and an
// expired record are taken over.
func TestBeginPgx(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	pool := testenv.PgxPool(t, 8) // beginPgx holds each of its six connections until the test ends
	s := newStore(t, db, postgresstore.WithTTL(time.Hour))
	ctx := context.Background()

	const fp = 0xfedcba9876543210 // the high bit set: kept as a negative bigint
	_, tx, recorded, _ := beginPgx(t, pool, s, "k1", fp, []byte("saved 'answer'\x00"))
	if !recorded {
		t.Fatal("a key never seen was not recorded")
	}
	if r, err := s.Lookup(ctx, "k1"); err != nil || r.State != stores.StateUnknown {
		t.Fatalf("Lookup before the commit = %v, %v; want nothing visible", r, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r, err := s.Lookup(ctx, "k1")
	if err != nil || !r.Remembered() || r.Fingerprint != fp || string(r.Value) != "saved 'answer'\x00" {
		t.Fatalf("Lookup after the commit = %+v, %v", r, err)
	}
	if until := time.Until(r.ExpiresAt); until < 59*time.Minute || until > 61*time.Minute {
		t.Fatalf("expires in %v, want the store's TTL of an hour", until)
	}

	conn, tx, recorded, found := beginPgx(t, pool, s, "k1", 1, nil)
	if recorded || !found.Remembered() || found.Fingerprint != fp || string(found.Value) != "saved 'answer'\x00" {
		t.Fatalf("BeginPgx of a remembered key = %v, %+v; want a duplicate with the kept fingerprint and value", recorded, found)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if status := conn.Conn().PgConn().TxStatus(); status != 'I' {
		t.Fatalf("connection in status %q after the duplicate's rollback, want idle", status)
	}

	// Another holder's live claim (a delivery of the claim mode) is in
	// flight: left alone.
	if claimed, _, err := s.Claim(stores.WithClaimToken(ctx, "another delivery"), "claimed", time.Minute); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	_, tx, recorded, found = beginPgx(t, pool, s, "claimed", 9, nil)
	if recorded || found.State != stores.StateInFlight {
		t.Fatalf("BeginPgx of another holder's live claim = %v, %+v; want it left alone, in flight", recorded, found)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	// The caller's own claim (the same holder: here the Store's, ctx naming
	// none) is replaced by the record, as RememberTx does.
	if claimed, _, err := s.Claim(ctx, "mine", time.Minute); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	_, tx, recorded, _ = beginPgx(t, pool, s, "mine", 9, nil)
	if !recorded {
		t.Fatal("BeginPgx did not replace the caller's own claim")
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// A lapsed claim and a record whose retention passed are taken over.
	if claimed, _, err := s.Claim(ctx, "lapsed", time.Millisecond); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	short := newStoreOnTable(t, db, s.Table(), postgresstore.WithTTL(time.Millisecond))
	if err := short.Remember(ctx, "expired", 7, nil); err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * time.Millisecond)
	for _, key := range []string{"lapsed", "expired"} {
		_, tx, recorded, _ := beginPgx(t, pool, s, key, 9, nil)
		if !recorded {
			t.Fatalf("BeginPgx(%q) did not take the row over", key)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if r, err := s.Lookup(ctx, key); err != nil || !r.Remembered() || r.Fingerprint != 9 {
			t.Fatalf("Lookup(%q) after the takeover = %+v, %v", key, r, err)
		}
	}
}

// TestBeginPgxWaitsForAnUncommittedRecord: a second transaction recording
// a key another one holds uncommitted waits for it, and is a duplicate if
// it commits, the recorder if it rolls back.
func TestBeginPgxWaitsForAnUncommittedRecord(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	pool := testenv.PgxPool(t, 0)
	s := newStore(t, db)
	ctx := context.Background()
	for _, commit := range []bool{true, false} {
		key := map[bool]string{true: "first-commits", false: "first-rolls-back"}[commit]
		_, first, recorded, _ := beginPgx(t, pool, s, key, 0, nil)
		if !recorded {
			t.Fatal("first transaction did not record")
		}
		type result struct {
			recorded bool
			err      error
		}
		done := make(chan result, 1)
		go func() {
			conn, err := pool.Acquire(ctx)
			if err != nil {
				done <- result{err: err}
				return
			}
			defer conn.Release()
			tx, recorded, _, err := s.BeginPgx(ctx, conn.Conn(), pgx.TxOptions{}, key, 0, nil)
			if err == nil {
				err = tx.Rollback(ctx)
			}
			done <- result{recorded, err}
		}()
		select {
		case r := <-done:
			t.Fatalf("%s: the second transaction returned %+v while the first held the key, want it to wait", key, r)
		case <-time.After(200 * time.Millisecond):
		}
		if commit {
			if err := first.Commit(ctx); err != nil {
				t.Fatal(err)
			}
		} else if err := first.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		r := <-done
		if r.err != nil || r.recorded == commit {
			t.Fatalf("%s: the second transaction = %+v, want recorded %v", key, r, !commit)
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
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, _, _, err := s.BeginPgx(ctx, conn.Conn(), pgx.TxOptions{}, "k", 0, nil); err == nil {
		t.Fatal("BeginPgx on a missing table succeeded")
	}
	if status := conn.Conn().PgConn().TxStatus(); status != 'I' || conn.Conn().IsClosed() {
		t.Fatalf("connection in status %q (closed %v) after the failure, want idle and open", status, conn.Conn().IsClosed())
	}
	if _, _, _, err := s.BeginPgx(ctx, conn.Conn(), pgx.TxOptions{}, "k", 0, make([]byte, postgresstore.MaxValue+1)); !errors.Is(err, stores.ErrValueTooLarge) {
		t.Fatalf("BeginPgx with a value over MaxValue = %v, want ErrValueTooLarge", err)
	}
}
