package effects

import (
	"bytes"
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/babelqueue/watermill-idempotency/stores"
)

// Outcomes of a provider's answer that met an operator's resolution, as
// the "outcome" attribute of MetricOperatorConflicts.
const (
	ConflictOverruled = "overruled" // the provider's success replaced the resolution
	ConflictKept      = "kept"      // the provider's failure met an operator's succeeded: kept
)

// byOperator reports whether e is final by an operator's resolution.
func byOperator(e stores.Effect) bool {
	return e.State.Final() && e.Evidence == EvidenceOperator
}

// answerOperator settles the provider's definitive answer t (To succeeded
// or failed: a call's, a lookup's, a callback's) that the store did not
// record because an operator's resolution, now, stood in its way. A success
// overrules the resolution when it says more than it (the resolution is
// failed, or succeeded with another result): move writes the overrule, and
// the effect is succeeded with the provider's result. A failure against an
// operator's succeeded leaves the resolution. Either is logged at error and
// counted. It reports whether the overrule was written, and the effect as
// it is now.
func (r *Runner) answerOperator(ctx context.Context, t stores.EffectTransition, now stores.Effect,
	move func(stores.EffectTransition) (bool, stores.Effect, error)) (bool, stores.Effect, error) {
	if !t.To.Final() || !byOperator(now) {
		return false, now, nil
	}
	fields := watermill.LogFields{"effect": now.Name, "provider_key": now.Key, "message_id": now.MessageID,
		"resolution": string(now.State), "operator_note": now.Note, "evidence": t.Evidence}
	switch {
	case t.To == stores.EffectSucceeded && (now.State == stores.EffectFailed || (len(t.Result) > 0 && !bytes.Equal(t.Result, now.Result))):
		o := stores.EffectTransition{From: now.State, To: stores.EffectSucceeded, Result: t.Result, Evidence: t.Evidence, Overrule: true,
			Note: fmt.Sprintf("the provider's answer (%s) overruled an operator's resolution (%s: %s)", t.Evidence, now.State, now.Note)}
		if t.Note != "" {
			o.Note += "; " + t.Note
		}
		moved, after, err := move(o)
		if err != nil || !moved {
			return false, after, err
		}
		r.cfg.logger.Error("Provider's success overruled an operator's resolution: the effect is succeeded, with the provider's result", nil, fields)
		r.obs.operatorConflict(ctx, now.Name, t.Evidence, ConflictOverruled)
		return true, after, nil
	case t.To == stores.EffectFailed && now.State == stores.EffectSucceeded:
		r.cfg.logger.Error("Provider's failure contradicts an operator's succeeded resolution; the resolution is kept", nil,
			fields.Add(watermill.LogFields{"reason": t.Note}))
		r.obs.operatorConflict(ctx, now.Name, t.Evidence, ConflictKept)
	}
	return false, now, nil
}

// settle records the provider's definitive answer t as record does, and
// answers an operator's resolution that stood in its way (answerOperator).
func (a *attempt) settle(ctx context.Context, t stores.EffectTransition) (bool, stores.Effect, error) {
	moved, now, err := a.record(ctx, t)
	if err != nil || moved {
		return moved, now, err
	}
	return a.e.r.answerOperator(ctx, t, now, func(o stores.EffectTransition) (bool, stores.Effect, error) { return a.record(ctx, o) })
}
