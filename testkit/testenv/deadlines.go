package testenv

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
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

// RequireContextErrors runs workers goroutines of rounds calls each,
// every call one of calls drawn at random, on one of a few keys of its
// worker (key), under a deadline of its own from 1 to 20ms, and fails t
// for a call whose error matches neither context.DeadlineExceeded nor
// context.Canceled: a call that ran out of time must say so, rather than
// look like a store that failed. Run it against a store whose replies
// come late (a FaultProxy's Delay), so that many calls run out of time.
func RequireContextErrors(t testing.TB, workers, rounds int, calls ...func(ctx context.Context, key string) error) {
	t.Helper()
	var mu sync.Mutex
	var failed, gaveUp int
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 11))
			for i := range rounds {
				d := time.Duration(1+rng.IntN(20)) * time.Millisecond
				ctx, cancel := context.WithTimeout(context.Background(), d)
				err := calls[rng.IntN(len(calls))](ctx, fmt.Sprintf("k-%d-%d", w, i%8))
				cancel()
				if err == nil {
					continue
				}
				mu.Lock()
				gaveUp++
				if !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
					failed++
					if failed <= 5 {
						t.Errorf("a call under a %v deadline: %v; want its answer or its context's error", d, err)
					}
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	t.Logf("%d calls gave up, %d with an error not their context's", gaveUp, failed)
}
