package postgresstore_test

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// The session's round trips send their arrays (row keys, fingerprints,
// locks, flags) as strings in PostgreSQL's text form of an array. These
// tests attack that from the outside: message ids of any content, the
// fingerprints and lock keys at the extremes of 64 bits, rounds that mix
// claims, renewals, records with and without a value, duplicates and
// colliding locks, every query mode a DSN can ask pgx for, and they compare
// the API's answers with the server's own view (the table, pg_locks).

// haFingerprints are the fingerprints the records take in turn: 0 (kept as
// none), the int64 extremes and the uint64s above math.MaxInt64 that the
// store keeps as negative int64s.
var haFingerprints = []uint64{0, 1, math.MaxInt64, 1 << 63, math.MaxUint64, math.MaxUint64 - 1, 1<<63 + 1, 7331}

// haKey returns the i-th hostile message id of a test (rnd keeps tests
// apart): quotes, backslashes, braces, commas, spaces, NULL spelled out,
// unicode, a line break, and now and then one 10 kB long.
func haKey(rnd string, i int) string {
	frags := []string{`"`, `\`, `{`, `}`, `,`, ` `, `NULL`, `\"`, `"\`, "ü✓", "a\nb", `{"a","b"}`, `''`, ``}
	k := fmt.Sprintf("ha-%s-%d-%s", rnd, i, frags[i%len(frags)])
	if i%37 == 5 {
		k += strings.Repeat(`"\{},`, 2000)
	}
	return k
}

// haDB opens a pgx pool asking for the query mode mode (pgx's default when
// empty): a user's DSN reaches the session's own connection too.
func haDB(t *testing.T, mode string) *sql.DB {
	t.Helper()
	if mode == "" {
		return testenv.Postgres(t)
	}
	testenv.Postgres(t) // the server is up, or the test is skipped
	db, err := sql.Open("pgx", testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN)+"&default_query_exec_mode="+mode)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// haRow is a key's row as the server holds it.
type haRow struct {
	claimNull   bool
	fingerprint sql.NullInt64
	value       []byte
}

// haRows reads every row of table, by row key.
func haRows(t *testing.T, db *sql.DB, table string) map[string]haRow {
	t.Helper()
	rows, err := db.QueryContext(context.Background(), `SELECT key::text, claim IS NULL, fingerprint, value FROM `+table)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]haRow{}
	for rows.Next() {
		var k string
		var r haRow
		if err := rows.Scan(&k, &r.claimNull, &r.fingerprint, &r.value); err != nil {
			t.Fatal(err)
		}
		out[k] = r
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// haCheckRow fails the test unless row is key's record with fingerprint fp
// (NULL for 0) and value.
func haCheckRow(t *testing.T, rows map[string]haRow, key string, fp uint64, value []byte) {
	t.Helper()
	r, ok := rows[postgresstore.RowKey(key)]
	switch {
	case !ok:
		t.Errorf("no row for %.40q (%s)", key, postgresstore.RowKey(key))
	case !r.claimNull:
		t.Errorf("the row of %.40q is still a claim row", key)
	case fp == 0 && r.fingerprint.Valid:
		t.Errorf("the row of %.40q has fingerprint %d; want NULL", key, r.fingerprint.Int64)
	case fp != 0 && (!r.fingerprint.Valid || r.fingerprint.Int64 != int64(fp)):
		t.Errorf("the row of %.40q has fingerprint %v; want %d (%d as uint64)", key, r.fingerprint, int64(fp), fp)
	case !slices.Equal(r.value, value):
		t.Errorf("the row of %.40q has value %.40q; want %.40q", key, r.value, value)
	}
}

// haWorkers returns two workers' stores with session claims on one table,
// each on a pool of its own (four connections) in the pgx query mode
// mode, b with bOpts besides, and a's pool.
func haWorkers(t *testing.T, mode string, bOpts ...postgresstore.Option) (db *sql.DB, a, b *postgresstore.Store) {
	t.Helper()
	db = haDB(t, mode)
	db.SetMaxOpenConns(4)
	a = newStore(t, db, postgresstore.WithSessionClaims())
	dbB := haDB(t, mode)
	dbB.SetMaxOpenConns(4)
	b, err := postgresstore.New(dbB, append([]postgresstore.Option{postgresstore.WithTable(a.Table()), postgresstore.WithSessionClaims()}, bOpts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return db, a, b
}

// haNoLocksLeft fails the test when the server process pid (a session)
// still holds advisory locks: every claim on it was recorded, released or
// given back.
func haNoLocksLeft(t *testing.T, db *sql.DB, pid int32) {
	t.Helper()
	if held := haHeldLocks(t, db, pid); len(held) != 0 {
		t.Fatalf("the session %d still holds the advisory locks %v; want none, every claim on it settled", pid, held)
	}
}

// haHeldLocks returns the advisory locks (64-bit keys) the server process
// pid holds, as the server reports them.
func haHeldLocks(t *testing.T, db *sql.DB, pid int32) []int64 {
	t.Helper()
	return testenv.Column[int64](context.Background(), t, db, `SELECT (classid::int8 << 32) | objid::int8 FROM pg_locks
		WHERE locktype = 'advisory' AND objsubid = 1 AND granted AND pid = $1 ORDER BY 1`, pid)
}

// TestArraysHostileManyCallers: many callers at once, two workers on one
// table, so that the session's round trips carry dozens of claims, records
// (with and without a value), renewals and duplicates together, for
// message ids of any content and fingerprints at the 64-bit extremes, in
// every query mode a DSN can ask pgx for. Each key is claimed exactly once;
// its losers are told in flight or its exact record; every record is
// written as sent, as the server's table shows; keys remembered twice in
// one worker without a claim are both written.
func TestArraysHostileManyCallers(t *testing.T) {
	t.Parallel()
	groups, perGroup := 16, 200 // 64 callers, 4 to a group of keys
	if testing.Short() {
		groups, perGroup = 4, 25
	}
	haEachMode(t, func(t *testing.T, mode string) {
		db, a, b := haWorkers(t, mode)
		runHostileCallers(t, db, a, b, groups, perGroup)
	})
}

// haEachMode runs f in a parallel subtest for each query mode a DSN can
// ask pgx for ("" for its default), the first two only under -short.
func haEachMode(t *testing.T, f func(t *testing.T, mode string)) {
	t.Helper()
	modes := []string{"", "simple_protocol", "exec", "describe_exec", "cache_describe"}
	if testing.Short() {
		modes = modes[:2]
	}
	for _, mode := range modes {
		t.Run(cmp.Or(mode, "default"), func(t *testing.T) {
			t.Parallel()
			f(t, mode)
		})
	}
}

// runHostileCallers runs groups×4 callers on a and b (two each) over
// perGroup keys a group, and checks the answers and the table.
func runHostileCallers(t *testing.T, db *sql.DB, a, b *postgresstore.Store, groups, perGroup int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	rnd := testenv.RandomHex(4)
	type key struct{ g, j int }
	var mu sync.Mutex
	winners := map[key][]int{}
	keyOf := func(k key) string { return haKey(rnd, k.g*perGroup+k.j) }
	plainOf := func(k key) string { return "plain-" + haKey(rnd, k.g*perGroup+k.j) }
	fpOf := func(k key) uint64 { return haFingerprints[(k.g+k.j)%len(haFingerprints)] }
	valueOf := func(k key) []byte {
		if k.j%4 == 1 {
			return []byte(fmt.Sprintf(`value "%d" \ {,}`, k.j))
		}
		return nil
	}
	plainFp := func(c int, k key) uint64 { return haFingerprints[(c+k.j)%len(haFingerprints)] }
	for _, err := range burst(groups*4, func(c int) error {
		s := a
		if c%4 >= 2 {
			s = b
		}
		g := c / 4
		token := fmt.Sprintf("caller-%d", c)
		hctx := stores.WithClaimToken(ctx, token)
		for j := range perGroup {
			k := key{g, j}
			id := keyOf(k)
			claimed, found, err := s.Claim(hctx, id, time.Minute)
			if err != nil {
				return fmt.Errorf("caller %d: Claim(%.40q): %w", c, id, err)
			}
			if claimed {
				mu.Lock()
				winners[k] = append(winners[k], c)
				mu.Unlock()
				if j%3 == 0 {
					if held, err := s.Extend(hctx, id, time.Minute); err != nil || !held {
						return fmt.Errorf("caller %d: Extend(%.40q) of its own claim = %v, %v", c, id, held, err)
					}
				}
				if err := s.Remember(hctx, id, fpOf(k), valueOf(k)); err != nil {
					return fmt.Errorf("caller %d: Remember(%.40q): %w", c, id, err)
				}
			} else {
				switch found.State {
				case stores.StateInFlight:
				case stores.StateRemembered:
					if found.Fingerprint != fpOf(k) || !slices.Equal(found.Value, valueOf(k)) {
						return fmt.Errorf("caller %d: a duplicate of %.40q was told fingerprint %d value %q; want %d %q", c, id, found.Fingerprint, found.Value, fpOf(k), valueOf(k))
					}
				default:
					return fmt.Errorf("caller %d: a duplicate of %.40q was told %v", c, id, found.State)
				}
			}
			// Without a claim: the two callers of the first worker
			// remember the same key, each its own fingerprint.
			if c%4 < 2 {
				if err := s.Remember(ctx, plainOf(k), plainFp(c, k), nil); err != nil {
					return fmt.Errorf("caller %d: Remember(%.40q) without a claim: %w", c, plainOf(k), err)
				}
			}
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
	want := 0
	for g := range groups {
		for j := range perGroup {
			k := key{g, j}
			want++
			if w := winners[k]; len(w) != 1 {
				t.Errorf("key %.40q claimed by callers %v; want exactly one", keyOf(k), w)
			}
			haCheckRow(t, rows, keyOf(k), fpOf(k), valueOf(k))
			want++
			r, ok := rows[postgresstore.RowKey(plainOf(k))]
			fps := []uint64{plainFp(4*g, k), plainFp(4*g+1, k)}
			var got uint64
			if r.fingerprint.Valid {
				got = uint64(r.fingerprint.Int64)
			}
			if !ok || !r.claimNull || !slices.Contains(fps, got) || r.value != nil {
				t.Errorf("the row of %.40q = %+v (found %v); want a record with one of the fingerprints %v", plainOf(k), r, ok, fps)
			}
		}
	}
	if len(rows) != want {
		t.Errorf("the table holds %d rows; want %d", len(rows), want)
	}
	if t.Failed() {
		return
	}
	// The records read back through the API, all 64 bits of each
	// fingerprint.
	for g := range groups {
		for _, j := range []int{0, 1, 2, 3, perGroup - 1} {
			k := key{g, j}
			r, err := b.Lookup(ctx, keyOf(k))
			if err != nil || !r.Remembered() || r.Fingerprint != fpOf(k) || !slices.Equal(r.Value, valueOf(k)) {
				t.Errorf("Lookup(%.40q) = %+v, %v; want remembered with %d, %q", keyOf(k), r, err, fpOf(k), valueOf(k))
			}
		}
	}
	for _, s := range []*postgresstore.Store{a, b} {
		if pid := s.SessionPID(); pid != 0 {
			haNoLocksLeft(t, db, pid)
		}
	}
}

// TestArraysHostileLocksOnServer: the locks a burst of claims takes are,
// in the server's pg_locks, exactly the keys' locks (half of them negative
// int64s); those released in a burst, and those recorded in another, are
// given back and no other.
func TestArraysHostileLocksOnServer(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	s := newStore(t, db, postgresstore.WithSessionClaims())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rnd := testenv.RandomHex(4)
	n := 96
	if testing.Short() {
		n = 32
	}
	keys := make([]string, n)
	for i := range keys {
		keys[i] = haKey(rnd, i)
	}
	tok := func(i int) context.Context { return stores.WithClaimToken(ctx, fmt.Sprintf("t%d", i)) }
	for i, err := range burst(n, func(i int) error {
		claimed, found, err := s.Claim(tok(i), keys[i], time.Minute)
		if err == nil && !claimed {
			err = fmt.Errorf("not claimed: %v", found.State)
		}
		return err
	}) {
		if err != nil {
			t.Fatalf("Claim(%.40q): %v", keys[i], err)
		}
	}
	pid := s.SessionPID()
	if pid == 0 {
		t.Fatal("no session after the claims")
	}
	expect := func(what string, held []string) {
		t.Helper()
		want := make([]int64, 0, len(held))
		for _, k := range held {
			want = append(want, s.RowLock(k))
		}
		slices.Sort(want)
		want = slices.Compact(want)
		got := haHeldLocks(t, db, pid)
		if !slices.Equal(got, want) {
			t.Fatalf("%s: the session holds the locks %v; want %v", what, got, want)
		}
	}
	negative := 0
	for _, k := range keys {
		if s.RowLock(k) < 0 {
			negative++
		}
	}
	if negative == 0 || negative == n {
		t.Fatalf("%d of %d locks negative: pick other keys", negative, n)
	}
	expect("after the claims", keys)
	// Half released, in one burst; the other half renewed meanwhile.
	for i, err := range burst(n, func(i int) error {
		if i%2 == 0 {
			return s.Release(tok(i), keys[i])
		}
		held, err := s.Extend(tok(i), keys[i], time.Minute)
		if err == nil && !held {
			err = errors.New("not held")
		}
		return err
	}) {
		if err != nil {
			t.Fatalf("Release or Extend of %.40q: %v", keys[i], err)
		}
	}
	var odd []string
	for i, k := range keys {
		if i%2 == 1 {
			odd = append(odd, k)
		}
	}
	waitCond(t, "the released locks given back", 10*time.Second, func() bool {
		return len(haHeldLocks(t, db, pid)) == len(odd)
	})
	expect("after half were released", odd)
	for i, err := range burst(n, func(i int) error {
		if i%2 == 0 {
			return nil
		}
		return s.Remember(tok(i), keys[i], haFingerprints[i%len(haFingerprints)], nil)
	}) {
		if err != nil {
			t.Fatalf("Remember(%.40q): %v", keys[i], err)
		}
	}
	waitCond(t, "the recorded locks given back", 10*time.Second, func() bool {
		return len(haHeldLocks(t, db, pid)) == 0
	})
	rows := haRows(t, db, s.Table())
	if len(rows) != len(odd) {
		t.Errorf("the table holds %d rows; want %d", len(rows), len(odd))
	}
	for i, k := range keys {
		if i%2 == 1 {
			haCheckRow(t, rows, k, haFingerprints[i%len(haFingerprints)], nil)
		}
	}
}

// TestArraysHostileCollidingExtremeLocks: keys whose locks all collide on
// the int64 extremes (and -1): of a burst of claims exactly one is taken,
// on the very lock the server shows; the others are in flight until it is
// recorded, then taken one after another, each record written; each key's
// duplicate is then told its record.
func TestArraysHostileCollidingExtremeLocks(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	for _, lock := range []int64{math.MinInt64, math.MaxInt64, -1, math.MinInt64 + 1} {
		t.Run(fmt.Sprint(lock), func(t *testing.T) {
			s := newStore(t, db, postgresstore.WithSessionClaims())
			s.CollideLocks(lock)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			rnd := testenv.RandomHex(4)
			n := 12
			keys := make([]string, n)
			for i := range keys {
				keys[i] = haKey(rnd, i)
			}
			tok := func(i int) context.Context { return stores.WithClaimToken(ctx, fmt.Sprintf("t%d", i)) }
			var mu sync.Mutex
			var won []int
			for i, err := range burst(n, func(i int) error {
				claimed, found, err := s.Claim(tok(i), keys[i], time.Minute)
				switch {
				case err != nil:
					return err
				case claimed:
					mu.Lock()
					won = append(won, i)
					mu.Unlock()
				case found.State != stores.StateInFlight:
					return fmt.Errorf("told %v; want in flight", found.State)
				}
				return nil
			}) {
				if err != nil {
					t.Fatalf("Claim(%.40q): %v", keys[i], err)
				}
			}
			if len(won) != 1 {
				t.Fatalf("claims taken on one colliding lock: %v; want exactly one", won)
			}
			if got := haHeldLocks(t, db, s.SessionPID()); !slices.Equal(got, []int64{lock}) {
				t.Fatalf("the session holds the locks %v; want [%d]", got, lock)
			}
			done := map[int]bool{}
			next := won[0]
			for len(done) < n {
				if err := s.Remember(tok(next), keys[next], haFingerprints[next%len(haFingerprints)], nil); err != nil {
					t.Fatalf("Remember(%.40q): %v", keys[next], err)
				}
				done[next] = true
				if len(done) == n {
					break
				}
				// The others at once again, until one is taken: the
				// others are in flight meanwhile.
				next = -1
				deadline := time.Now().Add(10 * time.Second)
				for next == -1 {
					if time.Now().After(deadline) {
						t.Fatal("no claim taken on a free lock within 10s")
					}
					for i, err := range burst(n, func(i int) error {
						if done[i] {
							return nil
						}
						claimed, found, err := s.Claim(tok(i), keys[i], time.Minute)
						switch {
						case err != nil:
							return err
						case claimed:
							mu.Lock()
							defer mu.Unlock()
							if next != -1 {
								return fmt.Errorf("taken beside %d on one lock", next)
							}
							next = i
						case found.State != stores.StateInFlight:
							return fmt.Errorf("told %v; want in flight", found.State)
						}
						return nil
					}) {
						if err != nil {
							t.Fatalf("Claim(%.40q): %v", keys[i], err)
						}
					}
				}
				if got := haHeldLocks(t, db, s.SessionPID()); !slices.Equal(got, []int64{lock}) {
					t.Fatalf("the session holds the locks %v; want [%d]", got, lock)
				}
			}
			waitCond(t, "the lock given back", 10*time.Second, func() bool {
				return len(haHeldLocks(t, db, s.SessionPID())) == 0
			})
			// Each key's record, told to a duplicate at once now that the
			// lock is free.
			for i, k := range keys {
				claimed, found, err := s.Claim(tok(i), k, time.Minute)
				if err != nil || claimed || !found.Remembered() || found.Fingerprint != haFingerprints[i%len(haFingerprints)] {
					t.Errorf("a duplicate of %.40q = %v, %+v, %v; want its record", k, claimed, found, err)
				}
			}
			rows := haRows(t, db, s.Table())
			if len(rows) != n {
				t.Errorf("the table holds %d rows; want %d", len(rows), n)
			}
			for i, k := range keys {
				haCheckRow(t, rows, k, haFingerprints[i%len(haFingerprints)], nil)
			}
		})
	}
}

// TestArraysHostileRecordsOfOneRound: claims taken in a burst, then each
// recorded twice by its holder in another burst, once with a value (a
// statement of its own) and once without (the grouped statement's arrays),
// so that round trips mix both forms and the same key twice. Each is
// written whole (one of its two records), as the table shows, and every
// lock is given back.
func TestArraysHostileRecordsOfOneRound(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	s := newStore(t, db, postgresstore.WithSessionClaims())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rnd := testenv.RandomHex(4)
	n := 32
	key := func(i int) string { return haKey(rnd, i%n) }
	tok := func(i int) context.Context { return stores.WithClaimToken(ctx, fmt.Sprintf("t%d", i%n)) }
	fp := func(i int) uint64 { return haFingerprints[i%len(haFingerprints)] }
	value := func(i int) []byte {
		if i >= n {
			return []byte(fmt.Sprintf(`{"v":%d,"q":"\""}`, i))
		}
		return nil
	}
	for i, err := range burst(n, func(i int) error {
		claimed, found, err := s.Claim(tok(i), key(i), time.Minute)
		if err == nil && !claimed {
			err = fmt.Errorf("not claimed: %v", found.State)
		}
		return err
	}) {
		if err != nil {
			t.Fatalf("Claim(%.40q): %v", key(i), err)
		}
	}
	for i, err := range burst(2*n, func(i int) error { return s.Remember(tok(i), key(i), fp(i), value(i)) }) {
		if err != nil {
			t.Fatalf("Remember(%.40q) (value %q): %v", key(i), value(i), err)
		}
	}
	rows := haRows(t, db, s.Table())
	if len(rows) != n {
		t.Errorf("the table holds %d rows; want %d", len(rows), n)
	}
	for i := range n {
		r, ok := rows[postgresstore.RowKey(key(i))]
		var got uint64
		if r.fingerprint.Valid {
			got = uint64(r.fingerprint.Int64)
		}
		j := i + n
		if !ok || !r.claimNull || !(got == fp(i) && slices.Equal(r.value, value(i)) || got == fp(j) && slices.Equal(r.value, value(j))) {
			t.Errorf("the row of %.40q = %+v (found %v); want fingerprint %d with %q or %d with %q", key(i), r, ok, int64(fp(i)), value(i), int64(fp(j)), value(j))
		}
	}
	if pid := s.SessionPID(); pid != 0 {
		waitCond(t, "every lock given back", 10*time.Second, func() bool { return len(haHeldLocks(t, db, pid)) == 0 })
	}
}

// TestArraysHostileWideRound: 2000 callers at once on one worker, each
// claiming and recording its own key, so that a round trip carries up to
// all of them (2000 claims in one array, measured): every claim is taken
// and every record written as sent, as the table shows.
func TestArraysHostileWideRound(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	s := newStore(t, db, postgresstore.WithSessionClaims())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rnd := testenv.RandomHex(4)
	n := 2000
	if testing.Short() {
		n = 200
	}
	tok := func(i int) context.Context { return stores.WithClaimToken(ctx, fmt.Sprintf("t%d", i)) }
	fp := func(i int) uint64 { return haFingerprints[i%len(haFingerprints)] }
	for i, err := range burst(n, func(i int) error {
		claimed, found, err := s.Claim(tok(i), haKey(rnd, i), time.Minute)
		if err == nil && !claimed {
			err = fmt.Errorf("not claimed: %v", found.State)
		}
		if err != nil {
			return err
		}
		return s.Remember(tok(i), haKey(rnd, i), fp(i), nil)
	}) {
		if err != nil {
			t.Fatalf("Claim and Remember of %.40q: %v", haKey(rnd, i), err)
		}
	}
	rows := haRows(t, db, s.Table())
	if len(rows) != n {
		t.Errorf("the table holds %d rows; want %d", len(rows), n)
	}
	for i := range n {
		haCheckRow(t, rows, haKey(rnd, i), fp(i), nil)
	}
	if pid := s.SessionPID(); pid != 0 {
		waitCond(t, "every lock given back", 10*time.Second, func() bool { return len(haHeldLocks(t, db, pid)) == 0 })
	}
}
