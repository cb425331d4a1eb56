package memstore_test

import (
	"context"
	"fmt"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// Final effects are kept stores.DefaultEffectsTTL (WithEffectsTTL to
// match your replay horizon); Purge removes older final effects, never one
// whose outcome nobody knows. redisstore and postgresstore have the same
// Purge, and bq-idempotency effects purge runs it.
func ExampleEffects_Purge() {
	ctx := context.Background()
	fx := memstore.NewEffects()
	for key, to := range map[string]stores.EffectState{"charge-1": stores.EffectSucceeded, "charge-2": stores.EffectUnknown} {
		_, _, _ = fx.Begin(ctx, stores.EffectIntent{Key: key}, time.Minute)
		_, _, _ = fx.Transition(ctx, key, stores.EffectTransition{To: to})
	}
	done, _ := fx.Lookup(ctx, "charge-1")
	fmt.Println("charge-1 kept for:", done.ExpiresAt.Sub(done.StateSince))

	// In production: time.Now().Add(-30 * 24 * time.Hour), or older.
	n, _ := fx.Purge(ctx, time.Now().Add(time.Second))
	fmt.Println("purged:", n)
	for _, key := range []string{"charge-1", "charge-2"} {
		e, _ := fx.Lookup(ctx, key)
		fmt.Printf("%s: %q\n", key, e.State)
	}
	// Output:
	// charge-1 kept for: 168h0m0s
	// purged: 1
	// charge-1: ""
	// charge-2: "unknown"
}
