package effects_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/babelqueue/watermill-idempotency/effects"
	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// TestMetrics: decisions, calls, resolutions and the store's gauges, by
// name and attributes; the oldest unknown effect's age grows with it.
func TestMetrics(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	p := newProvider()
	charge := f.fx.Effect("charge", effects.WithResolver(p.status))
	email := f.fx.Effect("email") // Park, no resolver
	_, _ = charge.Do(delivery("x-1", "a"), map[string]int{"amount": 1}, p.charge("ok"))
	_, _ = charge.Do(delivery("x-1", "b"), map[string]int{"amount": 1}, p.charge("ok")) // replay
	_, _ = charge.Do(delivery("x-2", "a"), nil, p.charge("timeout"))                    // unknown
	_, _ = charge.Do(delivery("x-2", "b"), nil, p.charge("ok"))                         // reconciled
	_, _ = email.Do(delivery("x-3", "a"), nil, p.charge("timeout"))                     // unknown
	_, _ = email.Do(delivery("x-3", "b"), nil, p.charge("ok"))                          // park
	_, _ = charge.Do(delivery("x-1", "c"), map[string]int{"amount": 2}, p.charge("ok"))
	time.Sleep(100 * time.Millisecond)

	for _, c := range []struct {
		name  string
		attrs []attribute.KeyValue
		want  int64
	}{
		{effects.MetricAttempts, attrs("effect", "charge", "decision", "call"), 1},
		{effects.MetricAttempts, attrs("effect", "charge", "decision", "unknown"), 1},
		{effects.MetricAttempts, attrs("effect", "charge", "decision", "replay"), 1},
		{effects.MetricAttempts, attrs("effect", "charge", "decision", "reconciled"), 1},
		{effects.MetricAttempts, attrs("effect", "charge", "decision", "conflict"), 1},
		{effects.MetricAttempts, attrs("effect", "email", "decision", "unknown"), 1},
		{effects.MetricAttempts, attrs("effect", "email", "decision", "park"), 1},
		{effects.MetricCalls, attrs("effect", "charge", "outcome", "succeeded"), 1},
		{effects.MetricCalls, attrs("effect", "charge", "outcome", "unknown"), 1},
		{effects.MetricResolutions, attrs("effect", "charge", "evidence", "lookup"), 1},
	} {
		if got := sum(t, f.reader, c.name, c.attrs...); got != c.want {
			t.Errorf("%s%v = %d, want %d", c.name, c.attrs, got, c.want)
		}
	}
	var rm metricdata.ResourceMetrics
	if err := f.reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	counts, ages := map[string]int64{}, map[string]float64{}
	var histogram bool
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Gauge[int64]:
				for _, dp := range d.DataPoints {
					s, _ := dp.Attributes.Value("state")
					counts[m.Name+"/"+s.AsString()] = dp.Value
				}
			case metricdata.Gauge[float64]:
				for _, dp := range d.DataPoints {
					s, _ := dp.Attributes.Value("state")
					ages[m.Name+"/"+s.AsString()] = dp.Value
				}
			case metricdata.Histogram[float64]:
				histogram = histogram || m.Name == effects.MetricCallDuration && m.Unit == "s" && len(d.DataPoints) > 0
			}
		}
	}
	if counts[effects.MetricEffects+"/succeeded"] != 2 || counts[effects.MetricEffects+"/unknown"] != 1 || counts[effects.MetricEffects+"/failed"] != 0 {
		t.Fatalf("%s by state = %v; want 2 succeeded, 1 unknown, 0 failed", effects.MetricEffects, counts)
	}
	if age := ages[effects.MetricOldestAge+"/unknown"]; age < 0.09 || age > 10 {
		t.Fatalf("%s{state=unknown} = %vs; want the unknown effect's age, about 0.1s", effects.MetricOldestAge, age)
	}
	if age := ages[effects.MetricOldestAge+"/pending"]; age != 0 {
		t.Fatalf("%s{state=pending} = %v with no pending effect, want 0", effects.MetricOldestAge, age)
	}
	if !histogram {
		t.Fatalf("no %s histogram in seconds", effects.MetricCallDuration)
	}
}

func attrs(kv ...string) []attribute.KeyValue {
	var out []attribute.KeyValue
	for i := 0; i+1 < len(kv); i += 2 {
		out = append(out, attribute.String(kv[i], kv[i+1]))
	}
	return out
}

// TestSpans: one span per decision with a call or lookup span under it,
// with the effect's attributes, continuing the message's trace: its W3C
// traceparent, or its envelope's trace_id.
func TestSpans(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	p := newProvider()
	charge := f.fx.Effect("charge", effects.WithResolver(p.status))

	const traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
	msg.Metadata.Set("traceparent", traceparent)
	ctx := stores.WithClaimToken(idempotency.ContextWithDelivery(context.Background(), idempotency.Delivery{
		Key: idempotency.Key("billing", "t-1"), Scope: "billing", ID: "t-1", Handler: "charge-handler", Message: msg}), "a")
	_, _ = charge.Do(ctx, nil, p.charge("timeout"))
	_, _ = charge.Do(ctx, nil, p.charge("ok"))

	spans := f.spans.Ended()
	if len(spans) != 4 {
		t.Fatalf("%d spans, want 4 (do+call, do+reconcile): %v", len(spans), names(spans))
	}
	want := []string{effects.SpanCall, effects.SpanDo, effects.SpanReconcile, effects.SpanDo}
	for i, s := range spans {
		if s.Name() != want[i] {
			t.Fatalf("spans %v, want %v", names(spans), want)
		}
		if s.SpanContext().TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" {
			t.Fatalf("span %s in trace %s, not the message's", s.Name(), s.SpanContext().TraceID())
		}
		a := attrMap(s)
		if a[string(effects.AttrEffect)] != "charge" || a[string(effects.AttrProviderKey)] != effects.ProviderKey("billing", "t-1", "charge") {
			t.Fatalf("span %s attributes %v", s.Name(), a)
		}
	}
	if spans[0].Parent().SpanID() != spans[1].SpanContext().SpanID() || spans[1].Parent().SpanID().String() != "00f067aa0ba902b7" {
		t.Fatal("the call span is not under the decision span, or the decision not under the message's span")
	}
	if a := attrMap(spans[1]); a[string(effects.AttrDecision)] != "unknown" || a[string(effects.AttrMessageID)] != "t-1" || a[string(effects.AttrHandler)] != "charge-handler" || a[string(effects.AttrAttempt)] != "1" {
		t.Fatalf("first decision span: %v", a)
	}
	if a := attrMap(spans[0]); a[string(effects.AttrOutcome)] != "unknown" {
		t.Fatalf("call span: %v", a)
	}
	if a := attrMap(spans[3]); a[string(effects.AttrDecision)] != "reconciled" || a[string(effects.AttrState)] != "succeeded" {
		t.Fatalf("second decision span: %v", a)
	}

	// An envelope from another SDK: no traceparent, a trace_id.
	env, err := envelope.New("urn:babel:orders:paid", map[string]int{"n": 1}, envelope.WithTraceID("0af7651916cd43dd8448eb211c80319c"))
	if err != nil {
		t.Fatal(err)
	}
	payload, _ := env.Marshal()
	ctx = idempotency.ContextWithDelivery(context.Background(), idempotency.Delivery{
		Key: idempotency.Key("billing", env.Meta.ID), Scope: "billing", ID: env.Meta.ID, Message: message.NewMessage("u", payload)})
	_, _ = charge.Do(ctx, nil, p.charge("ok"))
	last := f.spans.Ended()[len(f.spans.Ended())-1]
	if last.Name() != effects.SpanDo || last.SpanContext().TraceID().String() != "0af7651916cd43dd8448eb211c80319c" {
		t.Fatalf("a span for an envelope with trace_id: %s in trace %s", last.Name(), last.SpanContext().TraceID())
	}
}

func names(spans []sdktrace.ReadOnlySpan) []string {
	var out []string
	for _, s := range spans {
		out = append(out, s.Name())
	}
	return out
}

func attrMap(s sdktrace.ReadOnlySpan) map[string]string {
	out := map[string]string{}
	for _, kv := range s.Attributes() {
		out[string(kv.Key)] = kv.Value.String()
	}
	return out
}

// TestCallbacks: applied once by event id, through the transitions; a
// duplicate or an out-of-order event changes nothing; HTTP and Watermill
// helpers answer as documented.
func TestCallbacks(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	p := newProvider()
	charge := f.fx.Effect("charge")
	_, _ = charge.Do(delivery("c-1", "a"), nil, p.charge("timeout"))
	key := effects.ProviderKey("billing", "c-1", "charge")
	ctx := context.Background()
	apply := func(event string, o effects.Outcome, want string) {
		t.Helper()
		res, err := f.fx.ApplyCallback(ctx, effects.Callback{EventID: event, ProviderKey: key, Outcome: o})
		if err != nil || res.Outcome != want {
			t.Fatalf("callback %s: %q, %v; want %q", event, res.Outcome, err, want)
		}
	}
	apply("evt_2", effects.Unknown("processing"), effects.CallbackUnchanged)
	apply("evt_3", effects.Succeeded([]byte("ch_cb")), effects.CallbackApplied)
	apply("evt_3", effects.Succeeded([]byte("ch_cb")), effects.CallbackDuplicate)
	apply("evt_1", effects.Failed("insufficient_funds"), effects.CallbackContradicted) // older, arriving late
	apply("evt_4", effects.Succeeded([]byte("ch_cb")), effects.CallbackConfirmed)
	if res, err := charge.Do(delivery("c-1", "b"), nil, p.charge("ok")); err != nil || string(res) != "ch_cb" {
		t.Fatalf("after the callback: %q, %v", res, err)
	}
	wantCalls(t, p, 1, 1)
	if got := sum(t, f.reader, effects.MetricCallbacks, attribute.String("outcome", "duplicate")); got != 1 {
		t.Fatalf("duplicate callbacks counted %d", got)
	}

	parse := func(r *http.Request) (effects.Callback, error) {
		q := r.URL.Query()
		return effects.Callback{EventID: q.Get("event"), ProviderKey: q.Get("key"), Outcome: effects.Succeeded([]byte("ch"))}, nil
	}
	srv := httptest.NewServer(f.fx.HTTPHandler(parse))
	defer srv.Close()
	for _, c := range []struct {
		query string
		code  int
		body  string
	}{
		{"event=e9&key=" + key, 200, "confirmed"},
		{"event=e9&key=" + key, 200, "duplicate"},
		{"event=e10&key=nobody", 200, "no_effect"},
		{"event=&key=" + key, 400, ""},
	} {
		resp, err := http.Post(srv.URL+"/?"+c.query, "application/json", nil)
		if err != nil {
			t.Fatal(err)
		}
		var b strings.Builder
		buf := make([]byte, 256)
		n, _ := resp.Body.Read(buf)
		b.Write(buf[:n])
		resp.Body.Close()
		if resp.StatusCode != c.code || !strings.Contains(b.String(), c.body) {
			t.Fatalf("POST ?%s: %d %q, want %d %q", c.query, resp.StatusCode, b.String(), c.code, c.body)
		}
	}

	h := f.fx.CallbackHandler(func(m *message.Message) (effects.Callback, error) {
		return effects.Callback{EventID: m.UUID, ProviderKey: string(m.Payload), Outcome: effects.Failed("x")}, nil
	})
	if err := h(message.NewMessage("e20", []byte(key))); err != nil {
		t.Fatalf("Watermill callback handler: %v", err)
	}
	if err := h(message.NewMessage("", []byte(key))); !idempotency.IsPermanent(err) {
		t.Fatalf("a callback without event id: %v; want permanent", err)
	}
}

// TestLostOutcomeWriteIsReconciledLater: the call succeeded but its outcome
// could not be recorded: the handler gets the result (the charge
// happened); the record stays pending, and once its lease passes a later
// attempt reconciles it, without a second charge.
func TestLostOutcomeWriteIsReconciledLater(t *testing.T) {
	t.Parallel()
	s := &failingTransitions{EffectStore: memstore.NewEffects()}
	f := newFixture(t, s)
	p := newProvider()
	charge := f.fx.Effect("charge", effects.WithResolver(p.status))
	s.fail.Store(true)
	res, err := charge.Do(delivery("w-1", "a"), nil, p.charge("ok"))
	if err != nil || len(res) == 0 {
		t.Fatalf("a charge whose outcome could not be written: %q, %v; want the result", res, err)
	}
	s.fail.Store(false)
	if e := effectOf(t, s, "w-1", "charge"); e.State != stores.EffectPending {
		t.Fatalf("effect %s, want pending", e.State)
	}
	if got := sum(t, f.reader, effects.MetricRecordFailed); got != 1 {
		t.Fatalf("%s = %d", effects.MetricRecordFailed, got)
	}
	time.Sleep(450 * time.Millisecond)
	if _, err := charge.Do(delivery("w-1", "b"), nil, p.charge("ok")); err != nil {
		t.Fatal(err)
	}
	wantCalls(t, p, 1, 1)
}
