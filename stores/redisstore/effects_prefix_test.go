package redisstore_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// scanKeys returns the keys matching pattern on every master.
func scanKeys(t *testing.T, client redis.UniversalClient, pattern string) []string {
	t.Helper()
	ctx := context.Background()
	var keys []string
	scan := func(c *redis.Client) error {
		iter := c.Scan(ctx, 0, pattern, 100).Iterator()
		for iter.Next(ctx) {
			keys = append(keys, iter.Val())
		}
		return iter.Err()
	}
	var err error
	if cc, ok := client.(*redis.ClusterClient); ok {
		err = cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return scan(c) })
	} else {
		err = scan(client.(*redis.Client))
	}
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(keys)
	return keys
}

// TestEffectKeysStartWithThePrefix: every key an Effects store writes (the
// effect, the state indexes, a provider event) starts with the prefix as
// given, so a "prefix*" SCAN or a Redis ACL key pattern covers them, on a
// single Redis and on a Cluster (where they share one slot). Before: they
// started with "{prefix}" and "prefix*" found none.
func TestEffectKeysStartWithThePrefix(t *testing.T) {
	t.Parallel()
	for name, client := range map[string]redis.UniversalClient{"single": testenv.Redis(t), "cluster": testenv.RedisCluster(t)} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			prefix := "fx" + testenv.RandomHex(6) + ":"
			charge, evt := "charge-"+testenv.RandomHex(6), "evt-"+testenv.RandomHex(6)
			e := redisstore.NewEffects(client, redisstore.WithEffectsPrefix(prefix))
			ctx := context.Background()
			if _, _, err := e.Begin(ctx, stores.EffectIntent{Key: charge}, time.Minute); err != nil {
				t.Fatal(err)
			}
			if _, err := e.ApplyEvent(ctx, evt, charge, stores.EffectTransition{To: stores.EffectSucceeded}); err != nil {
				t.Fatal(err)
			}
			// Everything the store wrote, whatever its name: the keys
			// holding the effect's key or the event's id, or an index.
			all := append(scanKeys(t, client, "*"+charge+"*"), scanKeys(t, client, "*"+evt+"*")...)
			all = append(all, scanKeys(t, client, "*"+prefix+"*")...)
			slices.Sort(all)
			all = slices.Compact(all)
			got := scanKeys(t, client, prefix+"*")
			if len(all) < 3 || !slices.Equal(got, all) {
				t.Fatalf("keys written: %q; keys matching %q*: %q", all, prefix, got)
			}
			if e.EffectKey(charge)[:len(prefix)] != prefix {
				t.Fatalf("EffectKey = %q", e.EffectKey(charge))
			}
		})
	}
}

// TestMigrateKeysFromTheOldLayout: effects written in the layout of earlier
// releases ({prefix}e:…) are renamed by MigrateKeys and read by the store
// afterwards (a pending one still pending, its expiry kept, its index
// entry kept); a second run moves nothing; an effect begun again under the
// new layout is left as it is.
func TestMigrateKeysFromTheOldLayout(t *testing.T) {
	t.Parallel()
	for name, client := range map[string]redis.UniversalClient{"single": testenv.Redis(t), "cluster": testenv.RedisCluster(t)} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			prefix := "fx*" + testenv.RandomHex(6) // a glob character too
			old := "{" + prefix + "}"
			now := time.Now().UnixMilli()
			hash := func(key, state string) []any {
				return []any{"key", key, "name", "charge", "scope", "h", "mid", "m-" + key, "fp", "7", "state", state, "att", "1",
					"holder", "", "lease", "0", "created", now, "since", now, "updated", now, "note", "", "ev", "", "expires", "0"}
			}
			for _, cmd := range [][]any{
				append([]any{"HSET", old + "e:open"}, hash("open", "unknown")...),
				append([]any{"HSET", old + "e:again"}, hash("again", "unknown")...),
				{"ZADD", old + "s:unknown", now, "open", now, "again"},
				{"SET", old + "ev:evt", "1", "PX", 600000},
			} {
				if err := client.Do(ctx, cmd...).Err(); err != nil {
					t.Fatal(err)
				}
			}
			e := redisstore.NewEffects(client, redisstore.WithEffectsPrefix(prefix))
			// "again" is in the new layout too (begun anew by a worker of
			// this release whose store saw no earlier one).
			if err := client.Do(ctx, append([]any{"HSET", e.EffectKey("again")}, hash("again", "pending")...)...).Err(); err != nil {
				t.Fatal(err)
			}
			moved, left, err := e.MigrateKeys(ctx)
			if err != nil || moved != 3 || left != 1 {
				t.Fatalf("MigrateKeys = %d moved, %d left, %v; want 3 (open, the index, the event) and 1 (again)", moved, left, err)
			}
			got, err := e.Lookup(ctx, "open")
			if err != nil || got.State != stores.EffectUnknown || got.MessageID != "m-open" || got.Fingerprint != 7 {
				t.Fatalf("after the migration, Lookup(open) = %+v, %v", got, err)
			}
			list, err := e.List(ctx, stores.EffectQuery{States: []stores.EffectState{stores.EffectUnknown}})
			if err != nil || len(list) != 1 || list[0].Key != "open" {
				t.Fatalf("after the migration, unknown effects listed: %+v, %v", list, err)
			}
			if r, err := e.ApplyEvent(ctx, "evt", "open", stores.EffectTransition{To: stores.EffectSucceeded}); err != nil || r.First {
				t.Fatalf("the event recorded before the migration was applied again: %+v, %v", r, err)
			}
			if ttl := client.PTTL(ctx, prefix+old+"ev:evt").Val(); ttl <= 0 {
				t.Fatalf("the event lost its expiry: PTTL %v", ttl)
			}
			if moved, _, err := e.MigrateKeys(ctx); err != nil || moved != 0 {
				t.Fatalf("a second run moved %d (%v), want 0", moved, err)
			}
			_ = client.Del(ctx, old+"e:again").Err() // left by the migration: the test's to drop
		})
	}
}
