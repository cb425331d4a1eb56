package idempotency_test

import (
	"context"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// TestDeliverySpanContinuesTheMessageTrace runs deliveries through a router
// and reads the spans an OpenTelemetry SDK recorded: each delivery is an
// idempotency.delivery span in the trace the message carried (its
// traceparent metadata, or the envelope's trace_id), with the decision and
// the store calls as events, and the handler's own spans are its children.
func TestDeliverySpanContinuesTheMessageTrace(t *testing.T) {
	t.Parallel()
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })

	pubsub := newPubSub()
	router := newRouter(t)
	// Outermost, a dead-letter stand-in: every delivery is acked, so that
	// the rejected one does not come back for ever.
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			_, _ = h(msg)
			return nil, nil
		}
	}, idempotency.Middleware(memstore.New(), idempotency.WithTracerProvider(tp), idempotency.WithLogger(watermill.NopLogger{})))
	router.AddConsumerHandler("charge", "trace-test", pubsub, func(msg *message.Message) error {
		_, span := tp.Tracer("handler").Start(msg.Context(), "charge card")
		span.End()
		return nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go func() { _ = router.Run(ctx) }()
	<-router.Running()

	// The producer's span, carried as a W3C traceparent.
	_, producer := tp.Tracer("producer").Start(context.Background(), "publish")
	producer.End()
	first := msgOf(envelopeWithID(t, "trace-1"))
	(propagation.TraceContext{}).Inject(trace.ContextWithSpan(context.Background(), producer), propagation.MapCarrier(first.Metadata))
	duplicate := first.Copy()
	duplicate.UUID = watermill.NewUUID()
	// A message that names its trace only in the envelope.
	const envelopeTrace = "4bf92f3577b34da6a3ce929d0e0e4736"
	bare := msgOf([]byte(`{"job":"urn:babel:orders:created","trace_id":"` + envelopeTrace + `","data":{},"meta":{"id":"trace-2","schema_version":1},"attempts":0}`))
	conflict := msgOf([]byte(`{"job":"urn:babel:orders:created","trace_id":"t","data":{"other":1},"meta":{"id":"trace-1","schema_version":1},"attempts":0}`))
	byUUID := func(uuid string) sdktrace.ReadOnlySpan {
		for _, s := range spans.Ended() {
			if s.Name() != idempotency.SpanDelivery {
				continue
			}
			for _, a := range s.Attributes() {
				if a.Key == idempotency.AttrMessageUUID && a.Value.AsString() == uuid {
					return s
				}
			}
		}
		return nil
	}
	// One at a time, each once the last one's span ended: the router
	// handles deliveries concurrently.
	got := map[string]sdktrace.ReadOnlySpan{}
	for _, d := range []struct {
		name string
		msg  *message.Message
	}{{"first", first}, {"duplicate", duplicate}, {"bare", bare}, {"conflict", conflict}} {
		if err := pubsub.Publish("trace-test", d.msg); err != nil {
			t.Fatal(err)
		}
		eventually(t, "the span of "+d.name, func() bool {
			got[d.name] = byUUID(d.msg.UUID)
			return got[d.name] != nil
		})
	}
	events := func(s sdktrace.ReadOnlySpan) string {
		var names []string
		for _, e := range s.Events() {
			names = append(names, e.Name)
		}
		return strings.Join(names, " ")
	}
	check := func(name, wantEvents string, wantTrace trace.TraceID, wantStatus codes.Code) {
		t.Helper()
		s := got[name]
		if ev := events(s); ev != wantEvents {
			t.Errorf("%s: events %q, want %q", name, ev, wantEvents)
		}
		if wantTrace.IsValid() && s.SpanContext().TraceID() != wantTrace {
			t.Errorf("%s: trace %s, want the message's %s", name, s.SpanContext().TraceID(), wantTrace)
		}
		if s.Status().Code != wantStatus {
			t.Errorf("%s: status %v (%s), want %v", name, s.Status().Code, s.Status().Description, wantStatus)
		}
	}
	producerTrace := producer.SpanContext().TraceID()
	check("first", "store.claim run store.remember", producerTrace, codes.Unset)
	check("duplicate", "store.claim skip", producerTrace, codes.Unset)
	envTrace, _ := trace.TraceIDFromHex(envelopeTrace)
	check("bare", "store.claim run store.remember", envTrace, codes.Unset)
	// A conflict looks up whether that conflict ended before (its dead letter
	// out): it is then skipped rather than dead-lettered again.
	check("conflict", "store.claim conflict store.lookup", trace.TraceID{}, codes.Error) // a trace of its own: it carries none
	if p := got["first"].Parent(); p.SpanID() != producer.SpanContext().SpanID() {
		t.Errorf("first: parent span %s, want the producer's %s", p.SpanID(), producer.SpanContext().SpanID())
	}
	// The handler's span is a child of the delivery's.
	handlerSpans := 0
	for _, s := range spans.Ended() {
		if s.Name() == "charge card" && s.SpanContext().TraceID() == producerTrace {
			handlerSpans++
			if s.Parent().SpanID() != got["first"].SpanContext().SpanID() {
				t.Errorf("the handler's span has parent %s, want the delivery's %s", s.Parent().SpanID(), got["first"].SpanContext().SpanID())
			}
		}
	}
	if handlerSpans != 1 {
		t.Errorf("%d handler spans in the producer's trace, want 1", handlerSpans)
	}
	for _, a := range got["conflict"].Attributes() {
		if a.Key == idempotency.AttrOutcome && a.Value.AsString() != string(idempotency.OutcomeConflict) {
			t.Errorf("conflict: outcome attribute %q", a.Value.AsString())
		}
	}
}
