package postgresstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// Hostile tests of the fresh claims' plain insert: a claim held on the
// session whose read found no row writes its record without the upsert's
// conflict check, and a row that a writer taking no lock put there
// meanwhile sends the round trip again as an upsert. They mix such rows
// into busy round trips, lose the session around a conflict, and check
// every answer against the server's own view (the table, pg_locks).

// fhIntruderFp is the fingerprint of the records a writer that takes no
// lock puts in the way.
const fhIntruderFp = 99

// fhIntrude writes key's row as a writer that takes no lock would: a record
// (claim NULL) or, with live, another holder's live claim row.
func fhIntrude(t *testing.T, db *sql.DB, table, key string, live bool) {
	t.Helper()
	if err := fhIntrudeErr(db, table, key, live); err != nil {
		t.Fatal(err)
	}
}

// fhIntrudeErr is fhIntrude for a goroutine other than the test's.
func fhIntrudeErr(db *sql.DB, table, key string, live bool) error {
	q := `INSERT INTO ` + table + ` (key, expires_at, fingerprint) VALUES ($1::uuid, NULL, ` + fmt.Sprint(fhIntruderFp) + `)`
	if live {
		q = `INSERT INTO ` + table + ` (key, expires_at, claim) VALUES ($1::uuid, (extract(epoch FROM now()) * 1000)::int8 + 3600000, 'intruder')`
	}
	_, err := db.Exec(q, postgresstore.RowKey(key))
	return err
}

// fhLapsedRow writes key's row as a claim row whose lease ran out (another
// worker with claims of rows that died holding it).
func fhLapsedRow(t *testing.T, db *sql.DB, table, key string) {
	t.Helper()
	if _, err := db.Exec(`INSERT INTO `+table+` (key, expires_at, claim) VALUES ($1::uuid, 1, 'gone')`, postgresstore.RowKey(key)); err != nil {
		t.Fatal(err)
	}
}

// fhWaitsOnALock reports whether the server process pid waits for a lock.
func fhWaitsOnALock(t *testing.T, db *sql.DB, pid int32) bool {
	t.Helper()
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'`, pid).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n > 0
}

// fhBlockedRound locks blocker's row in a transaction of its own (tx,
// left to the caller to end), sends holder's Remember of blocker on a
// (an upsert that waits on that row) and returns once the session's round
// trip, on server process pid, waits on the lock: calls made meanwhile
// queue for the round trip after it. The Remember's result comes on
// blocked.
func fhBlockedRound(t *testing.T, db *sql.DB, a *postgresstore.Store, holder context.Context, blocker string, pid int32) (tx *sql.Tx, blocked <-chan error) {
	t.Helper()
	tx = fhLockRow(t, db, a.Table(), blocker)
	result := make(chan error, 1)
	go func() { result <- a.Remember(holder, blocker, 1, nil) }()
	testenv.Eventually(t, "the blocker's round trip to wait", func() bool { return fhWaitsOnALock(t, db, pid) })
	return tx, result
}

// fhLockRow begins a transaction that holds key's row locked (FOR UPDATE):
// an upsert of the key waits for it.
func fhLockRow(t *testing.T, db *sql.DB, table, key string) *sql.Tx {
	t.Helper()
	tx, err := db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback() })
	var n int
	if err := tx.QueryRow(`SELECT count(*) FROM (SELECT 1 FROM `+table+` WHERE key = $1::uuid FOR UPDATE) x`, postgresstore.RowKey(key)).Scan(&n); err != nil || n != 1 {
		t.Fatalf("locking the row of %s: %d rows, %v", key, n, err)
	}
	return tx
}

// fhClaim claims key on s for holder, and fails the test unless it is taken.
func fhClaim(t *testing.T, s *postgresstore.Store, holder context.Context, key string) {
	t.Helper()
	if claimed, found, err := s.Claim(holder, key, time.Minute); err != nil || !claimed {
		t.Fatalf("Claim(%s) = %v, %+v, %v; want claimed", key, claimed, found, err)
	}
}

// TestFreshHostileManyCallersWithALocklessWriter: many callers on two
// workers (one with asynchronous commit), in every query mode a DSN can
// ask pgx for, while a writer that takes no lock puts a record, or a live
// claim row of its own, in the way of a quarter of the keys between their
// claim and their record: the round trips mix fresh records, upserts,
// records with a value, claims and renewals, and the conflicts arrive in
// the middle of them. Every Remember's answer matches the table (written
// over a record in the way; refused by a live claim row, which stays), each
// key is claimed once, no lock is left on either session, neither session
// was lost, and the conflicts were counted.
func TestFreshHostileManyCallersWithALocklessWriter(t *testing.T) {
	t.Parallel()
	callers, perCaller := 16, 60
	if testing.Short() {
		perCaller = 15
	}
	haEachMode(t, func(t *testing.T, mode string) {
		db, a, b := haWorkers(t, mode, postgresstore.WithAsynchronousCommit())
		runFreshCallers(t, db, a, b, callers, perCaller)
	})
}

// runFreshCallers runs callers callers (half on a, half on b), each over
// perCaller keys of its own that a rival caller on the other worker claims
// too, and checks the answers against the table and pg_locks.
func runFreshCallers(t *testing.T, db *sql.DB, a, b *postgresstore.Store, callers, perCaller int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rnd := testenv.RandomHex(4)
	// The sessions open, and their server processes, before the race.
	pids := map[*postgresstore.Store]int32{}
	for _, s := range []*postgresstore.Store{a, b} {
		warm := stores.WithClaimToken(ctx, "warm")
		fhClaim(t, s, warm, "warm-"+rnd)
		pids[s] = s.SessionPID()
		if err := s.Release(warm, "warm-"+rnd); err != nil {
			t.Fatal(err)
		}
	}
	type outcome struct {
		winner int
		err    error
	}
	keyOf := func(pair, j int) string { return fmt.Sprintf("fh-%s-%d-%d", rnd, pair, j) }
	fpOf := func(j int) uint64 { return haFingerprints[j%len(haFingerprints)] }
	valueOf := func(j int) []byte {
		if j%5 == 1 {
			return []byte(fmt.Sprintf(`value "%d"`, j))
		}
		return nil
	}
	// intrusion: 0 none, 1 a record in the way, 2 a live claim row.
	intrusion := func(j int) int {
		switch j % 8 {
		case 2, 5:
			return 1
		case 6:
			return 2
		}
		return 0
	}
	var mu sync.Mutex
	outcomes := map[string][]outcome{}
	for _, err := range burst(callers, func(c int) error {
		s := a
		if c%2 == 1 {
			s = b
		}
		pair := c / 2
		hctx := stores.WithClaimToken(ctx, fmt.Sprintf("caller-%d", c))
		for i := range perCaller {
			j := i
			if c%2 == 1 {
				j = perCaller - 1 - i // the rival goes backwards: they meet
			}
			id := keyOf(pair, j)
			claimed, found, err := s.Claim(hctx, id, time.Minute)
			if err != nil {
				return fmt.Errorf("caller %d: Claim(%s): %w", c, id, err)
			}
			if !claimed {
				switch {
				case found.State == stores.StateInFlight:
				case found.Remembered() && (found.Fingerprint == fpOf(j) || (intrusion(j) == 1 && found.Fingerprint == fhIntruderFp)):
				default:
					return fmt.Errorf("caller %d: a duplicate of %s was told %+v", c, id, found)
				}
				continue
			}
			if j%3 == 0 {
				if held, err := s.Extend(hctx, id, time.Minute); err != nil || !held {
					return fmt.Errorf("caller %d: Extend(%s) = %v, %v", c, id, held, err)
				}
			}
			if n := intrusion(j); n > 0 {
				if err := fhIntrudeErr(db, a.Table(), id, n == 2); err != nil {
					return err
				}
			}
			err = s.Remember(hctx, id, fpOf(j), valueOf(j))
			mu.Lock()
			outcomes[id] = append(outcomes[id], outcome{c, err})
			mu.Unlock()
		}
		return nil
	}) {
		if err != nil {
			t.Error(err)
		}
	}
	if t.Failed() {
		return
	}
	rows := haRows(t, db, a.Table())
	for pair := range callers / 2 {
		for j := range perCaller {
			id := keyOf(pair, j)
			o := outcomes[id]
			if len(o) != 1 {
				t.Errorf("%s claimed and remembered %d times (%v); want once", id, len(o), o)
				continue
			}
			switch intrusion(j) {
			case 2:
				r := rows[postgresstore.RowKey(id)]
				if !errors.Is(o[0].err, stores.ErrClaimTaken) || r.claimNull {
					t.Errorf("%s, a live claim row put in the way: Remember = %v, row %+v; want ErrClaimTaken and the claim row kept", id, o[0].err, r)
				}
			default:
				if o[0].err != nil {
					t.Errorf("caller %d: Remember(%s) = %v (intrusion %d)", o[0].winner, id, o[0].err, intrusion(j))
					continue
				}
				haCheckRow(t, rows, id, fpOf(j), valueOf(j))
			}
		}
	}
	if want := callers / 2 * perCaller; len(rows) != want { // the warm-up claims, released, left none
		t.Errorf("the table holds %d rows; want %d", len(rows), want)
	}
	conflicts := a.FreshConflicts() + b.FreshConflicts()
	t.Logf("fresh records that met a row: %d round trips (a %d, b %d)", conflicts, a.FreshConflicts(), b.FreshConflicts())
	if conflicts == 0 {
		t.Errorf("no round trip met a row in the way of a fresh record; want some (were the records plain inserts?)")
	}
	for s, pid := range pids {
		if got := s.SessionPID(); got != pid {
			t.Errorf("a session's server process went from %d to %d: the session was lost", pid, got)
		}
		haNoLocksLeft(t, db, pid)
	}
}

// TestFreshHostileConflictMidRound: one round trip carries six fresh
// records (two of them with a row put in the way by a writer that takes no
// lock), a record over a lapsed claim row (an upsert), a fresh one with a
// value, a renewal and three new claims. The plain insert fails and the
// round trip goes again, once, as an upsert: every record is written, every
// claim taken and renewed, and only the claims still held keep a lock.
// The new claims are fresh in their turn.
func TestFreshHostileConflictMidRound(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	a := newStore(t, db, postgresstore.WithSessionClaims())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	holder := stores.WithClaimToken(ctx, "holder")
	rnd := testenv.RandomHex(4)
	key := func(what string, i int) string { return fmt.Sprintf("fh-mid-%s-%s-%d", rnd, what, i) }
	blocker, lapsed, valued, renewed := key("blocker", 0), key("lapsed", 0), key("valued", 0), key("renewed", 0)
	fhLapsedRow(t, db, a.Table(), blocker)
	fhLapsedRow(t, db, a.Table(), lapsed)
	var fresh []string
	for i := range 6 {
		fresh = append(fresh, key("fresh", i))
	}
	for _, k := range append(slices.Clone(fresh), blocker, lapsed, valued, renewed) {
		fhClaim(t, a, holder, k)
	}
	pid := a.SessionPID()
	// A round trip that waits: the blocker's record, an upsert over a row
	// another transaction holds.
	tx, blocked := fhBlockedRound(t, db, a, holder, blocker, pid)
	// The calls queued behind it, carried by the next round trip.
	fhIntrude(t, db, a.Table(), fresh[1], false)
	fhIntrude(t, db, a.Table(), fresh[4], false)
	type call struct {
		what string
		f    func() error
	}
	var calls []call
	for i, k := range fresh {
		calls = append(calls, call{k, func() error { return a.Remember(holder, k, uint64(10+i), nil) }})
	}
	calls = append(calls,
		call{lapsed, func() error { return a.Remember(holder, lapsed, 20, nil) }},
		call{valued, func() error { return a.Remember(holder, valued, 21, []byte("v")) }},
		call{renewed, func() error {
			if held, err := a.Extend(holder, renewed, time.Minute); err != nil || !held {
				return fmt.Errorf("Extend = %v, %v; want held", held, err)
			}
			return nil
		}},
	)
	for i := range 3 {
		k := key("new", i)
		calls = append(calls, call{k, func() error {
			if claimed, found, err := a.Claim(holder, k, time.Minute); err != nil || !claimed {
				return fmt.Errorf("Claim = %v, %+v, %v; want claimed", claimed, found, err)
			}
			return nil
		}})
	}
	results := make([]chan error, len(calls))
	for i, c := range calls {
		results[i] = make(chan error, 1)
		go func() { results[i] <- c.f() }()
	}
	testenv.Eventually(t, "every call to queue behind the blocker", func() bool { return a.SessionQueued() == len(calls) })
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if err := <-blocked; err != nil {
		t.Fatalf("the blocker's Remember = %v", err)
	}
	for i, c := range calls {
		if err := <-results[i]; err != nil {
			t.Errorf("%s: %v", c.what, err)
		}
	}
	if t.Failed() {
		return
	}
	if n := a.FreshConflicts(); n != 1 {
		t.Fatalf("round trips sent again = %d; want 1 (one round trip carried both rows in the way)", n)
	}
	if got := a.SessionPID(); got != pid {
		t.Fatalf("the session's server process went from %d to %d", pid, got)
	}
	rows := haRows(t, db, a.Table())
	for i, k := range fresh {
		haCheckRow(t, rows, k, uint64(10+i), nil)
	}
	haCheckRow(t, rows, lapsed, 20, nil)
	haCheckRow(t, rows, valued, 21, []byte("v"))
	haCheckRow(t, rows, blocker, 1, nil)
	held := haHeldLocks(t, db, pid)
	want := []int64{a.RowLock(renewed), a.RowLock(key("new", 0)), a.RowLock(key("new", 1)), a.RowLock(key("new", 2))}
	slices.Sort(want)
	if !slices.Equal(held, want) {
		t.Fatalf("the session's locks = %v; want those of the renewed claim and the three new ones, %v", held, want)
	}
	// The new claims were fresh: one meets a row in the way, and is sent
	// again; the other two are written as plain inserts.
	fhIntrude(t, db, a.Table(), key("new", 1), false)
	for i := range 3 {
		if err := a.Remember(holder, key("new", i), uint64(30+i), nil); err != nil {
			t.Fatalf("Remember(%s) = %v", key("new", i), err)
		}
	}
	if err := a.Remember(holder, renewed, 40, nil); err != nil {
		t.Fatal(err)
	}
	if n := a.FreshConflicts(); n != 2 {
		t.Fatalf("round trips sent again = %d; want 2 (was a claim taken in a round trip sent again fresh?)", n)
	}
	rows = haRows(t, db, a.Table())
	for i := range 3 {
		haCheckRow(t, rows, key("new", i), uint64(30+i), nil)
	}
	haCheckRow(t, rows, renewed, 40, nil)
	haNoLocksLeft(t, db, pid)
}

// TestFreshHostileFailThenRemember: a failing record written by the
// holder's Fail is a row of the key: the claim is fresh no more, and its
// record then goes as the upsert at once, not as a plain insert that meets
// its own failing record.
func TestFreshHostileFailThenRemember(t *testing.T) {
	t.Parallel()
	a, b := sessionPair(t)
	db := testenv.Postgres(t)
	holder := stores.WithClaimToken(context.Background(), "holder")
	key := "fh-fail-" + testenv.RandomHex(4)
	fhClaim(t, a, holder, key)
	pid := a.SessionPID()
	if err := a.Fail(holder, key, 5, stores.Failure{Attempts: 1, FirstFailure: time.Now()}); err != nil {
		t.Fatalf("Fail = %v", err)
	}
	if held, err := a.Extend(holder, key, time.Minute); err != nil || !held {
		t.Fatalf("Extend after Fail = %v, %v; want held", held, err)
	}
	if err := a.Remember(holder, key, 6, nil); err != nil {
		t.Fatalf("Remember after Fail = %v", err)
	}
	if n := a.FreshConflicts(); n != 0 {
		t.Fatalf("round trips sent again = %d; want 0 (the record went as a plain insert over its own failing record)", n)
	}
	rows := haRows(t, db, a.Table())
	haCheckRow(t, rows, key, 6, nil)
	if claimed, found, err := b.Claim(context.Background(), key, time.Second); err != nil || claimed || !found.Remembered() || found.Fingerprint != 6 {
		t.Fatalf("another worker's Claim = %v, %+v, %v; want the record", claimed, found, err)
	}
	haNoLocksLeft(t, db, pid)
}

// TestFreshHostileClaimOverARowIsNotFresh: a claim taken over a row of the
// key (a lapsed claim row, a failing record, an expired record) is not
// fresh: its record goes as the upsert, with no plain insert that meets
// the row first.
func TestFreshHostileClaimOverARowIsNotFresh(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	a := newStore(t, db, postgresstore.WithSessionClaims())
	rows := newStoreOnTable(t, db, a.Table(), postgresstore.WithRowClaims())
	ctx := context.Background()
	rnd := testenv.RandomHex(4)
	lapsed, failing, expired := "fh-lapsed-"+rnd, "fh-failing-"+rnd, "fh-expired-"+rnd
	fhLapsedRow(t, db, a.Table(), lapsed)
	// A failing record, left by another worker's Fail (no end).
	other := stores.WithClaimToken(ctx, "other")
	if claimed, _, err := rows.Claim(other, failing, time.Minute); err != nil || !claimed {
		t.Fatalf("row claim = %v, %v", claimed, err)
	}
	if err := rows.Fail(other, failing, 3, stores.Failure{Attempts: 1, FirstFailure: time.Now()}); err != nil {
		t.Fatal(err)
	}
	if err := rows.Release(other, failing); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`INSERT INTO `+a.Table()+` (key, expires_at, fingerprint) VALUES ($1::uuid, 1, 4)`, postgresstore.RowKey(expired)); err != nil {
		t.Fatal(err)
	}
	holder := stores.WithClaimToken(ctx, "holder")
	for i, k := range []string{lapsed, failing, expired} {
		claimed, found, err := a.Claim(holder, k, time.Minute)
		if err != nil || !claimed {
			t.Fatalf("Claim(%s) = %v, %+v, %v; want claimed", k, claimed, found, err)
		}
		if err := a.Remember(holder, k, uint64(50+i), nil); err != nil {
			t.Fatalf("Remember(%s) = %v", k, err)
		}
		if n := a.FreshConflicts(); n != 0 {
			t.Fatalf("after %s: round trips sent again = %d; want 0 (the claim over a row was taken as fresh)", k, n)
		}
	}
	got := haRows(t, db, a.Table())
	for i, k := range []string{lapsed, failing, expired} {
		haCheckRow(t, got, k, uint64(50+i), nil)
	}
	haNoLocksLeft(t, db, a.SessionPID())
}

// TestFreshHostileRowClaimsWorkerOnTheTable: a worker with claims of rows
// on the same table respects a fresh session claim: its claim is in flight,
// its Remember and Fail without a claim are refused, and none of them puts
// a row in the way (the session's record goes as a plain insert, with no
// conflict); once the record is written the row worker finds it.
func TestFreshHostileRowClaimsWorkerOnTheTable(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	a := newStore(t, db, postgresstore.WithSessionClaims())
	rows := newStoreOnTable(t, db, a.Table(), postgresstore.WithRowClaims())
	ctx := context.Background()
	key := "fh-rows-" + testenv.RandomHex(4)
	holder := stores.WithClaimToken(ctx, "holder")
	fhClaim(t, a, holder, key)
	other := stores.WithClaimToken(ctx, "row-worker")
	if claimed, found, err := rows.Claim(other, key, time.Minute); err != nil || claimed || found.State != stores.StateInFlight {
		t.Fatalf("the row worker's Claim = %v, %+v, %v; want in flight", claimed, found, err)
	}
	if err := rows.Remember(other, key, 7, nil); !errors.Is(err, stores.ErrClaimTaken) {
		t.Fatalf("the row worker's Remember without a claim = %v; want ErrClaimTaken", err)
	}
	if err := rows.Fail(other, key, 7, stores.Failure{Attempts: 1, FirstFailure: time.Now()}); !errors.Is(err, stores.ErrClaimTaken) {
		t.Fatalf("the row worker's Fail without a claim = %v; want ErrClaimTaken", err)
	}
	if got := haRows(t, db, a.Table()); len(got) != 0 {
		t.Fatalf("rows while the session claim is held = %v; want none", got)
	}
	if err := a.Remember(holder, key, 8, nil); err != nil {
		t.Fatalf("Remember = %v", err)
	}
	if n := a.FreshConflicts(); n != 0 {
		t.Fatalf("round trips sent again = %d; want 0", n)
	}
	haCheckRow(t, haRows(t, db, a.Table()), key, 8, nil)
	if claimed, found, err := rows.Claim(other, key, time.Minute); err != nil || claimed || !found.Remembered() || found.Fingerprint != 8 {
		t.Fatalf("the row worker's Claim after the record = %v, %+v, %v; want the record", claimed, found, err)
	}
}

// TestFreshHostileConflictThenSessionLost: a fresh record meets a row in
// the way, and the round trip sent again as an upsert waits for a row
// another transaction holds; the session is ended under it
// (pg_terminate_backend). The round trip goes again on a new session, the
// claims lost with the old one writing only as nobody holds their keys:
// each Remember's answer matches the table, and the new session holds no
// lock.
func TestFreshHostileConflictThenSessionLost(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	a := newStore(t, db, postgresstore.WithSessionClaims())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	holder := stores.WithClaimToken(ctx, "holder")
	rnd := testenv.RandomHex(4)
	blocker, fresh, waiting := "fh-lost-blocker-"+rnd, "fh-lost-fresh-"+rnd, "fh-lost-waiting-"+rnd
	fhLapsedRow(t, db, a.Table(), blocker)
	fhLapsedRow(t, db, a.Table(), waiting)
	for _, k := range []string{blocker, fresh, waiting} {
		fhClaim(t, a, holder, k)
	}
	pid := a.SessionPID()
	blockTx, blocked := fhBlockedRound(t, db, a, holder, blocker, pid)
	fhIntrude(t, db, a.Table(), fresh, false)
	waitTx := fhLockRow(t, db, a.Table(), waiting)
	results := map[string]chan error{fresh: make(chan error, 1), waiting: make(chan error, 1)}
	fps := map[string]uint64{fresh: 2, waiting: 3}
	for k, ch := range results {
		go func() { ch <- a.Remember(holder, k, fps[k], nil) }()
	}
	testenv.Eventually(t, "both records to queue", func() bool { return a.SessionQueued() == 2 })
	if err := blockTx.Commit(); err != nil {
		t.Fatal(err)
	}
	if err := <-blocked; err != nil {
		t.Fatalf("the blocker's Remember = %v", err)
	}
	// The fresh record met the row, and the upsert sent again waits for
	// the row the other transaction holds.
	testenv.Eventually(t, "the conflict, and the upsert sent again to wait", func() bool {
		return a.FreshConflicts() == 1 && fhWaitsOnALock(t, db, pid)
	})
	var ended bool
	if err := db.QueryRow(`SELECT pg_terminate_backend($1)`, pid).Scan(&ended); err != nil || !ended {
		t.Fatalf("pg_terminate_backend = %v, %v", ended, err)
	}
	testenv.Eventually(t, "the old session to end", func() bool {
		var n int
		if err := db.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 0
	})
	if err := waitTx.Rollback(); err != nil {
		t.Fatal(err)
	}
	errs := map[string]error{}
	for k, ch := range results {
		errs[k] = <-ch
	}
	rows := haRows(t, db, a.Table())
	for k, err := range errs {
		r := rows[postgresstore.RowKey(k)]
		written := r.claimNull && r.fingerprint.Valid && uint64(r.fingerprint.Int64) == fps[k]
		t.Logf("Remember(%s) = %v; row %+v", k, err, r)
		if (err == nil) != written {
			t.Errorf("Remember(%s) = %v, but the table's row is %+v (written: %v)", k, err, r, written)
		}
	}
	if got := a.SessionPID(); got != 0 && got != pid {
		haNoLocksLeft(t, db, got)
	}
	// Both keys are settled for every worker: the record, or free.
	for k := range results {
		claimed, found, err := a.Claim(stores.WithClaimToken(ctx, "retry"), k, time.Second)
		if err != nil || (!claimed && !found.Remembered()) {
			t.Errorf("a retry's Claim(%s) = %v, %+v, %v; want the record or the claim", k, claimed, found, err)
		}
	}
}

// TestFreshHostileRememberTxOfAFreshClaim: a fresh session claim whose
// holder writes its record in a transaction of its own (RememberTx, then
// BeginTx): the record goes in the transaction, or, after a rollback, on
// the session over a row a writer that takes no lock put in the way, as
// the upsert and never as a plain insert (the claim was yielded); the
// session keeps no lock.
func TestFreshHostileRememberTxOfAFreshClaim(t *testing.T) {
	t.Parallel()
	a, b := sessionPair(t)
	db := testenv.Postgres(t)
	ctx := context.Background()
	holder := stores.WithClaimToken(ctx, "holder")
	rnd := testenv.RandomHex(4)
	rolled, begun := "fh-tx-rolled-"+rnd, "fh-tx-begun-"+rnd
	fhClaim(t, a, holder, rolled)
	fhClaim(t, a, holder, begun)
	pid := a.SessionPID()
	// RememberTx, rolled back: the claim stays its holder's; its record
	// then goes on the session.
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if recorded, found, err := a.RememberTx(holder, tx, rolled, 1, nil); err != nil || !recorded {
		t.Fatalf("RememberTx = %v, %+v, %v", recorded, found, err)
	}
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	fhIntrude(t, db, a.Table(), rolled, false)
	if err := a.Remember(holder, rolled, 2, nil); err != nil {
		t.Fatalf("Remember after the transaction rolled back = %v", err)
	}
	// BeginTx, committed: the record goes in the transaction.
	btx, recorded, found, err := a.BeginTx(holder, db, nil, begun, 3, []byte("r"))
	if err != nil || !recorded {
		t.Fatalf("BeginTx = %v, %+v, %v; want recorded", recorded, found, err)
	}
	if err := btx.Commit(); err != nil {
		t.Fatal(err)
	}
	if err := a.Release(holder, begun); err != nil {
		t.Fatal(err)
	}
	if n := a.FreshConflicts(); n != 0 {
		t.Fatalf("round trips sent again = %d; want 0 (a claim yielded to its transaction wrote as fresh)", n)
	}
	rows := haRows(t, db, a.Table())
	haCheckRow(t, rows, rolled, 2, nil)
	haCheckRow(t, rows, begun, 3, []byte("r"))
	haNoLocksLeft(t, db, pid)
	for k, fp := range map[string]uint64{rolled: 2, begun: 3} {
		if claimed, found, err := b.Claim(ctx, k, time.Second); err != nil || claimed || !found.Remembered() || found.Fingerprint != fp {
			t.Fatalf("another worker's Claim(%s) = %v, %+v, %v; want the record %d", k, claimed, found, err, fp)
		}
	}
}

// TestFreshHostileTwoRecordsOfAFreshClaimInOneRound: the holder of a fresh
// claim remembers its key twice at once, and both calls ride one round
// trip (the first as the plain insert, the second as a statement of its
// own after it), over a row a writer that takes no lock put in the way:
// the round trip goes again once, both calls succeed, the row is the
// record of one of them, and no lock is left.
func TestFreshHostileTwoRecordsOfAFreshClaimInOneRound(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	a := newStore(t, db, postgresstore.WithSessionClaims())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	holder := stores.WithClaimToken(ctx, "holder")
	rnd := testenv.RandomHex(4)
	blocker, key := "fh-twice-blocker-"+rnd, "fh-twice-"+rnd
	fhLapsedRow(t, db, a.Table(), blocker)
	fhClaim(t, a, holder, blocker)
	fhClaim(t, a, holder, key)
	pid := a.SessionPID()
	tx, blocked := fhBlockedRound(t, db, a, holder, blocker, pid)
	fhIntrude(t, db, a.Table(), key, false)
	results := make(chan error, 2)
	for fp := range uint64(2) {
		go func() { results <- a.Remember(holder, key, 60+fp, nil) }()
	}
	testenv.Eventually(t, "both records to queue", func() bool { return a.SessionQueued() == 2 })
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if err := <-blocked; err != nil {
		t.Fatalf("the blocker's Remember = %v", err)
	}
	for range 2 {
		if err := <-results; err != nil {
			t.Errorf("Remember(%s) = %v", key, err)
		}
	}
	if n := a.FreshConflicts(); n != 1 {
		t.Errorf("round trips sent again = %d; want 1", n)
	}
	r := haRows(t, db, a.Table())[postgresstore.RowKey(key)]
	if !r.claimNull || !r.fingerprint.Valid || (r.fingerprint.Int64 != 60 && r.fingerprint.Int64 != 61) {
		t.Errorf("the row = %+v; want the record of one of the two calls", r)
	}
	haNoLocksLeft(t, db, pid)
	if got := a.SessionPID(); got != pid {
		t.Errorf("the session's server process went from %d to %d", pid, got)
	}
}
