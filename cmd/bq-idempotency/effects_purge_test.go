package main

import (
	"context"
	"strings"
	"testing"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestEffectsPurge: "effects purge --older-than D" removes the final
// effects that entered their state more than D ago and never an unknown
// one, on Redis and PostgreSQL; it needs --older-than.
func TestEffectsPurge(t *testing.T) {
	t.Parallel()
	for name, c := range effectStoresUnderTest(t) {
		t.Run(name, func(t *testing.T) {
			unknown, done := seedEffects(t, c.store)
			purge := func(extra ...string) result {
				t.Helper()
				return run1(t, append(append([]string{"effects", "purge"}, c.flags...), extra...)...)
			}
			if r := purge(); r.code != 2 {
				t.Fatalf("effects purge without --older-than: exit %d, want 2\n%s%s", r.code, r.stdout, r.stderr)
			}
			if r := purge("--older-than", "1h"); r.code != 0 || !strings.Contains(r.stdout, "purged 0 ") {
				t.Fatalf("effects purge --older-than 1h: %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			if r := purge("--older-than", "1ms"); r.code != 0 || !strings.Contains(r.stdout, "purged 1 ") {
				t.Fatalf("effects purge --older-than 1ms: %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			ctx := context.Background()
			if e, _ := c.store.Lookup(ctx, done); e.State != stores.EffectNone {
				t.Fatalf("the succeeded effect after the purge: %s", e.State)
			}
			for _, key := range unknown {
				if e, _ := c.store.Lookup(ctx, key); e.State != stores.EffectUnknown {
					t.Fatalf("an unknown effect after the purge: %s, want kept", e.State)
				}
			}
		})
	}
}

// TestEffectsMigrateKeys: an effect written in the Redis key layout of
// earlier releases ({prefix}e:…) is found by the store after
// "effects migrate-keys"; a second run moves nothing.
func TestEffectsMigrateKeys(t *testing.T) {
	t.Parallel()
	rdb := testenv.Redis(t)
	ctx := context.Background()
	prefix := "cli" + testenv.RandomHex(5)
	if err := rdb.HSet(ctx, "{"+prefix+"}e:ch-1", "key", "ch-1", "name", "charge", "state", "unknown", "att", "1", "created", "1", "since", "1", "updated", "1").Err(); err != nil {
		t.Fatal(err)
	}
	flags := []string{"effects", "migrate-keys", "--redis-url", redisURL(), "--prefix", prefix}
	if r := run1(t, flags...); r.code != 0 || !strings.Contains(r.stdout, "moved 1 ") {
		t.Fatalf("effects migrate-keys: %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if e, err := redisstore.NewEffects(rdb, redisstore.WithEffectsPrefix(prefix)).Lookup(ctx, "ch-1"); err != nil || e.State != stores.EffectUnknown {
		t.Fatalf("after migrate-keys: %+v, %v", e, err)
	}
	if r := run1(t, flags...); r.code != 0 || !strings.Contains(r.stdout, "moved 0 ") {
		t.Fatalf("a second effects migrate-keys: %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if r := run1(t, "effects", "migrate-keys", "--store", "postgres"); r.code != 2 {
		t.Fatalf("migrate-keys on postgres: exit %d, want 2", r.code)
	}
}
