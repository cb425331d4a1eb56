package keepalive

import (
	"context"
	"testing"
	"time"
)

// BenchmarkKeepStop: a claim kept and stopped before its first renewal, as
// a short message's, on a Keeper that holds 1,000 others.
func BenchmarkKeepStop(b *testing.B) {
	renew := func(context.Context, time.Duration) (bool, error) { return true, nil }
	ctx := context.Background()
	k := new(Keeper)
	for range 1000 {
		defer k.Keep(ctx, time.Minute, renew).Stop()
	}
	b.ReportAllocs()
	for b.Loop() {
		k.KeepFrom(ctx, time.Now(), 5*time.Second, renew).Stop()
	}
}
