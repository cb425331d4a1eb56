package keepalive

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestKeeperRenewsLeasesDueSoonTogether: leases taken at instants spread
// over a whole renewal period are renewed by a few firings of the
// keeper's timer a period, not one each: those due within half a period
// go with the first of them, and keep its rhythm.
func TestKeeperRenewsLeasesDueSoonTogether(t *testing.T) {
	t.Parallel()
	const n, lease = 200, 600 * time.Millisecond
	const period = lease / 3
	k := new(Keeper)
	counts := make([]atomic.Int64, n)
	var total atomic.Int64
	leases := make([]*Lease, n)
	start := time.Now()
	for i := range leases {
		taken := start.Add(-period * time.Duration(i) / n) // first renewals due all over a period
		leases[i] = k.KeepFrom(context.Background(), taken, lease, func(context.Context, time.Duration) (bool, error) {
			counts[i].Add(1)
			total.Add(1)
			return true, nil
		})
	}
	waitFor(t, "every lease renewed once", func() bool {
		for i := range counts {
			if counts[i].Load() == 0 {
				return false
			}
		}
		return true
	})
	ticks0, renewals0, from := Ticks(k), total.Load(), time.Now()
	waitFor(t, "five periods of renewals", func() bool { return total.Load() >= renewals0+5*n })
	ticks, renewals, took := Ticks(k)-ticks0, total.Load()-renewals0, time.Since(from)
	periods := float64(took) / float64(period)
	for i, l := range leases {
		if err := l.Stop(); err != nil {
			t.Errorf("lease %d lost: %v", i, err)
		}
	}
	t.Logf("%d leases: %d renewals in %d ticks over %.1f periods", n, renewals, ticks, periods)
	// Each tick clears the leases due within half a period: about two a
	// period; one lease alone a tick would make n.
	if max := uint64(4*periods) + 2; ticks > max {
		t.Fatalf("%d renewals took %d ticks over %.1f periods; want at most %d (a few a period, whatever the leases)", renewals, ticks, periods, max)
	}
	// Early renewals renew a lease at most every half period.
	if max := int64(2*periods*n) + n; renewals > max {
		t.Fatalf("%d renewals over %.1f periods of %d leases; want at most %d", renewals, periods, n, max)
	}
}

// TestKeeperRenewalThatWaitsDelaysNoOther: a renewal that hangs on the
// store holds up none of the keeper's other leases, renewed meanwhile in
// their own rhythm, and Stop of its lease waits for it.
func TestKeeperRenewalThatWaitsDelaysNoOther(t *testing.T) {
	t.Parallel()
	k := new(Keeper)
	inside, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	// Its first renewal is due at once, and hangs until released.
	slow := k.KeepFrom(context.Background(), time.Now().Add(-10*time.Second), 30*time.Second, func(context.Context, time.Duration) (bool, error) {
		once.Do(func() { close(inside) })
		<-release
		return true, nil
	})
	<-inside
	const n = 20
	counts := make([]atomic.Int64, n)
	others := make([]*Lease, n)
	for i := range others {
		others[i] = k.Keep(context.Background(), 60*time.Millisecond, func(context.Context, time.Duration) (bool, error) {
			counts[i].Add(1)
			return true, nil
		})
	}
	waitFor(t, "five renewals of every other lease while one renewal hangs", func() bool {
		for i := range counts {
			if counts[i].Load() < 5 {
				return false
			}
		}
		return true
	})
	stopped := make(chan error, 1)
	go func() { stopped <- slow.Stop() }()
	select {
	case err := <-stopped:
		t.Fatalf("Stop returned (%v) while the lease's renewal hung", err)
	case <-time.After(20 * time.Millisecond):
	}
	close(release)
	if err := <-stopped; err != nil {
		t.Fatalf("Stop of the slow lease = %v", err)
	}
	for i, l := range others {
		if err := l.Stop(); err != nil {
			t.Errorf("lease %d lost while another's renewal hung: %v", i, err)
		}
	}
}

// TestKeeperStopLeavesNothingBehind: a stopped lease leaves the keeper's
// queue and is renewed no more while the others are; once none is kept the
// timer is stopped and no goroutine of the keeper is left; a lease kept
// afterwards sets the timer again. Not parallel: it counts goroutines.
func TestKeeperStopLeavesNothingBehind(t *testing.T) {
	before := runtime.NumGoroutine()
	k := new(Keeper)
	const n, lease = 50, 60 * time.Millisecond
	counts := make([]atomic.Int64, n)
	leases := make([]*Lease, n)
	for i := range leases {
		leases[i] = k.Keep(context.Background(), lease, func(context.Context, time.Duration) (bool, error) {
			counts[i].Add(1)
			return true, nil
		})
	}
	waitFor(t, "two renewals of every lease", func() bool {
		for i := range counts {
			if counts[i].Load() < 2 {
				return false
			}
		}
		return true
	})
	if err := leases[0].Stop(); err != nil {
		t.Fatalf("Stop = %v", err)
	}
	at := counts[0].Load()
	waitFor(t, "the stopped lease out of the queue", func() bool { q, _ := Queued(k); return q <= n-1 })
	waitFor(t, "three more renewals of the others", func() bool { return counts[1].Load() >= at+3 })
	if got := counts[0].Load(); got != at {
		t.Fatalf("%d renewals of a stopped lease", got-at)
	}
	for _, l := range leases[1:] {
		if err := l.Stop(); err != nil {
			t.Fatalf("Stop = %v", err)
		}
	}
	if q, armed := Queued(k); q != 0 || armed {
		t.Fatalf("after every Stop: %d leases queued, timer set %v; want none, stopped", q, armed)
	}
	waitFor(t, "the goroutines back to what they were", func() bool { return runtime.NumGoroutine() <= before })

	var again atomic.Int64
	l := k.Keep(context.Background(), lease, func(context.Context, time.Duration) (bool, error) { again.Add(1); return true, nil })
	waitFor(t, "a lease kept after the keeper emptied renewed", func() bool { return again.Load() >= 2 })
	if err := l.Stop(); err != nil {
		t.Fatalf("Stop = %v", err)
	}
	if q, armed := Queued(k); q != 0 || armed {
		t.Fatalf("after Stop: %d leases queued, timer set %v", q, armed)
	}
	waitFor(t, "the goroutines back to what they were", func() bool { return runtime.NumGoroutine() <= before })
}

// TestKeeperLossAmongHeldLeases: on a keeper whose other leases are held,
// a lease whose store cannot be reached is tried again at its own
// intervals, never pulled early by the others' renewals, and lost only
// once its lease ran out; one the store gave to another holder is lost at
// its renewal. The held leases go on.
func TestKeeperLossAmongHeldLeases(t *testing.T) {
	t.Parallel()
	k := new(Keeper)
	const lease = 300 * time.Millisecond
	held := make([]*Lease, 20)
	for i := range held {
		held[i] = k.Keep(context.Background(), lease/2, func(context.Context, time.Duration) (bool, error) { return true, nil })
	}
	down := errors.New("connection refused")
	var mu sync.Mutex
	var tries []time.Time
	start := time.Now()
	unreachable := k.KeepFrom(context.Background(), start, lease, func(context.Context, time.Duration) (bool, error) {
		mu.Lock()
		tries = append(tries, time.Now())
		mu.Unlock()
		return false, down
	})
	taken := k.KeepFrom(context.Background(), start, lease, func(context.Context, time.Duration) (bool, error) { return false, nil })

	<-taken.Context().Done()
	if took := time.Since(start); took >= lease {
		t.Errorf("a lease the store holds for another was lost %v after it was taken; want at its first renewal, before its lease of %v ran out", took, lease)
	}
	if err := taken.Stop(); !errors.Is(err, ErrLost) {
		t.Errorf("Stop = %v, want ErrLost", err)
	}

	<-unreachable.Context().Done()
	took := time.Since(start)
	if cause := context.Cause(unreachable.Context()); !errors.Is(cause, ErrLost) || !errors.Is(cause, down) {
		t.Fatalf("cause = %v, want ErrLost wrapping the store's error", cause)
	}
	if took < lease {
		t.Fatalf("lost after %v, before its lease of %v ran out", took, lease)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(tries) < 3 {
		t.Fatalf("%d tries: a failed renewal must be tried again while the lease lasts", len(tries))
	}
	// Every retry but the last (bounded by what was left) waits a twelfth
	// of the lease after the failed try.
	for i := 1; i < len(tries)-1; i++ {
		if gap := tries[i].Sub(tries[i-1]); gap < lease/12 {
			t.Fatalf("retry %d came %v after the failed try; want a twelfth of the lease (%v) at least", i, gap, lease/12)
		}
	}
	unreachable.Stop()
	for i, l := range held {
		if err := l.Stop(); err != nil {
			t.Errorf("held lease %d lost: %v", i, err)
		}
	}
}
