package stores

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// EffectStore keeps the records of external effects (a card charge, a
// refund, an email, a partner webhook): effects that cannot commit with a
// message's record, so the kit tracks each one through states of its own
// (package effects drives them). Implementations are safe for concurrent use;
// a call whose context is done returns an error.
//
// An effect is keyed by its provider key, the stable identity it is sent
// under. Its state moves only along the transitions [EffectTransitionAllowed]
// lists:
//
//	(none) → pending                       Begin: the intent, durable before the call
//	pending → unknown | succeeded | failed  the call's outcome (unknown: no definitive answer)
//	unknown → pending                       another attempt sends it again, under the same key
//	unknown → succeeded | failed            evidence: a status lookup, a callback, an operator
//	pending → pending                       an attempt takes over a pending effect whose holder's lease passed
//	succeeded | failed → succeeded          an overrule: the provider's success over an operator's resolution
//
// succeeded and failed are final, but for one overrule: the provider's word
// that an effect happened (To succeeded, with EffectTransition.Overrule)
// replaces an operator's resolution (Evidence EffectEvidenceOperator), be it
// failed or succeeded with another result. An operator decides without the
// provider's answer; once it comes, a charge the provider made is never
// left recorded as failed, nor its result lost.
//
// The holder of a pending effect is named by
// the context's claim token ([WithClaimToken]; the store instance when it
// names none). While its lease runs, only its holder may declare its outcome
// unknown or send it again; evidence (succeeded, failed) is accepted from
// anyone, since it comes from the provider. The holder keeps its lease
// alive with Extend while its call runs, so the lease only bounds how long
// a dead holder goes unnoticed. A pending effect that becomes unknown keeps
// its attempt's last lease (LeaseUntil): the request it sent may still
// reach the provider and be acted on until then (Landing).
//
// An operator's resolution waits for the attempts acting on the effect
// (EffectTransition.IfIdle): it moves neither a pending effect whose
// holder's lease runs (its call may be under way) nor an unknown one still
// landing.
//
// Every call's result is read from the store in the same atomic step that
// wrote it: a transition that did not happen reports the record that stood
// in its way.
type EffectStore interface {
	// Begin records intent as a new pending effect held by the caller for
	// lease, with Attempts 1, and reports true; or, when an effect with
	// intent.Key exists, changes nothing and returns it.
	Begin(ctx context.Context, intent EffectIntent, lease time.Duration) (began bool, found Effect, err error)

	// Transition moves the effect key as t says, if the transition is
	// allowed from its current state (and t.From, when given) and the holder
	// rules above permit it, and returns the effect as it is now: moved or
	// not. An effect that does not exist is not moved (State EffectNone).
	// A transition that can never be allowed (t.To not reachable from
	// t.From) returns an error matching ErrEffectTransition and writes
	// nothing.
	Transition(ctx context.Context, key string, t EffectTransition) (moved bool, now Effect, err error)

	// Extend renews the lease of the pending effect key to lease from now,
	// and reports true, if the caller (the context's claim token, or the
	// store instance when it names none) holds it. It changes nothing and
	// reports false when the effect is not pending, is held by another
	// attempt, or does not exist. A lease that passed while nobody took the
	// effect over is still its holder's, and is renewed.
	Extend(ctx context.Context, key string, lease time.Duration) (held bool, err error)

	// Lookup returns the effect key, or an Effect with State EffectNone.
	Lookup(ctx context.Context, key string) (Effect, error)

	// ApplyEvent records the provider's event eventID once and, the first
	// time only, applies t to the effect key as Transition does, in one
	// atomic step: a duplicate event changes nothing. An event for an
	// effect that does not exist is recorded and moves nothing.
	ApplyEvent(ctx context.Context, eventID, key string, t EffectTransition) (EventResult, error)

	// List returns the effects q selects, oldest first by the time they
	// entered their state.
	List(ctx context.Context, q EffectQuery) ([]Effect, error)

	// Stats returns, for every state that holds effects, how many do and
	// since when the oldest has been in it.
	Stats(ctx context.Context) (map[EffectState]EffectStat, error)

	// Purge removes the final effects (succeeded, failed) that entered
	// their state before before, and the provider events recorded before
	// it, and reports how many records went. Pending and unknown effects
	// are never removed, whatever their age: the check and the removal are
	// one atomic step, so a purge racing a transition never drops an
	// effect that is not final.
	Purge(ctx context.Context, before time.Time) (int64, error)

	// Forget removes the effect key. A later attempt of its message starts
	// it afresh, under the same provider key. Forgetting an unknown key is
	// not an error.
	Forget(ctx context.Context, key string) error
}

// DefaultEffectsTTL is how long the shipped effect stores keep a final
// effect (succeeded, failed) and a recorded provider event unless told
// otherwise (their WithEffectsTTL): 7 days, the retention the kit's quick
// start gives message records. Pending and unknown effects never expire.
//
// Tie it to the replay horizon you declare for the messages (the message
// store's TTL, or idempotency.WithReplayHorizon): a redelivery or replay of
// a message within the horizon must still find its effects, or an effect
// whose message failed after the call is begun afresh (under the same
// provider key, so a provider deduplicating keys answers as before; one
// that does not would act again). Keep final effects at least as long as
// the horizon; each store's Purge removes older ones on demand
// (bq-idempotency effects purge).
const DefaultEffectsTTL = 7 * 24 * time.Hour

// Result lifetime. The shipped effect stores keep an effect in two tiers
// when given a result lifetime (their WithResultTTL): the provider's result
// of a succeeded effect (Effect.Result, the bytes a later attempt gets
// back) for the result lifetime, counted from when it succeeded, and the
// rest of the record (its identity: state, provider key, fingerprint,
// attempts, times) for the effects TTL. Past the result lifetime the store
// reports the effect with Result nil and Effect.ResultDropped set, and
// frees the result's storage; a replay within the horizon still finds the
// effect final and never calls the provider again. A result lifetime of
// zero (the default) keeps the result as long as the record; one longer
// than the effects TTL is refused (the stores' ErrInvalidOption), since a
// result never outlives its record.
//
// ValidResultTTL returns nil when resultTTL is such a lifetime for an
// effects TTL of ttl (0: records kept), or an error saying why not:
// negative, under a millisecond, or longer than ttl.
func ValidResultTTL(resultTTL, ttl time.Duration) error {
	switch {
	case resultTTL < 0 || (resultTTL > 0 && resultTTL < time.Millisecond):
		return fmt.Errorf("result TTL %v: want 0 (as long as the record) or at least 1ms", resultTTL)
	case ttl > 0 && resultTTL > ttl:
		return fmt.Errorf("result TTL %v is longer than the effects TTL %v: a result never outlives its record", resultTTL, ttl)
	}
	return nil
}

// EffectState is the state of an external effect.
type EffectState string

// The states of an effect.
const (
	EffectNone      EffectState = ""          // no record
	EffectPending   EffectState = "pending"   // intent recorded; the call is being made
	EffectUnknown   EffectState = "unknown"   // the call was made (or may have been): no definitive answer
	EffectSucceeded EffectState = "succeeded" // the provider did it (final)
	EffectFailed    EffectState = "failed"    // the provider did not, and says so (final)
)

// EffectStates lists the states an effect can be in, in order.
var EffectStates = []EffectState{EffectPending, EffectUnknown, EffectSucceeded, EffectFailed}

// Final reports whether s is succeeded or failed.
func (s EffectState) Final() bool { return s == EffectSucceeded || s == EffectFailed }

// Valid reports whether s is one of EffectStates.
func (s EffectState) Valid() bool {
	switch s {
	case EffectPending, EffectUnknown, EffectSucceeded, EffectFailed:
		return true
	}
	return false
}

// EffectTransitionAllowed reports whether an effect may move from state from
// to state to.
func EffectTransitionAllowed(from, to EffectState) bool {
	switch from {
	case EffectPending:
		return to.Valid()
	case EffectUnknown:
		return to == EffectPending || to.Final()
	}
	return false
}

// EffectSourcesOf returns the states from which an effect may move to to,
// narrowed to from when from is not EffectNone; nil when none may. It does
// not count overrules: see EffectTransition.Sources.
func EffectSourcesOf(from, to EffectState) []EffectState {
	var out []EffectState
	for _, s := range []EffectState{EffectPending, EffectUnknown} {
		if (from == EffectNone || from == s) && EffectTransitionAllowed(s, to) {
			out = append(out, s)
		}
	}
	return out
}

// EffectEvidenceOperator is the Evidence of an operator's resolution (the
// effects package's EvidenceOperator): the one final record a transition
// with Overrule may still move.
const EffectEvidenceOperator = "operator"

// EffectIntent is what Begin records before the call.
type EffectIntent struct {
	Key         string // the provider key: the effect's identity at the provider
	Name        string // the effect's name within its message ("charge")
	Scope       string // the message's scope (the handler name, or WithScope's)
	MessageID   string // the message's identity (meta.id)
	Fingerprint uint64 // of the request; 0: none
}

// EffectTransition says where an effect goes and with what evidence.
type EffectTransition struct {
	// From is the state the caller saw; EffectNone for any state the
	// transition is allowed from.
	From EffectState
	// To is the state to move to.
	To EffectState
	// Result is the provider's result of a succeeded effect (a charge id),
	// kept for later attempts. Ignored for other states.
	Result []byte
	// Note says why: the failure's reason, the error of a call whose
	// outcome is unknown, an operator's note. Kept until the next
	// transition that gives one.
	Note string
	// Evidence names what moved it: "call", "lookup", "callback",
	// "operator", … Kept with the record.
	Evidence string
	// Lease is the new attempt's lease when To is pending: the caller
	// becomes the holder until it passes, and Attempts grows by one.
	Lease time.Duration
	// IfIdle moves the effect only if no attempt may still be acting on
	// it: not a pending effect whose holder's lease runs (whoever the
	// caller is: an attempt's call may be under way, its lease renewed
	// while it runs), nor an unknown effect still landing (its last
	// attempt's request may still reach the provider). Such an effect is
	// not moved and is returned as it is, its LeaseUntil saying until
	// when. An operator's resolution sets it, unless forced.
	IfIdle bool
	// Overrule, with To succeeded, moves a final effect an operator
	// resolved (its Evidence EffectEvidenceOperator), and only such an
	// effect: the provider's word that the effect happened, with its
	// result, replaces the operator's resolution, failed or succeeded. From
	// narrows it to one of the two final states. With To other than
	// succeeded, or From not final, the transition is never allowed
	// (ErrEffectTransition).
	Overrule bool
}

// Sources returns the states t may move an effect from (EffectSourcesOf,
// or, for an overrule, the final states narrowed to From), or nil when t
// can never be allowed. For an overrule a store also requires the effect's
// Evidence to be EffectEvidenceOperator.
func (t EffectTransition) Sources() []EffectState {
	if !t.Overrule {
		return EffectSourcesOf(t.From, t.To)
	}
	if t.To != EffectSucceeded {
		return nil
	}
	switch t.From {
	case EffectNone:
		return []EffectState{EffectSucceeded, EffectFailed}
	case EffectSucceeded, EffectFailed:
		return []EffectState{t.From}
	}
	return nil
}

// Effect is the record of an external effect.
type Effect struct {
	EffectIntent
	State      EffectState
	Result     []byte    // succeeded: the provider's result
	Note       string    // the last reason given (see EffectTransition.Note)
	Evidence   string    // what moved it last
	Attempts   int       // how many times an attempt took it to send the call
	Holder     string    // pending: the claim token of the attempt holding it
	LeaseUntil time.Time // pending: until when its holder may still be calling; unknown: its last attempt's lease (see Landing)
	CreatedAt  time.Time // when the intent was recorded
	StateSince time.Time // when it entered its current state
	UpdatedAt  time.Time // its last change
	ExpiresAt  time.Time // when a final record lapses; zero: kept
	// ResultExpiresAt is when the provider's result of a succeeded effect
	// is dropped while the rest of its record is kept (the store's result
	// lifetime, see ResultDropped); zero: the result lives as long as the
	// record.
	ResultExpiresAt time.Time
	// ResultDropped is true for a succeeded effect whose result outlived
	// the store's result lifetime and was dropped: Result is nil, and
	// everything else (state, provider key, fingerprint, attempts, times)
	// is kept until ExpiresAt. The effect is still final: it is never sent
	// again; only the bytes the provider answered are gone.
	ResultDropped bool
	LeaseLapsed   bool // pending and its lease passed (by the store's clock, when read)
	// Landing is true for an unknown effect whose last attempt's lease has
	// not passed (by the store's clock, when read): the request that
	// attempt sent may still reach the provider and be acted on, so a
	// status lookup cannot yet tell that it never arrived.
	Landing bool
}

// EffectQuery selects effects for List.
type EffectQuery struct {
	States []EffectState // empty: every state
	// EnteredBefore keeps the effects that entered their state before it;
	// zero: any.
	EnteredBefore time.Time
	Limit         int // at most this many; 0: 100
}

// Normalized returns q with its defaults filled in: every state when it
// names none (states that are not valid are dropped), and
// EffectDefaultLimit when it sets no limit.
func (q EffectQuery) Normalized() EffectQuery {
	states := q.States
	if len(states) == 0 {
		states = EffectStates
	}
	q.States = make([]EffectState, 0, len(states))
	for _, s := range states {
		if s.Valid() {
			q.States = append(q.States, s)
		}
	}
	if q.Limit <= 0 {
		q.Limit = EffectDefaultLimit
	}
	return q
}

// EffectStat is what Stats reports for one state.
type EffectStat struct {
	Count  int64
	Oldest time.Time // when the effect longest in the state entered it
}

// EventResult is what ApplyEvent did.
type EventResult struct {
	First bool   // the event had not been recorded before
	Moved bool   // its transition was applied
	Now   Effect // the effect as it is now (State EffectNone: there is no such effect)
}

// ErrEffectTransition is matched by a transition that is never allowed
// (EffectTransitionAllowed), such as from a final state or to none.
var ErrEffectTransition = errors.New("effect transition not allowed")

// EffectDefaultLimit is the number of effects List returns when the query
// sets no limit.
const EffectDefaultLimit = 100
