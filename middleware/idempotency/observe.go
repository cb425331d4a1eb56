package idempotency

import (
	"context"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
)

// observe reports a decision to the observer and the logger, and returns
// the event's error so that callers can return it in one line.
func (g *Guard) observe(ctx context.Context, msg *message.Message, e Event) error {
	g.metrics.count(ctx, e.Handler, e.Outcome)
	if g.cfg.observer != nil {
		g.cfg.observer.Observe(ctx, e)
	}
	if _, nop := g.cfg.logger.(watermill.NopLogger); nop || e.Outcome == OutcomeRun {
		return e.Err
	}
	fields := g.fields(e).Add(watermill.LogFields{"message_uuid": msg.UUID, "decision": string(e.Outcome),
		"trace_id": envelope.ReadTraceID(msg.Payload)})
	switch e.Outcome {
	case OutcomeSkip:
		g.cfg.logger.Debug("Duplicate delivery skipped", fields)
	case OutcomePark:
		g.cfg.logger.Info("Delivery parked: the message is in flight in another delivery", fields)
	case OutcomeFailOpen:
		g.cfg.logger.Info("Message has no usable identity; handled without deduplication", fields.Add(
			watermill.LogFields{"reason": e.Err.Error()}))
	default:
		g.cfg.logger.Error("Idempotency decision failed", e.Err, fields)
	}
	return e.Err
}

func (g *Guard) fields(e Event) watermill.LogFields {
	return watermill.LogFields{"message_id": e.MessageID, "handler": e.Handler}
}
