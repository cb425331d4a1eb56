package postgresstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"go.uber.org/goleak"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// The hostile tests of the session's pause (WithGroupPause): every caller
// keeps its own deadline and its own answer while round trips wait for
// company.

// longPause is the longest pause WithGroupPause takes; hugePause, set past
// it (SetGroupPause), is long enough that a call bounded by the pause
// rather than by its deadline stands out however loaded the machine.
const (
	longPause = 50 * time.Millisecond
	hugePause = 10 * time.Second
)

// pauseStore is a Store of session claims with pause on a table of its
// own, on a small pool of its own.
func pauseStore(t *testing.T, pause time.Duration, opts ...postgresstore.Option) *postgresstore.Store {
	t.Helper()
	return newStore(t, h2Pool(t), append([]postgresstore.Option{postgresstore.WithSessionClaims(), postgresstore.WithGroupPause(pause)}, opts...)...)
}

// holdClaims takes n claims on s, each of a holder of its own, and returns
// their keys and holders' contexts: the session is busy (its round trips
// pause) from PauseSiblings on.
func holdClaims(t *testing.T, s *postgresstore.Store, prefix string, n int, lease time.Duration) (keys []string, holders []context.Context) {
	t.Helper()
	for i := range n {
		key := fmt.Sprintf("%s-%d", prefix, i)
		ctx := h2Token(fmt.Sprintf("%s-holder-%d", prefix, i))
		if claimed, _, err := s.Claim(ctx, key, lease); err != nil || !claimed {
			t.Fatalf("claim %s: %v, %v", key, claimed, err)
		}
		keys, holders = append(keys, key), append(holders, ctx)
	}
	if got := s.SessionPause(); n >= postgresstore.PauseSiblings && got == 0 {
		t.Fatalf("%d claims held: the session does not pause", n)
	}
	return keys, holders
}

// within runs f and fails t unless it returns within limit.
func within(t *testing.T, what string, limit time.Duration, f func()) time.Duration {
	t.Helper()
	start := time.Now()
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatalf("%s: still running after 30s", what)
	}
	took := time.Since(start)
	if took > limit {
		t.Errorf("%s took %v; want at most %v", what, took, limit)
	}
	return took
}

// A call whose deadline is shorter than the pause returns by its deadline,
// whether it leads the paused round trip (a claim, a Remember, a
// renewal) or queues behind a leader whose context has no deadline; a
// claim given up so is not left held.
func TestGroupPauseHostileDeadlines(t *testing.T) {
	t.Parallel()
	s := pauseStore(t, longPause)
	other := h2Worker(t, s.Table())
	keys, holders := holdClaims(t, s, "held", 40, time.Minute)
	s.SetGroupPause(hugePause)
	const short = 3 * time.Millisecond
	// The leaders below give up after leaderWait (their pause ends then);
	// a call that waited for a pause's end took at least that.
	const leaderWait = 2 * time.Second
	const limit = leaderWait / 2

	t.Run("leading claim", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(h2Token("lead"), short)
		defer cancel()
		var err error
		within(t, "a claim under a 3ms deadline leading a 10s pause", limit, func() { _, _, err = s.Claim(ctx, "lead", time.Minute) })
		if err == nil {
			return // it made it: nothing to undo
		}
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("claim: %v; want the deadline's error", err)
		}
		waitCond(t, "the given-up claim's key free for another worker", 10*time.Second, func() bool {
			claimed, _, err := other.Claim(h2Token("other"), "lead", time.Minute)
			if claimed {
				_ = other.Release(h2Token("other"), "lead")
			}
			return err == nil && claimed
		})
	})

	for _, kind := range []string{"claim", "remember", "extend"} {
		t.Run("behind a paused leader: "+kind, func(t *testing.T) {
			// The leader: a Remember that waits for company until its
			// own deadline, leaderWait (the pause is hugePause).
			leaderKey, leaderCtx := keys[len(keys)-1], holders[len(holders)-1]
			keys, holders = keys[:len(keys)-1], holders[:len(holders)-1]
			led := make(chan error, 1)
			go func() {
				ctx, cancel := context.WithTimeout(leaderCtx, leaderWait)
				defer cancel()
				led <- s.Remember(ctx, leaderKey, 1, nil)
			}()
			key, holder := keys[len(keys)-1], holders[len(holders)-1]
			if kind == "claim" {
				key, holder = "new-"+leaderKey, h2Token("new-"+leaderKey)
			}
			ctx, cancel := context.WithTimeout(holder, short)
			defer cancel()
			var err error
			within(t, "a "+kind+" under a 3ms deadline behind a paused leader", limit, func() {
				switch kind {
				case "claim":
					_, _, err = s.Claim(ctx, key, time.Minute)
				case "remember":
					err = s.Remember(ctx, key, 1, nil)
				case "extend":
					_, err = s.Extend(ctx, key, time.Minute)
				}
			})
			if err != nil && !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("%s: %v; want nil or the deadline's error", kind, err)
			}
			if err := <-led; err != nil && !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("the leader's Remember: %v; want nil or the deadline's error", err)
			}
		})
	}
}

// A renewal asked for a lease shorter than the pause is not held back
// past it, whether it leads the round trip or queues behind a leader
// paused for company: the claim stays its holder's, and Extend says so.
func TestGroupPauseHostileRenewalWithinItsLease(t *testing.T) {
	t.Parallel()
	s := pauseStore(t, longPause)
	keys, holders := holdClaims(t, s, "held", postgresstore.PauseSiblings+8, time.Minute)
	s.SetGroupPause(hugePause)
	ctx, key := holders[0], keys[0]
	// The lease asked for is hundreds of round trips, but a fifth of the
	// pause.
	const lease = 2 * time.Second
	for i := range 6 {
		var led chan error
		if i%2 == 1 { // behind a Remember that leads a paused round trip
			led = make(chan error, 1)
			go func() {
				// Bounded: a Remember that came second leads a pause of its
				// own, which nothing hurries.
				ctx, cancel := context.WithTimeout(holders[len(holders)-i], 2*time.Second)
				defer cancel()
				led <- s.Remember(ctx, keys[len(keys)-i], 1, nil)
			}()
		}
		held, err := s.Extend(ctx, key, lease)
		if err != nil || !held {
			t.Errorf("renewal %d of a live claim with a %v lease (pause %v): %v, %v; want held", i, lease, hugePause, held, err)
		}
		if _, err := s.Extend(ctx, key, time.Minute); err != nil { // not lapsing between tries
			t.Fatal(err)
		}
		if led != nil {
			if err := <-led; err != nil && !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("the leader's Remember: %v; want nil or the deadline's error", err)
			}
		}
	}
}

// A claim whose lease runs out unrenewed while the session pauses still
// lapses (another worker takes it), and renewals of the others keep them.
func TestGroupPauseHostileLapse(t *testing.T) {
	t.Parallel()
	s := pauseStore(t, longPause)
	other := h2Worker(t, s.Table())
	keys, holders := holdClaims(t, s, "held", postgresstore.PauseSiblings+4, time.Minute)
	if claimed, _, err := s.Claim(h2Token("lapsing"), "lapsing", 300*time.Millisecond); err != nil || !claimed {
		t.Fatalf("claim: %v, %v", claimed, err)
	}
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for i := range keys {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				if held, err := s.Extend(holders[i], keys[i], time.Minute); err != nil || !held {
					t.Errorf("renewal of %s: %v, %v", keys[i], held, err)
					return
				}
			}
		})
	}
	waitCond(t, "the lapsed claim taken by another worker", 10*time.Second, func() bool {
		claimed, _, err := other.Claim(h2Token("other"), "lapsing", time.Minute)
		return err == nil && claimed
	})
	close(stop)
	wg.Wait()
	if held, err := s.Extend(h2Token("lapsing"), "lapsing", time.Minute); err != nil || held {
		t.Errorf("Extend of the lapsed claim: %v, %v; want not held", held, err)
	}
	if err := s.Remember(h2Token("lapsing"), "lapsing", 1, nil); !errors.Is(err, stores.ErrClaimTaken) {
		t.Errorf("Remember of the lapsed claim another worker holds: %v; want ErrClaimTaken", err)
	}
}

// advisoryLocksOf counts the advisory locks server process pid holds.
func advisoryLocksOf(t *testing.T, db *sql.DB, pid int32) int {
	t.Helper()
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = $1 AND granted`, pid).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// pauseCalls starts, while the session pauses, a Remember of every held
// key and a claim of as many new keys, and returns a wait for all of
// them, each bounded by deadline; it reports every call that outlived its
// deadline.
func pauseCalls(t *testing.T, s *postgresstore.Store, keys []string, holders []context.Context, deadline time.Duration) (wait func() (claimed []string)) {
	var wg sync.WaitGroup
	var mu sync.Mutex
	var won []string
	call := func(what string, f func(ctx context.Context) error, ctx context.Context) {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(ctx, deadline)
			defer cancel()
			start := time.Now()
			_ = f(ctx)
			if took := time.Since(start); took > deadline+2*time.Second {
				t.Errorf("%s took %v under a %v deadline", what, took, deadline)
			}
		})
	}
	for i := range keys {
		call("remember "+keys[i], func(ctx context.Context) error { return s.Remember(ctx, keys[i], 1, nil) }, holders[i])
		nk := "new-" + keys[i]
		call("claim "+nk, func(ctx context.Context) error {
			claimed, _, err := s.Claim(ctx, nk, time.Minute)
			if claimed {
				mu.Lock()
				won = append(won, nk)
				mu.Unlock()
			}
			return err
		}, h2Token(nk))
	}
	return func() []string { wg.Wait(); return won }
}

// Close while round trips are paused: every call returns, no claim is left
// held on any session but those reported won (a call that began after Close
// cleared the claims takes its claim on a new session, as a Store used
// after Close does), and no goroutine is left.
func TestGroupPauseHostileCloseWhilePaused(t *testing.T) {
	db := h2Pool(t)
	s := newStore(t, db, postgresstore.WithSessionClaims(), postgresstore.WithGroupPause(longPause))
	keys, holders := holdClaims(t, s, "held", 40, time.Minute)
	pid := s.SessionPID()
	ignore := goleak.IgnoreCurrent()
	wait := pauseCalls(t, s, keys, holders, 10*time.Second)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	won := wait()
	waitCond(t, "the closed session's locks freed", 10*time.Second, func() bool { return advisoryLocksOf(t, db, pid) == 0 })
	if p := s.SessionPID(); p != 0 {
		// Round trips paused across Close opened a session after it: it
		// holds the claims reported won, and nothing else.
		locksMatchClaimsHeld(t, s, db, p, won)
		for _, k := range won {
			_ = s.Release(h2Token(k), k)
		}
		if n := advisoryLocksOf(t, db, p); n != 0 {
			t.Errorf("every claim released, the session holds %d advisory locks", n)
		}
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	goleak.VerifyNone(t, ignore)
}

// locksMatchClaimsHeld fails t unless the session of process pid holds as
// many advisory locks as the claims of won that s reports held.
func locksMatchClaimsHeld(t *testing.T, s *postgresstore.Store, db *sql.DB, pid int32, won []string) {
	t.Helper()
	want := 0
	for _, k := range won {
		if held, err := s.Extend(h2Token(k), k, time.Minute); err == nil && held {
			want++
		}
	}
	if n := advisoryLocksOf(t, db, pid); n != want {
		t.Errorf("the session (process %d) holds %d advisory locks; want %d (the claims it reports held)", pid, n, want)
	}
}

// The session's connection terminated while round trips are paused: every
// call returns by its deadline, the claims lost are reported lost, no
// lock is left on the new session, and no goroutine is left.
func TestGroupPauseHostileTerminatedWhilePaused(t *testing.T) {
	db := h2Pool(t)
	s := newStore(t, db, postgresstore.WithSessionClaims(), postgresstore.WithGroupPause(longPause))
	keys, holders := holdClaims(t, s, "held", 40, time.Minute)
	pid := s.SessionPID()
	ignore := goleak.IgnoreCurrent()
	wait := pauseCalls(t, s, keys, holders, 10*time.Second)
	if _, err := db.Exec(`SELECT pg_terminate_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	won := wait()
	for i, k := range keys {
		if held, err := s.Extend(holders[i], k, time.Minute); err == nil && held {
			t.Errorf("the claim of %s, remembered or lost with its session, still held", k)
		}
	}
	if p := s.SessionPID(); p != 0 {
		locksMatchClaimsHeld(t, s, db, p, won)
	}
	for _, k := range won {
		_ = s.Release(h2Token(k), k)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	goleak.VerifyNone(t, ignore)
}

// Two workers race over the same keys with 15, 16 and 17 claims held on
// the first (either side of the pause's threshold), claiming, remembering,
// releasing and renewing while the round trips pause: one winner per key
// and attempt, and a record only from a holder of the key's claim.
func TestGroupPauseHostileThreshold(t *testing.T) {
	t.Parallel()
	for _, held := range []int{postgresstore.PauseSiblings - 1, postgresstore.PauseSiblings, postgresstore.PauseSiblings + 1} {
		t.Run(fmt.Sprintf("%d held", held), func(t *testing.T) {
			t.Parallel()
			a := pauseStore(t, 2*time.Millisecond)
			b := h2Worker(t, a.Table(), postgresstore.WithGroupPause(2*time.Millisecond))
			holdClaims(t, a, "held", held, time.Minute)
			const keys, rounds = 12, 6
			var mu sync.Mutex
			effects := map[string]int{}
			holding := map[string]string{}
			var wg sync.WaitGroup
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			for w := range 8 {
				s := []*postgresstore.Store{a, b}[w%2]
				wg.Go(func() {
					for r := range rounds {
						for k := range keys {
							key := fmt.Sprintf("k%d-%d", k, r)
							token := fmt.Sprintf("w%d-%d-%d", w, k, r)
							hctx := stores.WithClaimToken(ctx, token)
							claimed, _, err := s.Claim(hctx, key, time.Minute)
							if err != nil {
								t.Errorf("claim %s: %v", key, err)
								return
							}
							if !claimed {
								continue
							}
							mu.Lock()
							if h := holding[key]; h != "" {
								t.Errorf("%s claimed by %s while %s holds it", key, token, h)
							}
							holding[key] = token
							mu.Unlock()
							if held, err := s.Extend(hctx, key, time.Minute); err != nil || !held {
								t.Errorf("renewal of %s: %v, %v", key, held, err)
							}
							if (k+w)%3 == 0 { // released: another worker runs it
								mu.Lock()
								holding[key] = ""
								mu.Unlock()
								if err := s.Release(hctx, key); err != nil {
									t.Errorf("release %s: %v", key, err)
								}
								continue
							}
							mu.Lock()
							effects[key]++
							holding[key] = ""
							mu.Unlock()
							if err := s.Remember(hctx, key, 1, nil); err != nil {
								t.Errorf("remember %s: %v", key, err)
							}
						}
					}
				})
			}
			wg.Wait()
			for key, n := range effects {
				if n != 1 {
					t.Errorf("%s took effect %d times", key, n)
				}
			}
		})
	}
}

// 32 handlers of one router on GoChannel, each handed every message (a
// subscriber each), on one Store of session claims whose round trips
// pause while they run: each message's effect once, also when a run fails
// or panics first.
func TestGroupPauseHostileMiddleware(t *testing.T) {
	t.Parallel()
	n := 60
	if testing.Short() {
		n = 20
	}
	db := testenv.Postgres(t)
	db.SetMaxOpenConns(8)
	s := newStore(t, db, postgresstore.WithSessionClaims(), postgresstore.WithGroupPause(2*time.Millisecond))
	const handlers = 32
	pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: int64(n)}, watermill.NopLogger{})
	t.Cleanup(func() { _ = pubsub.Close() })
	topic := "pause-" + testenv.RandomHex(4)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	obs := &outcomes{}
	// A lease of 5s: under a loaded -race run a 2s one once saw a renewal
	// miss it, which is not what this test is about.
	router.AddMiddleware(idempotency.Middleware(s, idempotency.WithClaim(5*time.Second), idempotency.WithObserver(obs), idempotency.WithScope("pause")))
	var mu sync.Mutex
	effects, tried := map[string]int{}, map[string]int{}
	watch := &overlapWatch{}
	var pauses atomic.Int32
	for h := range handlers {
		router.AddConsumerHandler(fmt.Sprintf("h%d", h), topic, pubsub, func(msg *message.Message) error {
			id := msg.Metadata.Get("id")
			defer watch.run(id, h)()
			if s.SessionPause() > 0 {
				pauses.Add(1)
			}
			mu.Lock()
			tried[id]++
			try := tried[id]
			mu.Unlock()
			switch {
			case try == 1 && len(id)%3 == 0:
				return errors.New("the first run fails")
			case try == 1 && len(id)%3 == 1:
				panic("the first run panics")
			}
			time.Sleep(time.Millisecond)
			mu.Lock()
			effects[id]++
			mu.Unlock()
			return nil
		})
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	wg.Go(func() { _ = router.Run(ctx) })
	select {
	case <-router.Running():
	case <-time.After(10 * time.Second):
		t.Fatal("the router did not start")
	}
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("m%d-%s", i, testenv.RandomHex(1+i%3))
		msg := envelopeMessage(t, ids[i])
		msg.Metadata.Set("id", ids[i])
		if err := pubsub.Publish(topic, msg); err != nil {
			t.Fatal(err)
		}
	}
	waitCond(t, "every message's effect", 60*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, id := range ids {
			if effects[id] == 0 {
				return false
			}
		}
		return true
	})
	// Every copy of every message handed out has been handled or skipped
	// once each handler's subscription drained: the outcomes count them.
	waitCond(t, "every copy settled", 60*time.Second, func() bool {
		return obs.of(idempotency.OutcomeRun)+obs.of(idempotency.OutcomeSkip) >= handlers*n
	})
	for _, o := range []idempotency.Outcome{idempotency.OutcomeStoreError, idempotency.OutcomeRememberFailed, idempotency.OutcomeClaimLost} {
		if got := obs.of(o); got > 0 {
			t.Errorf("%d deliveries with outcome %s: %v", got, o, obs.errs)
		}
	}
	cancel()
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	for _, id := range ids {
		if effects[id] != 1 {
			t.Errorf("message %s took effect %d times; want once", id, effects[id])
		}
	}
	watch.mu.Lock()
	defer watch.mu.Unlock()
	if len(watch.overlaps) > 0 {
		t.Errorf("messages ran twice at once: %v", watch.overlaps)
	}
	if pauses.Load() == 0 {
		t.Errorf("no handler ran while the session paused: the test did not test the pause")
	}
	var others []error // the store's, as the router stops
	for _, err := range obs.errs {
		if !errors.Is(err, idempotency.ErrInFlight) && err.Error() != "the first run fails" && !strings.Contains(err.Error(), "the first run panics") {
			others = append(others, err)
		}
	}
	t.Logf("%d messages × %d handlers: outcomes %v, runs while paused %d, other errors %v", n, handlers, obs.seen, pauses.Load(), others)
}

// The claims of a session the server ended, whose holders never came back
// (a handler stuck past its lease), stop counting once their lease ran
// out: the new session, which holds nothing, does not pause for company.
func TestGroupPauseHostileLostClaimsLapse(t *testing.T) {
	t.Parallel()
	db := h2Pool(t)
	s := newStore(t, db, postgresstore.WithSessionClaims(), postgresstore.WithGroupPause(longPause))
	holdClaims(t, s, "lost", postgresstore.PauseSiblings+4, time.Second)
	if _, err := db.Exec(`SELECT pg_terminate_backend($1)`, s.SessionPID()); err != nil {
		t.Fatal(err)
	}
	// The next round trip finds the session gone, and opens another.
	waitCond(t, "a claim on a new session", 10*time.Second, func() bool {
		claimed, _, err := s.Claim(h2Token("after"), "after", time.Minute)
		return err == nil && claimed
	})
	t.Logf("pause after the new session: %v", s.SessionPause())
	if err := s.Release(h2Token("after"), "after"); err != nil {
		t.Fatal(err)
	}
	waitCond(t, "no pause once the lost claims' leases ran out", 10*time.Second, func() bool { return s.SessionPause() == 0 })
}
