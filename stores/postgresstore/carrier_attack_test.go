package postgresstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// The hostile tests of the grouped statements' carrier: the goroutine that
// runs a statement goes on with the callers queued meanwhile. Every caller
// keeps its own deadline and its own answer, and what the carrier does for
// a caller that gave up holds nobody else back.

// caProxiedStore returns a migrated store made with opts on a table of its
// own, on a pool of driver whose replies come 3ms late (db), with a pool
// straight to the server (direct, which drops the table when the test
// ends), and the goroutines running before the store was made (for
// goleak).
func caProxiedStore(t *testing.T, driver string, opts ...postgresstore.Option) (s *postgresstore.Store, direct, db *sql.DB, ignore goleak.Option) {
	t.Helper()
	direct = h2DriverPool(t, driver)
	db = caProxied(t, driver, 3*time.Millisecond)
	ignore = goleak.IgnoreCurrent()
	s, err := postgresstore.New(db, append([]postgresstore.Option{postgresstore.WithTable("idem_test_" + testenv.RandomHex(4))}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = direct.Exec(`DROP TABLE IF EXISTS ` + s.Table()) })
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return s, direct, db, ignore
}

// caLockWaiters counts the statements on table whose text holds needle and
// that wait for a lock at the server.
func caLockWaiters(t *testing.T, db *sql.DB, table, needle string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM pg_stat_activity
		WHERE wait_event_type = 'Lock' AND position($1 in query) > 0 AND position($2 in query) > 0 AND pid <> pg_backend_pid()`,
		table, needle).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// caProxied opens a pool of driver ("pgx" or lib/pq's "postgres") to
// PostgreSQL through a fault proxy whose every reply waits delay.
func caProxied(t *testing.T, driver string, delay time.Duration) *sql.DB {
	t.Helper()
	dsn, proxy := testenv.PostgresProxyDSN(t)
	proxy.Delay.Store(int64(delay))
	db, err := sql.Open(driver, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	db.SetMaxOpenConns(4)
	return db
}

// caLoad runs workers goroutines of rounds calls each on s, every call
// under a deadline of its own drawn from 1 to 20ms: claims (of keys of
// their own and of keys they share, a claim won renewed under a short
// deadline and released), Remembers of keys of their own, and Lookups.
// It fails t for a call that returned long after its deadline, or (strict)
// with an error other than its context's, and returns the keys claimed and
// the keys remembered (whose Remember returned nil).
func caLoad(t *testing.T, s *postgresstore.Store, prefix string, workers, rounds int, strict bool, calls *atomic.Int64) (claimKeys, remembered []string) {
	t.Helper()
	const slack = 2 * time.Second // a loaded machine's scheduling under -race (540ms seen, every call at once); a caller held back by a statement or an undo waits out the 5s query timeout
	var mu sync.Mutex
	var worst time.Duration
	var ok, gaveUp int
	var wg sync.WaitGroup
	check := func(what string, d time.Duration, start time.Time, err error) {
		took := time.Since(start)
		mu.Lock()
		worst = max(worst, took-d)
		if err == nil {
			ok++
		} else {
			gaveUp++
		}
		mu.Unlock()
		if took > d+slack {
			t.Errorf("%s under a %v deadline took %v", what, d, took)
		}
		if strict && err != nil && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
			t.Errorf("%s: %v; want its result or its context's error", what, err)
		}
	}
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for i := range rounds {
				d := time.Duration(1+rng.IntN(20)) * time.Millisecond
				holder := fmt.Sprintf("%s-h%d-%d", prefix, w, i)
				ctx, cancel := context.WithTimeout(h2Token(holder), d)
				start := time.Now()
				switch rng.IntN(4) {
				case 0, 1:
					key := fmt.Sprintf("%s-own-%d-%d", prefix, w, i)
					if rng.IntN(2) == 0 {
						key = fmt.Sprintf("%s-shared-%d", prefix, i%8)
					}
					mu.Lock()
					claimKeys = append(claimKeys, key)
					mu.Unlock()
					claimed, _, err := s.Claim(ctx, key, time.Minute)
					check("claim "+key, d, start, err)
					if claimed {
						ectx, ecancel := context.WithTimeout(h2Token(holder), d)
						estart := time.Now()
						_, err := s.Extend(ectx, key, time.Minute)
						ecancel()
						check("extend "+key, d, estart, err)
						if err := s.Release(h2Token(holder), key); err != nil && strict {
							t.Errorf("release %s: %v", key, err)
						}
					}
				case 2:
					key := fmt.Sprintf("%s-rem-%d-%d", prefix, w, i)
					err := s.Remember(ctx, key, uint64(1+i), nil)
					check("remember "+key, d, start, err)
					if err == nil {
						mu.Lock()
						remembered = append(remembered, key)
						mu.Unlock()
					}
				case 3:
					key := fmt.Sprintf("%s-rem-%d-%d", prefix, w, max(i-1, 0))
					_, err := s.Lookup(ctx, key)
					check("lookup "+key, d, start, err)
				}
				cancel()
				calls.Add(1)
			}
		})
	}
	wg.Wait()
	t.Logf("%d workers × %d calls: %d answered, %d gave up; the latest return came %v after its deadline", workers, rounds, ok, gaveUp, worst.Round(time.Millisecond))
	return claimKeys, remembered
}

// caAllFree fails t unless every key of keys is claimed by other (another
// worker on the same table) within a few seconds: no claim of a caller
// that gave up, nor its session lock, was left behind.
func caAllFree(t *testing.T, other *postgresstore.Store, keys []string) {
	t.Helper()
	seen := map[string]bool{}
	for _, k := range keys {
		if seen[k] {
			continue
		}
		seen[k] = true
		var claimed bool
		var found stores.Record
		var err error
		deadline := time.Now().Add(10 * time.Second)
		for {
			claimed, found, err = other.Claim(h2Token("the-other"), k, time.Minute)
			if (err == nil && claimed) || time.Now().After(deadline) {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		if err != nil || !claimed {
			t.Errorf("key %s not free for another worker after the load: %v, %v (%+v)", k, claimed, err, found.State)
			continue
		}
		_ = other.Release(h2Token("the-other"), k)
	}
}

// caRemembered fails t unless every key of keys reads remembered on s.
func caRemembered(t *testing.T, s *postgresstore.Store, keys []string) {
	t.Helper()
	for _, k := range keys {
		r, err := s.Lookup(context.Background(), k)
		if err != nil || r.State != stores.StateRemembered {
			t.Errorf("key %s, its Remember returned nil: Lookup %v, %v; want remembered", k, r.State, err)
		}
	}
}

// Many callers with deadlines of 1 to 20ms against a store whose every
// reply takes 3ms (a proxy): each returns by its deadline, with its answer
// or its context's error; no claim given up is left behind (another
// worker claims every key); every record reported written is there; and
// no goroutine outlives Close.
func TestCarrierAttackRandomDeadlines(t *testing.T) {
	if testing.Short() {
		t.Skip("a load of a few seconds")
	}
	for _, c := range []struct {
		name   string
		driver string
		opts   []postgresstore.Option
	}{
		{"session claims", "pgx", []postgresstore.Option{postgresstore.WithSessionClaims()}},
		{"session claims, pause", "pgx", []postgresstore.Option{postgresstore.WithSessionClaims(), postgresstore.WithGroupPause(2 * time.Millisecond)}},
		{"rows claims", "pgx", []postgresstore.Option{postgresstore.WithRowClaims()}},
		{"rows claims, 2 in flight", "pgx", []postgresstore.Option{postgresstore.WithRowClaims(), postgresstore.WithStatementsInFlight(2)}},
		{"lib/pq", "postgres", nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, direct, db, ignore := caProxiedStore(t, c.driver, c.opts...)
			var otherOpts []postgresstore.Option
			if c.driver == "pgx" {
				otherOpts = []postgresstore.Option{postgresstore.WithRowClaims()}
			}
			other := newStoreOnTable(t, direct, s.Table(), otherOpts...)
			claimKeys, remembered := caLoad(t, s, "load", 48, 40, true, new(atomic.Int64))
			caAllFree(t, other, claimKeys)
			caRemembered(t, other, remembered)
			if err := s.Close(); err != nil {
				t.Fatal(err)
			}
			if err := db.Close(); err != nil {
				t.Fatal(err)
			}
			goleak.VerifyNone(t, ignore)
		})
	}
}

// caSessionPlug holds the only slot of s's session round trips: a
// Remember of a key of its own whose row another transaction (on side)
// holds locked. It returns release, which lets that round trip end, and
// the channel that gets the Remember's error. With gone, the Remember's
// caller gives up after it (its round trip, detached, runs on): a pause
// of the session's round trips then lasts only that long for it.
func caSessionPlug(t *testing.T, s *postgresstore.Store, side *sql.DB, name string, gone time.Duration) (release func(), done <-chan error) {
	t.Helper()
	return caPlugClaim(t, s, side, name)(gone)
}

// caPlugClaim takes the claim of caSessionPlug's key, and returns what
// plugs the session's round trips with it (caSessionPlug), so that the
// claim can be taken before the test sets a long pause.
func caPlugClaim(t *testing.T, s *postgresstore.Store, side *sql.DB, name string) func(gone time.Duration) (release func(), done <-chan error) {
	t.Helper()
	key := "plug-" + name
	// An expired record: the claim takes it over, and its row is there to lock.
	if _, err := side.Exec(`INSERT INTO `+s.Table()+` (key, expires_at, fingerprint) VALUES ($1, 1, 5)`, postgresstore.RowKey(key)); err != nil {
		t.Fatal(err)
	}
	hz := h2Token("plug-holder-" + name)
	if claimed, found, err := s.Claim(hz, key, time.Minute); err != nil || !claimed {
		t.Fatalf("the plug's claim: %v, %v (%+v)", claimed, err, found)
	}
	return func(gone time.Duration) (release func(), done <-chan error) {
		t.Helper()
		release, _ = holdLockedUntilReleased(t, side, s.Table(), postgresstore.RowKey(key))
		ch := make(chan error, 1)
		go func() {
			ctx := context.Context(hz)
			if gone > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, gone)
				defer cancel()
				if err := s.Remember(ctx, key, 6, nil); !errors.Is(err, context.DeadlineExceeded) {
					ch <- fmt.Errorf("the plug's caller: %v; want it gone", err)
					return
				}
				ch <- nil
				return
			}
			ch <- s.Remember(ctx, key, 6, nil)
		}()
		waitCond(t, "the plug's round trip waiting for the row", 10*time.Second, func() bool { return caLockWaiters(t, side, s.Table(), "INSERT") >= 1 })
		return release, ch
	}
}

// Two records of one key carried in one round trip (the first without a
// value, in the grouped statement; the second with one, after it; or both
// with values) are written in the order they came, as if one ran after the
// other, and both callers get their answer: the key keeps the second.
func TestCarrierAttackTwoRecordsOfOneKeyInOneRoundTrip(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name          string
		first, second []byte
	}{
		{"plain then value", nil, []byte("second")},
		{"value then plain", []byte("first"), nil},
		{"value then value", []byte("first"), []byte("second")},
	} {
		t.Run(c.name, func(t *testing.T) {
			side := h2Pool(t)
			s := newStore(t, h2Pool(t), postgresstore.WithSessionClaims())
			h := h2Token("holder")
			// Other keys, claimed and remembered in the same round trip,
			// whose locks sort around the key's.
			var others []string
			for i := range 6 {
				k := fmt.Sprintf("other-%d", i)
				if claimed, _, err := s.Claim(h2Token(k), k, time.Minute); err != nil || !claimed {
					t.Fatalf("claim %s: %v, %v", k, claimed, err)
				}
				others = append(others, k)
			}
			if claimed, _, err := s.Claim(h, "key", time.Minute); err != nil || !claimed {
				t.Fatalf("claim: %v, %v", claimed, err)
			}
			release, plugDone := caSessionPlug(t, s, side, "two", 0)
			errs := make([]chan error, 2)
			for i, value := range [][]byte{c.first, c.second} {
				errs[i] = make(chan error, 1)
				go func() { errs[i] <- s.Remember(h, "key", uint64(100+i), value) }()
				waitCond(t, "the record queued", 10*time.Second, func() bool { return s.GroupQueued("session") == i+1 })
			}
			oerrs := make(chan error, len(others))
			for i, k := range others {
				go func() { oerrs <- s.Remember(h2Token(k), k, 7, []byte(k)) }()
				waitCond(t, "the other record queued", 10*time.Second, func() bool { return s.GroupQueued("session") == 3+i })
			}
			release()
			if err := <-plugDone; err != nil {
				t.Errorf("the plug's Remember: %v", err)
			}
			for i := range errs {
				select {
				case err := <-errs[i]:
					if err != nil {
						t.Errorf("record %d of the key: %v; want written", i+1, err)
					}
				case <-time.After(10 * time.Second):
					t.Fatalf("record %d of the key not settled", i+1)
				}
			}
			for range others {
				if err := <-oerrs; err != nil {
					t.Errorf("another key's record: %v", err)
				}
			}
			r, err := s.Lookup(context.Background(), "key")
			if err != nil || r.State != stores.StateRemembered || r.Fingerprint != 101 || string(r.Value) != string(c.second) {
				t.Errorf("the key keeps %v fingerprint %d value %q (%v); want the second record's: fingerprint 101, value %q", r.State, r.Fingerprint, r.Value, err, c.second)
			}
			for _, k := range others {
				if r, err := s.Lookup(context.Background(), k); err != nil || string(r.Value) != k {
					t.Errorf("%s keeps %q (%v)", k, r.Value, err)
				}
			}
		})
	}
}

// A carrier's next statement led by a caller whose context is already
// done takes no pause: the callers queued behind it get their answers at
// once, not after the pause (10s here). A renewal queued behind a leader
// that pauses, before or during its pause, ends the pause.
func TestCarrierAttackPauseOfTheNextLeader(t *testing.T) {
	t.Parallel()
	setup := func(t *testing.T, name string) (*postgresstore.Store, func(time.Duration) (func(), <-chan error), []string, []context.Context) {
		side := h2Pool(t)
		s := pauseStore(t, longPause)
		plug := caPlugClaim(t, s, side, name)
		keys, holders := holdClaims(t, s, "held", postgresstore.PauseSiblings+4, time.Minute)
		s.SetGroupPause(hugePause)
		return s, plug, keys, holders
	}
	const limit = 2 * time.Second // far under hugePause

	t.Run("leader gone", func(t *testing.T) {
		s, plug, keys, holders := setup(t, "gone")
		release, plugDone := plug(300 * time.Millisecond)
		lctx, giveUp := context.WithCancel(h2Token("leader"))
		lDone := make(chan error, 1)
		go func() {
			_, _, err := s.Claim(lctx, "leader-key", time.Minute)
			lDone <- err
		}()
		waitCond(t, "the leader queued", 10*time.Second, func() bool { return s.GroupQueued("session") == 1 })
		mDone := make(chan error, 1)
		go func() { mDone <- s.Remember(holders[0], keys[0], 1, nil) }()
		waitCond(t, "the follower queued", 10*time.Second, func() bool { return s.GroupQueued("session") == 2 })
		giveUp()
		if err := <-lDone; !errors.Is(err, context.Canceled) {
			t.Fatalf("the leader gave up: %v", err)
		}
		within(t, "the follower of a leader gone, its round trip freed", limit, func() {
			release()
			<-plugDone
			if err := <-mDone; err != nil {
				t.Errorf("the follower's Remember: %v", err)
			}
		})
		waitCond(t, "the gone leader's claim undone", 10*time.Second, func() bool {
			claimed, _, err := h2Worker(t, s.Table()).Claim(h2Token("x"), "leader-key", time.Minute)
			return err == nil && claimed
		})
	})

	for _, when := range []string{"queued before the pause", "queued during the pause"} {
		t.Run("renewal "+when, func(t *testing.T) {
			s, plug, keys, holders := setup(t, "renew")
			release, plugDone := plug(300 * time.Millisecond)
			lDone := make(chan error, 1)
			go func() { lDone <- s.Remember(holders[0], keys[0], 1, nil) }() // no deadline: pauses the whole hugePause
			waitCond(t, "the leader queued", 10*time.Second, func() bool { return s.GroupQueued("session") == 1 })
			uDone := make(chan error, 1)
			renew := func() {
				held, err := s.Extend(holders[1], keys[1], time.Minute)
				if err == nil && !held {
					err = errors.New("not held")
				}
				uDone <- err
			}
			if when == "queued before the pause" {
				go renew()
				waitCond(t, "the renewal queued", 10*time.Second, func() bool { return s.GroupQueued("session") == 2 })
				within(t, "a renewal queued behind the next leader", limit, func() {
					release()
					<-plugDone
					if err := <-uDone; err != nil {
						t.Errorf("renewal: %v", err)
					}
				})
			} else {
				release()
				<-plugDone
				// The leader is taken off the queue, and pauses.
				waitCond(t, "the leader pausing", 10*time.Second, func() bool { return s.GroupQueued("session") == 0 })
				within(t, "a renewal queued during the next leader's pause", limit, func() {
					go renew()
					if err := <-uDone; err != nil {
						t.Errorf("renewal: %v", err)
					}
				})
			}
			if err := <-lDone; err != nil {
				t.Errorf("the leader's Remember: %v", err)
			}
		})
	}
}

// Claims of many holders carried in one statement each belong to their
// own holder: a statement runs under its leader's context, but no holder's
// token stands for another's (the rows claims' and the session's groups).
func TestCarrierAttackHoldersApartInOneStatement(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		opts []postgresstore.Option
	}{
		{"session claims", []postgresstore.Option{postgresstore.WithSessionClaims()}},
		{"rows claims", []postgresstore.Option{postgresstore.WithRowClaims()}},
	} {
		t.Run(c.name, func(t *testing.T) {
			side := h2Pool(t)
			s := newStore(t, h2Pool(t), c.opts...)
			var release func()
			var plugDone <-chan error
			kind := "claims"
			if c.name == "session claims" {
				kind = "session"
				release, plugDone = caSessionPlug(t, s, side, "holders", 0)
			} else {
				r, _ := holdUncommittedUntilReleased(t, side, s.Table(), postgresstore.RowKey("plug"))
				ch := make(chan error, 1)
				go func() {
					_, _, err := s.Claim(h2Token("plug"), "plug", time.Minute)
					ch <- err
				}()
				waitCond(t, "the plug waiting", 10*time.Second, func() bool { return caLockWaiters(t, side, s.Table(), "INSERT") >= 1 })
				release, plugDone = r, ch
			}
			const n = 12
			type res struct {
				claimed bool
				err     error
			}
			done := make([]chan res, n)
			for i := range n {
				done[i] = make(chan res, 1)
				go func() {
					claimed, _, err := s.Claim(h2Token(fmt.Sprintf("holder-%d", i)), fmt.Sprintf("key-%d", i), time.Minute)
					done[i] <- res{claimed, err}
				}()
				waitCond(t, "the claim queued", 10*time.Second, func() bool { return s.GroupQueued(kind) == i+1 })
			}
			release()
			if err := <-plugDone; err != nil {
				t.Fatalf("the plug: %v", err)
			}
			for i := range n {
				if r := <-done[i]; r.err != nil || !r.claimed {
					t.Fatalf("claim %d: %v, %v", i, r.claimed, r.err)
				}
			}
			for i := range n {
				key := fmt.Sprintf("key-%d", i)
				if held, err := s.Extend(h2Token(fmt.Sprintf("holder-%d", i)), key, time.Minute); err != nil || !held {
					t.Errorf("%s: Extend by its holder: %v, %v; want held", key, held, err)
				}
				wrong := h2Token(fmt.Sprintf("holder-%d", (i+1)%n))
				if held, err := s.Extend(wrong, key, time.Minute); err != nil || held {
					t.Errorf("%s: Extend by another holder of the statement: %v, %v; want not held", key, held, err)
				}
				if err := s.Remember(wrong, key, 1, nil); !errors.Is(err, stores.ErrClaimTaken) {
					t.Errorf("%s: Remember by another holder of the statement: %v; want ErrClaimTaken", key, err)
				}
			}
		})
	}
}

// Close while many callers with deadlines of 1 to 20ms come and go, the
// store's replies slow (3ms): every call returns by its deadline, no claim
// of a caller that gave up is left (another worker claims every key), and
// no goroutine outlives the last Close. (Claims of rows: with session
// claims, a claim queued before Close whose caller gave up is carried
// after it on a session opened anew, which stays open.)
func TestCarrierAttackCloseDuringLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("a load of a few seconds")
	}
	for _, c := range []struct {
		name string
		opts []postgresstore.Option
	}{
		{"rows claims", []postgresstore.Option{postgresstore.WithRowClaims()}},
		{"rows claims, 2 in flight", []postgresstore.Option{postgresstore.WithRowClaims(), postgresstore.WithStatementsInFlight(2)}},
		{"session claims", []postgresstore.Option{postgresstore.WithSessionClaims(), postgresstore.WithGroupPause(2 * time.Millisecond)}},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, direct, db, ignore := caProxiedStore(t, "pgx", c.opts...)
			other := newStoreOnTable(t, direct, s.Table(), postgresstore.WithRowClaims())
			var calls atomic.Int64
			closed := make(chan error, 1)
			go func() {
				deadline := time.Now().Add(20 * time.Second)
				for calls.Load() < 48*40/3 && time.Now().Before(deadline) {
					time.Sleep(time.Millisecond)
				}
				t.Logf("Close after %d calls", calls.Load())
				closed <- s.Close()
			}()
			claimKeys, _ := caLoad(t, s, "close", 48, 40, false, &calls)
			if err := <-closed; err != nil {
				t.Fatal(err)
			}
			// The calls made after Close used the Store again (a session
			// claim opens a new session): closed once more when every caller
			// returned. The calls whose callers gave up, still carried, open
			// none after it.
			if err := s.Close(); err != nil {
				t.Fatal(err)
			}
			caAllFree(t, other, claimKeys)
			if err := db.Close(); err != nil {
				t.Fatal(err)
			}
			goleak.VerifyNone(t, ignore)
		})
	}
}

// caOrderedKeys returns two keys, first and second, whose rows sort first
// before second (a grouped claim inserts its rows in that order).
func caOrderedKeys(prefix string) (first, second string) {
	for i := 0; ; i++ {
		a, b := fmt.Sprintf("%s-a%d", prefix, i), fmt.Sprintf("%s-b%d", prefix, i)
		if postgresstore.RowKey(a) < postgresstore.RowKey(b) {
			return a, b
		}
	}
}

// A caller gives up while its claim is carried with another's; the
// carrier's release of the abandoned claim then waits (another
// transaction holds its row). A caller queued meanwhile, whose deadline is
// generous, is claimed within it: the release runs beside the next
// statement, not before it. (Once the carrier went on with the queue
// itself, it ran every release before leading the next statement, and the
// queued caller failed on its deadline.)
func TestCarrierAttackUndoDoesNotHoldTheNextStatement(t *testing.T) {
	t.Parallel()
	db := h2Pool(t)
	s := newStore(t, db, postgresstore.WithRowClaims())
	table := s.Table()
	side := h2Pool(t)
	side.SetMaxOpenConns(5)
	other := h2Worker(t, table, postgresstore.WithRowClaims())
	k, j := caOrderedKeys("undo")
	plug := "plug"
	releasePlug, _ := holdUncommittedUntilReleased(t, side, table, postgresstore.RowKey(plug))
	releaseJ, _ := holdUncommittedUntilReleased(t, side, table, postgresstore.RowKey(j))
	plugDone := make(chan error, 1)
	go func() { _, _, err := s.Claim(h2Token("plug"), plug, time.Minute); plugDone <- err }()
	waitCond(t, "the plug's claim waiting at the server", 10*time.Second, func() bool { return caLockWaiters(t, side, table, "INSERT") >= 1 })
	actx, giveUp := context.WithCancel(h2Token("a"))
	defer giveUp()
	aDone, cDone := make(chan error, 1), make(chan error, 1)
	go func() { _, _, err := s.Claim(actx, k, time.Minute); aDone <- err }()
	waitCond(t, "A queued", 10*time.Second, func() bool { return s.GroupQueued("claims") == 1 })
	var cClaimed bool
	go func() {
		var err error
		cClaimed, _, err = s.Claim(h2Token("c"), j, time.Minute)
		cDone <- err
	}()
	waitCond(t, "C queued", 10*time.Second, func() bool { return s.GroupQueued("claims") == 2 })
	releasePlug()
	if err := <-plugDone; err != nil {
		t.Fatalf("the plug's claim: %v", err)
	}
	waitCond(t, "the grouped claim waiting at the server", 10*time.Second, func() bool { return caLockWaiters(t, side, table, "unnest") >= 1 })
	giveUp()
	if err := <-aDone; !errors.Is(err, context.Canceled) {
		t.Fatalf("A gave up: %v; want its context's error", err)
	}
	tx, err := side.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	yDone := make(chan error, 1)
	go func() {
		_, err := tx.Exec(`INSERT INTO `+table+` AS r (key, expires_at, claim) VALUES ($1, NULL, 'y')
			ON CONFLICT (key) DO UPDATE SET claim = r.claim`, postgresstore.RowKey(k))
		yDone <- err
	}()
	waitCond(t, "the row holder waiting for A's row", 10*time.Second, func() bool {
		return caLockWaiters(t, side, table, "DO UPDATE SET claim = r.claim") >= 1
	})
	const deadline = 2 * time.Second
	bctx, cancel := context.WithTimeout(h2Token("b"), deadline)
	defer cancel()
	type result struct {
		claimed bool
		err     error
		took    time.Duration
	}
	bDone := make(chan result, 1)
	go func() {
		start := time.Now()
		claimed, _, err := s.Claim(bctx, "b-key", time.Minute)
		bDone <- result{claimed, err, time.Since(start)}
	}()
	waitCond(t, "B queued", 10*time.Second, func() bool { return s.GroupQueued("claims") == 1 })
	releaseJ()
	if err := <-cDone; err != nil || !cClaimed {
		t.Errorf("C's claim: %v, %v; want claimed", cClaimed, err)
	}
	if err := <-yDone; err != nil {
		t.Fatalf("the row holder: %v", err)
	}
	b := <-bDone
	if b.err != nil || !b.claimed {
		t.Errorf("B's claim of a free key, queued while another caller's claim was being undone: %v, %v after %v; want claimed within its %v deadline "+
			"(the carrier released the abandoned claim before it led the next statement)", b.claimed, b.err, b.took.Round(time.Millisecond), deadline)
	}
	_ = tx.Rollback()
	waitCond(t, "A's key claimed by another worker", 10*time.Second, func() bool {
		claimed, _, err := other.Claim(h2Token("other"), k, time.Minute)
		return err == nil && claimed
	})
}
