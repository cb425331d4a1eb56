package idempotency

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
)

// NewChildMessage builds the Watermill message a handler produces while
// handling parent: its body is envelope.NewChild of parent's envelope (a
// meta.id derived from the parent's and name, the parent's trace_id), its
// Watermill UUID is that meta.id, its metadata carries the parent's
// out-of-band headers (envelope.CarriedHeaders: traceparent, tracestate,
// bq-replay-bypass, …) and the bq-message-id, bq-trace-id and bq-job
// projections of the child. A retry of the parent produces the same message,
// which downstream consumers skip. It fails when parent's body is not a valid
// envelope or the child cannot be built.
func NewChildMessage(parent *message.Message, name, urn string, data any, opts ...envelope.Option) (*message.Message, error) {
	p, err := envelope.Parse(parent.Payload)
	if err != nil {
		return nil, fmt.Errorf("idempotency: child of message %s: %w", parent.UUID, err)
	}
	child, err := envelope.NewChild(p, name, urn, data, opts...)
	if err != nil {
		return nil, fmt.Errorf("idempotency: child %q of %s: %w", name, p.Meta.ID, err)
	}
	payload, err := child.Marshal()
	if err != nil {
		return nil, fmt.Errorf("idempotency: child %q of %s: %w", name, p.Meta.ID, err)
	}
	msg := message.NewMessage(child.Meta.ID, payload)
	for k, v := range envelope.CarriedHeaders(parent.Metadata) {
		msg.Metadata.Set(k, v)
	}
	msg.Metadata.Set(envelope.MetadataMessageID, child.Meta.ID)
	msg.Metadata.Set(envelope.MetadataTraceID, child.TraceID)
	msg.Metadata.Set(envelope.MetadataJob, child.Job)
	return msg, nil
}

// CarryHeaders is router middleware that copies the handled message's
// out-of-band headers (envelope.CarriedHeaders: a W3C traceparent,
// tracestate, baggage, bq-replay-bypass, …) onto every message the handler
// returns, so that the trace and the replay marker follow the causal chain
// without code in the handler. A key the produced message already has is
// left as the handler set it; transport headers (x-attempts, bq-message-id,
// …) are never copied.
//
//	router.AddMiddleware(idempotency.CarryHeaders, idempotency.Middleware(store))
func CarryHeaders(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		produced, err := h(msg)
		if len(produced) == 0 {
			return produced, err
		}
		carried := envelope.CarriedHeaders(msg.Metadata)
		for _, out := range produced {
			if out == nil {
				continue
			}
			for k, v := range carried {
				if _, set := out.Metadata[k]; !set {
					if out.Metadata == nil {
						out.Metadata = make(message.Metadata, len(carried))
					}
					out.Metadata.Set(k, v)
				}
			}
		}
		return produced, err
	}
}
