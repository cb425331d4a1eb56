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
