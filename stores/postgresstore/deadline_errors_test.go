package postgresstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestEffectsDeadlineErrorsMatchTheContext: the effects store, on a pool
// whose replies come 3ms late, through both drivers: callers with
// deadlines of 1 to 20ms get their answer or an error that matches their
// context's, never the driver's own (lib/pq reports the server's
// "canceling statement due to user request" for a statement its context
// ended; a dial or read cut short by the deadline reports a network
// timeout).
func TestEffectsDeadlineErrorsMatchTheContext(t *testing.T) {
	if testing.Short() {
		t.Skip("a load of a few seconds")
	}
	for _, driver := range []string{"pgx", "postgres"} {
		t.Run(driver, func(t *testing.T) {
			direct := h2DriverPool(t, driver)
			db := caProxied(t, driver, 3*time.Millisecond)
			e, err := postgresstore.NewEffects(db, postgresstore.WithEffectsTable("idem_fx_"+testenv.RandomHex(4)))
			if err != nil {
				t.Fatal(err)
			}
			effects, events := e.Tables()
			t.Cleanup(func() { _, _ = direct.Exec(`DROP TABLE IF EXISTS ` + effects + `, ` + events) })
			if err := e.Migrate(context.Background()); err != nil {
				t.Fatal(err)
			}
			calls := []func(ctx context.Context, key string) error{
				func(ctx context.Context, key string) error {
					_, _, err := e.Begin(ctx, stores.EffectIntent{Key: key, Name: "charge"}, time.Minute)
					return err
				},
				func(ctx context.Context, key string) error {
					_, err := e.Lookup(ctx, key)
					return err
				},
				func(ctx context.Context, key string) error {
					_, _, err := e.Transition(ctx, key, stores.EffectTransition{From: stores.EffectPending, To: stores.EffectSucceeded, Result: []byte("ok")})
					return err
				},
				func(ctx context.Context, key string) error {
					_, err := e.Extend(ctx, key, time.Minute)
					return err
				},
				func(ctx context.Context, key string) error {
					_, err := e.ApplyEvent(ctx, "ev-"+key, key, stores.EffectTransition{From: stores.EffectPending, To: stores.EffectFailed})
					return err
				},
				func(ctx context.Context, key string) error {
					_, err := e.List(ctx, stores.EffectQuery{})
					return err
				},
				func(ctx context.Context, key string) error { return e.Forget(ctx, key) },
			}
			testenv.RequireContextErrors(t, 16, 40, calls...)
		})
	}
}
