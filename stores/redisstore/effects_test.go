package redisstore_test

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/internal/testenv"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/stores/storetest"
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
