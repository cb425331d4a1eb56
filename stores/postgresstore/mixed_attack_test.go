package postgresstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// Attacks on a fleet mixing session claims and claims of rows on one
// table: a worker with claims of rows sees the session claims (its Lookup
// says in flight, its Remember writes no record under one) unless the
// caller's own claim row is live.

// maDrivers are the drivers a worker with claims of rows runs on: pgx with
// WithRowClaims, and lib/pq, whose Stores claim rows by default.
var maDrivers = []struct {
	name, driver string
	opts         []postgresstore.Option
}{
	{"pgx", "pgx", []postgresstore.Option{postgresstore.WithRowClaims()}},
	{"libpq", "postgres", nil},
}

// maHoldLocks takes the advisory locks s takes for keys, exclusive, on
// one connection of its own, as a session claimer does for the round trip
// in which it reads a key's row; the returned func gives them back (also
// run when the test ends).
func maHoldLocks(t *testing.T, db *sql.DB, s *postgresstore.Store, keys ...string) func() {
	t.Helper()
	ctx := context.Background()
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	release := func() {
		once.Do(func() {
			_, _ = conn.ExecContext(ctx, `SELECT pg_advisory_unlock_all()`)
			_ = conn.Close()
		})
	}
	t.Cleanup(release)
	for _, key := range keys {
		if _, err := conn.ExecContext(ctx, `SELECT pg_advisory_lock($1)`, s.RowLock(key)); err != nil {
			t.Fatal(err)
		}
	}
	return release
}

// maLockRow locks key's row FOR UPDATE in a transaction of its own, and
// returns its end (commit), also run when the test ends.
func maLockRow(t *testing.T, db *sql.DB, table, key string) func() {
	t.Helper()
	tx, err := db.BeginTx(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	var one int
	if err := tx.QueryRowContext(context.Background(), `SELECT 1 FROM `+table+` WHERE key = $1 FOR UPDATE`, postgresstore.RowKey(key)).Scan(&one); err != nil {
		_ = tx.Rollback()
		t.Fatalf("lock the row of %s: %v", key, err)
	}
	var once sync.Once
	end := func() { once.Do(func() { _ = tx.Commit() }) }
	t.Cleanup(end)
	return end
}

// maWaitingStatement waits until a statement on table waits for a row's
// lock, grouped (over arrays: unnest) or not, and returns its start in ms
// (its statement_timestamp: the "now" it judges leases by).
func maWaitingStatement(t *testing.T, db *sql.DB, table string, grouped bool) int64 {
	t.Helper()
	var start int64
	waitCond(t, fmt.Sprintf("a Remember (grouped %v) waiting for a row's lock", grouped), 10*time.Second, func() bool {
		err := db.QueryRowContext(context.Background(), `SELECT (extract(epoch from query_start) * 1000)::bigint FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND query LIKE '%INSERT INTO "'||$1||'" AS r%' AND (query LIKE '%unnest%') = $2 LIMIT 1`,
			table, grouped).Scan(&start)
		if errors.Is(err, sql.ErrNoRows) {
			return false
		}
		if err != nil {
			t.Fatal(err)
		}
		return true
	})
	return start
}

// maQueued counts the goroutines of the test named test waiting in a
// Store's group for a statement to carry them (queued, none of their own
// running).
func maQueued(test string) int {
	buf := make([]byte, 1<<22)
	buf = buf[:runtime.Stack(buf, true)]
	n := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "postgresstore.(*group).do(") && strings.Contains(g, test+".") && !strings.Contains(g, "database/sql.") {
			n++
		}
	}
	return n
}

// maResult waits for a Remember run in a goroutine.
func maResult(t *testing.T, what string, c <-chan error) error {
	t.Helper()
	select {
	case err := <-c:
		return err
	case <-time.After(15 * time.Second):
		t.Fatalf("%s did not return within 15s", what)
		return nil
	}
}

// A rows holder's grouped Remember carries two of its keys, A and B, and
// waits on A's row (another transaction holds its lock, as a concurrent
// writer of the row would). Meanwhile B's lease runs out and a session
// claimer takes B (the row's claim lapsed, nobody holds the lock). When
// the statement goes on to B, the key's lock is the session's, and the
// holder's claim row is no longer live: B's record must be refused
// (ErrClaimTaken), not written under the session's live claim, whose
// holder is about to run the message's effect again.
func TestMixedAttackGroupedRememberAfterASessionTookTheLapsedKey(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out a lease of 1.5s")
	}
	t.Parallel()
	for _, d := range maDrivers {
		// One driver after the other: maQueued counts the test's goroutines.
		t.Run(d.name, func(t *testing.T) {
			ctx := context.Background()
			a := newStore(t, h2Pool(t))
			if !a.SessionClaims() {
				t.Fatal("the first worker has no session claims")
			}
			r := newStoreOnTable(t, h2DriverPool(t, d.driver), a.Table(), d.opts...)
			if r.SessionClaims() {
				t.Fatal("the second worker has session claims")
			}
			db := h2Pool(t)
			table := a.Table()
			tag := testenv.RandomHex(4)
			x, ka, kb := "x-"+tag, "a-"+tag, "b-"+tag
			if postgresstore.RowKey(ka) > postgresstore.RowKey(kb) {
				ka, kb = kb, ka // the grouped statement takes its keys in order: A first
			}
			holder := h2Token("rows-holder")
			for _, c := range []struct {
				key   string
				lease time.Duration
			}{{x, time.Minute}, {ka, time.Minute}, {kb, 1500 * time.Millisecond}} {
				if claimed, _, err := r.Claim(holder, c.key, c.lease); err != nil || !claimed {
					t.Fatalf("the rows holder's Claim(%s) = %v, %v", c.key, claimed, err)
				}
			}
			endX, endA := maLockRow(t, db, table, x), maLockRow(t, db, table, ka)

			// X's Remember runs alone and waits on X's row: A's and B's queue
			// behind it, and go as one statement once X's ends.
			results := map[string]chan error{x: make(chan error, 1), ka: make(chan error, 1), kb: make(chan error, 1)}
			go func() { results[x] <- r.Remember(holder, x, 1, nil) }()
			maWaitingStatement(t, db, table, false)
			go func() { results[ka] <- r.Remember(holder, ka, 2, nil) }()
			go func() { results[kb] <- r.Remember(holder, kb, 3, nil) }()
			test := strings.SplitN(t.Name(), "/", 2)[0]
			waitCond(t, "A's and B's Remember queued behind X's", 10*time.Second, func() bool { return maQueued(test) >= 2 })
			endX()
			if err := maResult(t, "X's Remember", results[x]); err != nil {
				t.Fatalf("X's Remember: %v", err)
			}
			began := maWaitingStatement(t, db, table, true)
			var expires int64
			if err := db.QueryRowContext(ctx, `SELECT expires_at FROM `+table+` WHERE key = $1`, postgresstore.RowKey(kb)).Scan(&expires); err != nil {
				t.Fatal(err)
			}
			if began >= expires {
				t.Fatalf("inconclusive: the grouped Remember began at %d, after B's lease ran out (%d)", began, expires)
			}
			// B's lease runs out; a session claimer takes B.
			taker := h2Token("session-taker")
			took := waitClaim(t, a, taker, kb, 10*time.Second)
			t.Cleanup(func() { _ = a.Release(taker, kb) })
			var lapsed bool
			if err := db.QueryRowContext(ctx, `SELECT expires_at <= (extract(epoch from clock_timestamp()) * 1000)::bigint FROM `+table+` WHERE key = $1`,
				postgresstore.RowKey(kb)).Scan(&lapsed); err != nil || !lapsed {
				t.Fatalf("B's claim row once the session took the key: lapsed %v, %v", lapsed, err)
			}
			endA()
			if err := maResult(t, "A's Remember", results[ka]); err != nil {
				t.Errorf("A's Remember (the holder's own live claim, nobody else on the key): %v; want it written", err)
			}
			errB := maResult(t, "B's Remember", results[kb])
			var claimNull bool
			var fp int64
			if err := db.QueryRowContext(ctx, `SELECT claim IS NULL, coalesce(fingerprint, 0) FROM `+table+` WHERE key = $1`,
				postgresstore.RowKey(kb)).Scan(&claimNull, &fp); err != nil {
				t.Fatal(err)
			}
			if !errors.Is(errB, stores.ErrClaimTaken) || claimNull {
				seen, _ := r.Lookup(ctx, kb)
				t.Errorf("the rows holder's grouped Remember of B, begun at %d ms while its claim was live (to %d ms), reaching B after the lease ran out and a session claimer took B (%v after the claim): err = %v, row is a record: %v (fingerprint %d), the rows worker now reads B as %v; want ErrClaimTaken and no record under the session's live claim (its holder runs the effect again)",
					began, expires, took.Round(time.Millisecond), errB, claimNull, fp, seen.State)
			}
		})
	}
}

// While a session claimer holds a key's lock (the round trip in which it
// reads the key's row), a worker with claims of rows records the keys its
// own live claims hold, and no other: not a key claimed by another
// holder, not its own lapsed claim, not a key without a claim row. Run on
// pgx and lib/pq, grouped and not, and with a value. The lock is held on
// a connection of the test's own, so each Remember meets it.
func TestMixedAttackRowsRememberWhileTheKeyLockIsHeld(t *testing.T) {
	t.Parallel()
	for _, d := range maDrivers {
		for _, v := range []struct {
			name  string
			opts  []postgresstore.Option
			value []byte
		}{{"Grouped", nil, nil}, {"Ungrouped", []postgresstore.Option{postgresstore.WithoutGrouping()}, nil}, {"Value", nil, []byte("value")}} {
			t.Run(d.name+"/"+v.name, func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				a := newStore(t, h2Pool(t))
				r := newStoreOnTable(t, h2DriverPool(t, d.driver), a.Table(), append(append([]postgresstore.Option{}, d.opts...), v.opts...)...)
				db := h2Pool(t)
				tag := testenv.RandomHex(4)
				own, other, lapsed, none := "own-"+tag, "other-"+tag, "lapsed-"+tag, "none-"+tag
				for _, c := range []struct {
					key, token string
					lease      time.Duration
				}{{own, "own", time.Minute}, {other, "other", time.Minute}, {lapsed, "lapsed", time.Millisecond}} {
					if claimed, _, err := r.Claim(h2Token(c.token), c.key, c.lease); err != nil || !claimed {
						t.Fatalf("Claim(%s) = %v, %v", c.key, claimed, err)
					}
				}
				waitCond(t, "the 1ms claim lapsed", 5*time.Second, func() bool {
					var gone bool
					err := db.QueryRowContext(ctx, `SELECT expires_at <= (extract(epoch from clock_timestamp()) * 1000)::bigint FROM `+a.Table()+` WHERE key = $1`,
						postgresstore.RowKey(lapsed)).Scan(&gone)
					return err == nil && gone
				})
				release := maHoldLocks(t, db, r, own, other, lapsed, none)
				// The lock is the one the Store reads: a key without a row is
				// in flight while it is held.
				if got, err := r.Lookup(ctx, none); err != nil || got.State != stores.StateInFlight {
					t.Fatalf("the rows worker's Lookup of a key whose lock is held = %v, %v; want in flight (the test's lock is not the Store's)", got.State, err)
				}
				// At once, so that a grouped Store carries them in one statement.
				var wg sync.WaitGroup
				errs := make([]error, 4)
				for i, c := range []struct{ key, token string }{{own, "own"}, {other, "mine"}, {lapsed, "lapsed"}, {none, "mine"}} {
					wg.Go(func() { errs[i] = r.Remember(h2Token(c.token), c.key, 7, v.value) })
				}
				wg.Wait()
				if errs[0] != nil {
					t.Errorf("the holder's Remember over its own live claim, the key's lock held by a session claimer passing through: %v; want it written", errs[0])
				} else if got, err := r.Lookup(ctx, own); err != nil || got.State != stores.StateRemembered || got.Fingerprint != 7 || string(got.Value) != string(v.value) {
					t.Errorf("the holder's record = %+v, %v; want remembered, fingerprint 7, value %q", got, err, v.value)
				}
				for i, k := range []string{"another holder's live claim", "its own lapsed claim", "no claim row"} {
					if !errors.Is(errs[i+1], stores.ErrClaimTaken) {
						t.Errorf("a Remember over %s, the key's lock held: %v; want ErrClaimTaken", k, errs[i+1])
					}
				}
				var rows int
				if err := db.QueryRowContext(ctx, `SELECT count(*) FROM `+a.Table()+` WHERE claim IS NULL`).Scan(&rows); err != nil {
					t.Fatal(err)
				}
				if errs[0] == nil && rows != 1 {
					t.Errorf("%d records in the table; want the holder's alone", rows)
				}
				release()
				// The locks given back: the lapsed holder and the Remember
				// without a claim write (nobody holds those keys), the other
				// holder's live claim still refuses.
				if err := r.Remember(h2Token("lapsed"), lapsed, 7, v.value); err != nil {
					t.Errorf("the lapsed holder's Remember, nobody holding the key: %v; want it written", err)
				}
				if err := r.Remember(h2Token("mine"), none, 7, v.value); err != nil {
					t.Errorf("a Remember without a claim, nobody holding the key: %v; want it written", err)
				}
				if err := r.Remember(h2Token("mine"), other, 7, v.value); !errors.Is(err, stores.ErrClaimTaken) {
					t.Errorf("a Remember over another holder's live claim: %v; want ErrClaimTaken", err)
				}
			})
		}
	}
}

// Session claimers on three workers hammer the keys a worker with claims
// of rows holds (each Claim takes the key's lock for its round trip, finds
// the live claim row and gives the lock back) while the holder records
// them, grouped and not, with and without a value: no record of the
// holder is refused, no session claim is taken before the record, and
// every claim after it finds the record.
func TestMixedAttackSessionClaimersHammerARowsHoldersKeys(t *testing.T) {
	t.Parallel()
	n := 40
	if testing.Short() {
		n = 10
	}
	for _, d := range maDrivers {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			a := newStore(t, h2Pool(t))
			hammers := []*postgresstore.Store{a, h2Worker(t, a.Table()), h2Worker(t, a.Table(), postgresstore.WithoutGrouping())}
			grouped := newStoreOnTable(t, h2DriverPool(t, d.driver), a.Table(), d.opts...)
			ungrouped := newStoreOnTable(t, h2DriverPool(t, d.driver), a.Table(), append(append([]postgresstore.Option{}, d.opts...), postgresstore.WithoutGrouping())...)
			tag := testenv.RandomHex(4)
			var refused, attempts atomic.Int32
			var mu sync.Mutex
			var problems []string
			for i := range n {
				key := fmt.Sprintf("k%d-%s", i, tag)
				r := grouped
				if i%2 == 1 {
					r = ungrouped
				}
				var value []byte
				if i%3 == 0 {
					value = []byte("v-" + key)
				}
				holder := h2Token("holder-" + key)
				if claimed, _, err := r.Claim(holder, key, time.Minute); err != nil || !claimed {
					t.Fatalf("the rows holder's Claim(%s) = %v, %v", key, claimed, err)
				}
				stop := make(chan struct{})
				var recorded atomic.Bool
				var wg sync.WaitGroup
				var before atomic.Int32
				for h, s := range hammers {
					wg.Go(func() {
						token := h2Token(fmt.Sprintf("hammer-%d", h))
						for {
							select {
							case <-stop:
								return
							default:
							}
							after := recorded.Load()
							claimed, found, err := s.Claim(token, key, 5*time.Second)
							attempts.Add(1)
							if !after {
								before.Add(1)
							}
							mu.Lock()
							switch {
							case err != nil:
								problems = append(problems, fmt.Sprintf("%s: hammer %d's Claim: %v", key, h, err))
							case claimed:
								problems = append(problems, fmt.Sprintf("%s: hammer %d took a session claim (record written before: %v, found %v)", key, h, after, found.State))
								_ = s.Release(token, key)
							case after && found.State != stores.StateRemembered && found.State != stores.StateInFlight:
								// In flight is a sibling hammer holding the key's
								// lock for its own round trip: the caller parks.
								problems = append(problems, fmt.Sprintf("%s: hammer %d's Claim after the record found %v", key, h, found.State))
							}
							mu.Unlock()
						}
					})
				}
				waitCond(t, "the hammers under way", 10*time.Second, func() bool { return before.Load() >= 6 })
				err := r.Remember(holder, key, uint64(i+1), value)
				if err != nil {
					refused.Add(1)
					mu.Lock()
					problems = append(problems, fmt.Sprintf("%s: the holder's Remember over its own live claim (grouped %v, value %v): %v", key, r == grouped, value != nil, err))
					mu.Unlock()
				} else {
					recorded.Store(true)
				}
				close(stop)
				wg.Wait()
				if err == nil {
					if claimed, found, err := hammers[0].Claim(h2Token("after-"+key), key, time.Minute); err != nil || claimed || found.State != stores.StateRemembered {
						t.Errorf("%s: a Claim once the hammers stopped = %v, %v, %v; want the record found", key, claimed, found.State, err)
					}
					if got, err := hammers[1].Lookup(ctx, key); err != nil || got.State != stores.StateRemembered || got.Fingerprint != uint64(i+1) || string(got.Value) != string(value) {
						t.Errorf("%s: the record = %+v, %v", key, got, err)
					}
				}
			}
			t.Logf("%d keys, %d hammer claims, %d records refused", n, attempts.Load(), refused.Load())
			for _, p := range problems {
				t.Error(p)
			}
		})
	}
}

// WithTable accepts a schema-qualified name ("public.t") as well as the
// bare one: two workers of a fleet naming the same table the two ways are
// on one table. A session claim made through one name must be seen by a
// worker with claims of rows that names it the other way (its Lookup says
// in flight, its Remember without a claim is refused, its Claim is
// refused) and by another session worker naming it so (its Claim is
// refused).
func TestMixedAttackSchemaQualifiedNameOfTheSameTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	a := newStore(t, h2Pool(t))
	var schema string
	if err := h2Pool(t).QueryRowContext(ctx, `SELECT table_schema FROM information_schema.tables WHERE table_name = $1`, a.Table()).Scan(&schema); err != nil {
		t.Fatal(err)
	}
	if schema != "public" {
		t.Skipf("the table is in schema %q: only a table of the public schema is one table under both names (another schema is named with it by every worker)", schema)
	}
	r := h2Worker(t, schema+"."+a.Table(), postgresstore.WithRowClaims())
	other := h2Worker(t, schema+"."+a.Table())
	key := "k-" + testenv.RandomHex(4)
	session := h2Token("session")
	if claimed, _, err := a.Claim(session, key, time.Minute); err != nil || !claimed {
		t.Fatalf("the session worker's Claim = %v, %v", claimed, err)
	}
	t.Cleanup(func() { _ = a.Release(session, key) })
	if claimed, _, err := other.Claim(h2Token("other-session"), key, time.Minute); err != nil || claimed {
		t.Errorf("a session worker on %s.%s: Claim of a key a session claim holds (through %s) = %v, %v; want refused (two runs at once)",
			schema, a.Table(), a.Table(), claimed, err)
		_ = other.Release(h2Token("other-session"), key)
	}
	if got, err := r.Lookup(ctx, key); err != nil || got.State != stores.StateInFlight {
		t.Errorf("the rows worker on %s.%s: Lookup of a key a session claim holds (through %s) = %v, %v; want in flight",
			schema, a.Table(), a.Table(), got.State, err)
	}
	if claimed, _, err := r.Claim(h2Token("rows"), key, time.Minute); err != nil || claimed {
		t.Errorf("the rows worker on %s.%s: Claim of a key a session claim holds = %v, %v; want refused", schema, a.Table(), claimed, err)
		_ = r.Release(h2Token("rows"), key)
	}
	if err := r.Remember(h2Token("seen"), key, 1, nil); !errors.Is(err, stores.ErrClaimTaken) {
		t.Errorf("the rows worker on %s.%s: Remember without a claim of a key a session claim holds = %v; want ErrClaimTaken (a record under the session's live claim)",
			schema, a.Table(), err)
	}
}
