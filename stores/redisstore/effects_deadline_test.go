package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestEffectsCallsReturnByTheirDeadline: against a Redis that accepts
// connections and never answers, every call of the effects store returns
// at its own context's deadline with the context's error, whether or not
// the client honours contexts' deadlines (without ContextTimeoutEnabled,
// go-redis would wait out its own read timeout, ten times the deadline
// here). Then the server answers again and the same store serves.
func TestEffectsCallsReturnByTheirDeadline(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out many deadlines")
	}
	for _, contextTimeout := range []bool{false, true} {
		t.Run(fmt.Sprintf("ContextTimeoutEnabled=%v", contextTimeout), func(t *testing.T) {
			t.Parallel()
			client, stall := stallingClient(t, contextTimeout)
			prefix, direct := "fxd"+testenv.RandomHex(6), testenv.Redis(t)
			t.Cleanup(func() { dropKeys(direct, prefix+"*") })
			e := redisstore.NewEffects(client, redisstore.WithEffectsPrefix(prefix))
			if _, err := e.Lookup(context.Background(), "warm-up"); err != nil { // a pooled connection, the script loaded
				t.Fatal(err)
			}
			stall(true)

			const callers, rounds, deadline = 8, 3, 200 * time.Millisecond
			calls := []func(ctx context.Context, key string) error{
				func(ctx context.Context, key string) error {
					_, _, err := e.Begin(ctx, stores.EffectIntent{Key: key, Name: "charge"}, time.Minute)
					return err
				},
				func(ctx context.Context, key string) error { _, err := e.Lookup(ctx, key); return err },
				func(ctx context.Context, key string) error {
					_, _, err := e.Transition(ctx, key, stores.EffectTransition{From: stores.EffectPending, To: stores.EffectSucceeded})
					return err
				},
				func(ctx context.Context, key string) error { _, err := e.Extend(ctx, key, time.Minute); return err },
				func(ctx context.Context, key string) error { return e.Forget(ctx, key) },
			}
			testenv.RequireDeadlines(t, callers, rounds, deadline, func(ctx context.Context, c, r int) error {
				err := calls[(c+r)%len(calls)](ctx, fmt.Sprintf("k-%d-%d", c, r))
				if err != nil && !errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("a call under a %v deadline: %v; want its context's error", deadline, err)
				}
				return err
			})

			// The server answers again: the same store serves.
			stall(false)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if began, _, err := e.Begin(ctx, stores.EffectIntent{Key: "after", Name: "charge"}, time.Minute); err != nil || !began {
				t.Fatalf("Begin after the server came back = %v, %v; want begun", began, err)
			}
		})
	}
}
