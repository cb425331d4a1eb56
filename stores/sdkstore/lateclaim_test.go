package sdkstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/sdkstore"
)

// TestRedisLateClaimIsReleased: on a client without ContextTimeoutEnabled,
// a Claim whose caller left at its deadline goes on, and the claim lands
// after: it must be released, not held for its lease (a minute here), so
// that the redelivery finds the key free. A layout that reads more after
// its claim script (the Go layout's record check, the PHP layout's release
// of a claim over an ended record) read with the caller's ended context,
// failed at once and left the claim held.
func TestRedisLateClaimIsReleased(t *testing.T) {
	t.Parallel()
	client, direct, proxy := dlRedisClient(t, false)
	p := redisPrefix(t, direct)
	php, err := sdkstore.NewPHPRedis(client, sdkstore.WithPrefix(p+":php:"))
	if err != nil {
		t.Fatal(err)
	}
	goStore, err := sdkstore.NewGoRedis(client, sdkstore.WithPrefix(p+":go:"), sdkstore.WithClaimPrefix(p+":claim:"))
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name     string
		s        stores.Store
		claimKey func(string) string
		prepare  func(ctx context.Context, key string) error
	}{
		{"GoRedis", goStore, goStore.ClaimKey, nil},
		{"PHPRedis/ended", php, php.RedisKey, func(ctx context.Context, key string) error {
			// An ended record: the claim lands over it, and is dropped.
			ctx = stores.WithClaimToken(ctx, "prep")
			if ok, _, err := php.Claim(ctx, key, time.Minute); err != nil || !ok {
				return errors.Join(err, errors.New("not claimed"))
			}
			return php.Fail(ctx, key, 1, stores.Failure{Attempts: 1, FirstFailure: time.Now(), End: &stores.End{Reason: "failed", Marker: "m"}})
		}},
	}
	for _, c := range cases {
		key := "late-" + c.name
		// The scripts loaded, the connection open: the claim is one round
		// trip.
		wctx := stores.WithClaimToken(context.Background(), "warm")
		if _, _, err := c.s.Claim(wctx, "warm", time.Minute); err != nil {
			t.Fatal(err)
		}
		if err := c.s.Release(wctx, "warm"); err != nil {
			t.Fatal(err)
		}
		if c.prepare != nil {
			if err := c.prepare(context.Background(), key); err != nil {
				t.Fatalf("%s: %v", c.name, err)
			}
		}
		proxy.Delay.Store(int64(300 * time.Millisecond))
		ctx, cancel := context.WithTimeout(stores.WithClaimToken(context.Background(), "gone"), 100*time.Millisecond)
		_, _, err := c.s.Claim(ctx, key, time.Minute)
		cancel()
		proxy.Delay.Store(0)
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("%s: the claim under a 100ms deadline, Redis answering in 300ms: %v", c.name, err)
		}
		// The claim lands at about 300ms; its release within a few seconds.
		deadline := time.Now().Add(6 * time.Second)
		for {
			v, err := direct.Get(context.Background(), c.claimKey(key)).Result()
			if errors.Is(err, redis.Nil) || (err == nil && v != "" && !containsHolder(v, "gone")) {
				break
			}
			if time.Now().After(deadline) {
				ttl, _ := direct.PTTL(context.Background(), c.claimKey(key)).Result()
				t.Fatalf("%s: the claim its caller left is still held 6 s later (%q, %v of its lease left)", c.name, v, ttl)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

func containsHolder(v, holder string) bool {
	return len(v) >= len(holder) && v[len(v)-len(holder):] == holder
}
