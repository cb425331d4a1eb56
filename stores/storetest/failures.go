package storetest

import (
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
)

// runFailures runs the subtests of Fail and Reopen: failure counts that
// outlive deliveries and claims, ends that are not claimed, and reopening
// on purpose.
func runFailures(t *testing.T, newStore func(t *testing.T) stores.Store, c config, k keys, run func(string, func(*testing.T))) {
	caps := newStore(t).Capabilities()
	if !caps.Failures {
		run("FailuresRefused", func(t *testing.T) { testFailuresRefused(t, newStore(t), k) })
		return
	}
	t.Run("Failures", func(t *testing.T) {
		run("FailWithoutAClaim", func(t *testing.T) { testFailWithoutClaim(t, newStore(t), k) })
		run("FailNeverOverARecord", func(t *testing.T) { testFailNeverOverRecord(t, newStore(t), k) })
		run("EndIsNotClaimed", func(t *testing.T) { testEndIsNotClaimed(t, newStore(t), k, caps.Claims) })
		run("ReopenOnlyThatEnd", func(t *testing.T) { testReopenOnlyThatEnd(t, newStore(t), k) })
		run("OneReopenWins", func(t *testing.T) { testOneReopenWins(t, newStore(t), k) })
		run("ForgetDropsFailures", func(t *testing.T) { testForgetDropsFailures(t, newStore(t), k) })
		run("RememberReplacesFailing", func(t *testing.T) { testRememberReplacesFailing(t, newStore(t), k, caps.Claims) })
		if caps.Claims {
			run("ClaimCarriesTheCount", func(t *testing.T) { testClaimCarriesCount(t, newStore(t), k) })
			run("FailRefusesAnothersLiveClaim", func(t *testing.T) { testFailRefuses(t, newStore(t), k) })
			run("LapsedClaimKeepsTheCount", func(t *testing.T) { testLapsedClaimKeepsCount(t, newStore(t), k, c.lease) })
		}
		run("FailuresExpire", func(t *testing.T) {
			if c.newTTLStore == nil {
				t.Skip("no WithTTLStore given")
			}
			testFailuresExpire(t, c.newTTLStore, k)
		})
	})
}

// failure is a failure of attempts runs, the first a minute ago, the next
// due in a second, cut to the millisecond the stores keep.
func failure(attempts int) stores.Failure {
	now := time.Now()
	return stores.Failure{Attempts: attempts, FirstFailure: now.Add(-time.Minute).Truncate(time.Millisecond),
		NotBefore: now.Add(time.Second).Truncate(time.Millisecond)}
}

// ended is the end of a message dead-lettered with marker.
func ended(attempts int, marker string) stores.Failure {
	f := failure(attempts)
	f.NotBefore = time.Time{}
	f.End = &stores.End{Reason: "failed", At: time.Now().Truncate(time.Millisecond), Topic: "orders.dlq", Marker: marker}
	return f
}

// wantFailure fails t unless r is a record in state with f's fields and a
// fingerprint that matches fp.
func wantFailure(t *testing.T, s stores.Store, r stores.Record, state stores.State, fp uint64, f stores.Failure, when string) {
	t.Helper()
	if r.State != state {
		t.Fatalf("%s: state %v, want %v (record %+v)", when, r.State, state, r)
	}
	g := r.Failure
	if g.Attempts != f.Attempts || !g.FirstFailure.Equal(f.FirstFailure) || !g.NotBefore.Equal(f.NotBefore) {
		t.Fatalf("%s: failure %d runs, first %v, not before %v; want %d, %v, %v",
			when, g.Attempts, g.FirstFailure, g.NotBefore, f.Attempts, f.FirstFailure, f.NotBefore)
	}
	switch {
	case (g.End == nil) != (f.End == nil):
		t.Fatalf("%s: end %+v, want %+v", when, g.End, f.End)
	case g.End != nil && (g.End.Reason != f.End.Reason || !g.End.At.Equal(f.End.At) || g.End.Topic != f.End.Topic || g.End.Marker != f.End.Marker):
		t.Fatalf("%s: end %+v, want %+v", when, *g.End, *f.End)
	}
	if !s.Capabilities().Matches(r.Fingerprint, fp) {
		t.Fatalf("%s: fingerprint %d kept, does not match %d", when, r.Fingerprint, fp)
	}
}

func testFailuresRefused(t *testing.T, s stores.Store, k keys) {
	ctx := ctxWithTimeout(t)
	key := k.of(t, "a")
	if err := s.Fail(ctx, key, 0, failure(1)); !errors.Is(err, stores.ErrNotSupported) {
		t.Fatalf("Fail on a store without failures = %v, want ErrNotSupported", err)
	}
	if _, err := s.Reopen(ctx, key, ""); !errors.Is(err, stores.ErrNotSupported) {
		t.Fatalf("Reopen on a store without failures = %v, want ErrNotSupported", err)
	}
}

func testFailWithoutClaim(t *testing.T, s stores.Store, k keys) {
	ctx := ctxWithTimeout(t)
	key := k.of(t, "a")
	f := failure(1)
	must(t, s.Fail(ctx, key, 4242, f), "Fail of a key never claimed")
	wantFailure(t, s, lookup(t, s, ctx, key, "after Fail"), stores.StateFailing, 4242, f, "Lookup after Fail")
	wantSeen(t, s, ctx, key, false, "after Fail")
	f = failure(2)
	must(t, s.Fail(ctx, key, 4242, f), "Fail again")
	wantFailure(t, s, lookup(t, s, ctx, key, "after a second Fail"), stores.StateFailing, 4242, f, "Lookup after a second Fail")
}

func testFailNeverOverRecord(t *testing.T, s stores.Store, k keys) {
	ctx := ctxWithTimeout(t)
	key := k.of(t, "a")
	must(t, remember(ctx, s, key), "Remember")
	must(t, s.Fail(ctx, key, 0, failure(1)), "Fail of a remembered key")
	must(t, s.Fail(ctx, key, 0, ended(1, "")), "Fail with an end of a remembered key")
	if r := lookup(t, s, ctx, key, "after Fail"); r.State != stores.StateRemembered {
		t.Fatalf("a remembered key after Fail is %v, want remembered: the effect happened", r.State)
	}
}

func testEndIsNotClaimed(t *testing.T, s stores.Store, k keys, claims bool) {
	ctx := stores.WithClaimToken(ctxWithTimeout(t), "holder")
	key := k.of(t, "a")
	f := ended(4, "")
	if claims {
		claim(t, s, ctx, key, time.Minute, true, "of a new key")
	}
	must(t, s.Fail(ctx, key, 77, f), "Fail with an end")
	wantFailure(t, s, lookup(t, s, ctx, key, "after the end"), stores.StateEnded, 77, f, "Lookup after the end")
	wantSeen(t, s, ctx, key, false, "after the end")
	if !claims {
		return
	}
	got, found, err := s.Claim(stores.WithClaimToken(ctx, "another"), key, time.Minute)
	must(t, err, "Claim of an ended key")
	if got {
		t.Fatal("Claim of an ended key took it: a redelivery would run a message that ended")
	}
	wantFailure(t, s, found, stores.StateEnded, 77, f, "the record a Claim of an ended key finds")
	got, _, err = s.Claim(ctx, key, time.Minute)
	must(t, err, "Claim of an ended key by the holder that ended it")
	if got {
		t.Fatal("the holder that ended a key claimed it again")
	}
}

func testReopenOnlyThatEnd(t *testing.T, s stores.Store, k keys) {
	ctx := ctxWithTimeout(t)
	key := k.of(t, "a")
	if ok, err := s.Reopen(ctx, key, ""); err != nil || ok {
		t.Fatalf("Reopen of an unknown key = %v, %v; want false, nil", ok, err)
	}
	must(t, s.Fail(ctx, key, 0, failure(2)), "Fail")
	if ok, err := s.Reopen(ctx, key, ""); err != nil || ok {
		t.Fatalf("Reopen of a failing key = %v, %v; want false, nil: only an end is reopened", ok, err)
	}
	must(t, s.Fail(ctx, key, 0, ended(3, "redrive-1")), "Fail with an end")
	if ok, err := s.Reopen(ctx, key, "redrive-2"); err != nil || ok {
		t.Fatalf("Reopen with another marker = %v, %v; want false, nil", ok, err)
	}
	if ok, err := s.Reopen(ctx, key, ""); err != nil || ok {
		t.Fatalf("Reopen with no marker of an end that has one = %v, %v; want false, nil", ok, err)
	}
	if r := lookup(t, s, ctx, key, "after refused reopens"); r.State != stores.StateEnded {
		t.Fatalf("after refused reopens the key is %v, want ended", r.State)
	}
	if ok, err := s.Reopen(ctx, key, "redrive-1"); err != nil || !ok {
		t.Fatalf("Reopen with the end's marker = %v, %v; want true, nil", ok, err)
	}
	if r := lookup(t, s, ctx, key, "after Reopen"); r.State != stores.StateUnknown {
		t.Fatalf("after Reopen the key is %v, want unknown (a fresh count)", r.State)
	}
	must(t, remember(ctx, s, key), "Remember")
	if ok, err := s.Reopen(ctx, key, "redrive-1"); err != nil || ok {
		t.Fatalf("Reopen of a remembered key = %v, %v; want false, nil", ok, err)
	}
	wantSeen(t, s, ctx, key, true, "after Reopen of a remembered key")
}

func testOneReopenWins(t *testing.T, s stores.Store, k keys) {
	ctx := ctxWithTimeout(t)
	key := k.of(t, "a")
	must(t, s.Fail(ctx, key, 0, ended(1, "m")), "Fail with an end")
	var wins atomic.Int32
	var wg sync.WaitGroup
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ok, err := s.Reopen(ctx, key, "m")
			if err != nil {
				t.Errorf("Reopen: %v", err)
			}
			if ok {
				wins.Add(1)
			}
		}()
	}
	wg.Wait()
	if n := wins.Load(); n != 1 {
		t.Fatalf("%d of 16 concurrent Reopens of one end reported true, want 1", n)
	}
}

func testForgetDropsFailures(t *testing.T, s stores.Store, k keys) {
	ctx := ctxWithTimeout(t)
	failingKey, endedKey := k.of(t, "failing"), k.of(t, "ended")
	must(t, s.Fail(ctx, failingKey, 0, failure(2)), "Fail")
	must(t, s.Fail(ctx, endedKey, 0, ended(2, "")), "Fail with an end")
	for _, key := range []string{failingKey, endedKey} {
		must(t, s.Forget(ctx, key), "Forget")
		if r := lookup(t, s, ctx, key, "after Forget"); r.State != stores.StateUnknown {
			t.Fatalf("%q after Forget is %v, want unknown", key, r.State)
		}
	}
}

func testRememberReplacesFailing(t *testing.T, s stores.Store, k keys, claims bool) {
	ctx := stores.WithClaimToken(ctxWithTimeout(t), "holder")
	key := k.of(t, "a")
	must(t, s.Fail(ctx, key, 0, failure(2)), "Fail")
	if claims {
		claim(t, s, ctx, key, time.Minute, true, "of a failing key")
	}
	must(t, remember(ctx, s, key), "Remember after the run that succeeded")
	wantSeen(t, s, ctx, key, true, "after Remember")
	if r := lookup(t, s, ctx, key, "after Remember"); r.Failure.Attempts != 0 {
		t.Fatalf("a remembered key keeps %d failed runs, want none", r.Failure.Attempts)
	}
}

func testClaimCarriesCount(t *testing.T, s stores.Store, k keys) {
	ctx := ctxWithTimeout(t)
	first, second := stores.WithClaimToken(ctx, "first"), stores.WithClaimToken(ctx, "second")
	key := k.of(t, "a")
	got, found, err := s.Claim(first, key, time.Minute)
	must(t, err, "Claim of a new key")
	if !got || found.Failure.Attempts != 0 {
		t.Fatalf("Claim of a new key = %v with %d failed runs, want true with none", got, found.Failure.Attempts)
	}
	f := failure(1)
	must(t, s.Fail(first, key, 9, f), "Fail by the holder")
	r := lookup(t, s, ctx, key, "after the holder's Fail")
	if r.State != stores.StateInFlight || r.Failure.Attempts != 1 {
		t.Fatalf("after the holder's Fail the key is %v with %d failed runs, want in flight (the claim kept) with 1", r.State, r.Failure.Attempts)
	}
	claim(t, s, second, key, time.Minute, false, "while the holder that failed keeps its claim")
	if got, found, err := s.Claim(first, key, time.Minute); err != nil || !got || found.Failure.Attempts != 1 {
		t.Fatalf("the holder's Claim again = %v, %d failed runs, %v; want true, 1, nil", got, found.Failure.Attempts, err)
	}
	must(t, s.Release(first, key), "Release by the holder")
	wantFailure(t, s, lookup(t, s, ctx, key, "after Release"), stores.StateFailing, 9, f, "Lookup after the holder released")

	got, found, err = s.Claim(second, key, time.Minute)
	must(t, err, "Claim of a failing key")
	if !got {
		t.Fatalf("Claim of a failing key = false (found %+v), want true: a failing key runs again", found)
	}
	wantFailure(t, s, found, stores.StateFailing, 9, f, "the record a Claim of a failing key took over")
	if r := lookup(t, s, ctx, key, "while claimed"); r.State != stores.StateInFlight || r.Failure.Attempts != 1 {
		t.Fatalf("a claimed failing key is %v with %d failed runs, want in flight with 1", r.State, r.Failure.Attempts)
	}
	f = failure(2)
	must(t, s.Fail(second, key, 9, f), "Fail by the second holder")
	must(t, s.Release(second, key), "Release by the second holder")
	wantFailure(t, s, lookup(t, s, ctx, key, "after the second Fail and Release"), stores.StateFailing, 9, f, "Lookup after the second Fail and Release")

	claim(t, s, first, key, time.Minute, true, "of the failing key again")
	end := ended(3, "")
	must(t, s.Fail(first, key, 9, end), "Fail with an end by the holder")
	wantFailure(t, s, lookup(t, s, ctx, key, "after the end"), stores.StateEnded, 9, end, "Lookup after the holder ended the key")
}

func testFailRefuses(t *testing.T, s stores.Store, k keys) {
	ctx := ctxWithTimeout(t)
	holder, late := stores.WithClaimToken(ctx, "holder"), stores.WithClaimToken(ctx, "late")
	key := k.of(t, "a")
	claim(t, s, holder, key, time.Minute, true, "of a new key")
	for _, f := range []stores.Failure{failure(1), ended(1, "")} {
		if err := s.Fail(late, key, 0, f); !errors.Is(err, stores.ErrClaimTaken) {
			t.Fatalf("Fail over another holder's live claim = %v, want ErrClaimTaken", err)
		}
	}
	if r := lookup(t, s, ctx, key, "after the refused Fail"); r.State != stores.StateInFlight {
		t.Fatalf("after a refused Fail the key is %v, want in flight (the holder's claim kept)", r.State)
	}
	claim(t, s, stores.WithClaimToken(ctx, "probe"), key, time.Minute, false, "after the refused Fail")
}

func testLapsedClaimKeepsCount(t *testing.T, s stores.Store, k keys, lease time.Duration) {
	ctx := ctxWithTimeout(t)
	key := k.of(t, "a")
	must(t, s.Fail(ctx, key, 5, failure(2)), "Fail")
	dies := stores.WithClaimToken(ctx, "dies")
	claim(t, s, dies, key, lease, true, "by a holder about to die")
	f := failure(3)
	must(t, s.Fail(dies, key, 5, f), "Fail by the holder about to die") // its claim carries the count
	deadline := time.Now().Add(10 * time.Second)
	for {
		got, found, err := s.Claim(stores.WithClaimToken(ctx, "next"), key, time.Minute)
		must(t, err, "Claim after the holder died")
		if got {
			wantFailure(t, s, found, stores.StateFailing, 5, f, "the record a Claim took over from a lapsed claim")
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the dead holder's claim of %v was still held after 10 s", lease)
		}
		time.Sleep(lease / 4)
	}
}

func testFailuresExpire(t *testing.T, newStore func(t *testing.T, ttl time.Duration) stores.Store, k keys) {
	const ttl = 400 * time.Millisecond
	s := newStore(t, ttl)
	ctx := ctxWithTimeout(t)
	failingKey, endedKey := k.of(t, "failing"), k.of(t, "ended")
	must(t, s.Fail(ctx, failingKey, 0, failure(1)), "Fail")
	must(t, s.Fail(ctx, endedKey, 0, ended(1, "")), "Fail with an end")
	deadline := time.Now().Add(10 * time.Second)
	for _, key := range []string{failingKey, endedKey} {
		for lookup(t, s, ctx, key, "after the TTL").State != stores.StateUnknown {
			if time.Now().After(deadline) {
				t.Fatalf("%q still held 10 s after a TTL of %v", key, ttl)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}
