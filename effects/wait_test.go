package effects_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/babelqueue/watermill-idempotency/effects"
	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/fakepay"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// orderRouter runs the README's wiring (dead letters outside Retry, the
// idempotency middleware innermost) on a GoChannel, with a handler that
// charges each order through charge, on stores of the test's own in Redis.
// It returns the topic to publish to; runs counts the handler's runs.
type orderRouter struct {
	pubsub *gochannel.GoChannel
	topic  string
	runs   atomic.Int64
	client fakepay.Client
}

func startOrderRouter(t *testing.T, charge *effects.Effect, client fakepay.Client, msgStore stores.Store) *orderRouter {
	t.Helper()
	o := &orderRouter{pubsub: gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{}),
		topic: "orders-" + testenv.RandomHex(4), client: client}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	dlq, err := deadletter.Middleware(o.pubsub)
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(
		dlq,
		middleware.Retry{MaxRetries: 3, InitialInterval: 100 * time.Millisecond,
			ShouldRetry: func(p middleware.RetryParams) bool { return idempotency.Retryable(p.Err) }}.Middleware,
		deadletter.CountAttempts,
		middleware.Recoverer,
		idempotency.Middleware(msgStore),
	)
	router.AddConsumerHandler("charge", o.topic, o.pubsub, func(msg *message.Message) error {
		o.runs.Add(1)
		e, err := envelope.Parse(msg.Payload)
		if err != nil {
			return err
		}
		var req fakepay.Request
		if err := json.Unmarshal(e.Data, &req); err != nil {
			return err
		}
		_, err = charge.Do(msg.Context(), req, func(ctx context.Context, key string) (effects.Outcome, error) {
			ch, err := o.client.Charge(ctx, key, req)
			if err != nil {
				return effects.Outcome{}, err // a timeout: unknown, never failed
			}
			return effects.Succeeded([]byte(ch.ID)), nil
		})
		return err
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("router: %v", err)
		}
		_ = o.pubsub.Close()
	})
	<-router.Running()
	return o
}

// publish puts the order on the topic and returns its message id.
func (o *orderRouter) publish(t *testing.T, req fakepay.Request) string {
	t.Helper()
	e, err := envelope.New("urn:babel:orders:charge", req)
	if err != nil {
		t.Fatal(err)
	}
	payload, err := e.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if err := o.pubsub.Publish(o.topic, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
		t.Fatal(err)
	}
	return e.Meta.ID
}

// startProvider starts a provider as cfg says, closed when the test ends,
// and a client of it.
func startProvider(t *testing.T, cfg fakepay.Config) (*fakepay.Provider, fakepay.Client) {
	t.Helper()
	provider, err := fakepay.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = provider.Close() })
	return provider, fakepay.Client{BaseURL: provider.URL(), HTTP: &http.Client{}}
}

// lookup is the README's resolver: the provider's status lookup by
// reference.
func lookup(client fakepay.Client) effects.Resolver {
	return func(ctx context.Context, key string) (effects.Outcome, error) {
		ch, found, err := client.Lookup(ctx, key)
		switch {
		case err != nil:
			return effects.Outcome{}, err
		case !found:
			return effects.NotFound(), nil // it never arrived: send it again, same key
		}
		return effects.Succeeded([]byte(ch.ID)), nil
	}
}

// waitFor polls cond every 10ms until it holds, or fails after within,
// printing what it saw.
func waitFor(t *testing.T, within time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		ok, saw := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %v, still waiting for %s: %s", within, what, saw)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestSlowProviderIsChargedOnce is a provider that ignores idempotency keys
// and acts on a charge some time after its POST arrived, longer than the
// call timeout: the call times out, the charge is unknown, and a status
// lookup made before the provider acted finds nothing. With the README's
// wiring (a resolver, Park), no order may be charged twice: the unknown
// charge is not looked up, nor sent again, before its lease (counted from
// the send) has passed. The figures (call timeout 1s, the provider
// acting after 2.5s, lease 10s) unless -short, and the same proportions a
// tenth as long.
func TestSlowProviderIsChargedOnce(t *testing.T) {
	t.Parallel()
	scales := map[string]time.Duration{"tenth": 100 * time.Millisecond}
	if !testing.Short() {
		scales["issue"] = time.Second
	}
	for name, unit := range scales {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			slowProvider(t, unit)
		})
	}
}

func slowProvider(t *testing.T, unit time.Duration) {
	const orders = 3
	provider, client := startProvider(t, fakepay.Config{Lookups: true, ActAfter: unit * 5 / 2})
	rdb := testenv.Redis(t)
	prefix := "fx" + testenv.RandomHex(6)
	fx, err := effects.New(redisstore.NewEffects(rdb, redisstore.WithEffectsPrefix(prefix)),
		effects.WithCallTimeout(unit), effects.WithLease(10*unit))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = fx.Close() })
	charge := fx.Effect("charge", effects.WithResolver(lookup(client)), effects.WithPolicy(effects.Park))
	o := startOrderRouter(t, charge, client, redisstore.New(rdb, redisstore.WithPrefix(prefix+"m")))

	var keys []string
	for i := range orders {
		id := o.publish(t, fakepay.Request{OrderID: fmt.Sprintf("order-%d", i+1), AmountCents: 1299})
		keys = append(keys, effects.ProviderKey("charge", id, "charge"))
	}
	waitFor(t, 40*unit+10*time.Second, "every charge settled and the provider idle", func() (bool, string) {
		settled := 0
		for _, key := range keys {
			e, err := fx.Store().Lookup(context.Background(), key)
			if err != nil {
				return false, err.Error()
			}
			if e.State.Final() {
				settled++
			}
		}
		return settled == orders && provider.Acting() == 0, fmt.Sprintf("%d of %d settled, %d requests still to act on, charges %v, %d handler runs",
			settled, orders, provider.Acting(), provider.ChargesPerOrder(), o.runs.Load())
	})
	requests, _ := provider.Stats()
	perOrder := provider.ChargesPerOrder()
	for i := range orders {
		order := fmt.Sprintf("order-%d", i+1)
		if perOrder[order] != 1 {
			t.Errorf("%s charged %d times, want once (charges %v, %d POSTs, %d handler runs)", order, perOrder[order], perOrder, requests, o.runs.Load())
		}
	}
	for _, key := range keys {
		e, err := fx.Store().Lookup(context.Background(), key)
		if err != nil || e.State != stores.EffectSucceeded || e.Attempts != 1 {
			t.Errorf("effect %s: %s after %d send(s), %v; want succeeded after one", key, e.State, e.Attempts, err)
		}
	}
	t.Logf("%d orders: %d POSTs, charges %v, %d handler runs", orders, requests, perOrder, o.runs.Load())
}

// TestHeldEffectIsWaitedFor is a message whose effect is held by an
// attempt that died (its process crashed mid-call; its lease runs on),
// redelivered by a broker that hands a nacked message straight back
// (GoChannel). Each delivery waits for the effect, looking again with
// growing pauses, before it is parked: a handful of runs while the lease
// runs out, not a storm of them. Once the lease passed, the charge is
// reconciled and sent.
func TestHeldEffectIsWaitedFor(t *testing.T) {
	t.Parallel()
	const lease = 2 * time.Second
	provider, client := startProvider(t, fakepay.Config{Lookups: true})
	rdb := testenv.Redis(t)
	prefix := "fx" + testenv.RandomHex(6)
	store := redisstore.NewEffects(rdb, redisstore.WithEffectsPrefix(prefix))
	fx, err := effects.New(store, effects.WithCallTimeout(time.Second), effects.WithLease(lease))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = fx.Close() })
	charge := fx.Effect("charge", effects.WithResolver(lookup(client)))
	o := startOrderRouter(t, charge, client, redisstore.New(rdb, redisstore.WithPrefix(prefix+"m")))

	// The attempt that died: its intent recorded, its lease running, no
	// request sent. The message it was handling comes back.
	req := fakepay.Request{OrderID: "order-1", AmountCents: 1299}
	e, err := envelope.New("urn:babel:orders:charge", req)
	if err != nil {
		t.Fatal(err)
	}
	key := effects.ProviderKey("charge", e.Meta.ID, "charge")
	dead := stores.WithClaimToken(context.Background(), "crashed-attempt")
	if began, _, err := store.Begin(dead, stores.EffectIntent{Key: key, Name: "charge", Scope: "charge", MessageID: e.Meta.ID}, lease); err != nil || !began {
		t.Fatalf("Begin of the dead attempt: %v, %v", began, err)
	}
	payload, err := e.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := o.pubsub.Publish(o.topic, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the charge settled", func() (bool, string) {
		e, err := store.Lookup(context.Background(), key)
		if err != nil {
			return false, err.Error()
		}
		return e.State.Final(), fmt.Sprintf("effect %s, %d handler runs", e.State, o.runs.Load())
	})
	runs := o.runs.Load()
	// One run per park wait (a second) while the lease runs, and the one
	// that charges: a storm is thousands.
	if limit := int64(lease/idempotency.DefaultParkWait) + 4; runs > limit {
		t.Fatalf("%d handler runs in %v while another attempt held the effect; want at most %d", runs, time.Since(start).Round(time.Millisecond), limit)
	}
	if n := len(provider.Ledger()); n != 1 {
		t.Fatalf("%d charges, want 1", n)
	}
	t.Logf("%d handler runs in %v", runs, time.Since(start).Round(time.Millisecond))
}
