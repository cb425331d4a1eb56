package postgresstore_test

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// Attacks on what a session Claim that finds the key's lock taken reports:
// the key's record or end, read after the lock was tried, when the row is
// final; in flight otherwise. A duplicate told a record or an end is acked
// at once, so neither may be reported while the holder of the lock is
// about to replace it with something that lets the message run: an expired
// record or end taken over, a failing record taken over, an end reopened
// or a record forgotten under the lock, a transaction's record that rolls
// back, another key's claim on a colliding lock.

// daClaim claims key on s for the holder token and fails the test on an
// error.
func daClaim(t *testing.T, s *postgresstore.Store, token, key string) (bool, stores.Record) {
	t.Helper()
	claimed, found, err := s.Claim(stores.WithClaimToken(context.Background(), token), key, 5*time.Second)
	if err != nil {
		t.Fatalf("Claim(%s) for %s: %v", key, token, err)
	}
	return claimed, found
}

// daInFlight fails the test unless a claim of key on s for token is refused
// as in flight: the key's lock is held by a holder about to change its row.
func daInFlight(t *testing.T, s *postgresstore.Store, token, key, why string) {
	t.Helper()
	if claimed, found := daClaim(t, s, token, key); claimed || found.State != stores.StateInFlight {
		t.Errorf("%s: Claim = %v, %v (%+v); want in flight", why, claimed, found.State, found)
	}
}

// daPair is two Stores of session claims on one table, on pools of their
// own, with opts.
func daPair(t *testing.T, opts ...postgresstore.Option) (a, b *postgresstore.Store) {
	t.Helper()
	opts = append([]postgresstore.Option{postgresstore.WithSessionClaims()}, opts...)
	a = newStore(t, testenv.Postgres(t), opts...)
	return a, newStoreOnTable(t, testenv.Postgres(t), a.Table(), opts...)
}

// An expired record, and an expired end, taken over by a claim: while its
// holder runs the message again, a duplicate is in flight, never told the
// expired record (acked) or the expired end (acked as ended); once the
// holder remembers, the duplicate is told the new record.
func TestDuplicateAttackExpiredRecordTakenOver(t *testing.T) {
	t.Parallel()
	const ttl = 300 * time.Millisecond
	a, b := daPair(t, postgresstore.WithTTL(ttl))
	done, ended := "da-exp-done-"+testenv.RandomHex(4), "da-exp-ended-"+testenv.RandomHex(4)
	if claimed, _ := daClaim(t, a, "first", done); !claimed {
		t.Fatal("first claim refused")
	}
	if err := a.Remember(stores.WithClaimToken(context.Background(), "first"), done, 7, []byte("old")); err != nil {
		t.Fatal(err)
	}
	if claimed, _ := daClaim(t, a, "first", ended); !claimed {
		t.Fatal("first claim refused")
	}
	end := &stores.End{Reason: "failed", At: time.Now().Truncate(time.Millisecond), Marker: "m1"}
	if err := a.Fail(stores.WithClaimToken(context.Background(), "first"), ended, 7, stores.Failure{Attempts: 1, End: end}); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{done, ended} {
		waitCond(t, "the record of "+k+" expires", 5*time.Second, func() bool {
			r, err := b.Lookup(context.Background(), k)
			return err == nil && r.State == stores.StateUnknown
		})
		if claimed, found := daClaim(t, a, "again", k); !claimed {
			t.Fatalf("the claim over the expired row of %s = %v, %+v; want it taken over", k, claimed, found)
		}
		daInFlight(t, b, "duplicate", k, "a duplicate while a holder runs "+k+" again over its expired row")
	}
	if err := a.Remember(stores.WithClaimToken(context.Background(), "again"), done, 7, []byte("new")); err != nil {
		t.Fatal(err)
	}
	if claimed, found := daClaim(t, b, "duplicate", done); claimed || !found.Remembered() || string(found.Value) != "new" {
		t.Errorf("the duplicate after the holder remembered = %v, %+v; want the new record", claimed, found)
	}
}

// A failing record taken over by a claim: while its holder runs the
// message, a duplicate is in flight with the count; the holder's end, then
// (another key) its record, are what the duplicate is told once written.
func TestDuplicateAttackFailingRecordTakenOver(t *testing.T) {
	t.Parallel()
	a, b := daPair(t)
	toEnd, toRecord := "da-fail-end-"+testenv.RandomHex(4), "da-fail-rec-"+testenv.RandomHex(4)
	first := stores.WithClaimToken(context.Background(), "first")
	for _, k := range []string{toEnd, toRecord} {
		if claimed, _ := daClaim(t, a, "first", k); !claimed {
			t.Fatal("first claim refused")
		}
		if err := a.Fail(first, k, 7, stores.Failure{Attempts: 1}); err != nil {
			t.Fatal(err)
		}
		if err := a.Release(first, k); err != nil {
			t.Fatal(err)
		}
		if claimed, found := daClaim(t, a, "second", k); !claimed || found.Failure.Attempts != 1 {
			t.Fatalf("the claim over the failing record of %s = %v, %+v; want it taken, carrying 1 attempt", k, claimed, found)
		}
		if claimed, found := daClaim(t, b, "duplicate", k); claimed || found.State != stores.StateInFlight || found.Failure.Attempts != 1 {
			t.Errorf("a duplicate while the failing record of %s is run again = %v, %+v; want in flight with 1 attempt", k, claimed, found)
		}
	}
	second := stores.WithClaimToken(context.Background(), "second")
	end := &stores.End{Reason: "failed", At: time.Now().Truncate(time.Millisecond)}
	if err := a.Fail(second, toEnd, 7, stores.Failure{Attempts: 2, End: end}); err != nil {
		t.Fatal(err)
	}
	if claimed, found := daClaim(t, b, "duplicate", toEnd); claimed || !found.Ended() || found.Failure.Attempts != 2 {
		t.Errorf("a duplicate after the holder's end = %v, %+v; want the end, 2 attempts", claimed, found)
	}
	if err := a.Remember(second, toRecord, 7, []byte("done")); err != nil {
		t.Fatal(err)
	}
	if claimed, found := daClaim(t, b, "duplicate", toRecord); claimed || !found.Remembered() || string(found.Value) != "done" {
		t.Errorf("a duplicate after the holder's record = %v, %+v; want the record", claimed, found)
	}
}

// Reopen and Forget take no lock: an end reopened, or a record forgotten,
// while another session holds the key's lock is not reported from then
// on; the key is in flight until the lock is given back, and then
// claimed.
func TestDuplicateAttackReopenAndForgetUnderAHeldLock(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	a, b := daPair(t)
	ended, done := "da-reopen-"+testenv.RandomHex(4), "da-forget-"+testenv.RandomHex(4)
	first := stores.WithClaimToken(context.Background(), "first")
	for _, k := range []string{ended, done} {
		if claimed, _ := daClaim(t, a, "first", k); !claimed {
			t.Fatal("first claim refused")
		}
	}
	end := &stores.End{Reason: "failed", At: time.Now().Truncate(time.Millisecond), Marker: "m1"}
	if err := a.Fail(first, ended, 7, stores.Failure{Attempts: 3, End: end}); err != nil {
		t.Fatal(err)
	}
	if err := a.Remember(first, done, 7, []byte("reply")); err != nil {
		t.Fatal(err)
	}
	release := maHoldLocks(t, db, a, ended, done)
	if claimed, found := daClaim(t, b, "redriven", ended); claimed || !found.Ended() || found.Failure.End.Marker != "m1" {
		t.Fatalf("the end under a held lock = %v, %+v; want the end (marker m1)", claimed, found)
	}
	if reopened, err := b.Reopen(context.Background(), ended, "m1"); err != nil || !reopened {
		t.Fatalf("Reopen under a held lock = %v, %v; want reopened", reopened, err)
	}
	daInFlight(t, b, "redriven", ended, "the reopened key while its lock is held")
	if claimed, found := daClaim(t, b, "duplicate", done); claimed || !found.Remembered() {
		t.Fatalf("the record under a held lock = %v, %+v; want the record", claimed, found)
	}
	if err := b.Forget(context.Background(), done); err != nil {
		t.Fatal(err)
	}
	daInFlight(t, b, "duplicate", done, "the forgotten key while its lock is held")
	release()
	for _, k := range []string{ended, done} {
		if claimed, found := daClaim(t, b, "after", k); !claimed || found.State != stores.StateUnknown {
			t.Errorf("%s once its lock is given back = %v, %+v; want claimed, nothing found", k, claimed, found)
		}
	}
}

// A transaction records the key (BeginTx, and RememberTx over the
// holder's own session claim, which yields its lock to the transaction):
// a duplicate is in flight while it is open, never told the record it may
// roll back; after a rollback the key is claimed (the message runs), after
// a commit the duplicate is told the record. A key whose expired record
// the transaction replaces is in flight too, never told the expired record.
func TestDuplicateAttackTransactionsRecordThenRollBack(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	const ttl = 300 * time.Millisecond
	a, b := daPair(t, postgresstore.WithTTL(ttl))
	ctx := context.Background()

	// BeginTx on a key never seen.
	fresh := "da-tx-fresh-" + testenv.RandomHex(4)
	tx, recorded, _, err := a.BeginTx(ctx, db, nil, fresh, 7, []byte("tx"))
	if err != nil || !recorded {
		t.Fatalf("BeginTx = %v, %v; want recorded", recorded, err)
	}
	daInFlight(t, b, "duplicate", fresh, "a duplicate while a transaction holds the record uncommitted")
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	if claimed, found := daClaim(t, b, "duplicate", fresh); !claimed {
		t.Errorf("the key after the transaction rolled back = %v, %+v; want claimed", claimed, found)
	}
	if err := b.Release(stores.WithClaimToken(ctx, "duplicate"), fresh); err != nil {
		t.Fatal(err)
	}

	// RememberTx over the holder's own session claim (yielded).
	yielded := "da-tx-yield-" + testenv.RandomHex(4)
	holder := stores.WithClaimToken(ctx, "holder")
	if claimed, _ := daClaim(t, a, "holder", yielded); !claimed {
		t.Fatal("the holder's claim refused")
	}
	for _, commit := range []bool{false, true} {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		recorded, found, err := a.RememberTx(holder, tx, yielded, 7, []byte("yielded"))
		if err != nil || !recorded {
			_ = tx.Rollback()
			t.Fatalf("RememberTx over the holder's claim = %v, %+v, %v; want recorded", recorded, found, err)
		}
		daInFlight(t, b, "duplicate", yielded, "a duplicate while the yielded claim's transaction is open")
		if !commit {
			if err := tx.Rollback(); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
	}
	if claimed, found := daClaim(t, b, "duplicate", yielded); claimed || !found.Remembered() || string(found.Value) != "yielded" {
		t.Errorf("a duplicate after the transaction committed = %v, %+v; want the record", claimed, found)
	}

	// BeginTx over an expired record: replaced in the transaction.
	expired := "da-tx-expired-" + testenv.RandomHex(4)
	if err := a.Remember(ctx, expired, 7, []byte("old")); err != nil {
		t.Fatal(err)
	}
	waitCond(t, "the record expires", 5*time.Second, func() bool {
		r, err := b.Lookup(ctx, expired)
		return err == nil && r.State == stores.StateUnknown
	})
	tx, recorded, found, err := a.BeginTx(ctx, db, nil, expired, 7, []byte("new"))
	if err != nil || !recorded {
		t.Fatalf("BeginTx over an expired record = %v, %+v, %v; want recorded", recorded, found, err)
	}
	daInFlight(t, b, "duplicate", expired, "a duplicate while a transaction replaces the expired record")
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	if claimed, found := daClaim(t, b, "duplicate", expired); !claimed {
		t.Errorf("the expired key after the transaction rolled back = %v, %+v; want claimed", claimed, found)
	}
}

// Two keys whose locks collide: one's claim holds the lock for as long as
// its message runs. The other's duplicates are told its record or end
// (what they would be told with the lock free), in flight when it has
// none or a failing one, and not told a record forgotten or an end
// reopened meanwhile.
func TestDuplicateAttackCollidingLocks(t *testing.T) {
	t.Parallel()
	a, b := daPair(t)
	lock, err := strconv.ParseInt(testenv.RandomHex(7), 16, 64) // apart from other tests' colliding locks
	if err != nil {
		t.Fatal(err)
	}
	a.CollideLocks(lock)
	b.CollideLocks(lock)
	rnd := testenv.RandomHex(4)
	running, done, ended, failing, fresh := "da-col-run-"+rnd, "da-col-done-"+rnd, "da-col-ended-"+rnd, "da-col-failing-"+rnd, "da-col-fresh-"+rnd
	first := stores.WithClaimToken(context.Background(), "first")
	for _, k := range []string{done, ended, failing} {
		if claimed, _ := daClaim(t, b, "first", k); !claimed {
			t.Fatalf("claim of %s refused", k)
		}
		var err error
		switch k {
		case done:
			err = b.Remember(first, k, 7, []byte("reply"))
		case ended:
			err = b.Fail(first, k, 7, stores.Failure{Attempts: 3, End: &stores.End{Reason: "failed", Marker: "m1"}})
		case failing:
			if err = b.Fail(first, k, 7, stores.Failure{Attempts: 2}); err == nil {
				err = b.Release(first, k)
			}
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if claimed, _ := daClaim(t, a, "runner", running); !claimed {
		t.Fatal("the colliding claim refused")
	}
	if claimed, found := daClaim(t, b, "dup", done); claimed || !found.Remembered() || string(found.Value) != "reply" {
		t.Errorf("a remembered key whose lock another key's claim holds = %v, %+v; want the record", claimed, found)
	}
	if claimed, found := daClaim(t, b, "dup", ended); claimed || !found.Ended() {
		t.Errorf("an ended key whose lock another key's claim holds = %v, %+v; want the end", claimed, found)
	}
	if claimed, found := daClaim(t, b, "dup", failing); claimed || found.State != stores.StateInFlight || found.Failure.Attempts != 2 {
		t.Errorf("a failing key whose lock another key's claim holds = %v, %+v; want in flight, 2 attempts", claimed, found)
	}
	daInFlight(t, b, "dup", fresh, "a key never seen whose lock another key's claim holds")
	if reopened, err := b.Reopen(context.Background(), ended, "m1"); err != nil || !reopened {
		t.Fatalf("Reopen = %v, %v", reopened, err)
	}
	if err := b.Forget(context.Background(), done); err != nil {
		t.Fatal(err)
	}
	daInFlight(t, b, "dup", ended, "an end reopened while its colliding lock is held")
	daInFlight(t, b, "dup", done, "a record forgotten while its colliding lock is held")
	if err := a.Release(stores.WithClaimToken(context.Background(), "runner"), running); err != nil {
		t.Fatal(err)
	}
	waitClaim(t, b, stores.WithClaimToken(context.Background(), "dup"), ended, 5*time.Second)
}

// A record live when the duplicate's round trip began but expiring while
// the key's lock is held elsewhere: each answer is the record while it is
// live at the call's start, in flight once it expired, and never the
// record again after that; the ended record alike.
func TestDuplicateAttackRecordExpiringUnderAHeldLock(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	const ttl = 400 * time.Millisecond
	a, b := daPair(t, postgresstore.WithTTL(ttl))
	done, ended := "da-edge-done-"+testenv.RandomHex(4), "da-edge-ended-"+testenv.RandomHex(4)
	first := stores.WithClaimToken(context.Background(), "first")
	for _, k := range []string{done, ended} {
		if claimed, _ := daClaim(t, a, "first", k); !claimed {
			t.Fatal("first claim refused")
		}
	}
	if err := a.Remember(first, done, 7, nil); err != nil {
		t.Fatal(err)
	}
	if err := a.Fail(first, ended, 7, stores.Failure{Attempts: 1, End: &stores.End{Reason: "failed"}}); err != nil {
		t.Fatal(err)
	}
	maHoldLocks(t, db, a, done, ended)
	for _, k := range []string{done, ended} {
		var sawFinal, sawInFlight bool
		deadline := time.Now().Add(5 * time.Second)
		for !sawInFlight || time.Now().Before(deadline.Add(-4*time.Second)) {
			if time.Now().After(deadline) {
				t.Fatalf("%s never reported in flight after its expiry (TTL %v)", k, ttl)
			}
			start := time.Now().Add(-2 * time.Millisecond) // the server's milliseconds against the client's
			claimed, found := daClaim(t, b, "dup", k)
			switch {
			case claimed:
				t.Fatalf("%s claimed while its lock is held", k)
			case found.State == stores.StateInFlight:
				sawInFlight = true
			case found.Remembered() || found.Ended():
				sawFinal = true
				if sawInFlight {
					t.Fatalf("%s: told %v after it was told in flight (its expiry passed)", k, found.State)
				}
				if !found.ExpiresAt.After(start) {
					t.Fatalf("%s: told %v expiring at %v, before the call began at %v", k, found.State, found.ExpiresAt, start)
				}
			default:
				t.Fatalf("%s: told %+v", k, found)
			}
		}
		if !sawFinal {
			t.Logf("%s: expired before the first look (a slow machine)", k)
		}
	}
}

// A holder whose session was lost (its lock went with it) writes its
// record only while nobody holds the key: with the key claimed anew, its
// late Remember is refused, and a duplicate is in flight until the new
// holder remembers, never told a record the new holder is about to
// replace.
func TestDuplicateAttackLostSessionWritesLate(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	a, b := daPair(t)
	c := newStoreOnTable(t, testenv.Postgres(t), a.Table(), postgresstore.WithSessionClaims())
	key := "da-lost-" + testenv.RandomHex(4)
	if claimed, _ := daClaim(t, a, "lost", key); !claimed {
		t.Fatal("the first claim refused")
	}
	pid := a.SessionPID()
	if _, err := db.ExecContext(context.Background(), `SELECT pg_terminate_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	waitCond(t, "the lost session's lock is freed", 5*time.Second, func() bool {
		claimed, _, err := b.Claim(stores.WithClaimToken(context.Background(), "new"), key, 5*time.Second)
		return err == nil && claimed
	})
	err := a.Remember(stores.WithClaimToken(context.Background(), "lost"), key, 7, []byte("late"))
	if !errors.Is(err, stores.ErrClaimTaken) {
		t.Errorf("the lost holder's Remember while another holds the key = %v; want ErrClaimTaken", err)
	}
	daInFlight(t, c, "dup", key, "a duplicate while the new holder runs")
	if err := b.Remember(stores.WithClaimToken(context.Background(), "new"), key, 7, []byte("new")); err != nil {
		t.Fatal(err)
	}
	if claimed, found := daClaim(t, c, "dup", key); claimed || !found.Remembered() || string(found.Value) != "new" {
		t.Errorf("a duplicate after the new holder's record = %v, %+v; want the new record", claimed, found)
	}
}
