// Package msgtrace finds the trace a Watermill message carries, so that the
// spans the kit starts for it continue that trace: the span already in the
// context, else the message's W3C traceparent (metadata), else the
// envelope's trace_id when it is a UUID or 32 hex digits.
package msgtrace

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Context returns ctx with the trace msg carries as the parent of the next
// span, or ctx unchanged when it already holds a span or msg carries no
// trace. traceID reads the envelope's trace_id from a payload (it is only
// called when the metadata carry no trace). id (the message's identity)
// derives the parent span id of an envelope's trace_id, which names a
// trace but no span: the same on every attempt of the message.
func Context(ctx context.Context, msg *message.Message, id string, traceID func(payload []byte) string) context.Context {
	if msg == nil || trace.SpanContextFromContext(ctx).IsValid() {
		return ctx
	}
	if traced := (propagation.TraceContext{}).Extract(ctx, propagation.MapCarrier(msg.Metadata)); trace.SpanContextFromContext(traced).IsValid() {
		return traced
	}
	tid, ok := ParseTraceID(traceID(msg.Payload))
	if !ok {
		return ctx
	}
	if id == "" {
		id = msg.UUID
	}
	sum := sha256.Sum256([]byte(id))
	var spanID trace.SpanID
	copy(spanID[:], sum[:8])
	return trace.ContextWithRemoteSpanContext(ctx, trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: tid, SpanID: spanID, TraceFlags: trace.FlagsSampled, Remote: true}))
}

// ParseTraceID reads a trace_id that is a UUID or 32 hex digits.
func ParseTraceID(s string) (trace.TraceID, bool) {
	s = strings.ReplaceAll(s, "-", "")
	var id trace.TraceID
	if len(s) != 32 {
		return id, false
	}
	if _, err := hex.Decode(id[:], []byte(strings.ToLower(s))); err != nil || !id.IsValid() {
		return id, false
	}
	return id, true
}
