package storetest

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
)

func begin(t *testing.T, db *sql.DB, ctx context.Context) *sql.Tx {
	t.Helper()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatalf("begin a transaction: %v", err)
	}
	t.Cleanup(func() { _ = tx.Rollback() })
	return tx
}

func rememberTxValue(t *testing.T, s stores.TxStore, ctx context.Context, tx *sql.Tx, key string, value []byte) {
	t.Helper()
	if recorded, _, err := s.RememberTx(ctx, tx, key, 0, value); err != nil || !recorded {
		t.Fatalf("RememberTx(%q) with a value = %v, %v; want recorded", key, recorded, err)
	}
}

func rememberTx(t *testing.T, s stores.TxStore, ctx context.Context, tx *sql.Tx, key string, fp uint64, want bool, when string) stores.Record {
	t.Helper()
	recorded, found, err := s.RememberTx(ctx, tx, key, fp, nil)
	if err != nil {
		t.Fatalf("RememberTx(%q) %s: %v", key, when, err)
	}
	if recorded != want {
		t.Fatalf("RememberTx(%q) %s = %v, want %v", key, when, recorded, want)
	}
	return found
}

// testTxCommitRollback: a record written in a transaction exists once that
// transaction commits, with its fingerprint, and never if it rolls back.
func testTxCommitRollback(t *testing.T, s stores.TxStore, db *sql.DB, k keys) {
	ctx := ctxWithTimeout(t)
	caps := s.Capabilities()
	committed, rolledBack := k.of(t, "committed"), k.of(t, "rolled-back")

	tx := begin(t, db, ctx)
	rememberTx(t, s, ctx, tx, committed, 0xfeed, true, "of a new key")
	wantSeen(t, s, ctx, committed, false, "before the transaction commits")
	must(t, tx.Commit(), "commit")
	if r := lookup(t, s, ctx, committed, "after the commit"); !r.Remembered() || r.Fingerprint != caps.KeptFingerprint(0xfeed) {
		t.Fatalf("Lookup(%q) after the commit = %v with fingerprint %d; want remembered, %d", committed, r.State, r.Fingerprint, caps.KeptFingerprint(0xfeed))
	}

	tx = begin(t, db, ctx)
	rememberTx(t, s, ctx, tx, rolledBack, 0, true, "of a new key")
	must(t, tx.Rollback(), "roll back")
	wantSeen(t, s, ctx, rolledBack, false, "after the rollback")
	tx = begin(t, db, ctx)
	rememberTx(t, s, ctx, tx, rolledBack, 0, true, "after the first transaction rolled back")
	must(t, tx.Commit(), "commit")
	must(t, s.Forget(ctx, rolledBack), "Forget")
	wantSeen(t, s, ctx, rolledBack, false, "after Forget")
}

// testTxDuplicate: recording a remembered key reports a duplicate with the
// record found, its fingerprint included.
func testTxDuplicate(t *testing.T, s stores.TxStore, db *sql.DB, k keys) {
	ctx := ctxWithTimeout(t)
	caps := s.Capabilities()
	key := k.of(t, "a")
	must(t, s.Remember(ctx, key, 0xbeef, nil), "Remember")
	tx := begin(t, db, ctx)
	found := rememberTx(t, s, ctx, tx, key, 0xfeed, false, "of a remembered key")
	if !found.Remembered() || found.Fingerprint != caps.KeptFingerprint(0xbeef) {
		t.Fatalf("RememberTx(%q) of a remembered key found %v with fingerprint %d; want remembered, %d", key, found.State, found.Fingerprint, caps.KeptFingerprint(0xbeef))
	}
	must(t, tx.Rollback(), "roll back")

	if caps.MaxValue > 0 {
		valued := k.of(t, "valued")
		tx = begin(t, db, ctx)
		rememberTxValue(t, s, ctx, tx, valued, []byte("the saved answer"))
		must(t, tx.Commit(), "commit")
		if r := lookup(t, s, ctx, valued, "after a commit with a value"); string(r.Value) != "the saved answer" {
			t.Fatalf("Lookup(%q) after RememberTx with a value = %q", valued, r.Value)
		}
		tx = begin(t, db, ctx)
		if recorded, found, err := s.RememberTx(ctx, tx, valued, 0, nil); err != nil || recorded || string(found.Value) != "the saved answer" {
			t.Fatalf("RememberTx(%q) of a key remembered with a value = %v, %q, %v; want a duplicate finding the value", valued, recorded, found.Value, err)
		}
		must(t, tx.Rollback(), "roll back")
	}

	tx = begin(t, db, ctx)
	rememberTx(t, s, ctx, tx, k.of(t, "twice"), 0, true, "of a new key")
	rememberTx(t, s, ctx, tx, k.of(t, "twice"), 0, false, "again in the same transaction")
}

// testTxWaits: a transaction recording a key another transaction holds
// uncommitted waits for it: a duplicate if the other commits, recorded if
// it rolls back.
func testTxWaits(t *testing.T, s stores.TxStore, db *sql.DB, k keys) {
	for _, commit := range []bool{true, false} {
		ctx := ctxWithTimeout(t)
		key := k.of(t, map[bool]string{true: "first-commits", false: "first-rolls-back"}[commit])
		first := begin(t, db, ctx)
		rememberTx(t, s, ctx, first, key, 0, true, "in the first transaction")
		type result struct {
			recorded bool
			err      error
		}
		second := begin(t, db, ctx)
		done := make(chan result, 1)
		go func() {
			recorded, _, err := s.RememberTx(ctx, second, key, 0, nil)
			done <- result{recorded, err}
		}()
		select {
		case r := <-done:
			t.Fatalf("RememberTx in a second transaction returned (%v, %v) while the first held the key uncommitted, want it to wait", r.recorded, r.err)
		case <-time.After(300 * time.Millisecond):
		}
		if commit {
			must(t, first.Commit(), "commit the first")
		} else {
			must(t, first.Rollback(), "roll back the first")
		}
		r := <-done
		if r.err != nil {
			t.Fatalf("RememberTx in the second transaction: %v", r.err)
		}
		if r.recorded == commit {
			t.Fatalf("RememberTx in the second transaction after the first %s = %v, want %v",
				map[bool]string{true: "committed", false: "rolled back"}[commit], r.recorded, !commit)
		}
		must(t, second.Commit(), "commit the second")
		wantSeen(t, s, ctx, key, true, "after both transactions ended")
	}
}

// testTxOverClaim: a transaction records a key a delivery holds claimed
// (another mode's claim, or one that lapsed): the record replaces it.
func testTxOverClaim(t *testing.T, s stores.TxStore, db *sql.DB, k keys) {
	if !s.Capabilities().Claims {
		t.Skip("the store has no claims")
	}
	ctx := ctxWithTimeout(t)
	key := k.of(t, "a")
	claim(t, s, stores.WithClaimToken(ctx, "a delivery"), key, 50*time.Millisecond, true, "of a new key")
	time.Sleep(150 * time.Millisecond)
	tx := begin(t, db, ctx)
	rememberTx(t, s, ctx, tx, key, 0, true, "of a key whose claim lapsed")
	must(t, tx.Commit(), "commit")
	wantSeen(t, s, ctx, key, true, "after the commit")

	// A live claim: another holder's is left alone, the caller's own is
	// replaced by the record (a claim taken first, then the record written
	// in a transaction, as an HTTP request under a claim does).
	own := stores.WithClaimToken(ctx, "request-1")
	live := k.of(t, "live")
	claim(t, s, own, live, time.Minute, true, "of a new key")
	tx = begin(t, db, ctx)
	if found := rememberTx(t, s, stores.WithClaimToken(ctx, "another"), tx, live, 0, false, "of a key another holder claims"); found.State != stores.StateInFlight {
		t.Fatalf("RememberTx(%q) over another holder's live claim found %v, want in flight", live, found.State)
	}
	must(t, tx.Rollback(), "roll back")
	tx = begin(t, db, ctx)
	rememberTxValue(t, s, own, tx, live, []byte("the answer"))
	must(t, tx.Commit(), "commit")
	if r := lookup(t, s, ctx, live, "after the holder's own record committed"); !r.Remembered() || string(r.Value) != "the answer" {
		t.Fatalf("Lookup(%q) = %v %q, want remembered with the value", live, r.State, r.Value)
	}
}

// testTxOverFailures: a transaction records a key whose runs failed before
// (the count kept outside the rolled-back transactions of those runs): it
// records it and reports the count, which the caller needs before it
// runs; a rollback leaves the count as it was. A key that ended is not
// recorded: the end is found.
func testTxOverFailures(t *testing.T, s stores.TxStore, db *sql.DB, k keys) {
	if !s.Capabilities().Failures {
		t.Skip("the store keeps no failures")
	}
	ctx := ctxWithTimeout(t)
	key := k.of(t, "failing")
	f := failure(2)
	must(t, s.Fail(ctx, key, 31, f), "Fail")
	tx := begin(t, db, ctx)
	found := rememberTx(t, s, ctx, tx, key, 31, true, "of a failing key")
	wantFailure(t, s, found, stores.StateFailing, 31, f, "the record RememberTx of a failing key found")
	must(t, tx.Rollback(), "roll back (the run failed)")
	wantFailure(t, s, lookup(t, s, ctx, key, "after the rollback"), stores.StateFailing, 31, f, "Lookup after the rollback")
	tx = begin(t, db, ctx)
	rememberTx(t, s, ctx, tx, key, 31, true, "of the failing key again")
	must(t, tx.Commit(), "commit (the run succeeded)")
	wantSeen(t, s, ctx, key, true, "after the commit")
	if r := lookup(t, s, ctx, key, "after the commit"); r.Failure.Attempts != 0 {
		t.Fatalf("a key remembered in a transaction keeps %d failed runs, want none", r.Failure.Attempts)
	}

	endedKey := k.of(t, "ended")
	end := ended(4, "")
	must(t, s.Fail(ctx, endedKey, 32, end), "Fail with an end")
	tx = begin(t, db, ctx)
	found = rememberTx(t, s, ctx, tx, endedKey, 32, false, "of an ended key")
	wantFailure(t, s, found, stores.StateEnded, 32, end, "the record RememberTx of an ended key found")
	must(t, tx.Rollback(), "roll back")
}
