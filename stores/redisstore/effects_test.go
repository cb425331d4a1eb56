package redisstore_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/stores/storetest"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func effectsOn(client redis.UniversalClient, opts ...redisstore.EffectsOption) func(*testing.T) stores.EffectStore {
	return func(*testing.T) stores.EffectStore {
		return redisstore.NewEffects(client, append([]redisstore.EffectsOption{redisstore.WithEffectsPrefix("fx" + testenv.RandomHex(6))}, opts...)...)
	}
}

func TestEffectsContract(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	storetest.RunEffects(t, effectsOn(client),
		storetest.WithEffectsTTLStore(func(t *testing.T, ttl time.Duration) stores.EffectStore {
			return effectsOn(client, redisstore.WithEffectsTTL(ttl))(t)
		}))
}

// TestEffectsContractOnCluster: every script of a store stays in one slot.
func TestEffectsContractOnCluster(t *testing.T) {
	t.Parallel()
	storetest.RunEffects(t, effectsOn(testenv.RedisCluster(t)))
}

func TestEffectsPurge(t *testing.T) {
	t.Parallel()
	for name, client := range map[string]redis.UniversalClient{"single": testenv.Redis(t), "cluster": testenv.RedisCluster(t)} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			storetest.RunEffectsPurge(t, func(*testing.T) storetest.PurgeableEffects {
				return redisstore.NewEffects(client, redisstore.WithEffectsPrefix("fx"+testenv.RandomHex(6)))
			})
		})
	}
}

func TestEffectsResultTTL(t *testing.T) {
	t.Parallel()
	for name, client := range map[string]redis.UniversalClient{"single": testenv.Redis(t), "cluster": testenv.RedisCluster(t)} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			storetest.RunEffects(t, effectsOn(client),
				storetest.WithEffectsResultTTLStore(func(t *testing.T, resultTTL, ttl time.Duration) storetest.PurgeableEffects {
					return effectsOn(client, redisstore.WithEffectsTTL(ttl), redisstore.WithResultTTL(resultTTL))(t).(*redisstore.Effects)
				}))
		})
	}
}

// TestEffectResultFreed: under a result lifetime the result is a key of its
// own that Redis expires: once dropped, neither it nor a result field in
// the effect's hash is left, while the hash keeps its own expiry.
func TestEffectResultFreed(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	e := effectsOn(client, redisstore.WithEffectsTTL(time.Hour), redisstore.WithResultTTL(200*time.Millisecond))(t).(*redisstore.Effects)
	ctx := context.Background()
	if _, _, err := e.Begin(ctx, stores.EffectIntent{Key: "paid"}, time.Minute); err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Transition(ctx, "paid", stores.EffectTransition{To: stores.EffectSucceeded, Result: bytes.Repeat([]byte("r"), 4096)}); err != nil {
		t.Fatal(err)
	}
	if ttl := client.PTTL(ctx, e.ResultKey("paid")).Val(); ttl <= 0 || ttl > 200*time.Millisecond {
		t.Fatalf("the result key's PTTL: %v; want up to 200ms", ttl)
	}
	deadline := time.Now().Add(5 * time.Second)
	for client.Exists(ctx, e.ResultKey("paid")).Val() == 1 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := client.Exists(ctx, e.ResultKey("paid")).Val(); n != 0 {
		t.Fatal("the result key outlived its lifetime by 5s")
	}
	if client.HExists(ctx, e.EffectKey("paid"), "result").Val() {
		t.Fatal("the effect's hash holds the result too")
	}
	if ttl := client.PTTL(ctx, e.EffectKey("paid")).Val(); ttl < 50*time.Minute {
		t.Fatalf("the effect's hash PTTL: %v; want about an hour", ttl)
	}
}

func TestEffectsResultTTLRefused(t *testing.T) {
	t.Parallel()
	defer func() {
		if p := recover(); p == nil {
			t.Fatal("a result TTL longer than the effects TTL was accepted")
		} else if err, ok := p.(error); !ok || !errors.Is(err, redisstore.ErrInvalidOption) {
			t.Fatalf("panic %v, want ErrInvalidOption", p)
		}
	}()
	redisstore.NewEffects(testenv.Redis(t), redisstore.WithEffectsTTL(time.Hour), redisstore.WithResultTTL(2*time.Hour))
}
