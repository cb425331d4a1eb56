package testenv

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// RequireDeadlines calls call from callers goroutines, rounds times each,
// every call with a context that ends after deadline, against a server that
// never answers: the test fails if any call succeeds, or if the slowest
// returns later than deadline plus a second (slack for a loaded machine
// under -race; the failures it catches, a call that waits for its client's
// read timeout or never returns, take longer: give the client a read
// timeout of 2 s or more). call gets the caller's and the
// round's numbers.
func RequireDeadlines(t testing.TB, callers, rounds int, deadline time.Duration, call func(ctx context.Context, caller, round int) error) {
	t.Helper()
	var slowest atomic.Int64
	var succeeded atomic.Int32
	var wg sync.WaitGroup
	for c := range callers {
		wg.Go(func() {
			for r := range rounds {
				ctx, cancel := context.WithTimeout(context.Background(), deadline)
				start := time.Now()
				err := call(ctx, c, r)
				took := time.Since(start)
				cancel()
				if err == nil {
					succeeded.Add(1)
				}
				for {
					s := slowest.Load()
					if int64(took) <= s || slowest.CompareAndSwap(s, int64(took)) {
						break
					}
				}
			}
		})
	}
	wg.Wait()
	if succeeded.Load() != 0 {
		t.Fatalf("%d calls succeeded against a server that never answers", succeeded.Load())
	}
	if took := time.Duration(slowest.Load()); took > deadline+time.Second {
		t.Fatalf("the slowest call took %v with a deadline of %v", took.Round(time.Millisecond), deadline)
	} else {
		t.Logf("the slowest of %d calls with a %v deadline returned after %v", callers*rounds, deadline, took.Round(time.Millisecond))
	}
}
