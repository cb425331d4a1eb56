package effects

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// Callback is a provider's notification about an effect (a webhook).
type Callback struct {
	// EventID is the provider's identity of the event: a callback is
	// applied once per EventID, however often it is delivered.
	EventID string
	// ProviderKey is the effect's provider key, as the provider echoes it
	// (the idempotency key or client reference the call sent).
	ProviderKey string
	// Outcome is what the event says: Succeeded (with the provider's
	// result) or Failed moves the effect; anything else is recorded and
	// moves nothing but a pending effect whose attempt's lease passed
	// (to unknown).
	Outcome Outcome
}

// What ApplyCallback did, as CallbackResult.Outcome and the "outcome"
// attribute of MetricCallbacks.
const (
	CallbackApplied      = "applied"      // the effect moved to the callback's state
	CallbackConfirmed    = "confirmed"    // it was in that state already
	CallbackDuplicate    = "duplicate"    // this event was applied before: nothing done
	CallbackContradicted = "contradicted" // the effect is final in another state: kept, logged
	CallbackNoEffect     = "no_effect"    // no effect under that key (another system's, or lapsed)
	CallbackUnchanged    = "unchanged"    // an event with no definitive outcome
	CallbackOverruled    = "overruled"    // a success that replaced an operator's resolution (see Runner.Resolve)
)

// CallbackResult is what ApplyCallback did.
type CallbackResult struct {
	Outcome string        // one of the Callback… constants
	Effect  stores.Effect // the effect as it is now
}

// ErrInvalidCallback is matched when a callback names no event or no
// provider key.
var ErrInvalidCallback = errors.New("invalid effect callback")

// ApplyCallback records cb once by its event identity and moves its effect
// along the allowed transitions, in one atomic step of the store. A
// duplicate changes nothing; an event arriving out of order (a "failed"
// after "succeeded", a "processing" after either) cannot move a final
// effect and is reported as contradicted (logged at error when the states
// disagree) or confirmed. The one exception is an operator's resolution: a
// success overrules it (the effect becomes succeeded with the callback's
// result, reported as overruled; see Runner.Resolve), also when the event
// is delivered again, in case its first delivery was recorded and the
// overrule lost.
func (r *Runner) ApplyCallback(ctx context.Context, cb Callback) (CallbackResult, error) {
	if cb.EventID == "" || cb.ProviderKey == "" {
		return CallbackResult{}, fmt.Errorf("effects: %w: event %q, provider key %q", ErrInvalidCallback, cb.EventID, cb.ProviderKey)
	}
	t := stores.EffectTransition{To: stores.EffectUnknown, Note: cb.Outcome.Reason, Evidence: EvidenceCallback}
	if cb.Outcome.State.Final() {
		t = stores.EffectTransition{To: cb.Outcome.State, Result: cb.Outcome.Result, Note: cb.Outcome.Reason, Evidence: EvidenceCallback}
	}
	sctx, cancel := r.storeContext(ctx)
	defer cancel()
	res, err := r.store.ApplyEvent(sctx, cb.EventID, cb.ProviderKey, t)
	if err != nil {
		r.obs.callbackOutcome(ctx, "store_error")
		return CallbackResult{}, fmt.Errorf("effects: callback %s for %s: %w: %w", cb.EventID, cb.ProviderKey, idempotency.ErrStore, err)
	}
	out := CallbackResult{Effect: res.Now}
	if t.To.Final() && !res.Moved && byOperator(res.Now) && (res.First || t.To == stores.EffectSucceeded) {
		// An operator's resolution: a success overrules it, also when
		// this event comes again (its first delivery may have been
		// recorded and the overrule lost with the process).
		overruled, now, err := r.answerOperator(ctx, t, res.Now, func(o stores.EffectTransition) (bool, stores.Effect, error) {
			return r.store.Transition(sctx, cb.ProviderKey, o)
		})
		if err != nil {
			r.obs.callbackOutcome(ctx, "store_error")
			return CallbackResult{}, fmt.Errorf("effects: callback %s for %s: %w: %w", cb.EventID, cb.ProviderKey, idempotency.ErrStore, err)
		}
		out.Effect = now
		switch {
		case overruled:
			out.Outcome = CallbackOverruled
		case !res.First:
			out.Outcome = CallbackDuplicate
		case now.State == t.To:
			out.Outcome = CallbackConfirmed
		default:
			out.Outcome = CallbackContradicted // logged by answerOperator
		}
		r.obs.callbackOutcome(ctx, out.Outcome)
		return out, nil
	}
	switch {
	case !res.First:
		out.Outcome = CallbackDuplicate
	case res.Now.State == stores.EffectNone:
		out.Outcome = CallbackNoEffect
	case res.Moved && t.To.Final():
		out.Outcome = CallbackApplied
		r.obs.resolved(ctx, res.Now)
	case res.Now.State == t.To && t.To.Final():
		out.Outcome = CallbackConfirmed
	case t.To.Final() && res.Now.State.Final():
		out.Outcome = CallbackContradicted
		r.cfg.logger.Error("Provider callback contradicts the effect's recorded outcome; kept the record", nil, map[string]any{
			"event_id": cb.EventID, "provider_key": cb.ProviderKey, "recorded": string(res.Now.State), "callback": string(t.To),
			"effect": res.Now.Name, "message_id": res.Now.MessageID})
	default:
		out.Outcome = CallbackUnchanged
	}
	r.obs.callbackOutcome(ctx, out.Outcome)
	return out, nil
}

// HTTPHandler serves a provider's webhook: parse reads the callback from
// the request (checking its signature is parse's job: return an error for
// one that does not verify). It answers 200 when the callback was applied,
// or needs nothing more (a duplicate, out of order, for no known effect), so
// that the provider stops sending it; 400 when parse fails; 503 when the
// store cannot be reached, so that the provider sends it again.
func (r *Runner) HTTPHandler(parse func(*http.Request) (Callback, error)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		cb, err := parse(req)
		if err != nil {
			http.Error(w, "invalid callback: "+err.Error(), http.StatusBadRequest)
			return
		}
		res, err := r.ApplyCallback(req.Context(), cb)
		switch {
		case errors.Is(err, ErrInvalidCallback):
			http.Error(w, err.Error(), http.StatusBadRequest)
		case err != nil:
			http.Error(w, "try again later", http.StatusServiceUnavailable)
		default:
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
			_, _ = fmt.Fprintln(w, res.Outcome)
		}
	})
}

// CallbackHandler is a Watermill handler for provider callbacks consumed
// from a topic: parse reads the callback from the message. A message parse
// rejects fails with a permanent error (idempotency.ErrPermanent: dead-letter
// it); a store that cannot be reached with idempotency.ErrStore (retried).
// A duplicate event is acked and changes nothing, whether or not the
// idempotency middleware also guards the handler.
func (r *Runner) CallbackHandler(parse func(*message.Message) (Callback, error)) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		cb, err := parse(msg)
		if err != nil {
			return fmt.Errorf("effects: callback message %s: %w: %w", msg.UUID, idempotency.ErrPermanent, err)
		}
		_, err = r.ApplyCallback(msg.Context(), cb)
		if errors.Is(err, ErrInvalidCallback) {
			return fmt.Errorf("%w (%w)", err, idempotency.ErrPermanent)
		}
		return err
	}
}
