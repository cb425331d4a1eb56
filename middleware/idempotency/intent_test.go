package idempotency_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/conformance"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func TestIntentChecksWithMemstore(t *testing.T) {
	t.Parallel()
	conformance.RunIntentChecks(t, "", func(t *testing.T) stores.Store { return memstore.New() })
}

// plainStore keeps no fingerprints: the conflict check is skipped for it.
type plainStore struct{ *memstore.Store }

func (p plainStore) Capabilities() stores.Capabilities {
	c := p.Store.Capabilities()
	c.Fingerprint = nil
	return c
}

func TestIntentChecksWithAStoreWithoutFingerprints(t *testing.T) {
	t.Parallel()
	conformance.RunIntentChecks(t, "", func(t *testing.T) stores.Store { return plainStore{memstore.New()} })
}

func envelopeCreated(t *testing.T, id string, created time.Time) []byte {
	t.Helper()
	e, err := envelope.New("urn:babel:orders:created", map[string]any{"n": 1}, envelope.WithID(id), envelope.WithCreatedAt(created))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := e.Marshal()
	return b
}

func TestReplayHorizon(t *testing.T) {
	t.Parallel()
	now := time.Now()
	cases := []struct {
		name    string
		store   stores.Store
		opts    []idempotency.Option
		created time.Time
		reject  bool
	}{
		{"older than the horizon", memstore.New(), []idempotency.Option{idempotency.WithReplayHorizon(time.Hour)}, now.Add(-2 * time.Hour), true},
		{"inside the horizon", memstore.New(), []idempotency.Option{idempotency.WithReplayHorizon(time.Hour)}, now.Add(-30 * time.Minute), false},
		{"past the horizon by less than the skew", memstore.New(), []idempotency.Option{idempotency.WithReplayHorizon(time.Hour)}, now.Add(-time.Hour - 30*time.Second), true},
		{"beyond a custom allowance", memstore.New(), []idempotency.Option{idempotency.WithReplayHorizon(time.Hour), idempotency.WithClockSkew(time.Second)}, now.Add(-time.Hour - 30*time.Second), true},
		{"default follows the store's TTL", memstore.New(memstore.WithTTL(time.Hour)), nil, now.Add(-2 * time.Hour), true},
		{"no TTL, no default horizon", memstore.New(), nil, now.Add(-24 * 365 * time.Hour), false},
		{"turned off", memstore.New(memstore.WithTTL(time.Hour)), []idempotency.Option{idempotency.WithReplayHorizon(0)}, now.Add(-2 * time.Hour), false},
		{"no created_at", memstore.New(memstore.WithTTL(time.Hour)), nil, time.Time{}, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			runs := 0
			h := idempotency.Middleware(c.store, c.opts...)(counting(&runs, nil))
			payload := envelopeCreated(t, "id-1", c.created)
			if c.created.IsZero() {
				payload = []byte(`{"job":"j","trace_id":"t","data":{},"meta":{"id":"id-1","schema_version":1},"attempts":0}`)
			}
			_, err := h(msgOf(payload))
			if c.reject {
				if !errors.Is(err, idempotency.ErrTooOld) || !idempotency.IsPermanent(err) || runs != 0 {
					t.Fatalf("err=%v runs=%d, want a permanent ErrTooOld and no run", err, runs)
				}
				if !strings.Contains(err.Error(), "created 2h0m0s ago") && !strings.Contains(err.Error(), "created 1h0m30s ago") {
					t.Fatalf("the error does not name the age: %v", err)
				}
				if !strings.Contains(err.Error(), "the horizon is 1h0m0s") {
					t.Fatalf("the error does not name the horizon: %v", err)
				}
				return
			}
			if err != nil || runs != 1 {
				t.Fatalf("err=%v runs=%d, want a run", err, runs)
			}
		})
	}
}

// TestMetricsCountEveryOutcome scripts deliveries covering every outcome and
// reads the exact counts back through an in-memory OpenTelemetry reader.
func TestMetricsCountEveryOutcome(t *testing.T) {
	t.Parallel()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	ctx := context.Background()

	store := &faultyStore{Store: memstore.New()}
	h := idempotency.Middleware(store, idempotency.WithClaim(time.Minute), idempotency.WithMeterProvider(mp),
		idempotency.WithRememberRetry(1, 0))(counting(new(int), nil))
	deliver := func(payload []byte) { _, _ = h(msgOf(payload)) }

	deliver(envelopeWithID(t, "a"))                                                           // run
	deliver(envelopeWithID(t, "a"))                                                           // skip
	deliver(envelopeWithID(t, "a"))                                                           // skip
	_, _, _ = store.Store.Claim(stores.WithClaimToken(ctx, "other"), "b", time.Minute)        // b is in flight elsewhere
	deliver(envelopeWithID(t, "b"))                                                           // park
	deliver([]byte("not json"))                                                               // fail_open
	deliver([]byte(`{"meta":{"id":"c","schema_version":2}}`))                                 // reject
	conflicting, _ := envelope.New("urn:other", map[string]any{"x": 1}, envelope.WithID("a")) // same id, other content
	p, _ := conflicting.Marshal()
	deliver(p)                      // conflict
	store.failRemember = 1 << 30    //
	deliver(envelopeWithID(t, "d")) // run, then remember_failed
	store.failRemember = 0          //
	store.failClaim = errors.New("dial tcp: connection refused")
	deliver(envelopeWithID(t, "e")) // store_error

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		t.Fatal(err)
	}
	counts := map[string]int64{}
	operations := map[string]uint64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch data := m.Data.(type) {
			case metricdata.Sum[int64]:
				if m.Name != idempotency.MetricDeliveries {
					continue
				}
				for _, dp := range data.DataPoints {
					o, _ := dp.Attributes.Value("outcome")
					counts[o.AsString()] += dp.Value
				}
			case metricdata.Histogram[float64]:
				if m.Name != idempotency.MetricStoreDuration {
					continue
				}
				for _, dp := range data.DataPoints {
					op, _ := dp.Attributes.Value("operation")
					operations[op.AsString()] += dp.Count
				}
			}
		}
	}
	want := map[string]int64{"run": 2, "skip": 2, "park": 1, "fail_open": 1, "reject": 1, "conflict": 1, "remember_failed": 1, "store_error": 1}
	for o, n := range want {
		if counts[o] != n {
			t.Fatalf("%s = %d, want %d (all: %v)", o, counts[o], n, counts)
		}
	}
	if len(counts) != len(want) {
		t.Fatalf("unexpected outcomes: %v", counts)
	}
	for _, op := range []string{"claim", "remember"} {
		if operations[op] == 0 {
			t.Fatalf("no %s latency recorded: %v", op, operations)
		}
	}
	// memstore reports why a claim failed: duplicates cost no second call.
	if operations["seen"] != 0 {
		t.Fatalf("%d seen calls under a claim with a ClaimReporter store: %v", operations["seen"], operations)
	}
}

// TestDerivedIDsLetDownstreamSkipARetriedParentsChildren: a parent handler
// publishes a child and then fails, so it is retried and publishes the child
// again. With ids derived from the parent, the downstream consumer runs once;
// with fresh ids it would run twice.
func TestDerivedIDsLetDownstreamSkipARetriedParentsChildren(t *testing.T) {
	t.Parallel()
	for _, derived := range []bool{true, false} {
		t.Run(map[bool]string{true: "derived ids", false: "fresh ids"}[derived], func(t *testing.T) {
			ps := newPubSub()
			var a acks
			var downstream atomic.Int64
			var attempts atomic.Int64
			r := newRouter(t)
			r.AddMiddleware(a.middleware, idempotency.Middleware(memstore.New(), idempotency.WithClaim(10*time.Second)))
			r.AddConsumerHandler("order", "orders", ps, func(msg *message.Message) error {
				parent, err := envelope.Parse(msg.Payload)
				if err != nil {
					return err
				}
				var child envelope.Envelope
				if derived {
					child, err = envelope.NewChild(parent, "invoice", "urn:babel:invoices:requested", map[string]any{"order": 1})
				} else {
					child, err = envelope.New("urn:babel:invoices:requested", map[string]any{"order": 1}, envelope.WithTraceID(parent.TraceID))
				}
				if err != nil {
					return err
				}
				payload, _ := child.Marshal()
				if err := ps.Publish("invoices", message.NewMessage(watermill.NewUUID(), payload)); err != nil {
					return err
				}
				if attempts.Add(1) == 1 {
					return errors.New("the order's own write failed after the child was sent")
				}
				return nil
			})
			r.AddConsumerHandler("invoice", "invoices", ps, func(*message.Message) error {
				downstream.Add(1)
				return nil
			})
			testenv.RunRouter(t, r)
			publish(t, ps, "orders", envelopeWithID(t, "order-1"))
			// order: nack then ack; invoices: two copies acked.
			eventually(t, "the order and both invoice copies", func() bool { return a.acked.Load() == 3 })
			want := int64(1)
			if !derived {
				want = 2
			}
			if attempts.Load() != 2 || downstream.Load() != want {
				t.Fatalf("parent attempts %d, downstream runs %d; want 2 and %d", attempts.Load(), downstream.Load(), want)
			}
		})
	}
}

// TestOldestClaimAge: the age of the oldest claim this worker holds, and
// how many it holds, are observed while a handler runs, and fall to zero
// once its message is remembered or released.
func TestOldestClaimAge(t *testing.T) {
	t.Parallel()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	release := make(chan struct{})
	h := idempotency.Middleware(memstore.New(), idempotency.WithMeterProvider(mp))(func(msg *message.Message) ([]*message.Message, error) {
		<-release
		if string(msg.Payload) != "" && msg.UUID == "fail" {
			return nil, errors.New("declined")
		}
		return nil, nil
	})
	gauges := func() (n int64, age float64) {
		var rm metricdata.ResourceMetrics
		if err := reader.Collect(context.Background(), &rm); err != nil {
			t.Fatal(err)
		}
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				switch m.Name {
				case idempotency.MetricClaimsInProgress:
					n = m.Data.(metricdata.Gauge[int64]).DataPoints[0].Value
				case idempotency.MetricOldestClaimAge:
					age = m.Data.(metricdata.Gauge[float64]).DataPoints[0].Value
				}
			}
		}
		return n, age
	}
	done := make(chan struct{}, 2)
	go func() { _, _ = h(msgOf(envelopeWithID(t, "slow-1"))); done <- struct{}{} }()
	time.Sleep(300 * time.Millisecond)
	failing := message.NewMessage("fail", envelopeWithID(t, "slow-2"))
	go func() { _, _ = h(failing); done <- struct{}{} }()
	time.Sleep(100 * time.Millisecond)
	if n, age := gauges(); n != 2 || age < 0.3 || age > 30 {
		t.Fatalf("while two handlers run: %d claims held, oldest %.2fs; want 2, at least 0.3s", n, age)
	}
	close(release)
	<-done
	<-done
	if n, age := gauges(); n != 0 || age != 0 {
		t.Fatalf("after both ended (one remembered, one released): %d claims held, oldest %.2fs; want 0, 0", n, age)
	}
}
