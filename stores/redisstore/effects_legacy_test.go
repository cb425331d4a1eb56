package redisstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// writeOldEffect writes the effect key as a worker of the release before
// the current key layout did ({prefix}e:…, its index entry in {prefix}s:…).
func writeOldEffect(t *testing.T, client redis.UniversalClient, prefix, key, state string, extra ...any) {
	t.Helper()
	ctx := context.Background()
	old := "{" + prefix + "}"
	now := time.Now().UnixMilli()
	lease := "0"
	if state == "pending" {
		lease = "1" // long passed
	}
	fields := append([]any{"key", key, "name", "charge", "scope", "billing", "mid", "m-" + key, "fp", "7", "state", state, "att", "1",
		"holder", "old-worker", "lease", lease, "created", now, "since", now, "updated", now, "note", "", "ev", "call", "expires", "0"}, extra...)
	for _, cmd := range [][]any{append([]any{"HSET", old + "e:" + key}, fields...), {"ZADD", old + "s:" + state, now, key}} {
		if err := client.Do(ctx, cmd...).Err(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestEffectsFindTheOldLayout: an effect an earlier release recorded under
// the old key layout ({prefix}e:…), MigrateKeys not run, is found by a
// store of this release: Begin does not begin it again, Lookup and
// Transition see it, ApplyEvent moves it. With WithLegacyKeys(false) it
// stays where it is (a worker of the earlier release still reads what this
// one wrote); with true it is moved to the current layout, its index entry
// with it, on first touch. On a Cluster the two layouts share the slot of
// the store's hash tag, so each call is still one script. Before the
// fallback, Begin began it afresh (a second provider call).
func TestEffectsFindTheOldLayout(t *testing.T) {
	t.Parallel()
	for name, client := range map[string]redis.UniversalClient{"single": testenv.Redis(t), "cluster": testenv.RedisCluster(t)} {
		for _, moveKeys := range []bool{false, true} {
			t.Run(name+map[bool]string{false: "/stay", true: "/move"}[moveKeys], func(t *testing.T) {
				t.Parallel()
				ctx := stores.WithClaimToken(context.Background(), "new-worker")
				prefix := "fx" + testenv.RandomHex(6)
				old := "{" + prefix + "}"
				e := redisstore.NewEffects(client, redisstore.WithEffectsPrefix(prefix), redisstore.WithLegacyKeys(moveKeys))
				if cc, ok := client.(*redis.ClusterClient); ok {
					if a, b := cc.ClusterKeySlot(ctx, old+"e:x").Val(), cc.ClusterKeySlot(ctx, e.EffectKey("x")).Val(); a != b {
						t.Fatalf("the layouts' slots differ: %d and %d", a, b)
					}
				}
				writeOldEffect(t, client, prefix, "paid", "succeeded", "result", "ch_1")
				writeOldEffect(t, client, prefix, "open", "pending")
				writeOldEffect(t, client, prefix, "unsure", "unknown")

				began, found, err := e.Begin(ctx, stores.EffectIntent{Key: "paid", Name: "charge", Scope: "billing", MessageID: "m-paid", Fingerprint: 7}, time.Minute)
				if err != nil || began || found.State != stores.EffectSucceeded || string(found.Result) != "ch_1" || found.Attempts != 1 {
					t.Fatalf("Begin of an effect succeeded under the old layout: began %v, %+v, %v; want found, succeeded, ch_1", began, found, err)
				}
				if got, err := e.Lookup(ctx, "unsure"); err != nil || got.State != stores.EffectUnknown || got.MessageID != "m-unsure" {
					t.Fatalf("Lookup of an unknown effect under the old layout: %+v, %v", got, err)
				}
				// The pending one, its lease passed, is taken over: Attempts 2.
				moved, now, err := e.Transition(ctx, "open", stores.EffectTransition{From: stores.EffectPending, To: stores.EffectPending, Lease: time.Minute})
				if err != nil || !moved || now.Attempts != 2 || now.Holder != "new-worker" {
					t.Fatalf("taking over a lapsed pending effect of the old layout: %v, %+v, %v", moved, now, err)
				}
				if held, err := e.Extend(ctx, "open", time.Minute); err != nil || !held {
					t.Fatalf("Extend of the effect taken over: %v, %v", held, err)
				}
				if r, err := e.ApplyEvent(ctx, "evt", "unsure", stores.EffectTransition{To: stores.EffectFailed, Note: "declined"}); err != nil || !r.Moved {
					t.Fatalf("ApplyEvent on the old layout's unknown effect: %+v, %v", r, err)
				}

				oldKeys := client.Exists(ctx, old+"e:paid", old+"e:open", old+"e:unsure").Val()
				newKeys := client.Exists(ctx, e.EffectKey("paid"), e.EffectKey("open"), e.EffectKey("unsure")).Val()
				if moveKeys {
					if oldKeys != 0 || newKeys != 3 {
						t.Fatalf("moving: %d effects left in the old layout, %d in the new; want 0 and 3", oldKeys, newKeys)
					}
					list, err := e.List(ctx, stores.EffectQuery{})
					if err != nil || len(list) != 3 {
						t.Fatalf("List after the moves: %d effects, %v; want 3", len(list), err)
					}
					if n := client.ZCard(ctx, old+"s:succeeded").Val() + client.ZCard(ctx, old+"s:pending").Val(); n != 0 {
						t.Fatalf("%d entries left in the old indexes", n)
					}
				} else {
					if oldKeys != 3 || newKeys != 0 {
						t.Fatalf("in place: %d effects in the old layout, %d in the new; want 3 and 0", oldKeys, newKeys)
					}
					// What a worker of the earlier release reads.
					if st := client.HGet(ctx, old+"e:unsure", "state").Val(); st != "failed" {
						t.Fatalf("the old layout's record of the resolved effect: %q, want failed", st)
					}
					if n := client.ZScore(ctx, old+"s:failed", "unsure").Val(); n == 0 {
						t.Fatal("the resolved effect is not in the old layout's failed index")
					}
				}
				if err := e.Forget(ctx, "open"); err != nil {
					t.Fatal(err)
				}
				if n := client.Exists(ctx, old+"e:open", e.EffectKey("open")).Val(); n != 0 {
					t.Fatalf("Forget left %d keys of the effect", n)
				}
				for _, k := range []string{"paid", "unsure"} {
					if err := e.Forget(ctx, k); err != nil {
						t.Fatal(err)
					}
				}
			})
		}
	}
}
