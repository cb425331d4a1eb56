package idempotency

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
)

type replayKey struct{}

// IsReplay reports whether the message being handled was deliberately
// replayed by an operator with the bypass marker (metadata
// envelope.MetadataReplayBypass set to "1", as redrive's WithReplayBypass
// stamps it). The middleware puts the marker in the message context.
func IsReplay(ctx context.Context) bool {
	replay, _ := ctx.Value(replayKey{}).(bool)
	return replay
}

// ContextWithReplay returns a copy of ctx marked as a replay, as the
// middleware does for a message carrying the bypass marker. Use it to unit
// test a handler's replay path.
func ContextWithReplay(ctx context.Context) context.Context {
	return context.WithValue(ctx, replayKey{}, true)
}

// BypassExternalEffects runs fn unless the message being handled is a
// replay. Wrap the effects that must not happen twice even when an operator
// replays a message on purpose (an email, a card charge, a webhook), and
// leave the idempotent core (database writes keyed by the message) outside:
// it runs again on a replay and converges.
//
//	if err := idempotency.BypassExternalEffects(msg.Context(), func(ctx context.Context) error {
//		return mailer.Send(ctx, confirmation)
//	}); err != nil {
//		return err
//	}
func BypassExternalEffects(ctx context.Context, fn func(ctx context.Context) error) error {
	if IsReplay(ctx) {
		return nil
	}
	return fn(ctx)
}

// isMarkedReplay reports whether msg carries the replay marker.
func isMarkedReplay(msg *message.Message) bool {
	return msg.Metadata.Get(envelope.MetadataReplayBypass) == "1"
}

// checkHorizon rejects a message that may be older than its record's
// lifetime, unless it is a deliberate replay. Clock skew tightens the check:
// a producer whose clock runs ahead of this consumer's stamps created_at
// late, so the message may be up to the skew older than it looks. The
// subtraction cannot wrap (both durations are non-negative), and a horizon
// of math.MaxInt64 is effectively forever.
func (g *Guard) checkHorizon(msg *message.Message, id envelope.Identity) error {
	if g.cfg.horizon <= 0 || id.CreatedAt <= 0 {
		return nil
	}
	limit := g.cfg.horizon - g.cfg.skew
	age := time.Since(time.UnixMilli(id.CreatedAt))
	if age <= limit || isMarkedReplay(msg) {
		return nil
	}
	return fmt.Errorf("idempotency: message %q: %w: created %v ago, the horizon is %v less %v of clock skew (its record may have expired; to run it deliberately, forget it and redrive it with the replay marker)",
		id.ID, ErrTooOld, age.Round(time.Second), g.cfg.horizon, g.cfg.skew)
}

// markReplay exposes the bypass marker of msg to its handler.
func markReplay(msg *message.Message) {
	if isMarkedReplay(msg) {
		msg.SetContext(ContextWithReplay(msg.Context()))
	}
}
