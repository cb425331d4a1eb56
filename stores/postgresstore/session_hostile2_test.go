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

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// h2Worker returns another worker's Store with opts on table, on a pool
// of its own, closed when the test ends.
func h2Worker(t *testing.T, table string, opts ...postgresstore.Option) *postgresstore.Store {
	t.Helper()
	return newStoreOnTable(t, h2Pool(t), table, opts...)
}

// h2Pool is a pool of at most 3 connections: the server's are shared by
// every test running beside this one.
func h2Pool(t *testing.T) *sql.DB { return h2DriverPool(t, "pgx") }

// h2DriverPool is h2Pool through the database/sql driver named driver
// ("pgx", or lib/pq's "postgres").
func h2DriverPool(t *testing.T, driver string) *sql.DB {
	t.Helper()
	db := testenv.PostgresWithDriver(t, driver)
	db.SetMaxOpenConns(3)
	return db
}

// h2Pair is sessionPair on pools of h2Pool's size.
func h2Pair(t *testing.T) (a, b *postgresstore.Store) {
	t.Helper()
	a = newStore(t, h2Pool(t))
	return a, h2Worker(t, a.Table())
}

// h2Token is a context naming the claim holder token.
func h2Token(token string) context.Context {
	return stores.WithClaimToken(context.Background(), token)
}

// h2Race is one race of a Remember against a Claim of the same key, and
// what each returned.
type h2Race struct {
	key     string
	remErr  error
	claimed bool
	found   stores.Record
	claimEr error
}

// h2Racers are the two sides of a race: a Remember (rem, with remCtx's
// holder, and value) and a Claim (claimer, with claimCtx's holder).
type h2Racers struct {
	rem      *postgresstore.Store
	remCtx   func(i int) context.Context
	value    []byte
	claimer  *postgresstore.Store
	claimCtx func(i int) context.Context
	// before runs ahead of the race of key i (a claim taken and released
	// by the remembering holder, say).
	before func(t *testing.T, i int, key string)
}

// raceRememberAndClaim races, for rounds of width keys at once, a Remember
// and a Claim of each key, and checks every outcome: never both (a record
// and a live claim, or a claim that missed a committed record), never
// neither (nothing held the key but the two of them), and the record, or
// the claim, is then what a third worker sees.
func raceRememberAndClaim(t *testing.T, observer *postgresstore.Store, r h2Racers) {
	t.Helper()
	rounds, width := 10, 16
	if testing.Short() {
		rounds = 3
	}
	var both, neither, inFlight, remembered, claims int
	for round := range rounds {
		races := make([]*h2Race, width)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range races {
			n := round*width + i
			race := &h2Race{key: fmt.Sprintf("race-%d-%s", n, testenv.RandomHex(3))}
			races[i] = race
			if r.before != nil {
				r.before(t, n, race.key)
			}
			wg.Add(2)
			go func() {
				defer wg.Done()
				<-start
				ctx, cancel := context.WithTimeout(r.remCtx(n), 10*time.Second)
				defer cancel()
				race.remErr = r.rem.Remember(ctx, race.key, 7, r.value)
			}()
			go func() {
				defer wg.Done()
				<-start
				ctx, cancel := context.WithTimeout(r.claimCtx(n), 10*time.Second)
				defer cancel()
				race.claimed, race.found, race.claimEr = r.claimer.Claim(ctx, race.key, time.Minute)
			}()
		}
		close(start)
		wg.Wait()
		for i, race := range races {
			n := round*width + i
			remOK := race.remErr == nil
			switch {
			case race.claimEr != nil:
				t.Errorf("%s: Claim: %v", race.key, race.claimEr)
				continue
			case !remOK && !errors.Is(race.remErr, stores.ErrClaimTaken):
				t.Errorf("%s: Remember: %v", race.key, race.remErr)
				continue
			case remOK && race.claimed:
				both++
				t.Errorf("%s: the Remember wrote its record and the Claim was taken too (found %v): a record under a live claim, or a claim that missed a committed record", race.key, race.found.State)
				continue
			case !remOK && !race.claimed:
				neither++
				t.Errorf("%s: the Remember was refused (%v) and the Claim was not taken (found %v): nothing else held the key", race.key, race.remErr, race.found.State)
				continue
			}
			ctx := context.Background()
			got, err := observer.Lookup(ctx, race.key)
			if err != nil {
				t.Fatalf("%s: Lookup: %v", race.key, err)
			}
			if race.claimed {
				claims++
				if got.State != stores.StateInFlight {
					t.Errorf("%s: claimed, but a third worker's Lookup says %v; want in flight", race.key, got.State)
				}
				// The holder records it: its record is the one kept.
				if err := r.claimer.Remember(r.claimCtx(n), race.key, 7, nil); err != nil {
					t.Errorf("%s: the claim holder's Remember: %v", race.key, err)
				}
				continue
			}
			switch race.found.State {
			case stores.StateInFlight:
				inFlight++ // the Claim met the record's statement
			case stores.StateRemembered:
				remembered++
			default:
				t.Errorf("%s: the Claim was not taken, and found %v; want remembered or in flight", race.key, race.found.State)
			}
			if !got.Remembered() {
				t.Errorf("%s: the Remember returned nil, but a third worker's Lookup says %v", race.key, got.State)
			}
		}
	}
	t.Logf("%d races: claimed first %d, remembered first %d (the Claim found the record %d, met its statement %d); both %d, neither %d",
		rounds*width, claims, remembered+inFlight, remembered, inFlight, both, neither)
}

// A Remember holding no claim (the seen-set mode: the pool's grouped
// statement under the key's lock, shared; a value: over the session; a
// Store without grouping: over the session) races a Claim of the same
// key, in another worker's Store and in its own Store by another holder,
// and after the remembering holder released its own claim: the key ends
// with the record or with the claim, never both, never neither.
func TestHostile2RememberWithoutAClaimRacesAClaim(t *testing.T) {
	t.Parallel()
	instance := func(int) context.Context { return context.Background() }
	seen := func(i int) context.Context { return h2Token(fmt.Sprintf("seen-%d", i)) }
	claimer := func(i int) context.Context { return h2Token(fmt.Sprintf("claimer-%d", i)) }
	for _, c := range []struct {
		name      string
		remOpts   []postgresstore.Option
		claimOpts []postgresstore.Option
		sameStore bool
		value     []byte
		release   bool // the remembering holder claims and releases the key first
	}{
		{name: "PoolRememberVsOtherStore"},
		{name: "PoolRememberVsSameStore", sameStore: true},
		{name: "ValueRememberVsOtherStore", value: []byte("v")},
		{name: "ValueRememberVsSameStore", sameStore: true, value: []byte("v")},
		{name: "UngroupedVsOtherStore", remOpts: []postgresstore.Option{postgresstore.WithoutGrouping()}},
		{name: "UngroupedVsSameStore", remOpts: []postgresstore.Option{postgresstore.WithoutGrouping()}, sameStore: true},
		{name: "AsyncCommitVsOtherStore", remOpts: []postgresstore.Option{postgresstore.WithAsynchronousCommit()}},
		{name: "VsUngroupedClaimer", claimOpts: []postgresstore.Option{postgresstore.WithoutGrouping()}},
		{name: "VsRowClaims", claimOpts: []postgresstore.Option{postgresstore.WithRowClaims()}},
		{name: "AfterReleaseVsOtherStore", release: true},
		{name: "AfterReleaseVsSameStore", release: true, sameStore: true},
		{name: "ValueAfterReleaseVsOtherStore", release: true, value: []byte("v")},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			a := newStore(t, h2Pool(t), c.remOpts...)
			b := a
			if !c.sameStore {
				b = h2Worker(t, a.Table(), c.claimOpts...)
			}
			observer := h2Worker(t, a.Table())
			r := h2Racers{rem: a, remCtx: instance, value: c.value, claimer: b, claimCtx: claimer}
			if c.sameStore || c.release {
				r.remCtx = seen
			}
			if c.release {
				r.before = func(t *testing.T, i int, key string) {
					if claimed, _, err := a.Claim(seen(i), key, time.Minute); err != nil || !claimed {
						t.Fatalf("%s: the remembering holder's Claim = %v, %v", key, claimed, err)
					}
					if err := a.Release(seen(i), key); err != nil {
						t.Fatalf("%s: Release: %v", key, err)
					}
				}
			}
			raceRememberAndClaim(t, observer, r)
		})
	}
}

// h2Terminate ends the server process of s's session
// (pg_terminate_backend), as a DBA or a failover would, and waits until it
// is gone: its locks are then free.
func h2Terminate(t *testing.T, s *postgresstore.Store) {
	t.Helper()
	pid := s.SessionPID()
	if pid == 0 {
		t.Fatal("the Store has no session open")
	}
	db := testenv.Postgres(t)
	if _, err := db.ExecContext(context.Background(), `SELECT pg_terminate_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	waitCond(t, "the terminated session gone", 10*time.Second, func() bool { return len(backendsAlive(t, db, []int32{pid})) == 0 })
}

// A holder whose session was terminated under its claim: when another
// worker took the key meanwhile, its Remember (plain or with a value) is
// refused and the other worker's claim stays in flight; when nobody did,
// its Remember writes the record; when another worker claims at the same
// moment, one of the two wins.
func TestHostile2RememberAfterTheSessionWasTerminated(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name  string
		value []byte
	}{{"Plain", nil}, {"Value", []byte("v")}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			a, b := h2Pair(t)
			observer := h2Worker(t, a.Table())
			holder, other := h2Token("holder"), h2Token("other")

			// Taken over by another worker.
			if claimed, _, err := a.Claim(holder, "taken", time.Minute); err != nil || !claimed {
				t.Fatalf("Claim = %v, %v", claimed, err)
			}
			h2Terminate(t, a)
			waitClaim(t, b, other, "taken", 5*time.Second)
			if err := a.Remember(holder, "taken", 1, c.value); !errors.Is(err, stores.ErrClaimTaken) {
				t.Fatalf("the terminated holder's Remember while another worker holds the key = %v; want ErrClaimTaken", err)
			}
			if r, err := observer.Lookup(context.Background(), "taken"); err != nil || r.State != stores.StateInFlight {
				t.Fatalf("Lookup after the refused Remember = %v, %v; want in flight (the other worker's claim)", r.State, err)
			}
			if held, err := b.Extend(other, "taken", time.Minute); err != nil || !held {
				t.Fatalf("the other worker's Extend = %v, %v; want held", held, err)
			}
			if err := b.Remember(other, "taken", 2, nil); err != nil {
				t.Fatalf("the other worker's Remember: %v", err)
			}

			// Nobody took it.
			if claimed, _, err := a.Claim(holder, "free", time.Minute); err != nil || !claimed {
				t.Fatalf("Claim = %v, %v", claimed, err)
			}
			h2Terminate(t, a)
			if err := a.Remember(holder, "free", 1, c.value); err != nil {
				t.Fatalf("the terminated holder's Remember, nobody holding the key: %v; want the record written", err)
			}
			if r, err := observer.Lookup(context.Background(), "free"); err != nil || !r.Remembered() || string(r.Value) != string(c.value) {
				t.Fatalf("Lookup = %v %q, %v; want remembered with %q", r.State, r.Value, err, c.value)
			}

			// Both at once: one wins.
			const n = 16
			keys := make([]string, n)
			for i := range keys {
				keys[i] = fmt.Sprintf("raced-%d", i)
				if claimed, _, err := a.Claim(holder, keys[i], time.Minute); err != nil || !claimed {
					t.Fatalf("Claim = %v, %v", claimed, err)
				}
			}
			h2Terminate(t, a)
			remErrs, claimed := make([]error, n), make([]bool, n)
			var wg sync.WaitGroup
			for i, k := range keys {
				wg.Go(func() { remErrs[i] = a.Remember(holder, k, 1, c.value) })
				wg.Go(func() {
					var err error
					if claimed[i], _, err = b.Claim(other, k, time.Minute); err != nil {
						t.Errorf("%s: Claim: %v", k, err)
					}
				})
			}
			wg.Wait()
			for i, k := range keys {
				switch {
				case remErrs[i] == nil && claimed[i]:
					t.Errorf("%s: the terminated holder's record written and the other worker's claim taken", k)
				case remErrs[i] != nil && !errors.Is(remErrs[i], stores.ErrClaimTaken):
					t.Errorf("%s: Remember: %v", k, remErrs[i])
				case remErrs[i] != nil && !claimed[i]:
					t.Errorf("%s: the Remember was refused (%v), and the other worker's claim not taken", k, remErrs[i])
				}
			}
		})
	}
}

// A holder whose claim lapsed (its lease ran out unrenewed): when a
// worker, another Store's or another holder of its own Store, took the
// key, its Remember is refused; when nobody did, it writes the record,
// whatever the moment it comes (also while the lapse is giving the lock
// back).
func TestHostile2RememberAfterTheClaimLapsed(t *testing.T) {
	t.Parallel()
	a, b := h2Pair(t)
	observer := h2Worker(t, a.Table())
	holder, other := h2Token("holder"), h2Token("other")
	const lease = 150 * time.Millisecond

	// Taken over by another Store.
	if claimed, _, err := a.Claim(holder, "other-store", lease); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	waitClaim(t, b, other, "other-store", 5*time.Second)
	if err := a.Remember(holder, "other-store", 1, nil); !errors.Is(err, stores.ErrClaimTaken) {
		t.Fatalf("the lapsed holder's Remember while another worker holds the key = %v; want ErrClaimTaken", err)
	}
	if err := a.Remember(holder, "other-store", 1, []byte("v")); !errors.Is(err, stores.ErrClaimTaken) {
		t.Fatalf("the lapsed holder's Remember of a value while another worker holds the key = %v; want ErrClaimTaken", err)
	}

	// Taken over by another holder of the same Store.
	if claimed, _, err := a.Claim(holder, "same-store", lease); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	waitClaim(t, a, other, "same-store", 5*time.Second)
	if err := a.Remember(holder, "same-store", 1, nil); !errors.Is(err, stores.ErrClaimTaken) {
		t.Fatalf("the lapsed holder's Remember while another holder of its Store holds the key = %v; want ErrClaimTaken", err)
	}
	if r, err := observer.Lookup(context.Background(), "same-store"); err != nil || r.State != stores.StateInFlight {
		t.Fatalf("Lookup = %v, %v; want in flight", r.State, err)
	}

	// Nobody took them: every record is written, those that come as the
	// lapse gives the locks back included.
	n := 64
	if testing.Short() {
		n = 16
	}
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("nobody-%d", i)
	}
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, k := range keys {
		if claimed, _, err := a.Claim(holder, k, lease); err != nil || !claimed {
			t.Fatalf("Claim = %v, %v", claimed, err)
		}
		// Spread over the lapse: from a little before to a little after.
		at := lease - 10*time.Millisecond + time.Duration(i)*20*time.Millisecond/time.Duration(n)
		wg.Go(func() {
			time.Sleep(at)
			errs[i] = a.Remember(holder, k, 1, nil)
		})
	}
	wg.Wait()
	refused := 0
	for i, err := range errs {
		if err != nil {
			refused++
			t.Errorf("%s: the lapsed holder's Remember, nobody else holding the key: %v; want the record written", keys[i], err)
		}
	}
	t.Logf("%d records around the lapse, %d refused", n, refused)
}

// h2Done is a context already done, naming holder.
func h2Done(holder string) context.Context {
	ctx, cancel := context.WithCancel(h2Token(holder))
	cancel()
	return ctx
}

// h2Flip is a context that becomes done (canceled) at its after-th call
// of Err: a caller's deadline passing while a call of the Store runs, at
// a point the test chooses.
type h2Flip struct {
	context.Context
	after int32
	calls atomic.Int32
	once  sync.Once
	done  chan struct{}
}

func newH2Flip(holder string, after int32) *h2Flip {
	return &h2Flip{Context: h2Token(holder), after: after, done: make(chan struct{})}
}

func (f *h2Flip) Err() error {
	if f.calls.Add(1) >= f.after {
		f.once.Do(func() { close(f.done) })
		return context.Canceled
	}
	return nil
}

func (f *h2Flip) Done() <-chan struct{} { return f.done }

// Renewals that come with a done context (a Guard's keeper running on after
// its delivery's context ended) fail, and renew nothing: the claim lapses
// with its lease, and another worker takes the key, while another holder
// of the Store renews its own claim (so that the server never finds the
// session idle).
func TestHostile2ExtendWithADoneContextRenewsNothing(t *testing.T) {
	t.Parallel()
	a, b := h2Pair(t)
	const lease = 300 * time.Millisecond
	for _, k := range []string{"k", "busy"} {
		if claimed, _, err := a.Claim(h2Token(k), k, lease); err != nil || !claimed {
			t.Fatalf("Claim = %v, %v", claimed, err)
		}
	}
	start := time.Now()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(lease / 6):
			}
			if held, err := a.Extend(h2Done("k"), "k", lease); err == nil {
				t.Errorf("Extend with a done context = %v, nil; want its error", held)
				return
			}
			if held, err := a.Extend(h2Token("busy"), "busy", lease); err != nil || !held {
				t.Errorf("the busy holder's Extend = %v, %v", held, err)
				return
			}
		}
	})
	defer func() { close(stop); wg.Wait() }()
	took := waitClaim(t, b, h2Token("other"), "k", lease+5*time.Second)
	if took > lease+2*time.Second {
		t.Errorf("the claim lapsed %v after it was taken, its lease %v: the renewals with a done context renewed it", time.Since(start).Round(time.Millisecond), lease)
	}
}

// Every call of a holder with a done context (done on arrival, or becoming
// done at any point of the call) fails or answers as if it were not made,
// and leaves nothing behind: the holder's claim is as it was (held, or
// given back and free to another worker at once), no record or failing
// record is written, and no lock stays on the session that nothing here
// knows of.
func TestHostile2DoneContextsLeaveNothingBehind(t *testing.T) {
	t.Parallel()
	a, b := h2Pair(t)
	observer := h2Worker(t, a.Table())
	ctx := context.Background()
	holder := h2Token("holder")
	claim := func(key string) {
		t.Helper()
		if claimed, _, err := a.Claim(holder, key, time.Minute); err != nil || !claimed {
			t.Fatalf("Claim(%s) = %v, %v", key, claimed, err)
		}
	}
	// stillHeld checks that the holder still holds key: Extend says so,
	// and another worker is refused.
	stillHeld := func(key, after string) {
		t.Helper()
		if held, err := a.Extend(holder, key, time.Minute); err != nil || !held {
			t.Fatalf("%s: after %s, the holder's Extend = %v, %v; want held", key, after, held, err)
		}
		if claimed, _, err := b.Claim(h2Token("other"), key, time.Minute); err != nil || claimed {
			t.Fatalf("%s: after %s, another worker's Claim = %v, %v; want refused", key, after, claimed, err)
		}
		if r, err := observer.Lookup(ctx, key); err != nil || r.State != stores.StateInFlight {
			t.Fatalf("%s: after %s, Lookup = %v, %v; want in flight", key, after, r.State, err)
		}
	}

	// Done on arrival.
	claim("held")
	if err := a.Remember(h2Done("holder"), "held", 1, nil); err == nil {
		t.Fatal("Remember with a done context returned nil")
	}
	stillHeld("held", "a Remember with a done context")
	if err := a.Remember(h2Done("holder"), "held", 1, []byte("v")); err == nil {
		t.Fatal("Remember of a value with a done context returned nil")
	}
	stillHeld("held", "a Remember of a value with a done context")
	if err := a.Fail(h2Done("holder"), "held", 1, stores.Failure{Attempts: 1}); err == nil {
		t.Fatal("Fail with a done context returned nil")
	}
	stillHeld("held", "a Fail with a done context")
	if err := a.Release(h2Done("holder"), "held"); err == nil {
		t.Fatal("Release with a done context returned nil")
	}
	stillHeld("held", "a Release with a done context")
	if _, err := a.Lookup(h2Done("holder"), "held"); err == nil {
		t.Fatal("Lookup with a done context returned nil")
	}
	if claimed, _, err := a.Claim(h2Done("other"), "held", time.Minute); err == nil && claimed {
		t.Fatal("another holder's Claim with a done context took the held key")
	}
	stillHeld("held", "another holder's Claim with a done context")
	if err := a.Remember(h2Done("other"), "held", 1, nil); err == nil {
		t.Fatal("another holder's Remember with a done context returned nil")
	}
	stillHeld("held", "another holder's Remember with a done context")
	if err := a.Remember(holder, "held", 1, nil); err != nil {
		t.Fatalf("the holder's Remember: %v", err)
	}
	if r, err := observer.Lookup(ctx, "held"); err != nil || !r.Remembered() {
		t.Fatalf("Lookup after the holder's Remember = %v, %v", r.State, err)
	}

	// Nothing written for a seen-set Remember with a done context.
	if err := a.Remember(h2Done("seen"), "unseen", 1, nil); err == nil {
		t.Fatal("a seen-set Remember with a done context returned nil")
	}
	if r, err := observer.Lookup(ctx, "unseen"); err != nil || r.State != stores.StateUnknown {
		t.Fatalf("Lookup after a seen-set Remember with a done context = %v, %v; want unknown", r.State, err)
	}
	waitClaim(t, a, h2Token("after"), "unseen", 5*time.Second)

	// Becoming done at every point of the call: the holder holds its
	// claim still, or it is free at once.
	for after := int32(1); after <= 8; after++ {
		for _, call := range []struct {
			name string
			do   func(ctx context.Context, key string) error
		}{
			{"Release", func(ctx context.Context, key string) error { return a.Release(ctx, key) }},
			{"Remember", func(ctx context.Context, key string) error { return a.Remember(ctx, key, 1, nil) }},
			{"RememberValue", func(ctx context.Context, key string) error { return a.Remember(ctx, key, 1, []byte("v")) }},
			{"Fail", func(ctx context.Context, key string) error { return a.Fail(ctx, key, 1, stores.Failure{Attempts: 1}) }},
			{"Extend", func(ctx context.Context, key string) error { _, err := a.Extend(ctx, key, time.Minute); return err }},
		} {
			key := fmt.Sprintf("%s-%d", call.name, after)
			claim(key)
			callErr := call.do(newH2Flip("holder", after), key)
			if callErr == nil {
				continue // it ran through before the context was done
			}
			if !errors.Is(callErr, context.Canceled) {
				t.Errorf("%s with a context done at its call %d of Err: %v; want context.Canceled", call.name, after, callErr)
			}
			if held, err := a.Extend(holder, key, time.Minute); err != nil {
				t.Fatal(err)
			} else if held {
				if err := a.Release(holder, key); err != nil {
					t.Fatal(err)
				}
			}
			// Given back, or released now: free to another worker.
			deadline := time.Now().Add(5 * time.Second)
			for {
				claimed, found, err := b.Claim(h2Token("other"), key, time.Minute)
				if err != nil {
					t.Fatal(err)
				}
				if claimed || found.Remembered() || found.State == stores.StateFailing {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("%s with a context done at its call %d of Err (%v): the key is still in flight to another worker 5s later (found %v), the holder's claim gone (Extend says not held): its lock was left on the session",
						call.name, after, callErr, found.State)
				}
				time.Sleep(10 * time.Millisecond)
			}
		}
	}
}

// Claims whose callers give up at every moment (their contexts canceled
// a few microseconds to milliseconds in, as a broker's deadline does) in
// both a grouped and an ungrouped Store: once every call returned and the
// caller released what it was told it took (or, on an error, released as
// the middleware does), every key is free to a new holder of the Store and
// to another worker, at once or once the abandoned claims are undone.
func TestHostile2ClaimsGivenUpAtAnyMomentLeaveNothing(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		opts []postgresstore.Option
	}{{"Grouped", nil}, {"Ungrouped", []postgresstore.Option{postgresstore.WithoutGrouping()}}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			a := newStore(t, h2Pool(t), c.opts...)
			b := h2Worker(t, a.Table())
			n := 200
			if testing.Short() {
				n = 60
			}
			var wg sync.WaitGroup
			var took, gaveUp atomic.Int32
			for i := range n {
				key := fmt.Sprintf("given-up-%d", i)
				holder := fmt.Sprintf("h%d", i)
				wg.Go(func() {
					ctx, cancel := context.WithTimeout(h2Token(holder), time.Duration(i%40)*500*time.Microsecond)
					defer cancel()
					claimed, _, err := a.Claim(ctx, key, time.Minute)
					switch {
					case err != nil:
						gaveUp.Add(1)
					case claimed:
						took.Add(1)
					}
					if err := a.Release(h2Token(holder), key); err != nil {
						t.Errorf("%s: Release: %v", key, err)
					}
				})
			}
			wg.Wait()
			t.Logf("%d claims: %d taken, %d given up", n, took.Load(), gaveUp.Load())
			for i := range n {
				key := fmt.Sprintf("given-up-%d", i)
				waitClaim(t, b, h2Token("other"), key, 5*time.Second)
				if err := b.Release(h2Token("other"), key); err != nil {
					t.Fatal(err)
				}
				waitClaim(t, a, h2Token("new"), key, 5*time.Second)
			}
		})
	}
}

// A worker with session claims and one with claims of rows on one table:
// the session worker's Remember without a claim (the seen-set mode, or
// after a Release) writes no record over the rows worker's live claim, a
// claim of rows is in flight to its Lookup, and a rows holder's own
// Remember is never refused because session workers tried its key.
func TestHostile2MixedRowClaimsRememberWithoutAClaim(t *testing.T) {
	t.Parallel()
	withRowsWorkers(t, func(t *testing.T, a, r *postgresstore.Store, key func(string) string) {
		ctx := context.Background()

		// The rows worker's claim; the session worker remembers.
		if claimed, _, err := r.Claim(h2Token("rows"), key("r"), time.Minute); err != nil || !claimed {
			t.Fatalf("the rows worker's Claim = %v, %v", claimed, err)
		}
		if got, err := a.Lookup(ctx, key("r")); err != nil || got.State != stores.StateInFlight {
			t.Errorf("the session worker's Lookup of a claimed row = %v, %v; want in flight", got.State, err)
		}
		for _, v := range [][]byte{nil, []byte("v")} {
			if err := a.Remember(h2Token("seen"), key("r"), 1, v); !errors.Is(err, stores.ErrClaimTaken) {
				t.Errorf("the session worker's Remember (value %q) without a claim over a live claim row = %v; want ErrClaimTaken", v, err)
			}
		}
		if claimed, _, err := a.Claim(h2Token("session"), key("r"), time.Minute); err != nil || claimed {
			t.Errorf("the session worker's Claim of a claimed row = %v, %v; want refused", claimed, err)
		}
		if err := r.Remember(h2Token("rows"), key("r"), 2, nil); err != nil {
			t.Fatalf("the rows holder's Remember: %v", err)
		}

		// A rows holder's own claim: its Remember is never refused by
		// session workers that try the key meanwhile (they find the
		// claim row and give the lock back).
		n := 40
		if testing.Short() {
			n = 10
		}
		for i := range n {
			k := key(fmt.Sprintf("own-%d", i))
			if claimed, _, err := r.Claim(h2Token("rows"), k, time.Minute); err != nil || !claimed {
				t.Fatalf("the rows worker's Claim = %v, %v", claimed, err)
			}
			var wg sync.WaitGroup
			var remErr error
			wg.Go(func() { remErr = r.Remember(h2Token("rows"), k, 1, nil) })
			for j := range 3 {
				wg.Go(func() {
					if claimed, _, err := a.Claim(h2Token(fmt.Sprintf("try-%d", j)), k, time.Minute); err != nil || claimed {
						t.Errorf("%s: the session worker's Claim of a claimed or remembered row = %v, %v", k, claimed, err)
					}
				})
			}
			wg.Wait()
			if remErr != nil {
				t.Errorf("%s: the rows holder's Remember while session workers tried the key: %v", k, remErr)
			}
		}
	})
}

// The other half of a mixed fleet (a worker on lib/pq gets claims of
// rows, one on pgx session claims, by default): the rows worker sees a
// session claim. Its Lookup says in flight while a session claim holds
// the key; its Remember without a claim (the seen-set mode, or after a
// Release), or with its own claim row lapsed and the key taken by a
// session since, writes nothing under the session's claim; a Remember
// over its own live claim row, or of a key nobody holds, is written, in
// one grouped statement with the refused ones.
func TestHostile2MixedRowsWorkerSeesSessionClaims(t *testing.T) {
	t.Parallel()
	withRowsWorkers(t, func(t *testing.T, a, r *postgresstore.Store, key func(string) string) {
		ctx := context.Background()

		// A live session claim.
		if claimed, _, err := a.Claim(h2Token("session"), key("s"), time.Minute); err != nil || !claimed {
			t.Fatalf("the session worker's Claim = %v, %v", claimed, err)
		}
		if got, err := r.Lookup(ctx, key("s")); err != nil || got.State != stores.StateInFlight {
			t.Errorf("the rows worker's Lookup of a key a session claim holds = %v, %v; want in flight", got.State, err)
		}
		if err := r.Remember(h2Token("seen"), key("s"), 1, nil); !errors.Is(err, stores.ErrClaimTaken) {
			t.Errorf("the rows worker's Remember without a claim over a live session claim = %v; want ErrClaimTaken", err)
		}
		if err := r.Remember(h2Token("seen"), key("s"), 1, []byte("v")); !errors.Is(err, stores.ErrClaimTaken) {
			t.Errorf("the rows worker's Remember of a value without a claim over a live session claim = %v; want ErrClaimTaken", err)
		}
		if got, err := a.Lookup(ctx, key("s")); err != nil || got.State != stores.StateInFlight {
			t.Fatalf("the session holder's key after the refused records = %v, %v; want still in flight (nothing written)", got.State, err)
		}
		if err := a.Remember(h2Token("session"), key("s"), 2, nil); err != nil {
			t.Fatalf("the session holder's Remember: %v", err)
		}
		if got, err := r.Lookup(ctx, key("s")); err != nil || got.State != stores.StateRemembered || got.Fingerprint != 2 {
			t.Errorf("the rows worker's Lookup of the session holder's record = %+v, %v; want remembered with fingerprint 2", got, err)
		}

		// The rows worker's own claim lapses; a session takes the key.
		if claimed, _, err := r.Claim(h2Token("rows"), key("lapsed"), 50*time.Millisecond); err != nil || !claimed {
			t.Fatalf("the rows worker's Claim = %v, %v", claimed, err)
		}
		waitClaim(t, a, h2Token("taker"), key("lapsed"), 5*time.Second)
		if err := r.Remember(h2Token("rows"), key("lapsed"), 1, nil); !errors.Is(err, stores.ErrClaimTaken) {
			t.Errorf("the rows worker's Remember over its own lapsed claim row, the key now a session's = %v; want ErrClaimTaken", err)
		}
		if err := a.Remember(h2Token("taker"), key("lapsed"), 3, nil); err != nil {
			t.Fatalf("the session taker's Remember: %v", err)
		}

		// At once: keys a session holds, keys nobody holds, and the
		// rows worker's own live claims.
		held, free, own := []string{key("h1"), key("h2")}, []string{key("f1"), key("f2")}, []string{key("o1"), key("o2")}
		for _, k := range held {
			if claimed, _, err := a.Claim(h2Token("session"), k, time.Minute); err != nil || !claimed {
				t.Fatalf("the session worker's Claim(%s) = %v, %v", k, claimed, err)
			}
		}
		for _, k := range own {
			if claimed, _, err := r.Claim(h2Token("own-"+k), k, time.Minute); err != nil || !claimed {
				t.Fatalf("the rows worker's Claim(%s) = %v, %v", k, claimed, err)
			}
		}
		var wg sync.WaitGroup
		errs := map[string]error{}
		var mu sync.Mutex
		remember := func(k, token string) {
			wg.Go(func() {
				err := r.Remember(h2Token(token), k, 1, nil)
				mu.Lock()
				errs[k] = err
				mu.Unlock()
			})
		}
		for _, k := range held {
			remember(k, "seen")
		}
		for _, k := range free {
			remember(k, "seen")
		}
		for _, k := range own {
			remember(k, "own-"+k)
		}
		wg.Wait()
		for _, k := range held {
			if !errors.Is(errs[k], stores.ErrClaimTaken) {
				t.Errorf("%s: the rows worker's Remember of a key a session claim holds = %v; want ErrClaimTaken", k, errs[k])
			}
		}
		for _, k := range append(free, own...) {
			if errs[k] != nil {
				t.Errorf("%s: the rows worker's Remember of a key nobody else holds = %v; want it written", k, errs[k])
			} else if got, err := a.Lookup(ctx, k); err != nil || got.State != stores.StateRemembered {
				t.Errorf("%s: the record the rows worker wrote = %v, %v; want remembered", k, got.State, err)
			}
		}
		for _, k := range held {
			if err := a.Release(h2Token("session"), k); err != nil {
				t.Fatal(err)
			}
		}
	})
}

// withRowsWorkers runs f with a Store of session claims (a) and a worker
// with claims of rows on its table (r), grouped and then ungrouped; key
// names a key of the run.
func withRowsWorkers(t *testing.T, f func(t *testing.T, a, r *postgresstore.Store, key func(string) string)) {
	t.Helper()
	a := newStore(t, h2Pool(t))
	for _, c := range []struct {
		name string
		opts []postgresstore.Option
	}{{"Grouped", []postgresstore.Option{postgresstore.WithRowClaims()}}, {"Ungrouped", []postgresstore.Option{postgresstore.WithRowClaims(), postgresstore.WithoutGrouping()}}} {
		t.Run(c.name, func(t *testing.T) {
			f(t, a, h2Worker(t, a.Table(), c.opts...), func(s string) string { return c.name + "-" + s })
		})
	}
}

// Three workers on one table through the middleware, each handed every
// message at the same moment (GoChannel gives each subscriber its own
// copy): one with session claims, one with session claims and no
// grouping, one with claims of rows, while a fourth Store looks the keys
// up all along (its shared tries of the keys' locks meeting the claims)
// and one message in four fails its first run (released, then run again).
// Every message's effect runs exactly once, never two at once, and every
// message is recorded.
func TestHostile2ThreeWorkersEveryEffectOnce(t *testing.T) {
	t.Parallel()
	n := 150
	if testing.Short() {
		n = 40
	}
	a := newStore(t, h2Pool(t))
	workers := []*postgresstore.Store{a,
		h2Worker(t, a.Table(), postgresstore.WithoutGrouping()),
		h2Worker(t, a.Table(), postgresstore.WithRowClaims())}
	looker := h2Worker(t, a.Table())
	pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: int64(n)}, watermill.NopLogger{})
	t.Cleanup(func() { _ = pubsub.Close() })
	const topic = "hostile2"

	watch := &overlapWatch{}
	var mu sync.Mutex
	effects, failed, keys := map[string]int{}, map[string]bool{}, map[string]string{}
	var runsAt [3]atomic.Int32
	obs := make([]*outcomes, len(workers))
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			cancel()
			wg.Wait()
		}
	}
	t.Cleanup(stop)
	for i, s := range workers {
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		obs[i] = &outcomes{}
		router.AddMiddleware(idempotency.Middleware(s, idempotency.WithClaim(2*time.Second), idempotency.WithObserver(obs[i])))
		router.AddConsumerHandler("h", topic, pubsub, func(msg *message.Message) error {
			id := msg.Metadata.Get("id")
			runsAt[i].Add(1)
			defer watch.run(id, i)()
			d, _ := idempotency.DeliveryFromContext(msg.Context())
			mu.Lock()
			keys[id] = d.Key
			fail := !failed[id] && len(id)%4 == 0
			failed[id] = true
			mu.Unlock()
			if fail {
				return errors.New("the first run fails")
			}
			time.Sleep(time.Duration(len(id)%3) * time.Millisecond)
			mu.Lock()
			effects[id]++
			mu.Unlock()
			return nil
		})
		wg.Go(func() { _ = router.Run(ctx) })
		select {
		case <-router.Running():
		case <-time.After(10 * time.Second):
			t.Fatal("the router did not start")
		}
	}
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("m%d-%s", i, testenv.RandomHex(1+i%4))
	}
	wg.Go(func() { // the fourth Store's lookups, all along
		for i := 0; ctx.Err() == nil; i++ {
			mu.Lock()
			key := keys[ids[i%n]]
			mu.Unlock()
			if key == "" {
				runtime.Gosched()
				continue
			}
			if _, err := looker.Lookup(ctx, key); err != nil && ctx.Err() == nil {
				t.Errorf("Lookup: %v", err)
				return
			}
		}
	})
	for _, id := range ids {
		msg := envelopeMessage(t, id)
		msg.Metadata.Set("id", id)
		if err := pubsub.Publish(topic, msg); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		var missing []string
		for _, id := range ids {
			mu.Lock()
			key, effected := keys[id], effects[id]
			mu.Unlock()
			r := stores.Record{}
			if key != "" {
				var err error
				if r, err = looker.Lookup(context.Background(), key); err != nil {
					t.Fatal(err)
				}
			}
			if !r.Remembered() {
				missing = append(missing, fmt.Sprintf("%s (%v, effects %d)", id, r.State, effected))
			}
		}
		if len(missing) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d messages not recorded after 60s: %v; runs %d / %d / %d; outcomes %v / %v / %v", len(missing), missing,
				runsAt[0].Load(), runsAt[1].Load(), runsAt[2].Load(), obs[0].seen, obs[1].seen, obs[2].seen)
		}
		time.Sleep(20 * time.Millisecond)
	}
	stop() // every run that began has ended
	mu.Lock()
	defer mu.Unlock()
	watch.mu.Lock()
	defer watch.mu.Unlock()
	for _, id := range ids {
		if effects[id] != 1 {
			t.Errorf("message %s took effect %d times; want once", id, effects[id])
		}
	}
	if len(watch.overlaps) > 0 {
		t.Errorf("messages ran twice at once: %v", watch.overlaps)
	}
	t.Logf("%d messages × 3 workers: runs %d / %d / %d; outcomes %v / %v / %v",
		n, runsAt[0].Load(), runsAt[1].Load(), runsAt[2].Load(), obs[0].seen, obs[1].seen, obs[2].seen)
}

// Every statement a Store runs on db's pool (those of a worker with claims
// of rows on the same table included) reads the table through its index
// with the plan the server keeps for it from the table's first moments
// (empty) to when it holds 20,000 rows: planned as the server chooses,
// and forced to the generic plan (a database or role whose plan_cache_mode
// is force_generic_plan, as the claims' session sets for itself).
func TestHostile2EveryPoolStatementKeepsReadingByTheIndex(t *testing.T) {
	t.Parallel()
	keys, ks, lks := planKeys()
	tokens := postgresstore.TextArray(keys)
	k := "'" + keys[0] + "'"
	for _, c := range []struct{ name, args string }{
		{"lookup", k},
		{"remember", k + ", 0, NULL, 'tok', 1"},
		{"remember-many", fmt.Sprintf("'%s', '%s', '%s', '%s'", ks, lks, tokens, lks)},
		{"claim", k + ", 1000, 'tok'"},
		{"claim-row", k + ", 'tok'"},
		{"seen-many", fmt.Sprintf("'%s'", ks)},
		{"seen-locked", fmt.Sprintf("'%s', '%s'", ks, lks)},
		{"extend", k + ", 1000, 'tok'"},
		{"extend-many", fmt.Sprintf("'%s', '%s', '%s'", ks, lks, tokens)},
		{"claim-many", fmt.Sprintf("'%s', '%s', '%s'", ks, lks, tokens)},
		{"takeover", k + ", 1000, 'tok'"},
		{"release", k + ", 'tok'"},
		{"remember-tx", k + ", 0, NULL, 'tok', 1"},
		{"forget", k},
		{"fail", k + `, 0, '{"attempts": 1}', 'tok'`},
		{"fail-row", k + ", 'tok'"},
		{"reopen", k + ", 'marker'"},
		{"remember-failing", k + ", 0, NULL, 'tok'"},
	} {
		for _, generic := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/generic=%v", c.name, generic), func(t *testing.T) {
				t.Parallel()
				db := h2Pool(t)
				s := newStore(t, db)
				query := s.Statements()[c.name]
				if query == "" {
					query = s.PoolStatements()[c.name]
				}
				if query == "" {
					t.Fatalf("no statement %q", c.name)
				}
				if p := planKept(t, db, s.Table(), query, c.args, generic); strings.Contains(p, "Seq Scan") {
					t.Errorf("the statement, planned while the table was empty, scans it once it holds 20,000 rows:\n%s", p)
				}
			})
		}
	}
}

// One key, four calls at once from four Stores on one table: a seen-set
// Remember (the pool's grouped statement), a session claim, a claim of
// rows, and a Lookup (its shared try of the key's lock meeting the
// others). Exactly one of the three writers wins: the record, or one
// claim; a record is never written beside a claim, and no claim misses it.
func TestHostile2FourStoresOneKey(t *testing.T) {
	t.Parallel()
	seen := newStore(t, h2Pool(t))
	session := h2Worker(t, seen.Table())
	rows := h2Worker(t, seen.Table(), postgresstore.WithRowClaims())
	looker := h2Worker(t, seen.Table(), postgresstore.WithoutGrouping())
	rounds, width := 12, 16
	if testing.Short() {
		rounds = 3
	}
	wins := map[string]int{}
	for round := range rounds {
		type result struct {
			remErr                   error
			sessClaimed, rowsClaimed bool
			errs                     []error
		}
		res := make([]result, width)
		start := make(chan struct{})
		var wg sync.WaitGroup
		var mu sync.Mutex
		for i := range res {
			key := fmt.Sprintf("four-%d-%d", round, i)
			r := &res[i]
			fail := func(err error) {
				mu.Lock()
				r.errs = append(r.errs, err)
				mu.Unlock()
			}
			wg.Go(func() { <-start; r.remErr = seen.Remember(context.Background(), key, 1, nil) })
			wg.Go(func() {
				<-start
				var err error
				if r.sessClaimed, _, err = session.Claim(h2Token("session"), key, time.Minute); err != nil {
					fail(err)
				}
			})
			wg.Go(func() {
				<-start
				var err error
				if r.rowsClaimed, _, err = rows.Claim(h2Token("rows"), key, time.Minute); err != nil {
					fail(err)
				}
			})
			wg.Go(func() {
				<-start
				if _, err := looker.Lookup(context.Background(), key); err != nil {
					fail(err)
				}
			})
		}
		close(start)
		wg.Wait()
		for i, r := range res {
			key := fmt.Sprintf("four-%d-%d", round, i)
			if len(r.errs) > 0 {
				t.Errorf("%s: %v", key, r.errs)
				continue
			}
			if r.remErr != nil && !errors.Is(r.remErr, stores.ErrClaimTaken) {
				t.Errorf("%s: Remember: %v", key, r.remErr)
				continue
			}
			var won []string
			if r.remErr == nil {
				won = append(won, "record")
			}
			if r.sessClaimed {
				won = append(won, "session claim")
			}
			if r.rowsClaimed {
				won = append(won, "claim of rows")
			}
			if len(won) != 1 {
				t.Errorf("%s: %d winners %v; want exactly one", key, len(won), won)
				continue
			}
			wins[won[0]]++
			got, err := looker.Lookup(context.Background(), key)
			switch {
			case err != nil:
				t.Fatal(err)
			case won[0] == "record" && !got.Remembered(), won[0] != "record" && got.State != stores.StateInFlight:
				t.Errorf("%s: won by the %s, and Lookup says %v", key, won[0], got.State)
			}
			if r.sessClaimed {
				if err := session.Remember(h2Token("session"), key, 1, nil); err != nil {
					t.Errorf("%s: the session holder's Remember: %v", key, err)
				}
			}
			if r.rowsClaimed {
				if err := rows.Remember(h2Token("rows"), key, 1, nil); err != nil {
					t.Errorf("%s: the rows holder's Remember: %v", key, err)
				}
			}
		}
	}
	t.Logf("%d keys: won by %v", rounds*width, wins)
}

// A holder whose session was terminated, once the Store found out, while
// another holder of the same Store took the key on the new session (once
// the first claim's lease ran out: until then the Store keeps the key for
// its holder): the first holder's Remember (plain, with a value) is
// refused, whichever way it is routed, and the second holder's claim holds
// and records.
func TestHostile2RememberAfterTheSessionWasTerminatedSameStore(t *testing.T) {
	t.Parallel()
	a := newStore(t, h2Pool(t))
	observer := h2Worker(t, a.Table())
	first, second := h2Token("first"), h2Token("second")
	if claimed, _, err := a.Claim(first, "k", time.Second); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	h2Terminate(t, a)
	if held, err := a.Extend(first, "k", time.Second); err != nil || held {
		t.Fatalf("Extend after the session was terminated = %v, %v; want not held", held, err)
	}
	waitClaim(t, a, second, "k", 10*time.Second)
	for _, v := range [][]byte{nil, []byte("v")} {
		if err := a.Remember(first, "k", 1, v); !errors.Is(err, stores.ErrClaimTaken) {
			t.Fatalf("the first holder's Remember (value %q) while the second holds the key = %v; want ErrClaimTaken", v, err)
		}
		if err := a.Remember(context.Background(), "k", 1, v); !errors.Is(err, stores.ErrClaimTaken) {
			t.Fatalf("a seen-set Remember (value %q) while the second holder holds the key = %v; want ErrClaimTaken", v, err)
		}
	}
	if r, err := observer.Lookup(context.Background(), "k"); err != nil || r.State != stores.StateInFlight {
		t.Fatalf("Lookup = %v, %v; want in flight", r.State, err)
	}
	if held, err := a.Extend(second, "k", time.Minute); err != nil || !held {
		t.Fatalf("the second holder's Extend = %v, %v; want held", held, err)
	}
	if err := a.Remember(second, "k", 2, nil); err != nil {
		t.Fatalf("the second holder's Remember: %v", err)
	}
	if r, err := observer.Lookup(context.Background(), "k"); err != nil || !r.Remembered() || r.Fingerprint == 0 {
		t.Fatalf("Lookup = %+v, %v; want the second holder's record", r, err)
	}
}

// Many Remembers without a claim of one key at once (grouped into one
// statement, the key's repeats written after it one by one) race another
// worker's claim of it: either the claim is taken and every Remember is
// refused, or the claim is not taken and the Remembers wrote the record.
func TestHostile2RepeatedRemembersOfOneKeyRaceAClaim(t *testing.T) {
	t.Parallel()
	a, b := h2Pair(t)
	rounds := 20
	if testing.Short() {
		rounds = 5
	}
	const repeats = 6
	for round := range rounds {
		key := fmt.Sprintf("repeated-%d", round)
		errs := make([]error, repeats)
		var claimed bool
		var claimErr error
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range errs {
			wg.Go(func() { <-start; errs[i] = a.Remember(context.Background(), key, uint64(i+1), nil) })
		}
		wg.Go(func() { <-start; claimed, _, claimErr = b.Claim(h2Token("other"), key, time.Minute) })
		close(start)
		wg.Wait()
		if claimErr != nil {
			t.Fatalf("%s: Claim: %v", key, claimErr)
		}
		written := 0
		for _, err := range errs {
			switch {
			case err == nil:
				written++
			case !errors.Is(err, stores.ErrClaimTaken):
				t.Fatalf("%s: Remember: %v", key, err)
			}
		}
		switch {
		case claimed && written > 0:
			t.Errorf("%s: the claim was taken, and %d of %d Remembers wrote the record", key, written, repeats)
		case !claimed && written == 0:
			t.Errorf("%s: the claim was not taken, and every Remember was refused", key)
		}
		if claimed {
			if err := b.Remember(h2Token("other"), key, 9, nil); err != nil {
				t.Errorf("%s: the holder's Remember: %v", key, err)
			}
		}
	}
}
