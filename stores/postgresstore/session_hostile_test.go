package postgresstore_test

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// backendsAlive returns those of pids whose server process still runs.
func backendsAlive(t *testing.T, db *sql.DB, pids []int32) []int32 {
	t.Helper()
	ints := make([]int64, len(pids))
	for i, p := range pids {
		ints[i] = int64(p)
	}
	return testenv.Column[int32](context.Background(), t, db, `SELECT pid FROM pg_stat_activity WHERE pid = ANY($1::int8[])`, ints)
}

// Many Stores in one process, never closed: each one's session, whatever
// opened it (Migrate at start-up, a Remember without a claim, a claim),
// is ended by the server once it held no claim for the idle time, so the
// connection count comes back down.
func TestHostileUnclosedStoresGiveTheirSessionsUp(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out the sessions' idle time")
	}
	db := testenv.Postgres(t)
	table := "idem_test_" + testenv.RandomHex(4)
	t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), `DROP TABLE IF EXISTS `+table) })
	const n = 18 // three ways of opening the session, six Stores each (max_connections is shared with other tests)
	pids := make([]int32, 0, n)
	for i := range n {
		s, err := postgresstore.New(testenv.Postgres(t), postgresstore.WithTable(table))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Close() })
		s.SetSessionIdle(time.Second)
		ctx := stores.WithClaimToken(context.Background(), fmt.Sprint("unclosed-", i))
		if err := s.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		key := fmt.Sprintf("unclosed-%d-%s", i, testenv.RandomHex(4))
		switch i % 3 {
		case 1: // a record without a claim (a Store used to record only)
			if err := s.Remember(ctx, key, 0, nil); err != nil {
				t.Fatal(err)
			}
		case 2: // a delivery
			if claimed, _, err := s.Claim(ctx, key, 500*time.Millisecond); err != nil || !claimed {
				t.Fatalf("Claim = %v, %v", claimed, err)
			}
			if err := s.Remember(ctx, key, 0, nil); err != nil {
				t.Fatal(err)
			}
		}
		pid := s.SessionPID()
		if pid == 0 {
			t.Fatalf("Store %d has no session after its calls", i)
		}
		pids = append(pids, pid)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		alive := backendsAlive(t, db, pids)
		if len(alive) == 0 {
			return
		}
		if time.Now().After(deadline) {
			var how []string
			for i, p := range pids {
				for _, a := range alive {
					if a == p {
						how = append(how, [...]string{"Migrate only", "Remember without a claim", "Claim+Remember"}[i%3])
					}
				}
			}
			t.Fatalf("%d of %d sessions of unclosed Stores still open 20s after their last call (idle time 1s): opened by %v", len(alive), n, how)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// A claim that comes once the session held nothing for more than half of
// its idle time opens a new session rather than race the server's timeout
// (a statement that reaches the server as the timeout fires can be cut by
// it after it ran): the claim's own reservation must not count as a claim
// the session holds.
func TestHostileLateClaimStartsAfresh(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	s := newStore(t, db)
	s.SetSessionIdle(time.Second)
	for i := range 3 {
		ctx := stores.WithClaimToken(context.Background(), fmt.Sprint("afresh-", i))
		key := fmt.Sprintf("afresh-%d-%s", i, testenv.RandomHex(4))
		if claimed, _, err := s.Claim(ctx, key, time.Second); err != nil || !claimed {
			t.Fatalf("Claim = %v, %v", claimed, err)
		}
		if err := s.Remember(ctx, key, 0, nil); err != nil {
			t.Fatal(err)
		}
		before := s.SessionPID()
		time.Sleep(700 * time.Millisecond) // the state under test: more than half the idle time (1s), less than all of it
		key2 := key + "-late"
		if claimed, _, err := s.Claim(ctx, key2, time.Second); err != nil || !claimed {
			t.Fatalf("late Claim = %v, %v", claimed, err)
		}
		after := s.SessionPID()
		if err := s.Remember(ctx, key2, 0, nil); err != nil {
			t.Fatal(err)
		}
		if after == before {
			t.Fatalf("a claim 700ms into the session's idle time of 1s ran on the same session (pid %d): it races the server's idle timeout", after)
		}
	}
}

// A claim renewed for a longer lease than it was taken with is held that
// long: the session's idle timeout (the lease of the claims it holds)
// must not end the session, and with it the claim, while Extend keeps
// saying it is held.
func TestHostileExtendForALongerLease(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out the claim's first lease")
	}
	t.Parallel()
	a, b := sessionPair(t)
	db := testenv.Postgres(t)
	ctx := stores.WithClaimToken(context.Background(), "longer-lease")
	key := "longer-lease-" + testenv.RandomHex(4)
	if claimed, _, err := a.Claim(ctx, key, time.Second); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	if held, err := a.Extend(ctx, key, 30*time.Second); err != nil || !held {
		t.Fatalf("Extend(30s) = %v, %v", held, err)
	}
	pid := a.SessionPID()
	// Past the first lease (1s), well within the second (30s), renewing
	// every 2.5s, a twelfth of the lease: the claim is held throughout.
	for range 2 {
		end := time.Now().Add(2500 * time.Millisecond)
		for time.Now().Before(end) {
			if len(backendsAlive(t, db, []int32{pid})) == 0 {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		held, err := a.Extend(ctx, key, 30*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		other := stores.WithClaimToken(context.Background(), "other-worker")
		taken, _, err := b.Claim(other, key, 30*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if taken {
			_ = b.Release(other, key)
			t.Fatalf("another worker took the key %v after its holder renewed it for 30s (Extend said held=%v; the holder's session, pid %d, alive: %v)",
				time.Since(end.Add(-2500*time.Millisecond)), held, pid, len(backendsAlive(t, db, []int32{pid})) == 1)
		}
		if !held {
			t.Fatalf("Extend(30s) reported the claim lost, though nobody took it and the lease was renewed")
		}
	}
	if err := a.Remember(ctx, key, 0, nil); err != nil {
		t.Fatal(err)
	}
}

// The session's server process terminated at random, and the Store closed
// now and then, while claims and records flow: every Remember that
// returned nil left its record, every call returns by its deadline, and
// once the Store is closed no key is held (no lock of it left behind).
func TestHostileTerminatedAndClosedUnderLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("seconds of load")
	}
	t.Parallel()
	a, b := sessionPair(t)
	db := testenv.Postgres(t)
	const workers, perWorker = 6, 40
	type result struct {
		key        string
		remembered bool
	}
	results := make(chan result, workers*perWorker)
	stop := make(chan struct{})
	killerDone := make(chan struct{})
	go func() { // the server ends the session, or the Store is closed, every 30-90ms
		defer close(killerDone)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(time.Duration(30+i*17%60) * time.Millisecond):
			}
			if i%3 == 2 {
				_ = a.Close()
				continue
			}
			if pid := a.SessionPID(); pid != 0 {
				_, _ = db.ExecContext(context.Background(), `SELECT pg_terminate_backend($1)`, pid)
			}
		}
	}()
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perWorker {
				key := fmt.Sprintf("kill-%d-%d-%s", w, i, testenv.RandomHex(4))
				ctx, cancel := context.WithTimeout(stores.WithClaimToken(context.Background(), key), 5*time.Second)
				start := time.Now()
				claimed, _, err := a.Claim(ctx, key, 2*time.Second)
				ok := false
				if err == nil && claimed {
					if held, err := a.Extend(ctx, key, 2*time.Second); err == nil && held {
						ok = a.Remember(ctx, key, 0, nil) == nil
					} else {
						ok = a.Remember(ctx, key, 0, nil) == nil // a lost claim still records when nobody took the key
					}
				}
				if took := time.Since(start); took > 6*time.Second {
					t.Errorf("a delivery's calls took %v, past their 5s deadline", took)
				}
				cancel()
				results <- result{key, ok}
			}
		}()
	}
	wg.Wait()
	close(stop)
	<-killerDone
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	close(results)
	var recorded, lost int
	var notRecorded []string
	for r := range results {
		rec, err := b.Lookup(context.Background(), r.key)
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case r.remembered && rec.State != stores.StateRemembered:
			t.Errorf("Remember(%q) returned nil, and the key is %v", r.key, rec.State)
		case r.remembered:
			recorded++
		default:
			lost++
			notRecorded = append(notRecorded, r.key)
		}
	}
	// No key of the closed Store is held: each one not recorded is free
	// for another worker at once.
	for _, key := range notRecorded {
		ctx := stores.WithClaimToken(context.Background(), "after-"+key)
		claimed, found, err := b.Claim(ctx, key, time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if !claimed && found.State == stores.StateInFlight {
			t.Errorf("key %q is still held after its Store was closed", key)
		}
		if claimed {
			_ = b.Release(ctx, key)
		}
	}
	t.Logf("%d recorded, %d not (their session ended under them)", recorded, lost)
	if recorded == 0 {
		t.Fatal("nothing was recorded: the attack left no delivery through")
	}
	// A Store used after Close opens a new session.
	ctx := stores.WithClaimToken(context.Background(), "after-close")
	if claimed, _, err := a.Claim(ctx, "after-close", time.Second); err != nil || !claimed {
		t.Fatalf("Claim after Close = %v, %v", claimed, err)
	}
	if err := a.Remember(ctx, "after-close", 0, nil); err != nil {
		t.Fatal(err)
	}
}

// A claim held on a session whose server stops answering: every call on
// it (a renewal that must ask the server, a record, a claim, a failure, a
// release, a lookup) returns by its deadline, and so does Close, which
// ends the session; the key is then free for another worker.
func TestHostileSilentSessionUnderAHeldClaim(t *testing.T) {
	t.Parallel()
	direct := testenv.Postgres(t)
	b := newStore(t, direct)
	db, proxy := proxiedPostgres(t)
	a, err := postgresstore.New(db, postgresstore.WithTable(b.Table()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close() })
	ctx := stores.WithClaimToken(context.Background(), "silent-holder")
	key := "silent-" + testenv.RandomHex(4)
	if claimed, _, err := a.Claim(ctx, key, 3*time.Second); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	time.Sleep(time.Second + 100*time.Millisecond) // the state under test: past a third of the lease, so a renewal asks the server
	proxy.Delay.Store(int64(time.Hour))
	const deadline = 300 * time.Millisecond
	calls := map[string]func(ctx context.Context) error{
		"Extend": func(ctx context.Context) error { _, err := a.Extend(ctx, key, 3*time.Second); return err },
		"Remember other": func(ctx context.Context) error {
			return a.Remember(stores.WithClaimToken(ctx, "x"), key+"-other", 0, nil)
		},
		"Claim other": func(ctx context.Context) error {
			_, _, err := a.Claim(stores.WithClaimToken(ctx, "y"), key+"-claim", time.Second)
			return err
		},
		"Fail":    func(ctx context.Context) error { return a.Fail(ctx, key, 0, stores.Failure{Attempts: 1}) },
		"Release": func(ctx context.Context) error { return a.Release(ctx, key) },
		"Lookup":  func(ctx context.Context) error { _, err := a.Lookup(ctx, key); return err },
	}
	var wg sync.WaitGroup
	for name, call := range calls {
		wg.Go(func() {
			cctx, cancel := context.WithTimeout(ctx, deadline)
			defer cancel()
			start := time.Now()
			_ = call(cctx)
			if took := time.Since(start); took > deadline+time.Second {
				t.Errorf("%s took %v against a silent server; its deadline was %v", name, took, deadline)
			}
		})
	}
	wg.Wait()
	start := time.Now()
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("Close took %v against a silent server", took)
	}
	proxy.Delay.Store(0)
	waitClaim(t, b, stores.WithClaimToken(context.Background(), "next-worker"), key, 15*time.Second)
}

// The caller's pool closed before the Store: Close returns, and a call
// after it fails with an error instead of hanging or panicking.
func TestHostilePoolClosedBeforeTheStore(t *testing.T) {
	t.Parallel()
	direct := testenv.Postgres(t)
	b := newStore(t, direct)
	db := testenv.Postgres(t)
	a, err := postgresstore.New(db, postgresstore.WithTable(b.Table()))
	if err != nil {
		t.Fatal(err)
	}
	ctx := stores.WithClaimToken(context.Background(), "pool-closed")
	key := "pool-closed-" + testenv.RandomHex(4)
	if claimed, _, err := a.Claim(ctx, key, 5*time.Second); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	// The session is the Store's own: the claim is still held, and the
	// record goes through it.
	if err := a.Remember(ctx, key, 0, nil); err != nil {
		t.Fatalf("Remember on the session after db.Close: %v", err)
	}
	if r, err := b.Lookup(context.Background(), key); err != nil || !r.Remembered() {
		t.Fatalf("the record: %v, %v", r.State, err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if claimed, _, err := a.Claim(cctx, key+"-after", time.Second); err == nil || claimed {
		t.Fatalf("Claim after db.Close and Close = %v, %v; want an error", claimed, err)
	}
}

// Close while claims are being taken: a claim reported taken is either
// held (Extend says so) or, once its holder lets it go as the middleware
// does (Release after Extend said lost), free for another worker at once:
// no lock is left on a session the Store no longer knows it holds.
func TestHostileCloseWhileClaimsAreTaken(t *testing.T) {
	t.Parallel()
	a, b := sessionPair(t)
	const rounds, callers = 8, 12
	var leaked []string
	var mu sync.Mutex
	for r := range rounds {
		var wg sync.WaitGroup
		keys := make([]string, callers)
		claimed := make([]bool, callers)
		for i := range callers {
			keys[i] = fmt.Sprintf("close-race-%d-%d-%s", r, i, testenv.RandomHex(4))
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(stores.WithClaimToken(context.Background(), keys[i]), 5*time.Second)
				defer cancel()
				ok, _, err := a.Claim(ctx, keys[i], 30*time.Second)
				claimed[i] = err == nil && ok
			})
		}
		wg.Go(func() { _ = a.Close() })
		wg.Wait()
		for i, key := range keys {
			if !claimed[i] {
				continue
			}
			ctx := stores.WithClaimToken(context.Background(), key)
			held, err := a.Extend(ctx, key, 30*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			if held {
				if err := a.Release(ctx, key); err != nil {
					t.Fatal(err)
				}
			} else if err := a.Release(ctx, key); err != nil { // the middleware lets a lost claim go
				t.Fatal(err)
			}
			// Released either way: another worker takes it at once.
			other := stores.WithClaimToken(context.Background(), "other-"+key)
			deadline := time.Now().Add(3 * time.Second)
			for {
				ok, _, err := b.Claim(other, key, time.Second)
				if err != nil {
					t.Fatal(err)
				}
				if ok {
					_ = b.Release(other, key)
					break
				}
				if time.Now().After(deadline) {
					mu.Lock()
					leaked = append(leaked, fmt.Sprintf("%s (Extend said held=%v)", key, held))
					mu.Unlock()
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
		}
	}
	if len(leaked) > 0 {
		t.Fatalf("%d claims taken while Close ran stayed locked after their holders released them: %v", len(leaked), leaked)
	}
}

// The holder's session terminated by the server (pg_terminate_backend):
// another worker takes the key at once, and the holder's Extend must then
// say the claim is no longer held (the stores contract: held is false
// when another holder's claim holds the key).
func TestHostileExtendAfterTheSessionWasTerminated(t *testing.T) {
	t.Parallel()
	a, b := sessionPair(t)
	db := testenv.Postgres(t)
	ctx := stores.WithClaimToken(context.Background(), "terminated-holder")
	key := "terminated-" + testenv.RandomHex(4)
	if claimed, _, err := a.Claim(ctx, key, 30*time.Second); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	pid := a.SessionPID()
	if _, err := db.ExecContext(context.Background(), `SELECT pg_terminate_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	other := stores.WithClaimToken(context.Background(), "other-worker")
	waitClaim(t, b, other, key, 5*time.Second)
	defer func() { _ = b.Release(other, key) }()
	if held, err := a.Extend(ctx, key, 30*time.Second); err != nil || held {
		t.Fatalf("Extend after the holder's session was terminated and another worker took the key = %v, %v; want false", held, err)
	}
}

// Claims, records and renewals arriving around the moment the server ends
// the idle session (its idle time 1s): none fails, and a claim reported
// taken is held (another worker cannot take the key) until recorded.
//
// What a call meets depends only on how long its own session has been
// idle, so each wait runs on a Store (a session) of its own, all at once:
// twice each, once claiming first and once recording another key first,
// in about two idle times rather than twenty-four one after the other.
func TestHostileClaimsAroundTheIdleEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("about two idle times of a second")
	}
	t.Parallel()
	_, b := sessionPair(t)
	db := testenv.Postgres(t)
	waits := []time.Duration{400, 480, 520, 600, 900, 960, 990, 1000, 1010, 1040, 1100, 1300}
	var wg sync.WaitGroup
	for w, wait := range waits {
		a := newStoreOnTable(t, db, b.Table(), postgresstore.WithSessionClaims())
		a.SetSessionIdle(time.Second)
		wait *= time.Millisecond
		wg.Go(func() {
			for round := range 2 {
				if err := claimsAroundTheIdleEnd(a, b, fmt.Sprintf("edge-%d-%d", w, round), wait, (w+round)%2 == 1); err != nil {
					t.Errorf("a call %v into the idle time (round %d): %v", wait, round, err)
					return
				}
			}
		})
	}
	wg.Wait()
}

// claimsAroundTheIdleEnd claims and records a key on a, waits wait, then
// claims another key (recording a third first when recordFirst), checks
// that b cannot take it, renews and records it.
func claimsAroundTheIdleEnd(a, b *postgresstore.Store, name string, wait time.Duration, recordFirst bool) error {
	ctx := stores.WithClaimToken(context.Background(), name)
	key := name + "-" + testenv.RandomHex(4)
	if claimed, _, err := a.Claim(ctx, key, time.Second); err != nil || !claimed {
		return fmt.Errorf("first Claim = %v, %v", claimed, err)
	}
	if err := a.Remember(ctx, key, 0, nil); err != nil {
		return fmt.Errorf("first Remember: %w", err)
	}
	time.Sleep(wait) // the state under test: this far into the idle time
	key2 := key + "-edge"
	var err error
	var claimed bool
	// The claim's own lease is long: the second worker's claim below
	// must not find it lapsed on a loaded machine (a holder that does
	// not renew within its lease loses the session, as promised).
	if !recordFirst {
		claimed, _, err = a.Claim(ctx, key2, 30*time.Second)
	} else if err = a.Remember(ctx, key2+"-r", 0, nil); err == nil {
		claimed, _, err = a.Claim(ctx, key2, 30*time.Second)
	}
	if err != nil || !claimed {
		return fmt.Errorf("claimed=%v, %v", claimed, err)
	}
	other := stores.WithClaimToken(context.Background(), "other")
	if taken, _, err := b.Claim(other, key2, time.Second); err != nil || taken {
		return fmt.Errorf("another worker's claim of the key held since then = %v, %v", taken, err)
	}
	if held, err := a.Extend(ctx, key2, 30*time.Second); err != nil || !held {
		return fmt.Errorf("Extend = %v, %v", held, err)
	}
	if err := a.Remember(ctx, key2, 0, nil); err != nil {
		return fmt.Errorf("Remember: %w", err)
	}
	return nil
}
