package postgresstore_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/internal/sqlstate"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// A fresh claim's record goes as a plain insert. A writer that takes no
// lock (another program sharing the table) puts a row of the key there
// meanwhile: the record is written all the same (the round trip goes
// again as an upsert, which replaces a record), the session is kept, and
// so is every other claim it holds, whose own record then goes as a plain
// insert again.
func TestSessionFreshRecordMeetsARowWrittenWithoutTheLock(t *testing.T) {
	t.Parallel()
	a, b := sessionPair(t)
	db := testenv.Postgres(t)
	holder := stores.WithClaimToken(context.Background(), "holder")
	keyA, keyB := "fresh-a-"+testenv.RandomHex(4), "fresh-b-"+testenv.RandomHex(4)
	for _, k := range []string{keyA, keyB} {
		if claimed, _, err := a.Claim(holder, k, 5*time.Second); err != nil || !claimed {
			t.Fatalf("Claim(%s) = %v, %v; want claimed", k, claimed, err)
		}
	}
	pid := a.SessionPID()
	if _, err := db.Exec(`INSERT INTO `+a.Table()+` (key, expires_at, fingerprint) VALUES ($1::uuid, NULL, 99)`, postgresstore.RowKey(keyB)); err != nil {
		t.Fatal(err)
	}
	if err := a.Remember(holder, keyB, 7, nil); err != nil {
		t.Fatalf("Remember(%s) over a row written without the lock = %v; want written", keyB, err)
	}
	if n := a.FreshConflicts(); n != 1 {
		t.Fatalf("round trips sent again after a fresh record met a row = %d; want 1 (was the record a plain insert?)", n)
	}
	if got := a.SessionPID(); got != pid {
		t.Fatalf("the session's server process after the conflict = %d; want %d, the session kept", got, pid)
	}
	if locks := haHeldLocks(t, db, pid); !slices.Contains(locks, a.RowLock(keyA)) || slices.Contains(locks, a.RowLock(keyB)) {
		t.Fatalf("the session's locks after %s was recorded = %v; want %s's (%d) and not %s's (%d)", keyB, locks, keyA, a.RowLock(keyA), keyB, a.RowLock(keyB))
	}
	if held, err := a.Extend(holder, keyA, 5*time.Second); err != nil || !held {
		t.Fatalf("Extend(%s) after the other key's conflict = %v, %v; want held", keyA, held, err)
	}
	if err := a.Remember(holder, keyA, 8, nil); err != nil {
		t.Fatalf("Remember(%s) = %v", keyA, err)
	}
	if n := a.FreshConflicts(); n != 1 {
		t.Fatalf("round trips sent again = %d after %s's record; want still 1", n, keyA)
	}
	for k, fp := range map[string]uint64{keyA: 8, keyB: 7} {
		if claimed, found, err := b.Claim(context.Background(), k, 5*time.Second); err != nil || claimed || !found.Remembered() || found.Fingerprint != fp {
			t.Fatalf("another worker's Claim(%s) = %v, %+v, %v; want the record with fingerprint %d", k, claimed, found, err, fp)
		}
	}
	haNoLocksLeft(t, db, pid)
}

// The plain insert of fresh records fails at a row in its way before it
// gives any lock back: the session's locks are not undone by the failed
// transaction's rollback, so a lock given back before the failure would be
// lost to a claim its holder still believes held.
func TestSessionFreshRecordFailsBeforeAnyLockGoesBack(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	s := newStore(t, db, postgresstore.WithSessionClaims())
	ctx := context.Background()
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	if _, err := conn.ExecContext(ctx, `SET plan_cache_mode = force_generic_plan`); err != nil {
		t.Fatal(err)
	}
	// The keys in the order of the statement's arrays: the one in the way
	// comes last, after a row the statement has inserted.
	keys := []string{"before-" + testenv.RandomHex(4), "between-" + testenv.RandomHex(4), "in-the-way-" + testenv.RandomHex(4)}
	rowKeys, locks := make([]string, len(keys)), make([]int64, len(keys))
	for i, k := range keys {
		rowKeys[i], locks[i] = postgresstore.RowKey(k), s.RowLock(k)
		if _, err := conn.ExecContext(ctx, `SELECT pg_advisory_lock($1)`, locks[i]); err != nil {
			t.Fatal(err)
		}
	}
	var pid int32
	if err := conn.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	defer func() { _, _ = conn.ExecContext(context.Background(), `SELECT pg_advisory_unlock_all()`) }()
	if _, err := db.Exec(`INSERT INTO `+s.Table()+` (key, expires_at) VALUES ($1::uuid, NULL)`, rowKeys[2]); err != nil {
		t.Fatal(err)
	}
	fresh := s.SessionStatements()["remember-fresh"]
	for try := range 7 { // past the five runs after which a prepared statement may keep a generic plan
		_, err := conn.ExecContext(ctx, fresh, postgresstore.TextArray(rowKeys), postgresstore.Int64Array([]int64{1, 2, 3}, nil), postgresstore.Int64Array(locks, nil))
		if !sqlstate.Is(err, "23505") {
			t.Fatalf("run %d: the fresh records over a row in the way = %v; want unique_violation", try, err)
		}
		held := haHeldLocks(t, db, pid)
		slices.Sort(held)
		want := slices.Sorted(slices.Values(locks))
		if !slices.Equal(held, want) {
			t.Fatalf("run %d: the session's locks after the failed statement = %v; want all three still held, %v", try, held, want)
		}
	}
	if rows := testenv.Column[string](ctx, t, db, `SELECT key::text FROM `+s.Table()+` ORDER BY 1`); !slices.Equal(rows, rowKeys[2:]) {
		t.Fatalf("rows after the failed statements = %v; want only the one in the way, %v", rows, rowKeys[2:])
	}
}
