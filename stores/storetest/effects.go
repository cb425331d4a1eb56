package storetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
)

// EffectsOption configures RunEffects.
type EffectsOption func(*effectsConfig)

type effectsConfig struct {
	lease       time.Duration
	newTTLStore func(t *testing.T, ttl time.Duration) stores.EffectStore
	newTiered   func(t *testing.T, resultTTL, ttl time.Duration) PurgeableEffects
}

// WithEffectsLease sets the lease RunEffects uses when it waits for one to
// pass (default 200ms).
func WithEffectsLease(lease time.Duration) EffectsOption {
	return func(c *effectsConfig) { c.lease = lease }
}

// WithEffectsTTLStore lets RunEffects test retention: newStore must return
// a store (as isolated as RunEffects's) whose final effects and recorded
// events lapse after ttl (a fraction of a second).
func WithEffectsTTLStore(newStore func(t *testing.T, ttl time.Duration) stores.EffectStore) EffectsOption {
	return func(c *effectsConfig) { c.newTTLStore = newStore }
}

// WithEffectsResultTTLStore lets RunEffects test the two retention tiers:
// newStore must return a store (as isolated as RunEffects's) that keeps the
// result of a succeeded effect for resultTTL (a fraction of a second) and
// its record for ttl (a minute or more).
func WithEffectsResultTTLStore(newStore func(t *testing.T, resultTTL, ttl time.Duration) PurgeableEffects) EffectsOption {
	return func(c *effectsConfig) { c.newTiered = newStore }
}

// RunEffects runs the contract suite of [stores.EffectStore] against the
// stores newStore returns. Each call must return a store of its own (a
// fresh key prefix or table): List and Stats see the whole store, and the
// subtests run in parallel.
//
// It covers: the intent recorded once (one winner among racing attempts);
// every transition, allowed or refused, and the holder rules of a pending
// effect (another attempt neither declares its outcome unknown nor sends it
// again while its lease runs; evidence is accepted from anyone); its lease
// extended by its holder only, never another's, never an effect that is
// not pending; an unknown effect keeping its last attempt's lease (Landing
// until it passes); a transition IfIdle (an operator's resolution)
// refused while an attempt may still act on the effect (pending within its
// lease, unknown and landing), whoever asks, and allowed once it cannot; an
// overrule moving an operator's final resolution, and nothing else, to
// succeeded with the provider's result; what a
// record keeps (provider result, note, evidence, attempts, times);
// provider events applied once, also when racing, in any order; listing by
// state and age, and the counts and ages of Stats; Forget; done contexts;
// with WithEffectsTTLStore, final effects lapsing while pending and
// unknown ones never do; and, with WithEffectsResultTTLStore, a succeeded
// effect's result dropped after its lifetime while the effect stays
// final, with its identity, in every read (Begin, Transition, ApplyEvent,
// Lookup, List) and through Purge.
func RunEffects(t *testing.T, newStore func(t *testing.T) stores.EffectStore, opts ...EffectsOption) {
	c := effectsConfig{lease: 200 * time.Millisecond}
	for _, opt := range opts {
		opt(&c)
	}
	k := keys{run: randomHex(6)}
	run := func(name string, test func(t *testing.T)) {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			test(t)
		})
	}
	run("BeginOnce", func(t *testing.T) { testEffectBeginOnce(t, newStore(t), k) })
	run("OneBeginAmong32", func(t *testing.T) { testEffectOneBegin(t, newStore(t), k) })
	run("Transitions", func(t *testing.T) { testEffectTransitions(t, newStore(t), k, c.lease) })
	run("NeverAllowed", func(t *testing.T) { testEffectNeverAllowed(t, newStore(t), k) })
	run("HolderRules", func(t *testing.T) { testEffectHolders(t, newStore(t), k, c.lease) })
	run("ExtendByTheHolderOnly", func(t *testing.T) { testEffectExtend(t, newStore(t), k, c.lease) })
	run("UnknownKeepsItsLease", func(t *testing.T) { testEffectLanding(t, newStore(t), k, c.lease) })
	run("IfIdleWaitsForTheAttempts", func(t *testing.T) { testEffectIfIdle(t, newStore(t), k, c.lease) })
	run("OverruleAnOperatorsResolution", func(t *testing.T) { testEffectOverrule(t, newStore(t), k) })
	run("KeepsWhatItIsGiven", func(t *testing.T) { testEffectKeeps(t, newStore(t), k) })
	run("Events", func(t *testing.T) { testEffectEvents(t, newStore(t), k) })
	run("RacingEvents", func(t *testing.T) { testEffectRacingEvents(t, newStore(t), k) })
	run("ListAndStats", func(t *testing.T) { testEffectListStats(t, newStore(t), k) })
	run("Forget", func(t *testing.T) { testEffectForget(t, newStore(t), k) })
	run("OddKeys", func(t *testing.T) { testEffectOddKeys(t, newStore(t), k) })
	run("DoneContext", func(t *testing.T) { testEffectDoneContext(t, newStore(t), k) })
	run("TTL", func(t *testing.T) {
		if c.newTTLStore == nil {
			t.Skip("no WithEffectsTTLStore given")
		}
		testEffectTTL(t, c.newTTLStore, k)
	})
	run("ResultTTL", func(t *testing.T) {
		if c.newTiered == nil {
			t.Skip("no WithEffectsResultTTLStore given")
		}
		testEffectResultTTL(t, c.newTiered, k)
	})
}

func intent(t *testing.T, k keys, name string) stores.EffectIntent {
	return stores.EffectIntent{Key: k.of(t, name), Name: "charge", Scope: "billing", MessageID: "m-" + name, Fingerprint: 0xfeedbeef}
}

func begin1(t *testing.T, s stores.EffectStore, ctx context.Context, in stores.EffectIntent, lease time.Duration, want bool) stores.Effect {
	t.Helper()
	began, found, err := s.Begin(ctx, in, lease)
	if err != nil {
		t.Fatalf("Begin(%q): %v", in.Key, err)
	}
	if began != want {
		t.Fatalf("Begin(%q) = %v (found %s), want %v", in.Key, began, found.State, want)
	}
	return found
}

func move(t *testing.T, s stores.EffectStore, ctx context.Context, key string, tr stores.EffectTransition, want bool, when string) stores.Effect {
	t.Helper()
	moved, now, err := s.Transition(ctx, key, tr)
	if err != nil {
		t.Fatalf("Transition(%q, %s→%s) %s: %v", key, tr.From, tr.To, when, err)
	}
	if moved != want {
		t.Fatalf("Transition(%q, %s→%s) %s = %v (now %s, holder %q, lapsed %v), want %v", key, tr.From, tr.To, when, moved, now.State, now.Holder, now.LeaseLapsed, want)
	}
	return now
}

func lookupEffect(t *testing.T, s stores.EffectStore, ctx context.Context, key string) stores.Effect {
	t.Helper()
	e, err := s.Lookup(ctx, key)
	if err != nil {
		t.Fatalf("Lookup(%q): %v", key, err)
	}
	return e
}

// sane fails unless at is within a minute of now: stores may use their
// server's clock.
func sane(t *testing.T, what string, at time.Time) {
	t.Helper()
	if d := time.Since(at); d > time.Minute || d < -time.Minute {
		t.Fatalf("%s = %v, not within a minute of now", what, at)
	}
}

func testEffectBeginOnce(t *testing.T, s stores.EffectStore, k keys) {
	ctx := stores.WithClaimToken(ctxWithTimeout(t), "attempt-1")
	in := intent(t, k, "a")
	got := begin1(t, s, ctx, in, time.Minute, true)
	if got.State != stores.EffectPending || got.Attempts != 1 || got.Holder != "attempt-1" || got.EffectIntent != in || got.LeaseLapsed {
		t.Fatalf("Begin returned %+v; want pending, attempt 1, held by attempt-1, the intent as given", got)
	}
	sane(t, "CreatedAt", got.CreatedAt)
	sane(t, "StateSince", got.StateSince)
	if d := got.LeaseUntil.Sub(got.StateSince); d < 55*time.Second || d > 65*time.Second {
		t.Fatalf("LeaseUntil is %v after StateSince, want the 1m lease", d)
	}
	other := in
	other.Fingerprint, other.Name = 1, "other"
	found := begin1(t, s, stores.WithClaimToken(ctx, "attempt-2"), other, time.Minute, false)
	if found.EffectIntent != in || found.State != stores.EffectPending || found.Holder != "attempt-1" {
		t.Fatalf("a second Begin found %+v; want the first intent, pending, held by attempt-1", found)
	}
	if e := lookupEffect(t, s, ctx, in.Key); e.EffectIntent != in || e.State != stores.EffectPending || e.Attempts != 1 {
		t.Fatalf("Lookup after two Begins = %+v", e)
	}
	if e := lookupEffect(t, s, ctx, in.Key+"-none"); e.State != stores.EffectNone {
		t.Fatalf("Lookup of a key never begun = %s, want none", e.State)
	}
}

func testEffectOneBegin(t *testing.T, s stores.EffectStore, k keys) {
	ctx := ctxWithTimeout(t)
	in := intent(t, k, "race")
	var wins atomic.Int32
	var wg sync.WaitGroup
	for i := range 32 {
		wg.Go(func() {
			began, _, err := s.Begin(stores.WithClaimToken(ctx, fmt.Sprint("a", i)), in, time.Minute)
			if err != nil {
				t.Error(err)
			}
			if began {
				wins.Add(1)
			}
		})
	}
	wg.Wait()
	if wins.Load() != 1 {
		t.Fatalf("%d of 32 racing Begins won, want 1", wins.Load())
	}
}

func testEffectTransitions(t *testing.T, s stores.EffectStore, k keys, lease time.Duration) {
	ctx := stores.WithClaimToken(ctxWithTimeout(t), "holder")
	type step struct {
		from, to stores.EffectState
		want     bool
	}
	// From a fresh pending effect (held by the caller), through each path.
	paths := map[string][]step{
		"pending-succeeded":       {{stores.EffectPending, stores.EffectSucceeded, true}},
		"pending-failed":          {{stores.EffectPending, stores.EffectFailed, true}},
		"pending-unknown-pending": {{stores.EffectPending, stores.EffectUnknown, true}, {stores.EffectUnknown, stores.EffectPending, true}, {stores.EffectPending, stores.EffectSucceeded, true}},
		"unknown-failed":          {{stores.EffectPending, stores.EffectUnknown, true}, {stores.EffectUnknown, stores.EffectFailed, true}},
		"stale-from":              {{stores.EffectUnknown, stores.EffectSucceeded, false}, {stores.EffectPending, stores.EffectUnknown, true}, {stores.EffectPending, stores.EffectSucceeded, false}},
		"own-retake":              {{stores.EffectPending, stores.EffectPending, true}},
		"any-from":                {{stores.EffectNone, stores.EffectUnknown, true}, {stores.EffectNone, stores.EffectSucceeded, true}, {stores.EffectNone, stores.EffectFailed, false}, {stores.EffectNone, stores.EffectPending, false}},
	}
	for name, steps := range paths {
		in := intent(t, k, name)
		begin1(t, s, ctx, in, time.Minute, true)
		attempts := 1
		for i, st := range steps {
			now := move(t, s, ctx, in.Key, stores.EffectTransition{From: st.from, To: st.to, Lease: lease, Evidence: "test"}, st.want, fmt.Sprintf("in %s, step %d", name, i+1))
			if st.want {
				if st.to == stores.EffectPending {
					attempts++
				}
				if now.State != st.to || now.Attempts != attempts {
					t.Fatalf("%s step %d: now %s with %d attempts, want %s with %d", name, i+1, now.State, now.Attempts, st.to, attempts)
				}
				if st.to == stores.EffectPending && (now.Holder != "holder" || now.LeaseLapsed) {
					t.Fatalf("%s step %d: retaken pending held by %q (lapsed %v), want the caller", name, i+1, now.Holder, now.LeaseLapsed)
				}
				if st.to != stores.EffectPending && now.Holder != "" {
					t.Fatalf("%s step %d: %s still names holder %q", name, i+1, now.State, now.Holder)
				}
			}
		}
	}
	if moved, now, err := s.Transition(ctx, k.of(t, "never-begun"), stores.EffectTransition{To: stores.EffectSucceeded}); err != nil || moved || now.State != stores.EffectNone {
		t.Fatalf("Transition of an effect never begun = %v, %s, %v; want not moved, none", moved, now.State, err)
	}
}

func testEffectNeverAllowed(t *testing.T, s stores.EffectStore, k keys) {
	ctx := ctxWithTimeout(t)
	in := intent(t, k, "final")
	begin1(t, s, ctx, in, time.Minute, true)
	move(t, s, ctx, in.Key, stores.EffectTransition{To: stores.EffectSucceeded, Result: []byte("ch_1")}, true, "to succeeded")
	for _, to := range stores.EffectStates {
		move(t, s, ctx, in.Key, stores.EffectTransition{To: to, Result: []byte("ch_2")}, false, "out of succeeded")
	}
	for _, tr := range []stores.EffectTransition{
		{From: stores.EffectSucceeded, To: stores.EffectFailed},
		{From: stores.EffectFailed, To: stores.EffectPending},
		{From: stores.EffectPending, To: stores.EffectNone},
		{To: stores.EffectNone},
		{To: "refunded"},
	} {
		if _, _, err := s.Transition(ctx, in.Key, tr); !errors.Is(err, stores.ErrEffectTransition) {
			t.Fatalf("Transition %q→%q = %v, want ErrEffectTransition", tr.From, tr.To, err)
		}
		if _, err := s.ApplyEvent(ctx, k.of(t, "ev-"+string(tr.To)), in.Key, tr); !errors.Is(err, stores.ErrEffectTransition) {
			t.Fatalf("ApplyEvent %q→%q = %v, want ErrEffectTransition", tr.From, tr.To, err)
		}
	}
	if e := lookupEffect(t, s, ctx, in.Key); e.State != stores.EffectSucceeded || string(e.Result) != "ch_1" {
		t.Fatalf("after refused transitions: %s %q, want succeeded ch_1", e.State, e.Result)
	}
}

func testEffectHolders(t *testing.T, s stores.EffectStore, k keys, lease time.Duration) {
	ctx := ctxWithTimeout(t)
	first, second := stores.WithClaimToken(ctx, "first"), stores.WithClaimToken(ctx, "second")

	live := intent(t, k, "live")
	begin1(t, s, first, live, time.Minute, true)
	move(t, s, second, live.Key, stores.EffectTransition{From: stores.EffectPending, To: stores.EffectUnknown}, false, "by another holder within the lease")
	move(t, s, second, live.Key, stores.EffectTransition{From: stores.EffectPending, To: stores.EffectPending, Lease: time.Minute}, false, "retaken by another holder within the lease")
	move(t, s, ctx, live.Key, stores.EffectTransition{From: stores.EffectPending, To: stores.EffectUnknown}, false, "by a caller naming no holder within the lease")
	now := move(t, s, second, live.Key, stores.EffectTransition{From: stores.EffectPending, To: stores.EffectSucceeded, Result: []byte("ch_9")}, true, "evidence from another holder")
	if string(now.Result) != "ch_9" {
		t.Fatalf("result %q, want ch_9", now.Result)
	}

	lapsing := intent(t, k, "lapsing")
	begin1(t, s, first, lapsing, lease, true)
	time.Sleep(lease + 50*time.Millisecond)
	if e := lookupEffect(t, s, ctx, lapsing.Key); !e.LeaseLapsed || e.State != stores.EffectPending {
		t.Fatalf("after its lease: %s, lapsed %v; want pending, lapsed", e.State, e.LeaseLapsed)
	}
	now = move(t, s, second, lapsing.Key, stores.EffectTransition{From: stores.EffectPending, To: stores.EffectPending, Lease: time.Minute}, true, "taken over after the lease")
	if now.Holder != "second" || now.Attempts != 2 || now.LeaseLapsed {
		t.Fatalf("taken over: holder %q, %d attempts, lapsed %v; want second, 2, live", now.Holder, now.Attempts, now.LeaseLapsed)
	}
	move(t, s, first, lapsing.Key, stores.EffectTransition{From: stores.EffectPending, To: stores.EffectUnknown}, false, "by the first holder after the takeover")
	move(t, s, first, lapsing.Key, stores.EffectTransition{From: stores.EffectPending, To: stores.EffectFailed, Note: "declined"}, true, "evidence from the first holder")
}

func extendEffect(t *testing.T, s stores.EffectStore, ctx context.Context, key string, lease time.Duration, want bool, when string) {
	t.Helper()
	held, err := s.Extend(ctx, key, lease)
	if err != nil {
		t.Fatalf("Extend(%q) %s: %v", key, when, err)
	}
	if held != want {
		e := lookupEffect(t, s, ctx, key)
		t.Fatalf("Extend(%q) %s = %v (the effect: %s, holder %q, lapsed %v), want %v", key, when, held, e.State, e.Holder, e.LeaseLapsed, want)
	}
}

// near fails unless at is within tolerance of want.
func near(t *testing.T, what string, at, want time.Time) {
	t.Helper()
	if d := at.Sub(want); d > 5*time.Second || d < -5*time.Second {
		t.Fatalf("%s = %v, want about %v", what, at, want)
	}
}

func testEffectExtend(t *testing.T, s stores.EffectStore, k keys, lease time.Duration) {
	ctx := ctxWithTimeout(t)
	first, second := stores.WithClaimToken(ctx, "first"), stores.WithClaimToken(ctx, "second")

	held := intent(t, k, "held")
	begun := begin1(t, s, first, held, lease, true)
	extendEffect(t, s, first, held.Key, time.Hour, true, "by its holder")
	e := lookupEffect(t, s, ctx, held.Key)
	near(t, "LeaseUntil after an extension by an hour", e.LeaseUntil, begun.StateSince.Add(time.Hour))
	if e.State != stores.EffectPending || e.Holder != "first" || e.Attempts != 1 || !e.StateSince.Equal(begun.StateSince) {
		t.Fatalf("after an extension: %+v; want pending, held by first, 1 attempt, the same StateSince", e)
	}
	extendEffect(t, s, second, held.Key, time.Minute, false, "by another attempt")
	extendEffect(t, s, ctx, held.Key, time.Minute, false, "by a caller naming no holder")
	if after := lookupEffect(t, s, ctx, held.Key); !after.LeaseUntil.Equal(e.LeaseUntil) || after.Holder != "first" {
		t.Fatalf("refused extensions changed the effect: until %v, holder %q; was until %v, held by first", after.LeaseUntil, after.Holder, e.LeaseUntil)
	}
	extendEffect(t, s, first, k.of(t, "never-begun"), time.Minute, false, "of an effect never begun")

	// An extended lease keeps another attempt out past the lease it began with.
	kept := intent(t, k, "kept")
	begin1(t, s, first, kept, lease, true)
	deadline := time.Now().Add(2 * lease)
	for time.Now().Before(deadline) {
		extendEffect(t, s, first, kept.Key, lease, true, "while its holder works")
		time.Sleep(lease / 4)
	}
	// Past the lease it began with, by twice; the last extension is long,
	// so that a loaded machine's pause before the take-over cannot let it
	// lapse: what is checked is that an extension counts, not a race.
	extendEffect(t, s, first, kept.Key, time.Minute, true, "past the lease it began with")
	move(t, s, second, kept.Key, stores.EffectTransition{From: stores.EffectPending, To: stores.EffectPending, Lease: time.Minute}, false, "taken over while its holder extends it")
	if e := lookupEffect(t, s, ctx, kept.Key); e.LeaseLapsed || e.Holder != "first" {
		t.Fatalf("an extended lease: lapsed %v, holder %q; want live, first", e.LeaseLapsed, e.Holder)
	}

	// A lease that passed while nobody took the effect is still its holder's.
	lapsed := intent(t, k, "lapsed")
	begin1(t, s, first, lapsed, lease, true)
	time.Sleep(lease + 50*time.Millisecond)
	extendEffect(t, s, first, lapsed.Key, time.Minute, true, "by its holder after its lease passed, nobody having taken it")
	if e := lookupEffect(t, s, ctx, lapsed.Key); e.LeaseLapsed {
		t.Fatal("an extended lease still reads lapsed")
	}
	// Once another attempt took it over, never again.
	taken := intent(t, k, "taken")
	begin1(t, s, first, taken, lease, true)
	time.Sleep(lease + 50*time.Millisecond)
	move(t, s, second, taken.Key, stores.EffectTransition{From: stores.EffectPending, To: stores.EffectPending, Lease: time.Minute}, true, "taken over after the lease")
	extendEffect(t, s, first, taken.Key, time.Minute, false, "by the first holder after the takeover")
	extendEffect(t, s, second, taken.Key, time.Minute, true, "by the attempt that took it over")

	// Never an effect that is not pending.
	for _, to := range []stores.EffectState{stores.EffectUnknown, stores.EffectSucceeded, stores.EffectFailed} {
		in := intent(t, k, "not-pending-"+string(to))
		begin1(t, s, first, in, time.Minute, true)
		move(t, s, first, in.Key, stores.EffectTransition{To: to}, true, "to "+string(to))
		before := lookupEffect(t, s, ctx, in.Key)
		extendEffect(t, s, first, in.Key, time.Hour, false, "of a "+string(to)+" effect by its last holder")
		if after := lookupEffect(t, s, ctx, in.Key); after.State != to || !after.LeaseUntil.Equal(before.LeaseUntil) {
			t.Fatalf("Extend of a %s effect changed it: %s until %v, was until %v", to, after.State, after.LeaseUntil, before.LeaseUntil)
		}
	}
}

func testEffectLanding(t *testing.T, s stores.EffectStore, k keys, lease time.Duration) {
	ctx := stores.WithClaimToken(ctxWithTimeout(t), "sender")
	in := intent(t, k, "landing")
	start := time.Now()
	begun := begin1(t, s, ctx, in, lease, true)
	e := move(t, s, ctx, in.Key, stores.EffectTransition{From: stores.EffectPending, To: stores.EffectUnknown, Evidence: "call"}, true, "to unknown by its holder")
	if e.Holder != "" || !e.LeaseUntil.Equal(begun.LeaseUntil) {
		t.Fatalf("unknown right after its send: holder %q, until %v; want no holder, until %v (its lease)", e.Holder, e.LeaseUntil, begun.LeaseUntil)
	}
	looked := lookupEffect(t, s, ctx, in.Key)
	// Within the lease only if the calls came back within it: a loaded
	// machine can take longer, and the checks would then say nothing.
	if surelyWithin(start, lease) {
		if !e.Landing {
			t.Fatalf("unknown right after its send: landing false; want landing (within its lease)")
		}
		if !looked.Landing || looked.LeaseLapsed {
			t.Fatalf("Lookup of an unknown effect within its lease: landing %v, lapsed %v; want landing, not lapsed", looked.Landing, looked.LeaseLapsed)
		}
	} else {
		t.Logf("the calls took %v, longer than the lease of %v: within-the-lease checks skipped", time.Since(start), lease)
	}
	deadline := time.Now().Add(lease + 10*time.Second)
	for e = lookupEffect(t, s, ctx, in.Key); e.Landing && time.Now().Before(deadline); e = lookupEffect(t, s, ctx, in.Key) {
		time.Sleep(20 * time.Millisecond)
	}
	if e.Landing || e.State != stores.EffectUnknown {
		t.Fatalf("an unknown effect after its lease: %s, landing %v; want unknown, not landing", e.State, e.Landing)
	}
	// Sent again: a new lease, from the new send.
	e = move(t, s, ctx, in.Key, stores.EffectTransition{From: stores.EffectUnknown, To: stores.EffectPending, Lease: time.Hour}, true, "sent again")
	near(t, "LeaseUntil of the second send", e.LeaseUntil, e.StateSince.Add(time.Hour))
	e = move(t, s, ctx, in.Key, stores.EffectTransition{To: stores.EffectUnknown}, true, "unknown again")
	if !e.Landing {
		t.Fatal("unknown after a second send with an hour's lease: not landing")
	}
	for _, tr := range []stores.EffectTransition{{To: stores.EffectSucceeded, Result: []byte("ch_1")}} {
		e = move(t, s, ctx, in.Key, tr, true, "settled")
		if e.Landing || !e.LeaseUntil.IsZero() {
			t.Fatalf("a settled effect: landing %v, until %v; want neither", e.Landing, e.LeaseUntil)
		}
	}
	// An attempt that took over a lapsed pending effect and declares it
	// unknown: the lease it found had passed, nothing is landing.
	lapsed := intent(t, k, "lapsed-unknown")
	begin1(t, s, stores.WithClaimToken(ctx, "dead"), lapsed, lease, true)
	time.Sleep(lease + 50*time.Millisecond)
	if e := move(t, s, ctx, lapsed.Key, stores.EffectTransition{From: stores.EffectPending, To: stores.EffectUnknown, Evidence: "lapsed"}, true, "declared unknown after its holder's lease"); e.Landing {
		t.Fatal("an effect declared unknown after its holder's lease passed reads landing")
	}
}

// awaitEffect looks the effect key up until cond holds, and fails after
// the lease and 10s more, printing what it saw.
func awaitEffect(t *testing.T, s stores.EffectStore, ctx context.Context, key string, lease time.Duration, what string, cond func(stores.Effect) bool) stores.Effect {
	t.Helper()
	deadline := time.Now().Add(lease + 10*time.Second)
	for {
		e := lookupEffect(t, s, ctx, key)
		if cond(e) {
			return e
		}
		if time.Now().After(deadline) {
			t.Fatalf("still waiting for %s: %s, until %v, lapsed %v, landing %v", what, e.State, e.LeaseUntil, e.LeaseLapsed, e.Landing)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func testEffectIfIdle(t *testing.T, s stores.EffectStore, k keys, lease time.Duration) {
	ctx := ctxWithTimeout(t)
	holder, operator := stores.WithClaimToken(ctx, "holder"), stores.WithClaimToken(ctx, "operator")
	failed := stores.EffectTransition{To: stores.EffectFailed, Note: "not in the ledger", Evidence: stores.EffectEvidenceOperator, IfIdle: true}
	succeeded := stores.EffectTransition{To: stores.EffectSucceeded, Result: []byte("ch_op"), Evidence: stores.EffectEvidenceOperator, IfIdle: true}

	// Pending, its holder's lease running (its call may be under way):
	// refused whoever asks, its holder too, and the lease's end reported.
	live := intent(t, k, "live")
	begun := begin1(t, s, holder, live, time.Minute, true)
	for _, c := range []context.Context{ctx, operator, holder} {
		for _, tr := range []stores.EffectTransition{failed, succeeded} {
			now := move(t, s, c, live.Key, tr, false, "IfIdle, of a pending effect within its holder's lease")
			if now.State != stores.EffectPending || now.Holder != "holder" || now.LeaseLapsed || !now.LeaseUntil.Equal(begun.LeaseUntil) {
				t.Fatalf("refused: %s held by %q until %v (lapsed %v); want pending, held by holder until %v", now.State, now.Holder, now.LeaseUntil, now.LeaseLapsed, begun.LeaseUntil)
			}
		}
	}
	if r, err := s.ApplyEvent(ctx, k.of(t, "evt-live"), live.Key, failed); err != nil || !r.First || r.Moved || r.Now.State != stores.EffectPending {
		t.Fatalf("ApplyEvent IfIdle of a pending effect within its lease: %+v, %v; want recorded, not moved", r, err)
	}
	// Unknown while its request may still land: refused, Landing reported.
	landing := intent(t, k, "landing")
	begun = begin1(t, s, holder, landing, time.Minute, true)
	move(t, s, holder, landing.Key, stores.EffectTransition{From: stores.EffectPending, To: stores.EffectUnknown, Evidence: "call"}, true, "to unknown by its holder")
	for _, tr := range []stores.EffectTransition{failed, succeeded} {
		now := move(t, s, operator, landing.Key, tr, false, "IfIdle, of an unknown effect still landing")
		if now.State != stores.EffectUnknown || !now.Landing || !now.LeaseUntil.Equal(begun.LeaseUntil) {
			t.Fatalf("refused: %s until %v, landing %v; want unknown, landing until %v", now.State, now.LeaseUntil, now.Landing, begun.LeaseUntil)
		}
	}
	// Without IfIdle (a forced resolution) both move.
	if now := move(t, s, operator, live.Key, stores.EffectTransition{To: stores.EffectFailed, Evidence: stores.EffectEvidenceOperator}, true, "forced, within the lease"); now.State != stores.EffectFailed {
		t.Fatalf("forced: %s, want failed", now.State)
	}
	move(t, s, operator, landing.Key, stores.EffectTransition{To: stores.EffectSucceeded, Evidence: stores.EffectEvidenceOperator}, true, "forced, while landing")

	// Once no attempt may act on it: a pending effect whose lease passed
	// (its holder died), an unknown one no longer landing.
	lapsed := intent(t, k, "lapsed")
	begin1(t, s, holder, lapsed, lease, true)
	landed := intent(t, k, "landed")
	begin1(t, s, holder, landed, lease, true)
	move(t, s, holder, landed.Key, stores.EffectTransition{From: stores.EffectPending, To: stores.EffectUnknown, Evidence: "call"}, true, "to unknown by its holder")
	awaitEffect(t, s, ctx, lapsed.Key, lease, "the lease to pass", func(e stores.Effect) bool { return e.LeaseLapsed })
	awaitEffect(t, s, ctx, landed.Key, lease, "the request to have landed", func(e stores.Effect) bool { return !e.Landing })
	if now := move(t, s, operator, lapsed.Key, failed, true, "IfIdle, of a pending effect whose lease passed"); now.State != stores.EffectFailed || now.Evidence != stores.EffectEvidenceOperator {
		t.Fatalf("resolved: %s by %q, want failed by operator", now.State, now.Evidence)
	}
	if now := move(t, s, operator, landed.Key, succeeded, true, "IfIdle, of an unknown effect no longer landing"); now.State != stores.EffectSucceeded || string(now.Result) != "ch_op" {
		t.Fatalf("resolved: %s %q, want succeeded ch_op", now.State, now.Result)
	}
}

func testEffectOverrule(t *testing.T, s stores.EffectStore, k keys) {
	ctx := ctxWithTimeout(t)
	byOperator := func(name string, tr stores.EffectTransition) string {
		t.Helper()
		in := intent(t, k, name)
		begin1(t, s, ctx, in, time.Minute, true)
		move(t, s, ctx, in.Key, tr, true, "resolved")
		return in.Key
	}
	overrule := stores.EffectTransition{From: stores.EffectFailed, To: stores.EffectSucceeded, Result: []byte("ch_1"), Evidence: "call", Overrule: true}

	// An operator's failed: the provider's success replaces it, with its result.
	key := byOperator("failed", stores.EffectTransition{To: stores.EffectFailed, Note: "not in the ledger", Evidence: stores.EffectEvidenceOperator})
	now := move(t, s, ctx, key, overrule, true, "overruling an operator's failed")
	if now.State != stores.EffectSucceeded || string(now.Result) != "ch_1" || now.Evidence != "call" {
		t.Fatalf("overruled: %s %q by %q; want succeeded ch_1 by call", now.State, now.Result, now.Evidence)
	}
	// The provider's own word now: no second overrule.
	again := overrule
	again.From, again.Result, again.Evidence = stores.EffectSucceeded, []byte("ch_2"), "callback"
	move(t, s, ctx, key, again, false, "overruling the provider's own success")
	if e := lookupEffect(t, s, ctx, key); e.State != stores.EffectSucceeded || string(e.Result) != "ch_1" {
		t.Fatalf("after a refused overrule: %s %q; want succeeded ch_1", e.State, e.Result)
	}

	// An operator's succeeded with a result of its own: the provider's replaces it.
	key = byOperator("succeeded", stores.EffectTransition{To: stores.EffectSucceeded, Result: []byte("manual"), Evidence: stores.EffectEvidenceOperator})
	move(t, s, ctx, key, overrule, false, "overruling from failed an effect that succeeded")
	fromAny := overrule
	fromAny.From, fromAny.Result = stores.EffectNone, []byte("ch_3")
	if now := move(t, s, ctx, key, fromAny, true, "overruling an operator's succeeded"); now.State != stores.EffectSucceeded || string(now.Result) != "ch_3" {
		t.Fatalf("overruled: %s %q; want succeeded ch_3", now.State, now.Result)
	}

	// A failure the provider declared, a pending and an unknown effect: an
	// overrule moves none.
	key = byOperator("declined", stores.EffectTransition{To: stores.EffectFailed, Note: "card_declined", Evidence: "call"})
	move(t, s, ctx, key, fromAny, false, "overruling the provider's failed")
	if e := lookupEffect(t, s, ctx, key); e.State != stores.EffectFailed || e.Note != "card_declined" {
		t.Fatalf("after a refused overrule: %s %q; want failed card_declined", e.State, e.Note)
	}
	pending := intent(t, k, "pending")
	begin1(t, s, ctx, pending, time.Minute, true)
	move(t, s, ctx, pending.Key, fromAny, false, "overruling a pending effect")
	move(t, s, ctx, pending.Key, stores.EffectTransition{To: stores.EffectUnknown}, true, "to unknown")
	move(t, s, ctx, pending.Key, fromAny, false, "overruling an unknown effect")

	// Applied by a provider event, once.
	key = byOperator("event", stores.EffectTransition{To: stores.EffectFailed, Evidence: stores.EffectEvidenceOperator})
	event := k.of(t, "evt")
	if r, err := s.ApplyEvent(ctx, event, key, fromAny); err != nil || !r.First || !r.Moved || r.Now.State != stores.EffectSucceeded || string(r.Now.Result) != "ch_3" {
		t.Fatalf("an event overruling an operator's failed: %+v, %v; want first, moved to succeeded ch_3", r, err)
	}
	if r, err := s.ApplyEvent(ctx, event, key, fromAny); err != nil || r.First || r.Moved {
		t.Fatalf("the same event again: %+v, %v; want a duplicate", r, err)
	}

	// Never allowed: to anything but succeeded, or from a state that is not final.
	for _, tr := range []stores.EffectTransition{
		{To: stores.EffectFailed, Overrule: true},
		{To: stores.EffectUnknown, Overrule: true},
		{From: stores.EffectPending, To: stores.EffectSucceeded, Overrule: true},
		{From: stores.EffectUnknown, To: stores.EffectSucceeded, Overrule: true},
	} {
		if _, _, err := s.Transition(ctx, key, tr); !errors.Is(err, stores.ErrEffectTransition) {
			t.Fatalf("Transition overrule %q→%q = %v, want ErrEffectTransition", tr.From, tr.To, err)
		}
		if _, err := s.ApplyEvent(ctx, k.of(t, "evt-"+string(tr.From)+string(tr.To)), key, tr); !errors.Is(err, stores.ErrEffectTransition) {
			t.Fatalf("ApplyEvent overrule %q→%q = %v, want ErrEffectTransition", tr.From, tr.To, err)
		}
	}
}

func testEffectKeeps(t *testing.T, s stores.EffectStore, k keys) {
	ctx := stores.WithClaimToken(ctxWithTimeout(t), "h")
	in := intent(t, k, "keeps")
	begun := begin1(t, s, ctx, in, time.Minute, true)
	time.Sleep(20 * time.Millisecond)
	move(t, s, ctx, in.Key, stores.EffectTransition{To: stores.EffectUnknown, Note: "read tcp: i/o timeout", Evidence: "call"}, true, "to unknown")
	e := lookupEffect(t, s, ctx, in.Key)
	if e.Note != "read tcp: i/o timeout" || e.Evidence != "call" || !e.StateSince.After(begun.StateSince) || !e.CreatedAt.Equal(begun.CreatedAt) {
		t.Fatalf("unknown effect %+v; want the note and evidence, a later StateSince, the same CreatedAt", e)
	}
	result := []byte("ch_\x00\xff 3QK")
	move(t, s, ctx, in.Key, stores.EffectTransition{To: stores.EffectSucceeded, Result: result, Evidence: "lookup"}, true, "to succeeded")
	e = lookupEffect(t, s, ctx, in.Key)
	if !bytes.Equal(e.Result, result) || e.Evidence != "lookup" || e.Note != "read tcp: i/o timeout" || e.Attempts != 1 || e.EffectIntent != in {
		t.Fatalf("succeeded effect %+v; want the result byte for byte, evidence lookup, the earlier note kept, 1 attempt, the intent", e)
	}
	sane(t, "UpdatedAt", e.UpdatedAt)
	failed := intent(t, k, "failed")
	begin1(t, s, ctx, failed, time.Minute, true)
	move(t, s, ctx, failed.Key, stores.EffectTransition{To: stores.EffectFailed, Note: "card_declined", Evidence: "call"}, true, "to failed")
	if e := lookupEffect(t, s, ctx, failed.Key); e.Note != "card_declined" || len(e.Result) != 0 {
		t.Fatalf("failed effect note %q result %q; want card_declined, none", e.Note, e.Result)
	}
}

func testEffectEvents(t *testing.T, s stores.EffectStore, k keys) {
	ctx := ctxWithTimeout(t)
	in := intent(t, k, "ev")
	begin1(t, s, ctx, in, time.Minute, true)
	move(t, s, ctx, in.Key, stores.EffectTransition{To: stores.EffectUnknown}, true, "to unknown")

	apply := func(event string, tr stores.EffectTransition) stores.EventResult {
		t.Helper()
		r, err := s.ApplyEvent(ctx, k.of(t, event), in.Key, tr)
		if err != nil {
			t.Fatalf("ApplyEvent(%s): %v", event, err)
		}
		return r
	}
	succeeded := stores.EffectTransition{To: stores.EffectSucceeded, Result: []byte("ch_1"), Evidence: "callback"}
	if r := apply("evt_1", succeeded); !r.First || !r.Moved || r.Now.State != stores.EffectSucceeded || string(r.Now.Result) != "ch_1" {
		t.Fatalf("first event: %+v; want first, moved to succeeded with ch_1", r)
	}
	if r := apply("evt_1", succeeded); r.First || r.Moved || r.Now.State != stores.EffectSucceeded {
		t.Fatalf("the same event again: first %v moved %v; want neither", r.First, r.Moved)
	}
	// An older event arriving late: recorded, moves nothing out of a final state.
	if r := apply("evt_0", stores.EffectTransition{To: stores.EffectFailed, Note: "late"}); !r.First || r.Moved || r.Now.State != stores.EffectSucceeded {
		t.Fatalf("an out-of-order event: first %v moved %v now %s; want first, not moved, succeeded", r.First, r.Moved, r.Now.State)
	}
	if r := apply("evt_0", stores.EffectTransition{To: stores.EffectFailed}); r.First {
		t.Fatal("an event refused by the transitions was not recorded: its second delivery counts as first")
	}
	if r, err := s.ApplyEvent(ctx, k.of(t, "evt_x"), in.Key+"-none", succeeded); err != nil || !r.First || r.Moved || r.Now.State != stores.EffectNone {
		t.Fatalf("an event for no effect: %+v, %v; want first, not moved, none", r, err)
	}
	if r, err := s.ApplyEvent(ctx, k.of(t, "evt_x"), in.Key+"-none", succeeded); err != nil || r.First {
		t.Fatalf("an event for no effect, again: first %v, %v; want a duplicate", r.First, err)
	}
}

func testEffectRacingEvents(t *testing.T, s stores.EffectStore, k keys) {
	ctx := ctxWithTimeout(t)
	in := intent(t, k, "racing")
	begin1(t, s, ctx, in, time.Minute, true)
	var first, moved atomic.Int32
	var wg sync.WaitGroup
	for i := range 16 {
		wg.Go(func() {
			to := stores.EffectSucceeded
			if i%2 == 1 {
				to = stores.EffectFailed
			}
			r, err := s.ApplyEvent(ctx, k.of(t, fmt.Sprint("evt-", i%4)), in.Key, stores.EffectTransition{To: to})
			if err != nil {
				t.Error(err)
				return
			}
			if r.First {
				first.Add(1)
			}
			if r.Moved {
				moved.Add(1)
			}
		})
	}
	wg.Wait()
	if first.Load() != 4 || moved.Load() != 1 {
		t.Fatalf("16 deliveries of 4 racing events: %d first, %d moved; want 4, 1", first.Load(), moved.Load())
	}
}

func testEffectListStats(t *testing.T, s stores.EffectStore, k keys) {
	ctx := ctxWithTimeout(t)
	if stats, err := s.Stats(ctx); err != nil || len(stats) != 0 {
		t.Fatalf("Stats of an empty store = %v, %v; want none (give RunEffects a store of its own per call)", stats, err)
	}
	var unknown []string
	for i := range 5 {
		in := intent(t, k, fmt.Sprint("u", i))
		begin1(t, s, ctx, in, time.Minute, true)
		move(t, s, ctx, in.Key, stores.EffectTransition{To: stores.EffectUnknown}, true, "to unknown")
		unknown = append(unknown, in.Key)
		time.Sleep(15 * time.Millisecond) // distinct StateSince, in order
	}
	cut := time.Now()
	time.Sleep(15 * time.Millisecond)
	for i := range 3 {
		in := intent(t, k, fmt.Sprint("s", i))
		begin1(t, s, ctx, in, time.Minute, true)
		move(t, s, ctx, in.Key, stores.EffectTransition{To: stores.EffectSucceeded}, true, "to succeeded")
	}
	begin1(t, s, ctx, intent(t, k, "p"), time.Minute, true)

	list := func(q stores.EffectQuery) []string {
		t.Helper()
		got, err := s.List(ctx, q)
		if err != nil {
			t.Fatalf("List(%+v): %v", q, err)
		}
		var keys []string
		for _, e := range got {
			keys = append(keys, e.Key)
		}
		return keys
	}
	if got := list(stores.EffectQuery{States: []stores.EffectState{stores.EffectUnknown}}); strings.Join(got, ",") != strings.Join(unknown, ",") {
		t.Fatalf("List(unknown) = %v, want %v oldest first", got, unknown)
	}
	if got := list(stores.EffectQuery{States: []stores.EffectState{stores.EffectUnknown}, Limit: 2}); strings.Join(got, ",") != strings.Join(unknown[:2], ",") {
		t.Fatalf("List(unknown, limit 2) = %v, want %v", got, unknown[:2])
	}
	if got := list(stores.EffectQuery{EnteredBefore: cut}); strings.Join(got, ",") != strings.Join(unknown, ",") {
		t.Fatalf("List(entered before the cut) = %v, want %v", got, unknown)
	}
	if got := list(stores.EffectQuery{States: []stores.EffectState{stores.EffectPending, stores.EffectSucceeded}}); len(got) != 4 {
		t.Fatalf("List(pending, succeeded) = %d effects, want 4", len(got))
	}
	if got := list(stores.EffectQuery{}); len(got) != 9 {
		t.Fatalf("List() = %d effects, want 9", len(got))
	}
	stats, err := s.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := map[stores.EffectState]int64{stores.EffectUnknown: 5, stores.EffectSucceeded: 3, stores.EffectPending: 1}
	for state, n := range want {
		if stats[state].Count != n {
			t.Fatalf("Stats[%s].Count = %d, want %d (all: %v)", state, stats[state].Count, n, stats)
		}
		sane(t, "Stats["+string(state)+"].Oldest", stats[state].Oldest)
	}
	if _, ok := stats[stores.EffectFailed]; ok {
		t.Fatalf("Stats reports failed effects, there are none: %v", stats)
	}
	first := lookupEffect(t, s, ctx, unknown[0])
	if !stats[stores.EffectUnknown].Oldest.Equal(first.StateSince) || !stats[stores.EffectUnknown].Oldest.Before(stats[stores.EffectSucceeded].Oldest) {
		t.Fatalf("Stats[unknown].Oldest = %v, want the first unknown effect's %v (before the succeeded ones' %v)",
			stats[stores.EffectUnknown].Oldest, first.StateSince, stats[stores.EffectSucceeded].Oldest)
	}
	// A move out of a state leaves its counts.
	move(t, s, ctx, unknown[0], stores.EffectTransition{To: stores.EffectFailed}, true, "to failed")
	stats, err = s.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if stats[stores.EffectUnknown].Count != 4 || stats[stores.EffectFailed].Count != 1 {
		t.Fatalf("after one unknown effect failed: %v", stats)
	}
}

func testEffectForget(t *testing.T, s stores.EffectStore, k keys) {
	ctx := ctxWithTimeout(t)
	in := intent(t, k, "forget")
	begin1(t, s, ctx, in, time.Minute, true)
	move(t, s, ctx, in.Key, stores.EffectTransition{To: stores.EffectUnknown}, true, "to unknown")
	must(t, s.Forget(ctx, in.Key), "Forget")
	if e := lookupEffect(t, s, ctx, in.Key); e.State != stores.EffectNone {
		t.Fatalf("after Forget: %s", e.State)
	}
	if got, err := s.List(ctx, stores.EffectQuery{}); err != nil || len(got) != 0 {
		t.Fatalf("List after Forget = %d, %v; want none", len(got), err)
	}
	if stats, err := s.Stats(ctx); err != nil || stats[stores.EffectUnknown].Count != 0 {
		t.Fatalf("Stats after Forget = %v, %v", stats, err)
	}
	must(t, s.Forget(ctx, in.Key), "Forget of an unknown key")
	begin1(t, s, ctx, in, time.Minute, true)
}

func testEffectOddKeys(t *testing.T, s stores.EffectStore, k keys) {
	ctx := ctxWithTimeout(t)
	base := k.of(t, "K")
	for _, key := range []string{base + " ", base + "\x00x", base + "é", base + strings.Repeat("x", 600), strings.ToLower(base), base + "{tag}"} {
		in := stores.EffectIntent{Key: key, Name: "n\x1fm", Scope: "s\x00", MessageID: "é"}
		begin1(t, s, ctx, in, time.Minute, true)
		if e := lookupEffect(t, s, ctx, key); e.EffectIntent != in {
			t.Fatalf("Lookup(%q) = %+v, want %+v", key, e.EffectIntent, in)
		}
	}
	begin1(t, s, ctx, stores.EffectIntent{Key: base}, time.Minute, true)
}

func testEffectDoneContext(t *testing.T, s stores.EffectStore, k keys) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	key := k.of(t, "done")
	if _, _, err := s.Begin(ctx, stores.EffectIntent{Key: key}, time.Minute); err == nil {
		t.Fatal("Begin with a done context succeeded")
	}
	if _, _, err := s.Transition(ctx, key, stores.EffectTransition{To: stores.EffectUnknown}); err == nil {
		t.Fatal("Transition with a done context succeeded")
	}
	if _, err := s.ApplyEvent(ctx, key, key, stores.EffectTransition{To: stores.EffectUnknown}); err == nil {
		t.Fatal("ApplyEvent with a done context succeeded")
	}
	if _, err := s.Lookup(ctx, key); err == nil {
		t.Fatal("Lookup with a done context succeeded")
	}
	if _, err := s.Extend(ctx, key, time.Minute); err == nil {
		t.Fatal("Extend with a done context succeeded")
	}
	if _, err := s.List(ctx, stores.EffectQuery{}); err == nil {
		t.Fatal("List with a done context succeeded")
	}
	if _, err := s.Stats(ctx); err == nil {
		t.Fatal("Stats with a done context succeeded")
	}
	if err := s.Forget(ctx, key); err == nil {
		t.Fatal("Forget with a done context succeeded")
	}
}

func testEffectTTL(t *testing.T, newStore func(t *testing.T, ttl time.Duration) stores.EffectStore, k keys) {
	const ttl = 300 * time.Millisecond
	s := newStore(t, ttl)
	ctx := ctxWithTimeout(t)
	done, open, pending := intent(t, k, "done"), intent(t, k, "open"), intent(t, k, "pending")
	for _, in := range []stores.EffectIntent{done, open, pending} {
		begin1(t, s, ctx, in, time.Millisecond, true)
	}
	succeeded := time.Now() // done lapses no earlier than succeeded + ttl
	move(t, s, ctx, done.Key, stores.EffectTransition{To: stores.EffectSucceeded}, true, "to succeeded")
	move(t, s, ctx, open.Key, stores.EffectTransition{To: stores.EffectUnknown}, true, "to unknown")
	if r, err := s.ApplyEvent(ctx, k.of(t, "evt"), open.Key, stores.EffectTransition{To: stores.EffectUnknown}); err != nil || !r.First {
		t.Fatalf("ApplyEvent: %+v, %v", r, err)
	}
	// A loaded machine can stretch the calls above past the TTL: the
	// effect has lapsed then, which is no failure.
	if e := lookupEffect(t, s, ctx, done.Key); (e.State != stores.EffectSucceeded || e.ExpiresAt.IsZero()) && (e.State != stores.EffectNone || surelyWithin(succeeded, ttl)) {
		t.Fatalf("a succeeded effect under a TTL, %v after it succeeded: %s, expires %v; want succeeded with an expiry", time.Since(succeeded), e.State, e.ExpiresAt)
	}
	time.Sleep(ttl + 200*time.Millisecond)
	if e := lookupEffect(t, s, ctx, done.Key); e.State != stores.EffectNone {
		t.Fatalf("a succeeded effect after its TTL: %s, want lapsed", e.State)
	}
	if e := lookupEffect(t, s, ctx, open.Key); e.State != stores.EffectUnknown {
		t.Fatalf("an unknown effect after the TTL: %s, want kept", e.State)
	}
	if e := lookupEffect(t, s, ctx, pending.Key); e.State != stores.EffectPending || !e.LeaseLapsed {
		t.Fatalf("a pending effect after the TTL: %s lapsed %v, want kept, its lease lapsed", e.State, e.LeaseLapsed)
	}
	if r, err := s.ApplyEvent(ctx, k.of(t, "evt"), open.Key, stores.EffectTransition{To: stores.EffectUnknown}); err != nil || !r.First {
		t.Fatalf("an event after its TTL: %+v, %v; want first again", r, err)
	}
	stats, err := s.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if stats[stores.EffectSucceeded].Count != 0 || stats[stores.EffectUnknown].Count != 1 || stats[stores.EffectPending].Count != 1 {
		t.Fatalf("Stats after the TTL: %v; want the succeeded effect gone", stats)
	}
}

func testEffectResultTTL(t *testing.T, newStore func(t *testing.T, resultTTL, ttl time.Duration) PurgeableEffects, k keys) {
	const resultTTL, ttl = 300 * time.Millisecond, time.Hour
	s := newStore(t, resultTTL, ttl)
	ctx := ctxWithTimeout(t)
	paid, declined := intent(t, k, "paid"), intent(t, k, "declined")
	for _, in := range []stores.EffectIntent{paid, declined} {
		begin1(t, s, ctx, in, time.Minute, true)
	}
	succeeded := time.Now()
	now := move(t, s, ctx, paid.Key, stores.EffectTransition{To: stores.EffectSucceeded, Result: []byte("ch_1"), Evidence: "call"}, true, "to succeeded")
	move(t, s, ctx, declined.Key, stores.EffectTransition{To: stores.EffectFailed, Note: "card declined"}, true, "to failed")
	// A loaded machine can stretch the calls above past the lifetime: the
	// result is dropped then, which is no failure.
	if (string(now.Result) != "ch_1" || now.ResultDropped) && surelyWithin(succeeded, resultTTL) {
		t.Fatalf("the succeeded effect within its result's lifetime: result %q, dropped %v; want ch_1", now.Result, now.ResultDropped)
	}
	near(t, "ResultExpiresAt", now.ResultExpiresAt, succeeded.Add(resultTTL))
	near(t, "ExpiresAt", now.ExpiresAt, succeeded.Add(ttl))
	if e := lookupEffect(t, s, ctx, declined.Key); !e.ResultExpiresAt.IsZero() || e.ResultDropped {
		t.Fatalf("a failed effect: result expires %v, dropped %v; want neither (it has no result)", e.ResultExpiresAt, e.ResultDropped)
	}

	// Wait for the result to go, the record staying.
	var e stores.Effect
	for deadline := time.Now().Add(5 * time.Second); ; {
		e = lookupEffect(t, s, ctx, paid.Key)
		if e.ResultDropped || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	wantDropped := func(what string, e stores.Effect) {
		t.Helper()
		if !e.ResultDropped || e.Result != nil || e.State != stores.EffectSucceeded || e.EffectIntent != paid ||
			e.Attempts != 1 || e.Evidence != "call" || e.ExpiresAt.IsZero() || e.ResultExpiresAt.IsZero() {
			t.Fatalf("%s, %v after it succeeded (result lifetime %v): %+v; want succeeded, its intent and attempts kept, "+
				"the result dropped (nil, ResultDropped)", what, time.Since(succeeded), resultTTL, e)
		}
	}
	wantDropped("Lookup", e)
	if surelyWithin(succeeded, resultTTL) {
		t.Fatalf("the result was dropped %v after the effect succeeded, before its lifetime %v", time.Since(succeeded), resultTTL)
	}
	wantDropped("Begin", begin1(t, s, ctx, paid, time.Minute, false))
	wantDropped("a refused Transition", move(t, s, ctx, paid.Key, stores.EffectTransition{To: stores.EffectPending, Lease: time.Minute}, false, "after the result was dropped"))
	r, err := s.ApplyEvent(ctx, k.of(t, "evt"), paid.Key, stores.EffectTransition{To: stores.EffectSucceeded, Result: []byte("ch_2")})
	if err != nil || !r.First || r.Moved {
		t.Fatalf("ApplyEvent on a succeeded effect: %+v, %v; want first, not moved", r, err)
	}
	wantDropped("ApplyEvent", r.Now)
	list, err := s.List(ctx, stores.EffectQuery{States: []stores.EffectState{stores.EffectSucceeded}})
	if err != nil || len(list) != 1 {
		t.Fatalf("List succeeded: %d effects, %v; want 1", len(list), err)
	}
	wantDropped("List", list[0])
	if n, err := s.Purge(ctx, time.Now().Add(-time.Minute)); err != nil || n != 0 {
		t.Fatalf("Purge of older effects: %d, %v; want nothing removed (a dropped result is not a record)", n, err)
	}
	wantDropped("Lookup after Purge", lookupEffect(t, s, ctx, paid.Key))
	if e := lookupEffect(t, s, ctx, declined.Key); e.State != stores.EffectFailed || e.Note != "card declined" || e.ResultDropped {
		t.Fatalf("the failed effect after Purge: %+v", e)
	}
}
