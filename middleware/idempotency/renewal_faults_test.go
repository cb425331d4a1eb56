package idempotency_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// redisBehindProxy is a redisstore whose client goes through a fault
// proxy, and one that reaches Redis directly (the other worker).
func redisBehindProxy(t *testing.T) (through, direct *redisstore.Store, p *testenv.FaultProxy) {
	t.Helper()
	return redisBehindProxyTimeout(t, 200*time.Millisecond)
}

// redisBehindProxyTimeout is redisBehindProxy whose proxied client waits
// timeout for a reply.
func redisBehindProxyTimeout(t *testing.T, timeout time.Duration) (through, direct *redisstore.Store, p *testenv.FaultProxy) {
	t.Helper()
	client := testenv.Redis(t)
	prefix := "bqr" + testenv.RandomHex(4) + ":"
	// Registered before the proxy, so it runs after the proxy is closed:
	// a command the proxy still held (a renewal or release sent as the
	// test ended, delayed or cut off) can land after the tracked keys are
	// dropped; nothing can once the proxy is gone.
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := testenv.DropKeys(ctx, client, prefix+"*"); err != nil {
			t.Errorf("removing the keys under %s: %v", prefix, err)
		}
	})
	p = testenv.NewFaultProxy(t, client.Options().Addr)
	o := client.Options()
	o.Addr, o.MaxRetries, o.ReadTimeout, o.WriteTimeout, o.DialTimeout = p.Addr(), -1, timeout, timeout, timeout
	proxied := redis.NewClient(o)
	t.Cleanup(func() { _ = proxied.Close() })
	testenv.TrackKeys(t, proxied, client)
	return redisstore.New(proxied, redisstore.WithPrefix(prefix)), redisstore.New(client, redisstore.WithPrefix(prefix)), p
}

// TestRedisOutageLongerThanTheLeaseLosesTheClaim: the worker's Redis is
// unreachable for longer than the lease while its handler runs; another
// worker takes the lapsed claim meanwhile. The handler's context ends
// with ErrClaimLost, the loss is counted, the delivery fails with a
// transient ErrClaimLost, and once Redis is back the record is not written
// over the other worker's claim.
func TestRedisOutageLongerThanTheLeaseLosesTheClaim(t *testing.T) {
	if testing.Short() {
		t.Skip("an outage of a second")
	}
	t.Parallel()
	const lease = 500 * time.Millisecond
	through, direct, proxy := redisBehindProxy(t)
	obs := &eventLog{}
	started := make(chan string, 1)
	var cause atomic.Value
	reader := sdkmetric.NewManualReader()
	h := idempotency.Middleware(through, idempotency.WithClaim(lease), idempotency.WithObserver(obs),
		idempotency.WithMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))))(untilItsContextEnds(started, &cause))
	done := make(chan error, 1)
	go func() {
		_, err := h(msgOf(envelopeWithID(t, "outage-1")))
		done <- err
	}()
	key := <-started
	proxy.Cut()
	other := stores.WithClaimToken(context.Background(), "the-other-worker")
	waitUntil(t, "the other worker to take the lapsed claim", func() bool {
		claimed, _, err := direct.Claim(other, key, time.Minute)
		return err == nil && claimed
	})
	waitUntil(t, "the handler's context to end", func() bool { return cause.Load() != nil })
	proxy.Restore()
	// The delivery does not own the run any more: it is not acked as if it
	// did (a transient error: the router nacks it).
	if err := <-done; !errors.Is(err, idempotency.ErrClaimLost) || !idempotency.IsTransient(err) {
		t.Fatalf("delivery: %v, want a transient error matching ErrClaimLost", err)
	}
	if c, _ := cause.Load().(error); !errors.Is(c, idempotency.ErrClaimLost) {
		t.Fatalf("the handler's context ended with %v, want ErrClaimLost", c)
	}
	if lost := obs.of(idempotency.OutcomeClaimLost); len(lost) != 1 {
		t.Fatalf("claim_lost events = %v, want 1", lost)
	}
	if held, err := direct.Extend(other, key, time.Minute); err != nil || !held {
		t.Fatalf("the other worker's claim after the outage: held %v, %v (the loser wrote over it?)", held, err)
	}
	// The renewals that failed during the outage are counted.
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var failures int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if sum, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == idempotency.MetricRenewalFailures {
				for _, p := range sum.DataPoints {
					failures += p.Value
				}
			}
		}
	}
	if failures == 0 {
		t.Fatalf("%s = 0 after an outage longer than the lease; want the failed renewals counted", idempotency.MetricRenewalFailures)
	}
}

// TestSlowStoreKeepsTheClaim: every reply of the worker's Redis comes a
// fifth of the lease late (a slow network, a loaded server): renewals
// still land within the lease, the claim is never lost and a handler
// three leases long runs once, its context intact. The lease is long
// enough that a loaded machine's own delays stay well inside it (at
// 400ms, a CI run under -race once took a renewal past it).
func TestSlowStoreKeepsTheClaim(t *testing.T) {
	if testing.Short() {
		t.Skip("handlers of a few seconds")
	}
	t.Parallel()
	const lease = 1500 * time.Millisecond
	through, _, proxy := redisBehindProxyTimeout(t, time.Second)
	// A connection opened behind the delay costs three round trips: open
	// it before, as a worker's pool has.
	if _, err := through.Lookup(context.Background(), "warm-up"); err != nil {
		t.Fatal(err)
	}
	proxy.Delay.Store(int64(lease / 5))
	runsOnceKeepingTheClaim(t, through, lease, time.Second, "slow-store-1")
}

// TestStoreSlowerThanAThirdOfTheLeaseKeepsTheClaim: every reply of the
// worker's Redis comes 0.36 of the lease late, more than the third of the
// lease between renewals, yet each renewal lands within the lease the one
// before it set. The claim must hold through a handler three leases long:
// a worker must not give up (and cancel) a claim the store still holds for
// it only because its store is slow.
func TestStoreSlowerThanAThirdOfTheLeaseKeepsTheClaim(t *testing.T) {
	if testing.Short() {
		t.Skip("handlers of a few seconds")
	}
	t.Parallel()
	const lease = 2 * time.Second
	through, _, proxy := redisBehindProxyTimeout(t, 3*time.Second)
	// A connection opened behind the delay costs three round trips (go-redis
	// says HELLO and CLIENT SETINFO first), more than the lease: open it
	// before, as a worker's pool has.
	if _, err := through.Lookup(context.Background(), "warm-up"); err != nil {
		t.Fatal(err)
	}
	proxy.Delay.Store(int64(lease * 36 / 100))
	runsOnceKeepingTheClaim(t, through, lease, 3*time.Second, "slower-store-1")
}

// runsOnceKeepingTheClaim delivers message id once through the middleware
// on store, with a handler three leases long, and fails unless it ran once
// and kept its claim throughout.
func runsOnceKeepingTheClaim(t *testing.T, store stores.Store, lease, storeTimeout time.Duration, id string) {
	t.Helper()
	obs := &eventLog{}
	var runs atomic.Int32
	h := idempotency.Middleware(store, idempotency.WithClaim(lease), idempotency.WithObserver(obs), idempotency.WithStoreTimeout(storeTimeout))(
		func(msg *message.Message) ([]*message.Message, error) {
			runs.Add(1)
			select {
			case <-time.After(3 * lease):
				return nil, nil
			case <-msg.Context().Done():
				return nil, context.Cause(msg.Context())
			}
		})
	if _, err := h(msgOf(envelopeWithID(t, id))); err != nil {
		t.Fatalf("delivery on a slow store (lease %v): %v", lease, err)
	}
	if lost := obs.of(idempotency.OutcomeClaimLost); len(lost) != 0 || runs.Load() != 1 {
		t.Fatalf("runs %d, claims lost %v; want one run, none lost", runs.Load(), lost)
	}
}
