package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestEffectsScansReturnByTheirDeadline: Purge and MigrateKeys, which
// SCAN for keys between their scripts, return by their context's deadline
// with the context's error, whether or not the client honours contexts'
// deadlines (without ContextTimeoutEnabled, go-redis waits out its own
// read timeout on a SCAN, ten times the deadline here; with it, a SCAN or
// a script cut short reports a network timeout):
//   - against a Redis that never answers;
//   - against one whose every reply takes longer than half the deadline,
//     so that the deadline passes while the SCAN that follows the first
//     script is out;
//   - against one whose replies take 3ms, under deadlines of 1 to 20ms,
//     with keys of the old layout to move and events to purge, so that
//     deadlines pass in the scans and in the scripts.
//
// Then the server answers again and the same store serves.
func TestEffectsScansReturnByTheirDeadline(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out many deadlines")
	}
	for _, contextTimeout := range []bool{false, true} {
		t.Run(fmt.Sprintf("ContextTimeoutEnabled=%v", contextTimeout), func(t *testing.T) {
			t.Parallel()
			client, proxy := proxiedClient(t, func(o *redis.Options) {
				o.ReadTimeout, o.WriteTimeout, o.ContextTimeoutEnabled = 2*time.Second, 2*time.Second, contextTimeout
			})
			prefix, direct := "fxs"+testenv.RandomHex(6), testenv.Redis(t)
			t.Cleanup(func() {
				dropKeys(direct, prefix+"*")
				dropKeys(direct, "{"+prefix+"}*") // the old layout's keys
			})
			e := redisstore.NewEffects(client, redisstore.WithEffectsPrefix(prefix))
			purge := func(ctx context.Context) error { _, err := e.Purge(ctx, time.Now()); return err }
			migrate := func(ctx context.Context) error { _, _, err := e.MigrateKeys(ctx); return err }
			// Pooled connections for every caller, the scripts loaded: a
			// connection dialled under the deadline spends it on its
			// handshake, and the call never reaches its SCAN.
			warm := func(t *testing.T) {
				var wg sync.WaitGroup
				for range 8 {
					wg.Go(func() {
						if err := purge(context.Background()); err != nil {
							t.Error(err)
						}
					})
				}
				wg.Wait()
			}
			warm(t)

			t.Run("never answers", func(t *testing.T) {
				proxy.Silent.Store(true)
				proxy.Delay.Store(int64(time.Hour))
				defer func() { proxy.Silent.Store(false); proxy.Delay.Store(0) }()
				const deadline = 200 * time.Millisecond
				testenv.RequireDeadlines(t, 8, 2, deadline, func(ctx context.Context, c, r int) error {
					err := []func(context.Context) error{purge, migrate}[(c+r)%2](ctx)
					if err != nil && !errors.Is(err, context.DeadlineExceeded) {
						t.Errorf("a call under a %v deadline: %v; want its context's error", deadline, err)
					}
					return err
				})
			})

			t.Run("a scan outlives the deadline", func(t *testing.T) {
				const delay, deadline, slack = 500 * time.Millisecond, 700 * time.Millisecond, 150 * time.Millisecond
				warm(t)
				proxy.Delay.Store(int64(delay))
				defer proxy.Delay.Store(0)
				var wg sync.WaitGroup
				for c := range 8 {
					wg.Go(func() {
						name, call := "Purge", purge
						if c%2 == 1 {
							name, call = "MigrateKeys", migrate
						}
						ctx, cancel := context.WithTimeout(context.Background(), deadline)
						defer cancel()
						start := time.Now()
						err := call(ctx)
						took := time.Since(start)
						switch {
						case err == nil:
							t.Errorf("%s under a %v deadline, every reply %v late, succeeded after %v; want its context's error", name, deadline, delay, took.Round(time.Millisecond))
						case !errors.Is(err, context.DeadlineExceeded):
							t.Errorf("%s under a %v deadline: %v; want its context's error", name, deadline, err)
						}
						if took > deadline+slack {
							t.Errorf("%s under a %v deadline returned after %v", name, deadline, took.Round(time.Millisecond))
						}
					})
				}
				wg.Wait()
			})

			t.Run("random deadlines", func(t *testing.T) {
				warm(t)
				proxy.Delay.Store(int64(3 * time.Millisecond))
				defer proxy.Delay.Store(0)
				testenv.RequireContextErrors(t, 8, 30,
					func(ctx context.Context, key string) error {
						// An event recorded long ago, for Purge to remove.
						if err := direct.Set(context.Background(), prefix+"{"+prefix+"}ev:"+key, 1, time.Hour).Err(); err != nil {
							return err
						}
						return purge(ctx)
					},
					func(ctx context.Context, key string) error {
						// An event of the old layout, for MigrateKeys to move
						// (or to leave, once the new layout holds it).
						if err := direct.Set(context.Background(), "{"+prefix+"}ev:"+key, 1, time.Hour).Err(); err != nil {
							return err
						}
						return migrate(ctx)
					},
				)
			})

			// The server answers again: the same store serves.
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if err := purge(ctx); err != nil {
				t.Fatalf("Purge after the server came back: %v", err)
			}
			if _, _, err := e.MigrateKeys(ctx); err != nil {
				t.Fatalf("MigrateKeys after the server came back: %v", err)
			}
		})
	}
}
