package effects_test

import (
	"context"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/effects"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestResultDroppedIsReplayedWithoutACall: a charge succeeds; once the
// store dropped its result (its result lifetime, shorter than the
// record's), a replay of the message finds the effect succeeded and never
// charges again: Do returns no result and no error (the message does not
// fail for it), DoResult says the result was dropped and gives the
// provider key, and with a Resolver the result is looked up again (no
// call). On every shipped store.
func TestResultDroppedIsReplayedWithoutACall(t *testing.T) {
	t.Parallel()
	const resultTTL = 150 * time.Millisecond
	for name, newStore := range map[string]func(t *testing.T) stores.EffectStore{
		"memory": func(*testing.T) stores.EffectStore {
			return memstore.NewEffects(memstore.WithEffectsTTL(time.Hour), memstore.WithResultTTL(resultTTL))
		},
		"redis": func(t *testing.T) stores.EffectStore {
			return redisstore.NewEffects(testenv.Redis(t), redisstore.WithEffectsPrefix("rd"+testenv.RandomHex(6)),
				redisstore.WithEffectsTTL(time.Hour), redisstore.WithResultTTL(resultTTL))
		},
		"cluster": func(t *testing.T) stores.EffectStore {
			return redisstore.NewEffects(testenv.RedisCluster(t), redisstore.WithEffectsPrefix("rd"+testenv.RandomHex(6)),
				redisstore.WithEffectsTTL(time.Hour), redisstore.WithResultTTL(resultTTL))
		},
		"postgres": func(t *testing.T) stores.EffectStore {
			return testenv.PostgresEffects(t, testenv.Postgres(t), postgresstore.WithEffectsTTL(time.Hour), postgresstore.WithResultTTL(resultTTL))
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			store := newStore(t)
			p := newProvider()
			plain := newFixture(t, store).fx.Effect("charge")
			resolved := newFixture(t, store).fx.Effect("charge", effects.WithResolver(p.status))
			id := "m-" + testenv.RandomHex(4)
			first, err := plain.Do(delivery(id, "a1"), []byte(`{"amount":5}`), p.charge("ok"))
			if err != nil || len(first) == 0 {
				t.Fatalf("the first charge: %q, %v", first, err)
			}
			deadline := time.Now().Add(5 * time.Second)
			for e := effectOf(t, store, id, "charge"); !e.ResultDropped; e = effectOf(t, store, id, "charge") {
				if time.Now().After(deadline) {
					t.Fatalf("the result outlived its lifetime by 5s: %+v", e)
				}
				time.Sleep(20 * time.Millisecond)
			}
			got, err := plain.Do(delivery(id, "a2"), []byte(`{"amount":5}`), p.charge("ok"))
			if err != nil || got != nil {
				t.Fatalf("a replay after the result was dropped: %q, %v; want no result, no error", got, err)
			}
			done, err := plain.DoResult(delivery(id, "a3"), []byte(`{"amount":5}`), p.charge("ok"))
			if err != nil || !done.ResultDropped || done.Result != nil || done.ProviderKey != effects.ProviderKey("billing", id, "charge") {
				t.Fatalf("DoResult after the result was dropped: %+v, %v; want ResultDropped and the provider key", done, err)
			}
			done, err = resolved.DoResult(delivery(id, "a4"), []byte(`{"amount":5}`), p.charge("ok"))
			if err != nil || done.ResultDropped || string(done.Result) != string(first) {
				t.Fatalf("DoResult with a Resolver: %+v, %v; want the result looked up again, %q", done, err, first)
			}
			wantCalls(t, p, 1, 1)
			if e := effectOf(t, store, id, "charge"); e.State != stores.EffectSucceeded || e.Attempts != 1 {
				t.Fatalf("the effect after the replays: %s, %d attempts; want succeeded, 1", e.State, e.Attempts)
			}
		})
	}
}

// TestResultWithinItsLifetime: a replay within the result lifetime gets
// the kept result, without a call or a lookup.
func TestResultWithinItsLifetime(t *testing.T) {
	t.Parallel()
	p := newProvider()
	lookups := 0
	f := newFixture(t, memstore.NewEffects(memstore.WithResultTTL(time.Hour)))
	charge := f.fx.Effect("charge", effects.WithResolver(func(ctx context.Context, key string) (effects.Outcome, error) {
		lookups++
		return p.status(ctx, key)
	}))
	first, err := charge.Do(delivery("m-1", "a1"), nil, p.charge("ok"))
	if err != nil {
		t.Fatal(err)
	}
	done, err := charge.DoResult(delivery("m-1", "a2"), nil, p.charge("ok"))
	if err != nil || done.ResultDropped || string(done.Result) != string(first) || lookups != 0 {
		t.Fatalf("a replay within the result's lifetime: %+v, %v, %d lookups; want %q, none", done, err, lookups, first)
	}
	wantCalls(t, p, 1, 1)
}
