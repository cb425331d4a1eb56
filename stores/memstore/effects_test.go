package memstore_test

import (
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/stores/storetest"
)

func TestEffectsContract(t *testing.T) {
	t.Parallel()
	storetest.RunEffects(t, func(*testing.T) stores.EffectStore { return memstore.NewEffects() },
		storetest.WithEffectsTTLStore(func(_ *testing.T, ttl time.Duration) stores.EffectStore {
			return memstore.NewEffects(memstore.WithEffectsTTL(ttl))
		}))
}

func TestEffectsPurge(t *testing.T) {
	storetest.RunEffectsPurge(t, func(*testing.T) storetest.PurgeableEffects { return memstore.NewEffects() })
}

func TestEffectsResultTTL(t *testing.T) {
	t.Parallel()
	storetest.RunEffects(t, func(*testing.T) stores.EffectStore { return memstore.NewEffects() },
		storetest.WithEffectsResultTTLStore(func(_ *testing.T, resultTTL, ttl time.Duration) storetest.PurgeableEffects {
			return memstore.NewEffects(memstore.WithEffectsTTL(ttl), memstore.WithResultTTL(resultTTL))
		}))
}

// TestEffectsResultTTLRefused: a result lifetime longer than the records'
// is refused, as is a negative one; one as long, or records kept forever,
// are not.
func TestEffectsResultTTLRefused(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		rttl, ttl time.Duration
		ok        bool
	}{{time.Hour, time.Minute, false}, {-time.Second, time.Hour, false}, {time.Hour, time.Hour, true}, {time.Hour, 0, true}, {0, time.Hour, true}} {
		func() {
			defer func() {
				if p := recover(); (p == nil) != c.ok {
					t.Errorf("result TTL %v, effects TTL %v: panic %v, want ok %v", c.rttl, c.ttl, p, c.ok)
				}
			}()
			memstore.NewEffects(memstore.WithEffectsTTL(c.ttl), memstore.WithResultTTL(c.rttl))
		}()
	}
}
