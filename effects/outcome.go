package effects

import (
	"errors"
	"fmt"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// Outcome is what a call, a status lookup or a callback knows of an effect.
// Build it with Succeeded, Failed, Unknown, NotSent or NotFound.
type Outcome struct {
	// State is stores.EffectSucceeded or stores.EffectFailed for definitive
	// evidence, stores.EffectUnknown when there is none.
	State stores.EffectState
	// Result is the provider's result of a succeeded effect (a charge id):
	// kept, and returned to every later attempt instead of calling again.
	Result []byte
	// Reason says why it failed, or why it is not known.
	Reason string

	notSent  bool // a call: the request provably never left
	notFound bool // a lookup: the provider never received the key
}

// Succeeded is the provider's word that the effect happened, with its
// result (a charge id, a message id), which later attempts get back.
func Succeeded(result []byte) Outcome {
	return Outcome{State: stores.EffectSucceeded, Result: result}
}

// Failed is the provider's word that the effect did not happen and will not
// (a declined card, a rejected address): final. Do returns it as an error
// matching ErrFailed; no later attempt calls again under the same key.
func Failed(reason string) Outcome { return Outcome{State: stores.EffectFailed, Reason: reason} }

// Unknown is no definitive answer: a timeout, a reset connection, a 5xx, a
// status lookup that cannot tell yet. A call returning an error is Unknown
// too.
func Unknown(reason string) Outcome { return Outcome{State: stores.EffectUnknown, Reason: reason} }

// NotSent is what a call returns when its request provably never reached
// the provider: the connection was refused, the name did not resolve, the
// request could not be built. The next attempt sends it again, under the
// same key, without reconciling. Never return it for a timeout, a reset or
// anything after the first byte went out: that is Unknown.
func NotSent(reason string) Outcome {
	return Outcome{State: stores.EffectUnknown, Reason: reason, notSent: true}
}

// NotFound is what a Resolver returns when the provider has no request
// under the key at all: the attempt that recorded the intent never got its
// request through. The effect is then sent again, under the same key.
// Return it only when the provider's lookup sees every request it will
// ever act on (see Resolver).
func NotFound() Outcome { return Outcome{State: stores.EffectUnknown, notFound: true} }

// Evidence values kept with an effect's record (stores.Effect.Evidence).
const (
	EvidenceCall     = "call"     // the call's own answer
	EvidenceLookup   = "lookup"   // the Resolver's status lookup
	EvidenceCallback = "callback" // a provider callback (ApplyCallback)
	EvidenceOperator = "operator" // a manual resolution (Resolve)
	EvidenceNotSent  = "not_sent" // the call said its request never left (NotSent)
	EvidenceLapsed   = "lapsed"   // the attempt holding it ended without an outcome (a crash, a lost write)
)

// Errors of effects. Branch on them with errors.Is.
var (
	// ErrUnknownOutcome is matched when an effect's outcome is unknown and
	// nothing settled it: the call got no definitive answer, or a later
	// attempt could not reconcile it. The effect is not called again
	// blindly. Under the Park policy (and right after the call) the error
	// is retryable: a later delivery reconciles again. Under DeadLetter, or
	// once the budget is exhausted, it also matches
	// idempotency.ErrPermanent, so that Retry stops and the dead-letter
	// middleware moves the message, with the reason unknown_outcome.
	ErrUnknownOutcome error = &reasonError{text: "effect outcome unknown", reason: envelope.ReasonUnknownOutcome}

	// ErrBudgetExhausted is matched when an effect would be sent again (a
	// resubmission, or after NotSent or NotFound) but has been sent
	// WithMaxCalls times, or has been unknown for longer than
	// WithParkLimit. It also matches ErrUnknownOutcome and
	// idempotency.ErrPermanent.
	ErrBudgetExhausted = fmt.Errorf("effect retry budget exhausted (%w, %w)", ErrUnknownOutcome, idempotency.ErrPermanent)

	// ErrLeaseLost is matched, with ErrUnknownOutcome, when an attempt
	// lost its lease on the effect while its call ran: another attempt
	// took the effect over, or the lease could not be renewed before it
	// ran out (the store unreachable). The call's context was cancelled;
	// the outcome is unknown unless the call answered anyway. Retryable: a
	// later attempt reconciles.
	ErrLeaseLost = errors.New("effect lease lost")

	// ErrFailed is matched by the error Do returns for an effect the
	// provider declined (Failed), now or on an earlier attempt: a business
	// answer for the handler to act on. See FailedError. It also matches
	// idempotency.ErrPermanent: running the message again finds the same
	// answer, so Retry does not retry it and the dead-letter middleware
	// sends it on at once, with the reason "rejected" (not "failed": a
	// redrive of the failed ones leaves declined charges alone).
	ErrFailed = errors.New("effect failed")

	// ErrPayloadConflict is matched when an effect is done again for the
	// same message with a different request (fingerprint) than its intent
	// recorded: the same provider key would carry two different requests.
	// Nothing is sent. It also matches idempotency.ErrPermanent.
	ErrPayloadConflict error = &reasonError{text: "effect request differs from its recorded intent", reason: envelope.ReasonConflict,
		cause: idempotency.ErrPermanent}

	// ErrNoDelivery is matched when Do runs outside the idempotency
	// middleware (no idempotency.DeliveryFromContext), or for a message the
	// middleware could not identify (no meta.id: it runs fail-open): there
	// is no identity to derive the provider key from, and a charge without
	// one could never be recognised again. It also matches
	// idempotency.ErrPermanent, so that such a message is dead-lettered
	// rather than charged.
	ErrNoDelivery = fmt.Errorf("effect outside a delivery: no message identity in the context; run it under the idempotency middleware, or use idempotency.ContextWithDelivery (%w)", idempotency.ErrPermanent)

	// ErrNotResolved is matched when Resolve or a callback cannot move an
	// effect: it does not exist, or its state does not allow it.
	ErrNotResolved = errors.New("effect not resolved")

	// ErrEffectInFlight is matched, with ErrNotResolved, when Resolve
	// refuses an effect an attempt may still act on: pending while its
	// holder's lease runs (its call may be under way; the lease is renewed
	// while it runs), or unknown while the request its last attempt sent
	// may still reach the provider (stores.Effect.Landing). The error says
	// until when (the effect's LeaseUntil); resolve it then, or force it
	// (WithForce).
	ErrEffectInFlight error = &alsoError{text: "effect in flight", also: ErrNotResolved}
)

// alsoError is a sentinel that matches another one too.
type alsoError struct {
	text string
	also error
}

func (e *alsoError) Error() string { return e.text }

func (e *alsoError) Is(target error) bool { return target == e.also }

// reasonError is a sentinel that names its dead-letter reason
// (DeadLetterReason), so that the dead-letter middleware files a message
// failing with it under that reason without importing this package.
type reasonError struct {
	text   string
	reason string
	cause  error // also matched, when not nil
}

func (e *reasonError) Error() string {
	if e.cause == nil {
		return e.text
	}
	return e.text + " (" + e.cause.Error() + ")"
}

func (e *reasonError) Unwrap() error { return e.cause }

// DeadLetterReason returns the dead_letter reason of a message that failed
// for good with this error.
func (e *reasonError) DeadLetterReason() string { return e.reason }

// FailedError is the error of an effect the provider declined.
type FailedError struct {
	Effect      string // its name
	ProviderKey string
	Reason      string // the provider's reason
}

func (e *FailedError) Error() string {
	return fmt.Sprintf("effects: %s (provider key %s) failed: %s", e.Effect, e.ProviderKey, e.Reason)
}

// Is makes a FailedError match ErrFailed and idempotency.ErrPermanent.
func (e *FailedError) Is(target error) bool {
	return target == ErrFailed || target == idempotency.ErrPermanent
}

// errDeadLetterUnknown is the error of an unknown outcome left to the
// dead-letter middleware (permanent).
var errDeadLetterUnknown = fmt.Errorf("%w (%w)", ErrUnknownOutcome, idempotency.ErrPermanent)
