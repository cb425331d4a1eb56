package redisstore_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestDeadlineErrorsMatchTheContext: through a proxy whose replies come
// 3ms late, callers of the store and of the effects store with deadlines
// of 1 to 20ms get their answer or an error that matches their context's,
// never a bare network timeout: whether or not the client honours
// contexts' deadlines (ContextTimeoutEnabled, which sets the connection's
// read deadline from the context's: it fires a moment before the context
// reports done) and whether or not it retries (MaxRetries -1: its retry's
// wait is what reported the context's error).
func TestDeadlineErrorsMatchTheContext(t *testing.T) {
	if testing.Short() {
		t.Skip("a load of a few seconds")
	}
	for _, contextTimeout := range []bool{false, true} {
		for _, retries := range []int{3, -1} {
			t.Run(fmt.Sprintf("ContextTimeoutEnabled=%v/MaxRetries=%d", contextTimeout, retries), func(t *testing.T) {
				client, proxy := proxiedClient(t, func(o *redis.Options) {
					o.ContextTimeoutEnabled, o.MaxRetries = contextTimeout, retries
				})
				proxy.Delay.Store(int64(3 * time.Millisecond))
				for _, tc := range []struct {
					name string
					opts []redisstore.Option
				}{{"pipelined", nil}, {"unpipelined", []redisstore.Option{redisstore.WithoutPipelining()}}} {
					t.Run(tc.name, func(t *testing.T) {
						store := newStore(t, client, tc.opts...)
						testenv.RequireContextErrors(t, 16, 60,
							func(ctx context.Context, key string) error { return store.Remember(ctx, key, 1, nil) },
							func(ctx context.Context, key string) error {
								_, _, err := store.Claim(ctx, key, time.Minute)
								return err
							},
							func(ctx context.Context, key string) error { _, err := store.Lookup(ctx, key); return err },
							func(ctx context.Context, key string) error { _, err := store.Extend(ctx, key, time.Minute); return err },
							func(ctx context.Context, key string) error { return store.Release(ctx, key) },
							func(ctx context.Context, key string) error { return store.Forget(ctx, key) },
						)
					})
				}
				t.Run("effects", func(t *testing.T) {
					prefix, direct := "fx"+testenv.RandomHex(6), testenv.Redis(t)
					t.Cleanup(func() { dropKeys(direct, prefix+"*") }) // the scripts' keys, whichever call wrote them
					e := redisstore.NewEffects(client, redisstore.WithEffectsPrefix(prefix))
					testenv.RequireContextErrors(t, 16, 60,
						func(ctx context.Context, key string) error {
							_, _, err := e.Begin(ctx, stores.EffectIntent{Key: key, Name: "charge"}, time.Minute)
							return err
						},
						func(ctx context.Context, key string) error { _, err := e.Lookup(ctx, key); return err },
						func(ctx context.Context, key string) error {
							_, _, err := e.Transition(ctx, key, stores.EffectTransition{From: stores.EffectPending, To: stores.EffectSucceeded, Result: []byte("ok")})
							return err
						},
						func(ctx context.Context, key string) error { _, err := e.Extend(ctx, key, time.Minute); return err },
						func(ctx context.Context, key string) error {
							_, err := e.ApplyEvent(ctx, "ev-"+key, key, stores.EffectTransition{From: stores.EffectPending, To: stores.EffectFailed})
							return err
						},
						func(ctx context.Context, key string) error { return e.Forget(ctx, key) },
					)
				})
			})
		}
	}
}
