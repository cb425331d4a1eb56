package keepalive

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"
)

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestHeldLeaseIsRenewedUntilStop(t *testing.T) {
	t.Parallel()
	var renewals atomic.Int64
	l := Keep(context.Background(), 30*time.Millisecond, func(ctx context.Context, lease time.Duration) (bool, error) {
		if lease != 30*time.Millisecond {
			t.Errorf("renewed for %v, want the lease given to Keep", lease)
		}
		renewals.Add(1)
		return true, nil
	})
	waitFor(t, "five renewals", func() bool { return renewals.Load() >= 5 })
	if err := l.Context().Err(); err != nil {
		t.Fatalf("a held lease's context ended: %v", context.Cause(l.Context()))
	}
	if err := l.Stop(); err != nil {
		t.Fatalf("Stop of a held lease = %v, want nil", err)
	}
	if l.Context().Err() == nil {
		t.Fatal("Stop did not end the context")
	}
	n := renewals.Load()
	time.Sleep(50 * time.Millisecond) // nothing to wait for: no renewal may come
	if got := renewals.Load(); got != n {
		t.Fatalf("%d renewals after Stop", got-n)
	}
	if err := l.Stop(); err != nil {
		t.Fatalf("second Stop = %v", err)
	}
}

func TestLeaseTakenByAnotherHolderIsLost(t *testing.T) {
	t.Parallel()
	var calls atomic.Int64
	l := Keep(context.Background(), 30*time.Millisecond, func(context.Context, time.Duration) (bool, error) {
		return calls.Add(1) < 3, nil
	})
	<-l.Context().Done()
	cause := context.Cause(l.Context())
	if !errors.Is(cause, ErrLost) {
		t.Fatalf("cause = %v, want ErrLost", cause)
	}
	if err := l.Lost(); !errors.Is(err, ErrLost) {
		t.Fatalf("Lost() = %v", err)
	}
	if err := l.Stop(); !errors.Is(err, ErrLost) {
		t.Fatalf("Stop() = %v, want ErrLost", err)
	}
	if got := calls.Load(); got != 3 {
		t.Fatalf("%d renewals, want 3 (the third found it lost, none after)", got)
	}
}

func TestUnreachableStoreLosesTheLeaseWhenItRunsOut(t *testing.T) {
	t.Parallel()
	down := errors.New("connection refused")
	start := time.Now()
	var tries atomic.Int64
	l := Keep(context.Background(), 60*time.Millisecond, func(context.Context, time.Duration) (bool, error) {
		tries.Add(1)
		return false, down
	})
	<-l.Context().Done()
	took := time.Since(start)
	cause := context.Cause(l.Context())
	if !errors.Is(cause, ErrLost) || !errors.Is(cause, down) {
		t.Fatalf("cause = %v, want ErrLost wrapping the store's error", cause)
	}
	if took < 60*time.Millisecond {
		t.Fatalf("lost after %v, before its lease of 60ms ran out", took)
	}
	if tries.Load() < 2 {
		t.Fatalf("%d tries: a failed renewal must be tried again while the lease lasts", tries.Load())
	}
	l.Stop()
}

func TestPassingHiccupKeepsTheLease(t *testing.T) {
	t.Parallel()
	var calls atomic.Int64
	l := Keep(context.Background(), 60*time.Millisecond, func(context.Context, time.Duration) (bool, error) {
		if calls.Add(1) == 1 {
			return false, errors.New("timeout")
		}
		return true, nil
	})
	waitFor(t, "renewals after the hiccup", func() bool { return calls.Load() >= 6 })
	if err := l.Stop(); err != nil {
		t.Fatalf("one failed renewal lost the lease: %v", err)
	}
}

func TestRenewalIsBoundedByTheLease(t *testing.T) {
	t.Parallel()
	l := Keep(context.Background(), 30*time.Millisecond, func(ctx context.Context, _ time.Duration) (bool, error) {
		<-ctx.Done() // a store that never answers
		return false, ctx.Err()
	})
	select {
	case <-l.Context().Done():
	case <-time.After(10 * time.Second):
		t.Fatal("a renewal that never answers held the lease for ever")
	}
	if err := l.Stop(); !errors.Is(err, ErrLost) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Stop() = %v, want ErrLost wrapping the deadline", err)
	}
}

func TestParentEndsTheContextButNotTheRenewal(t *testing.T) {
	t.Parallel()
	parent, cancel := context.WithCancel(context.Background())
	var renewals atomic.Int64
	l := Keep(parent, 30*time.Millisecond, func(ctx context.Context, _ time.Duration) (bool, error) {
		if ctx.Err() != nil {
			t.Error("renewal ran on a cancelled context")
		}
		renewals.Add(1)
		return true, nil
	})
	cancel()
	<-l.Context().Done()
	n := renewals.Load()
	waitFor(t, "renewals after the parent ended", func() bool { return renewals.Load() >= n+2 })
	if err := l.Stop(); err != nil {
		t.Fatalf("Stop() = %v", err)
	}
}

// TestKeepFromCountsFromTheTaking: a lease whose taking call was slow is
// renewed a third of the lease after it was taken, not after Keep.
func TestKeepFromCountsFromTheTaking(t *testing.T) {
	t.Parallel()
	const lease = 300 * time.Millisecond
	taken := time.Now().Add(-lease / 3) // the claim took a third of the lease to come back
	renewed := make(chan time.Time, 1)
	start := time.Now()
	l := KeepFrom(context.Background(), taken, lease, func(context.Context, time.Duration) (bool, error) {
		select {
		case renewed <- time.Now():
		default:
		}
		return true, nil
	})
	defer l.Stop()
	first := <-renewed
	if after := first.Sub(start); after >= lease/3 {
		t.Fatalf("first renewal %v after KeepFrom, want at once (a third of the lease after the taking had passed already)", after)
	}
}

// TestStopWaitsForTheRenewalUnderWay: a Stop that meets a renewal on the
// wire returns only once it answered, and no renewal starts after it: the
// holder's release can never be overtaken by a renewal that re-extends
// the lease it just dropped.
func TestStopWaitsForTheRenewalUnderWay(t *testing.T) {
	t.Parallel()
	inside, release := make(chan struct{}), make(chan struct{})
	var after atomic.Int64
	var stopped atomic.Bool
	l := Keep(context.Background(), 30*time.Millisecond, func(context.Context, time.Duration) (bool, error) {
		if stopped.Load() {
			after.Add(1)
		}
		select {
		case inside <- struct{}{}:
			<-release
		default:
		}
		return true, nil
	})
	<-inside // a renewal is under way
	returned := make(chan struct{})
	go func() { _ = l.Stop(); stopped.Store(true); close(returned) }()
	select {
	case <-returned:
		t.Fatal("Stop returned while a renewal was under way")
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	<-returned
	time.Sleep(100 * time.Millisecond) // three periods: no renewal may start
	if n := after.Load(); n != 0 {
		t.Fatalf("%d renewals after Stop returned", n)
	}
}

// TestStoreSlowerThanAThirdOfTheLease: every renewal takes more than a
// third of the lease to come back (a slow store or network), yet each one
// lands well within the lease the one before it set. The lease must hold:
// the next renewal is due a period after the last one was sent, not a
// period after it came back, or the renewals fall behind the lease and a
// claim the store still holds is given up.
func TestStoreSlowerThanAThirdOfTheLease(t *testing.T) {
	t.Parallel()
	const lease = 1500 * time.Millisecond
	const roundTrip = lease * 36 / 100 // above lease/3, well below lease/2
	var renewals atomic.Int64
	l := Keep(context.Background(), lease, func(ctx context.Context, _ time.Duration) (bool, error) {
		select {
		case <-time.After(roundTrip):
			renewals.Add(1)
			return true, nil
		case <-ctx.Done():
			return false, ctx.Err()
		}
	})
	waitFor(t, "six renewals", func() bool { return renewals.Load() >= 6 || l.Lost() != nil })
	if err := l.Stop(); err != nil {
		t.Fatalf("renewals answering in %v (lease %v) lost the lease after %d renewals: %v", roundTrip, lease, renewals.Load(), err)
	}
}

// TestConfirmAsksTheStoreAfterAPause: a holder that was paused past its
// renewals (its lease taken nine tenths of a lease ago, no renewal since)
// and is about to act learns from Confirm that the store gave the lease to
// another holder, before it acts; its context ends.
func TestConfirmAsksTheStoreAfterAPause(t *testing.T) {
	t.Parallel()
	const lease = 10 * time.Second
	var asked atomic.Int64
	l := KeepFrom(context.Background(), time.Now().Add(-lease*9/10), lease, func(context.Context, time.Duration) (bool, error) {
		asked.Add(1)
		return false, nil // another holder has it
	})
	defer l.Stop()
	err := l.Confirm()
	if !errors.Is(err, ErrLost) {
		t.Fatalf("Confirm after a pause, the store holding the lease for another = %v; want ErrLost", err)
	}
	if asked.Load() == 0 {
		t.Fatal("Confirm did not ask the store")
	}
	if !errors.Is(context.Cause(l.Context()), ErrLost) {
		t.Fatalf("the holder's context after Confirm found the lease lost: %v; want ended with ErrLost", context.Cause(l.Context()))
	}
}

// TestConfirmOfAFreshLeaseAsksNothing: a lease taken or renewed a moment
// ago is confirmed without a round trip; one the store still holds after a
// pause is confirmed by asking it, and kept.
func TestConfirmOfAFreshLeaseAsksNothing(t *testing.T) {
	t.Parallel()
	const lease = 10 * time.Second
	var asked atomic.Int64
	renew := func(context.Context, time.Duration) (bool, error) { asked.Add(1); return true, nil }
	fresh := Keep(context.Background(), lease, renew)
	defer fresh.Stop()
	if err := fresh.Confirm(); err != nil || asked.Load() != 0 {
		t.Fatalf("Confirm of a lease just taken = %v after %d renewals; want nil after none", err, asked.Load())
	}
	paused := KeepFrom(context.Background(), time.Now().Add(-lease*9/10), lease, renew)
	defer paused.Stop()
	if err := paused.Confirm(); err != nil {
		t.Fatalf("Confirm after a pause, the store still holding the lease = %v; want nil", err)
	}
	if asked.Load() == 0 {
		t.Fatal("Confirm after a pause did not ask the store")
	}
	if err := paused.Context().Err(); err != nil {
		t.Fatalf("a confirmed lease's context ended: %v", context.Cause(paused.Context()))
	}
}
