package effects_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/effects"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/fakepay"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestFailover is the failover: worker 1 sends the charge, the
// provider charges, and worker 1 freezes inside the call (a stop-the-world
// pause, a stopped container: its lease is not renewed either) while the
// lease passes, so the charge is pending with an outcome nobody knows. Worker 2 (another store client,
// another holder) gets the message: it reconciles first and does not
// charge again. When worker 1 wakes with the provider's answer, it records
// nothing new. On Redis and on PostgreSQL; with a provider that answers
// lookups, one that only deduplicates keys (Resubmit), and one with
// neither (Park).
func TestFailover(t *testing.T) {
	t.Parallel()
	backends := map[string]func(t *testing.T) (first, second stores.EffectStore){
		"redis": func(t *testing.T) (stores.EffectStore, stores.EffectStore) {
			prefix := redisstore.WithEffectsPrefix("fo" + testenv.RandomHex(6))
			return redisstore.NewEffects(testenv.Redis(t), prefix), redisstore.NewEffects(testenv.Redis(t), prefix)
		},
		"postgres": func(t *testing.T) (stores.EffectStore, stores.EffectStore) {
			first := testenv.PostgresEffects(t, testenv.Postgres(t))
			effectsTable, _ := first.Tables()
			second, err := postgresstore.NewEffects(testenv.Postgres(t), postgresstore.WithEffectsTable(strings.Trim(effectsTable, `"`)))
			if err != nil {
				t.Fatal(err)
			}
			return first, second
		},
	}
	providers := map[string]fakepay.Config{
		"lookups":   {IdempotentKeys: true, Lookups: true},
		"keys-only": {IdempotentKeys: true},
		"neither":   {},
	}
	for backend, stores2 := range backends {
		for kind, cfg := range providers {
			t.Run(backend+"/"+kind, func(t *testing.T) {
				t.Parallel()
				failover(t, stores2, kind, cfg)
			})
		}
	}
}

func failover(t *testing.T, newStores func(t *testing.T) (stores.EffectStore, stores.EffectStore), kind string, cfg fakepay.Config) {
	provider, err := fakepay.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = provider.Close() })
	client := fakepay.Client{BaseURL: provider.URL(), HTTP: &http.Client{}}
	first, store2 := newStores(t)
	store1 := &pausable{EffectStore: first}
	worker := func(store stores.EffectStore) *effects.Effect {
		fx, err := effects.New(store, effects.WithCallTimeout(200*time.Millisecond), effects.WithLease(500*time.Millisecond),
			effects.WithParkWait(0)) // worker 2 is told at once that worker 1 holds it
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = fx.Close() })
		opts := []effects.EffectOption{effects.WithPolicy(effects.Park)}
		switch kind {
		case "lookups":
			opts = append(opts, effects.WithResolver(lookupCharge(client)))
		case "keys-only":
			opts = []effects.EffectOption{effects.WithPolicy(effects.Resubmit)}
		}
		return fx.Effect("charge", opts...)
	}
	charge := chargeOrder(client)
	id := "msg-" + testenv.RandomHex(4)
	delivery := func(token string) context.Context {
		return stores.WithClaimToken(idempotency.ContextWithDelivery(context.Background(), idempotency.Delivery{
			Key: idempotency.Key("billing", id), Scope: "billing", ID: id, Handler: "billing"}), token)
	}

	// Worker 1 charges, then freezes inside the call, past its lease.
	wake := make(chan struct{})
	charged := make(chan struct{})
	frozen := func(ctx context.Context, key string) (effects.Outcome, error) {
		store1.paused.Store(true) // from here on, worker 1 does nothing, renewals included
		o, err := charge(context.WithoutCancel(ctx), key)
		close(charged)
		<-wake // frozen: the call's deadline passes unnoticed
		return o, err
	}
	done1 := make(chan error, 1)
	var res1 []byte
	go func() {
		var err error
		res1, err = worker(store1).Do(delivery("worker-1"), nil, frozen)
		done1 <- err
	}()
	<-charged

	w2 := worker(store2)
	if _, err := w2.Do(delivery("worker-2"), nil, charge); !errors.Is(err, idempotency.ErrInFlight) {
		t.Fatalf("worker 2 within worker 1's lease: %v; want ErrInFlight", err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for { // the lease passes; worker 1 is still frozen
		e, err := store2.Lookup(context.Background(), effects.ProviderKey("billing", id, "charge"))
		if err != nil {
			t.Fatal(err)
		}
		if e.LeaseLapsed {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("worker 1's lease never passed while it was frozen: %+v", e)
		}
		time.Sleep(10 * time.Millisecond)
	}
	res2, err2 := w2.Do(delivery("worker-2"), nil, charge)
	switch kind {
	case "lookups":
		if err2 != nil || len(res2) == 0 {
			t.Fatalf("worker 2 after the lease: %q, %v; want the charge found by the lookup", res2, err2)
		}
	case "keys-only":
		if err2 != nil || len(res2) == 0 {
			t.Fatalf("worker 2 after the lease: %q, %v; want the first charge, resubmitted under the same key", res2, err2)
		}
	case "neither":
		if !errors.Is(err2, effects.ErrUnknownOutcome) {
			t.Fatalf("worker 2 after the lease: %v; want the charge parked as unknown", err2)
		}
	}
	close(wake)
	if err := <-done1; err != nil {
		t.Fatalf("worker 1 after waking: %v", err)
	}
	if kind != "neither" && string(res1) != string(res2) {
		t.Fatalf("worker 1 got %q, worker 2 %q", res1, res2)
	}
	if n := len(provider.Ledger()); n != 1 {
		t.Fatalf("the provider charged %d times, want once", n)
	}
	e, err := store2.Lookup(context.Background(), effects.ProviderKey("billing", id, "charge"))
	if err != nil || e.State != stores.EffectSucceeded {
		t.Fatalf("the effect: %s, %v; want succeeded", e.State, err)
	}
	t.Logf("%s: provider got %d request(s), charged once; evidence %s, %d send(s)", kind, requests(provider), e.Evidence, e.Attempts)
}

// pausable is an effect store whose lease renewals do not get through
// while paused, as a frozen process's do not.
type pausable struct {
	stores.EffectStore
	paused atomic.Bool
}

func (s *pausable) Extend(ctx context.Context, key string, lease time.Duration) (bool, error) {
	if s.paused.Load() {
		<-ctx.Done()
		return false, ctx.Err()
	}
	return s.EffectStore.Extend(ctx, key, lease)
}

func requests(p *fakepay.Provider) int { n, _ := p.Stats(); return n }

// TestPausedBeforeTheCallSendsNothing: worker 1 takes the effect's lease
// and is paused (SIGSTOP, a long GC pause) before it sends the charge,
// past its lease. Worker 2 finds the lease lapsed, looks the charge up
// (not found) and charges. Worker 1 wakes and, before it sends, asks the
// store whether its lease is still its own: it is not, so it sends
// nothing. The provider, which charges every request it gets (no
// idempotency keys), charges once. On Redis and on PostgreSQL.
func TestPausedBeforeTheCallSendsNothing(t *testing.T) {
	pausedWorkerSendsNothing(t, func(first stores.EffectStore, pause func()) stores.EffectStore {
		return &pausedAfterBegin{EffectStore: first, pause: pause}
	})
}

// pausedWorkerSendsNothing runs the pause tests' scenario on every
// backend, in parallel subtests: worker 1 charges through the store
// pausing makes of its client, which calls pause where the worker is to be
// paused; worker 2 charges once worker 1's lease has passed; then worker 1
// resumes. The provider (no idempotency keys: every request it gets
// charges) must have charged once, and both workers must hold that charge.
func pausedWorkerSendsNothing(t *testing.T, pausing func(first stores.EffectStore, pause func()) stores.EffectStore) {
	t.Parallel()
	for _, backend := range pauseBackends {
		t.Run(backend, func(t *testing.T) {
			t.Parallel()
			pausedWorker(t, backend, pausing)
		})
	}
}

func pausedWorker(t *testing.T, backend string, pausing func(first stores.EffectStore, pause func()) stores.EffectStore) {
	first, second := twoEffectStores(t, backend)
	provider, err := fakepay.Start(fakepay.Config{Lookups: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = provider.Close() })
	client := fakepay.Client{BaseURL: provider.URL(), HTTP: &http.Client{}}
	paused, wake := make(chan struct{}), make(chan struct{})
	store1 := pausing(first, func() { close(paused); <-wake })
	w1, w2 := pauseWorker(t, store1, client), pauseWorker(t, second, client)
	id := "msg-" + testenv.RandomHex(4)
	done1 := make(chan error, 1)
	var res1 []byte
	go func() {
		var err error
		res1, err = w1.Do(billingDelivery(id, "worker-1"), nil, chargeOrder(client))
		done1 <- err
	}()
	<-paused
	key := effects.ProviderKey("billing", id, "charge")
	testenv.Eventually(t, "worker 1's lease to pass while it is paused", func() bool {
		e, err := second.Lookup(context.Background(), key)
		return err == nil && e.LeaseLapsed
	})
	res2, err := w2.Do(billingDelivery(id, "worker-2"), nil, chargeOrder(client))
	if err != nil || len(res2) == 0 {
		t.Fatalf("worker 2 after worker 1's lease passed: %q, %v; want the charge made", res2, err)
	}
	close(wake)
	err1 := <-done1
	if n := len(provider.Ledger()); n != 1 {
		t.Fatalf("the provider charged %d times (worker 1 got %q, %v; worker 2 %q); want once: worker 1 sent after its lease passed", n, res1, err1, res2)
	}
	if err1 != nil || string(res1) != string(res2) {
		t.Fatalf("worker 1 after waking: %q, %v; want worker 2's charge %q", res1, err1, res2)
	}
}

// pausedAfterBegin is an effect store whose first Begin that takes an
// effect calls pause before it returns, as a process paused right after it
// took the effect's lease.
type pausedAfterBegin struct {
	stores.EffectStore
	pause func()
	once  sync.Once
}

func (s *pausedAfterBegin) Begin(ctx context.Context, intent stores.EffectIntent, lease time.Duration) (bool, stores.Effect, error) {
	began, e, err := s.EffectStore.Begin(ctx, intent, lease)
	if began {
		s.once.Do(s.pause)
	}
	return began, e, err
}

// chargeOrder is the call of the failover tests: one charge of order-1.
func chargeOrder(client fakepay.Client) effects.Call {
	return func(ctx context.Context, key string) (effects.Outcome, error) {
		ch, err := client.Charge(ctx, key, fakepay.Request{OrderID: "order-1", AmountCents: 1299})
		if err != nil {
			return effects.Outcome{}, err
		}
		return effects.Succeeded([]byte(ch.ID)), nil
	}
}

// lookupCharge is the resolver of the failover tests: the charge made
// under the key, or NotFound.
func lookupCharge(client fakepay.Client) effects.Resolver {
	return func(ctx context.Context, key string) (effects.Outcome, error) {
		ch, found, err := client.Lookup(ctx, key)
		if err != nil || !found {
			return effects.NotFound(), err
		}
		return effects.Succeeded([]byte(ch.ID)), nil
	}
}

// pauseBackends are the stores the pause tests run on: two clients of one
// Redis, and two pools on one PostgreSQL table.
var pauseBackends = []string{"redis", "postgres"}

// twoEffectStores returns two clients of one effect store on backend, as
// two workers have.
func twoEffectStores(t *testing.T, backend string) (first, second stores.EffectStore) {
	t.Helper()
	switch backend {
	case "redis":
		prefix := redisstore.WithEffectsPrefix("pz" + testenv.RandomHex(6))
		return redisstore.NewEffects(testenv.Redis(t), prefix), redisstore.NewEffects(testenv.Redis(t), prefix)
	case "postgres":
		pg := testenv.PostgresEffects(t, testenv.Postgres(t))
		table, _ := pg.Tables()
		other, err := postgresstore.NewEffects(testenv.Postgres(t), postgresstore.WithEffectsTable(strings.Trim(table, `"`)))
		if err != nil {
			t.Fatal(err)
		}
		return pg, other
	}
	t.Fatalf("no backend %q", backend)
	return nil, nil
}

// pauseWorker is a worker of the pause tests: a lease of a second, calls of
// half a second, Park with a resolver that looks the charge up.
func pauseWorker(t *testing.T, store stores.EffectStore, client fakepay.Client) *effects.Effect {
	t.Helper()
	fx, err := effects.New(store, effects.WithCallTimeout(500*time.Millisecond), effects.WithLease(time.Second), effects.WithParkWait(0))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = fx.Close() })
	return fx.Effect("charge", effects.WithPolicy(effects.Park), effects.WithResolver(lookupCharge(client)))
}

// billingDelivery is the context of a delivery of message id to the
// billing handler, by the holder token.
func billingDelivery(id, token string) context.Context {
	return stores.WithClaimToken(idempotency.ContextWithDelivery(context.Background(), idempotency.Delivery{
		Key: idempotency.Key("billing", id), Scope: "billing", ID: id, Handler: "billing"}), token)
}
