package keepalive_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/internal/keepalive"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestKeeperRenewsManyClaimsInFewRoundTrips: 500 claims on a real Redis,
// kept alive by one Keeper as a Guard's are, are renewed in one or two
// round trips a tick (the store pipelines the renewals started together)
// and a few ticks a renewal period, not one round trip a claim.
func TestKeeperRenewsManyClaimsInFewRoundTrips(t *testing.T) {
	t.Parallel()
	const n, lease = 500, 1500 * time.Millisecond
	const period = lease / 3
	client := testenv.Redis(t)
	trips := &testenv.RoundTrips{}
	client.AddHook(trips)
	s := redisstore.New(client, redisstore.WithPrefix("bqkeeper"+strconv.FormatInt(time.Now().UnixNano(), 36)+":"))
	ctx := context.Background()

	k := new(keepalive.Keeper)
	var renewals atomic.Int64
	leases := make([]*keepalive.Lease, n)
	for i := range leases {
		cctx := stores.WithClaimToken(ctx, "holder-"+strconv.Itoa(i))
		key := "claim:" + strconv.Itoa(i)
		taken := time.Now()
		if ok, _, err := s.Claim(cctx, key, lease); err != nil || !ok {
			t.Fatalf("claim %s: %v %v", key, ok, err)
		}
		leases[i] = k.KeepFrom(cctx, taken, lease, func(ctx context.Context, lease time.Duration) (bool, error) {
			renewals.Add(1)
			return s.Extend(ctx, key, lease)
		})
	}
	defer func() {
		for i, l := range leases {
			if err := l.Stop(); err != nil {
				t.Errorf("claim %d lost: %v", i, err)
			}
			_ = s.Release(stores.WithClaimToken(ctx, "holder-"+strconv.Itoa(i)), "claim:"+strconv.Itoa(i))
		}
	}()
	waitFor(t, "every claim renewed once", func() bool { return renewals.Load() >= n })
	_, trips0 := trips.Totals()
	ticks0, renewals0, from := keepalive.Ticks(k), renewals.Load(), time.Now()
	waitFor(t, "four periods of renewals", func() bool { return renewals.Load() >= renewals0+4*n })
	_, trips1 := trips.Totals()
	ticks, sent, took := keepalive.Ticks(k)-ticks0, trips1-trips0, time.Since(from)
	periods := float64(took) / float64(period)
	t.Logf("%d claims: %d renewals in %d round trips, %d ticks, over %.1f periods", n, renewals.Load()-renewals0, sent, ticks, periods)
	if max := uint64(4*periods) + 2; ticks > max {
		t.Fatalf("%d ticks over %.1f periods; want at most %d", ticks, periods, max)
	}
	// A tick's renewals start together and the store pipelines what is
	// concurrent: a round trip or two a tick on a quiet machine, more
	// while the goroutines of a large tick start on a loaded one (61 for
	// 2,000 renewals in four ticks, seen beside a full test run). What
	// must not happen is a round trip a claim, or one for every few: at
	// least five renewals ride each round trip.
	if done := renewals.Load() - renewals0; sent > done/5 {
		t.Fatalf("%d round trips for %d renewals in %d ticks; want at most %d (five renewals or more a round trip)", sent, done, ticks, done/5)
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}
