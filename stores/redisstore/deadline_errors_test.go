package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
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
						requireContextErrors(t, []func(ctx context.Context, key string) error{
							func(ctx context.Context, key string) error { return store.Remember(ctx, key, 1, nil) },
							func(ctx context.Context, key string) error {
								_, _, err := store.Claim(ctx, key, time.Minute)
								return err
							},
							func(ctx context.Context, key string) error { _, err := store.Lookup(ctx, key); return err },
							func(ctx context.Context, key string) error { _, err := store.Extend(ctx, key, time.Minute); return err },
							func(ctx context.Context, key string) error { return store.Release(ctx, key) },
							func(ctx context.Context, key string) error { return store.Forget(ctx, key) },
						})
					})
				}
				if !contextTimeout {
					return // the effects store's calls then wait out the client's read timeout
				}
				t.Run("effects", func(t *testing.T) {
					prefix, direct := "fx"+testenv.RandomHex(6), testenv.Redis(t)
					t.Cleanup(func() { dropKeys(direct, prefix+"*") }) // the scripts' keys, whichever call wrote them
					e := redisstore.NewEffects(client, redisstore.WithEffectsPrefix(prefix))
					requireContextErrors(t, []func(ctx context.Context, key string) error{
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
					})
				})
			})
		}
	}
}

// requireContextErrors runs 16 workers of 60 calls each, every call one
// of calls drawn at random under a deadline of its own from 1 to 20ms,
// and fails t for a call whose error does not match its context's.
func requireContextErrors(t *testing.T, calls []func(ctx context.Context, key string) error) {
	t.Helper()
	var mu sync.Mutex
	var failed, gaveUp int
	var wg sync.WaitGroup
	for w := range 16 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 11))
			for i := range 60 {
				d := time.Duration(1+rng.IntN(20)) * time.Millisecond
				ctx, cancel := context.WithTimeout(context.Background(), d)
				err := calls[rng.IntN(len(calls))](ctx, fmt.Sprintf("k-%d-%d", w, i%8))
				cancel()
				if err == nil {
					continue
				}
				mu.Lock()
				gaveUp++
				if !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
					failed++
					if failed <= 5 {
						t.Errorf("a call under a %v deadline: %v; want its answer or its context's error", d, err)
					}
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	t.Logf("%d calls gave up, %d with an error not their context's", gaveUp, failed)
}
