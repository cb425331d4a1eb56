package effects

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"go.opentelemetry.io/otel/trace"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/internal/kitlog"
	"github.com/babelqueue/watermill-idempotency/internal/parkwait"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// Call sends an effect's request to its provider under key, the effect's
// provider key: pass it as the provider's idempotency key, or as the
// client reference a status lookup finds it by. ctx carries the call
// timeout. Return Succeeded with the provider's result, Failed with its
// reason, NotSent when the request provably never left; any error (a
// timeout, a reset, a 5xx) makes the outcome unknown.
type Call func(ctx context.Context, key string) (Outcome, error)

// Resolver looks an effect up at its provider by its provider key: a
// later attempt asks it before acting on a pending or unknown effect.
// Return Succeeded or Failed when the provider knows, NotFound when it has
// no request under the key (it never arrived: the effect is sent again),
// Unknown when it cannot tell; an error is Unknown. Return NotFound only
// if the provider's lookup sees every request it will act on: a request
// still on its way would otherwise be sent twice.
type Resolver func(ctx context.Context, key string) (Outcome, error)

// Policy says what a later attempt does with an effect whose outcome is
// still unknown after reconciling.
type Policy int

const (
	// Park leaves the effect unknown and fails the delivery with a
	// retryable error matching ErrUnknownOutcome: the message waits,
	// redelivered by the broker and reconciled on every attempt, until
	// evidence (a lookup, a callback, an operator) settles it; with a
	// dead-letter middleware outside Retry, it is dead-lettered with the
	// reason unknown_outcome once Retry gives up. The default.
	Park Policy = iota
	// DeadLetter leaves the effect unknown and fails the delivery with a
	// permanent error matching ErrUnknownOutcome and
	// idempotency.ErrPermanent: straight to the dead-letter topic (reason
	// unknown_outcome), for an operator to resolve and redrive.
	DeadLetter
	// Resubmit sends the request again under the same key: only for a
	// provider that deduplicates its idempotency keys (it answers a second
	// request with the first one's result), up to WithMaxCalls sends.
	Resubmit
)

// String returns "park", "dead_letter" or "resubmit".
func (p Policy) String() string {
	switch p {
	case DeadLetter:
		return "dead_letter"
	case Resubmit:
		return "resubmit"
	}
	return "park"
}

// Effect is one declared external effect of a handler: "charge", "refund",
// "email". Declare it once with Runner.Effect and call Do from the handler.
type Effect struct {
	r          *Runner
	name       string
	resolver   Resolver
	policy     Policy
	maxCalls   int
	parkLimit  time.Duration
	escalate   func(ctx context.Context, e stores.Effect, err error)
	fingerprnt func(request any) (uint64, error)
}

// EffectOption configures an Effect.
type EffectOption func(*Effect)

// WithResolver sets the status lookup a later attempt asks first.
func WithResolver(r Resolver) EffectOption { return func(e *Effect) { e.resolver = r } }

// WithPolicy sets what happens to an outcome still unknown after
// reconciling (default Park).
func WithPolicy(p Policy) EffectOption { return func(e *Effect) { e.policy = p } }

// WithMaxCalls bounds how many times the effect is sent under its key
// (default 3): by Resubmit, and after NotSent or NotFound. Past it the
// delivery fails with ErrBudgetExhausted (dead-lettered as
// unknown_outcome).
func WithMaxCalls(n int) EffectOption { return func(e *Effect) { e.maxCalls = n } }

// WithParkLimit makes a parked effect (Park) that has been unknown for
// longer than d fail with ErrBudgetExhausted instead, so that it leaves
// the broker for the dead-letter topic and an operator. Zero (the
// default): parked until settled.
func WithParkLimit(d time.Duration) EffectOption { return func(e *Effect) { e.parkLimit = d } }

// WithEscalation calls fn whenever an attempt leaves the effect unknown
// (parked or dead-lettered) or exhausts its budget, with the effect and
// the error the delivery fails with: page someone, open a ticket.
func WithEscalation(fn func(ctx context.Context, e stores.Effect, err error)) EffectOption {
	return func(e *Effect) { e.escalate = fn }
}

// WithRequestFingerprint replaces how a request is fingerprinted (default:
// a JSON value's meaning, as envelope.FingerprintJSON; []byte that is not
// JSON byte for byte; nil: none).
func WithRequestFingerprint(fn func(request any) (uint64, error)) EffectOption {
	return func(e *Effect) { e.fingerprnt = fn }
}

// Effect declares the effect name (unique among a handler's effects: it is
// part of the provider key).
func (r *Runner) Effect(name string, opts ...EffectOption) *Effect {
	e := &Effect{r: r, name: name, maxCalls: 3, fingerprnt: fingerprint}
	for _, opt := range opts {
		opt(e)
	}
	e.maxCalls = max(e.maxCalls, 1)
	return e
}

// Name returns the effect's name.
func (e *Effect) Name() string { return e.name }

// Do performs the effect once for the message being handled (ctx is the
// handler's message context), whatever happens to its deliveries:
//
//  1. Derive its provider key from the message's identity, scope and the
//     effect's name (ProviderKey), and record the intent (pending, the key,
//     the request's fingerprint) before anything is sent; in the
//     transactional mode this write commits on its own, before the call,
//     never inside the handler's transaction.
//  2. First attempt: call. Succeeded or Failed is recorded as the final
//     state; no reply, an error or a crash leaves it unknown (never
//     failed), and Do returns a retryable error matching ErrUnknownOutcome.
//  3. Later attempts (a retry, a redelivery, another worker, a replay):
//     succeeded returns the kept result without calling; failed returns
//     the FailedError; pending within another attempt's lease (renewed
//     while that attempt's call runs), or unknown while the request sent
//     may still reach the provider (within the lease of the attempt that
//     sent it), is waited for (WithParkWait) and, if still so, in flight
//     (idempotency.ErrInFlight, retryable); pending past its lease or
//     unknown past it is reconciled first (WithResolver), then handled by
//     the policy: Park, DeadLetter or Resubmit. Never a blind second call.
//
// While the call runs, the attempt's lease is renewed (WithLease); a lost
// lease cancels the call's context, and the error matches ErrLeaseLost
// when the outcome is then unknown.
//
// A request that differs from the recorded intent fails with
// ErrPayloadConflict; a store that cannot be reached fails with
// idempotency.ErrStore before anything is sent.
//
// A succeeded effect whose result the store no longer keeps (its result
// lifetime passed: stores.Effect.ResultDropped) is not called again
// either: its result is asked of the Resolver when there is one (a status
// lookup, never a call), and otherwise Do returns a nil result and a nil
// error, as the effect did happen. A handler that needs the result to go
// on uses DoResult, which says so (Done.ResultDropped).
func (e *Effect) Do(ctx context.Context, request any, call Call) ([]byte, error) {
	done, err := e.DoResult(ctx, request, call)
	return done.Result, err
}

// Done is what DoResult reports of an effect that succeeded.
type Done struct {
	// Result is the provider's result (a charge id); nil when
	// ResultDropped.
	Result []byte
	// ProviderKey is the effect's provider key: what the provider knows
	// it by, to look it up there.
	ProviderKey string
	// ResultDropped is true when the effect succeeded on an earlier
	// attempt but the store dropped its result (the store's result
	// lifetime passed) and no Resolver found it again. The effect is done
	// and will never be sent again; only the provider's answer is gone:
	// look it up by ProviderKey if the handler needs it, or go on without
	// it. It is not an error, so a replayed message never fails for it.
	ResultDropped bool
}

// DoResult is Do, reporting the succeeded effect as a Done: with its
// provider key, and whether its result was dropped by the store
// (Done.ResultDropped) rather than empty. Errors are Do's.
func (e *Effect) DoResult(ctx context.Context, request any, call Call) (Done, error) {
	d, ok := idempotency.DeliveryFromContext(ctx)
	if !ok {
		return Done{}, fmt.Errorf("effects: %s: %w", e.name, ErrNoDelivery)
	}
	fp, err := e.fingerprnt(request)
	if err != nil {
		return Done{}, fmt.Errorf("effects: %s: fingerprint the request: %w", e.name, err)
	}
	if stores.ClaimToken(ctx) == "" { // each attempt is a holder of its own
		ctx = stores.WithClaimToken(ctx, stores.NewClaimToken())
	}
	a := &attempt{e: e, d: d, key: ProviderKey(d.Scope, d.ID, e.name), fp: fp}
	ctx, a.span = e.r.obs.startDo(ctx, a)
	result, err := a.do(ctx, call)
	e.r.obs.endDo(ctx, a, err)
	if err != nil {
		return Done{ProviderKey: a.key}, err
	}
	return Done{Result: result, ProviderKey: a.key, ResultDropped: a.dropped}, nil
}

// Decisions an attempt takes, as counted and traced.
const (
	DecisionCall      = "call"       // first attempt: sent
	DecisionReplay    = "replay"     // final already: the kept outcome, no call
	DecisionReconcile = "reconciled" // settled by the Resolver, no call
	DecisionResend    = "resend"     // sent again: NotSent or NotFound
	DecisionResubmit  = "resubmit"   // sent again under the same key (Resubmit)
	DecisionInFlight  = "in_flight"  // another attempt holds it
	DecisionPark      = "park"       // unknown, parked
	DecisionUnknown   = "unknown"    // sent just now: no definitive answer
	DecisionDeadLeter = "dead_letter"
	DecisionExhausted = "budget_exhausted"
	DecisionConflict  = "conflict"    // another request under the same key
	DecisionStore     = "store_error" // the store could not be reached
)

// attempt is one Do.
type attempt struct {
	e        *Effect
	d        idempotency.Delivery
	key      string
	fp       uint64
	span     trace.Span
	decision string
	now      stores.Effect    // the effect as last read or written
	wait     *parkwait.Waiter // paces the wait for another attempt (nil: not begun)
	taken    time.Time        // when the call that took the effect's lease was sent
	dropped  bool             // succeeded, its result dropped by the store and not found again
}

func (a *attempt) errorf(format string, args ...any) error {
	return fmt.Errorf("effects: %s (provider key %s) of message %q: "+format,
		append([]any{a.e.name, a.key, a.d.ID}, args...)...)
}

func (a *attempt) do(ctx context.Context, call Call) ([]byte, error) {
	r := a.e.r
	sctx, cancel := r.storeContext(ctx)
	a.taken = time.Now()
	began, found, err := r.store.Begin(sctx, stores.EffectIntent{Key: a.key, Name: a.e.name, Scope: a.d.Scope,
		MessageID: a.d.ID, Fingerprint: a.fp}, r.cfg.lease)
	cancel()
	if err != nil {
		a.decision = DecisionStore
		return nil, a.errorf("record the intent: %w: %w", idempotency.ErrStore, err)
	}
	a.now = found
	if began {
		return a.send(ctx, call, DecisionCall)
	}
	if found.Fingerprint != 0 && a.fp != 0 && found.Fingerprint != a.fp {
		a.decision = DecisionConflict
		err := a.errorf("%w: recorded %016x, now %016x", ErrPayloadConflict, found.Fingerprint, a.fp)
		kitlog.Warn(r.cfg.logger, "Effect requested again with a different request; nothing sent", err, a.fields())
		return nil, err
	}
	return a.resume(ctx, call, found, 0)
}

// resume handles an effect an earlier attempt recorded.
func (a *attempt) resume(ctx context.Context, call Call, found stores.Effect, depth int) ([]byte, error) {
	a.now = found
	switch {
	case found.State == stores.EffectSucceeded && found.ResultDropped:
		a.decision = DecisionReplay
		return a.refetch(ctx), nil
	case found.State == stores.EffectSucceeded:
		a.decision = DecisionReplay
		return found.Result, nil
	case found.State == stores.EffectFailed:
		a.decision = DecisionReplay
		return nil, &FailedError{Effect: a.e.name, ProviderKey: a.key, Reason: found.Note}
	case found.State == stores.EffectNone || depth > 3:
		// Forgotten meanwhile, or moving under our feet: let the delivery
		// come back and look again.
		a.decision = DecisionInFlight
		return nil, a.errorf("%w: the effect changed while this attempt looked at it", idempotency.ErrInFlight)
	case a.held(ctx, found) != "":
		now, err := a.await(ctx, found)
		if err != nil {
			a.decision = DecisionStore
			return nil, err
		}
		if why := a.held(ctx, now); why != "" {
			a.now = now
			a.decision = DecisionInFlight
			return nil, a.errorf("%w: %s", idempotency.ErrInFlight, why)
		}
		return a.resume(ctx, call, now, depth+1)
	case found.State == stores.EffectUnknown && found.Evidence == EvidenceNotSent:
		return a.again(ctx, call, found, DecisionResend, depth)
	}

	// Pending past its lease, or unknown: reconcile before acting.
	if a.e.resolver != nil {
		o := a.reconcile(ctx)
		switch {
		case o.State.Final():
			moved, now, err := a.settle(ctx, stores.EffectTransition{To: o.State, Result: o.Result, Note: o.Reason, Evidence: EvidenceLookup})
			if err != nil {
				a.decision = DecisionStore
				return nil, err
			}
			result, err := a.resume(ctx, call, now, depth+1)
			if moved {
				a.decision = DecisionReconcile
				a.e.r.obs.reconciled(ctx, a)
			}
			return result, err
		case o.notFound:
			return a.again(ctx, call, found, DecisionResend, depth)
		}
	}
	if a.e.policy == Resubmit {
		return a.again(ctx, call, found, DecisionResubmit, depth)
	}
	return a.leaveUnknown(ctx, call, found, depth)
}

// refetch returns the result of a succeeded effect whose result the store
// dropped, as the Resolver finds it again; when there is none, or it does
// not answer succeeded, nil, with a.dropped set. Nothing is sent.
func (a *attempt) refetch(ctx context.Context) []byte {
	if a.e.resolver != nil {
		if o := a.reconcile(ctx); o.State == stores.EffectSucceeded {
			return o.Result
		}
	}
	a.dropped = true
	a.e.r.cfg.logger.Debug("Effect succeeded earlier; its result is no longer kept; not called again", a.fields())
	return nil
}

// held says why this attempt must leave found alone for now, or "" when
// it need not: another attempt holds it (pending, its lease running), or
// the request an attempt sent may still reach the provider (unknown within
// that attempt's lease, unless its call said it never left).
func (a *attempt) held(ctx context.Context, found stores.Effect) string {
	switch {
	case found.State == stores.EffectPending && !found.LeaseLapsed && found.Holder != stores.ClaimToken(ctx):
		return fmt.Sprintf("another attempt is calling (its lease runs until %v)", found.LeaseUntil.UTC())
	case found.State == stores.EffectUnknown && found.Landing && found.Evidence != EvidenceNotSent:
		return fmt.Sprintf("the request sent may still reach the provider until %v (its attempt's lease): "+
			"not looked up nor sent again before then", found.LeaseUntil.UTC())
	}
	return ""
}

// await waits, for up to WithParkWait in all over this attempt, for the
// effect to be left alone by the attempt holding it (held), looking at it
// again with growing pauses, and returns it as last read.
func (a *attempt) await(ctx context.Context, found stores.Effect) (stores.Effect, error) {
	r := a.e.r
	if a.wait == nil {
		a.wait = parkwait.Until(time.Now().Add(r.cfg.parkWait))
	}
	for a.held(ctx, found) != "" {
		if !a.wait.Pause(ctx) {
			break
		}
		sctx, cancel := r.storeContext(ctx)
		now, err := r.store.Lookup(sctx, a.key)
		cancel()
		if err != nil {
			return found, a.errorf("look at the effect again: %w: %w", idempotency.ErrStore, err)
		}
		found = now
	}
	return found, nil
}

// again sends the effect again under the same key, within the budget.
func (a *attempt) again(ctx context.Context, call Call, found stores.Effect, decision string, depth int) ([]byte, error) {
	if found.Attempts >= a.e.maxCalls {
		return nil, a.exhausted(ctx, found, fmt.Sprintf("sent %d times (WithMaxCalls %d)", found.Attempts, a.e.maxCalls))
	}
	taken := time.Now()
	moved, now, err := a.move(ctx, stores.EffectTransition{From: found.State, To: stores.EffectPending, Lease: a.e.r.cfg.lease, Evidence: found.Evidence})
	if err != nil {
		a.decision = DecisionStore
		return nil, err
	}
	if !moved {
		return a.resume(ctx, call, now, depth+1)
	}
	a.now, a.taken = now, taken
	return a.send(ctx, call, decision)
}

// leaveUnknown applies the Park or DeadLetter policy to an effect nothing
// settled.
func (a *attempt) leaveUnknown(ctx context.Context, call Call, found stores.Effect, depth int) ([]byte, error) {
	if found.State == stores.EffectPending { // the attempt holding it ended without an outcome
		moved, now, err := a.move(ctx, stores.EffectTransition{From: stores.EffectPending, To: stores.EffectUnknown,
			Note: "the attempt holding it ended without an outcome", Evidence: EvidenceLapsed})
		if err != nil {
			a.decision = DecisionStore
			return nil, err
		}
		if !moved {
			return a.resume(ctx, call, now, depth+1) // moved by someone else meanwhile
		}
		found = now
	}
	a.now = found
	if a.e.policy == Park && a.e.parkLimit > 0 && time.Since(found.StateSince) > a.e.parkLimit {
		return nil, a.exhausted(ctx, found, fmt.Sprintf("unknown for %v (WithParkLimit %v)", time.Since(found.StateSince).Round(time.Second), a.e.parkLimit))
	}
	var err error
	if a.e.policy == DeadLetter {
		a.decision = DecisionDeadLeter
		err = a.errorf("%w: %s; left for an operator", errDeadLetterUnknown, found.Note)
	} else {
		a.decision = DecisionPark
		err = a.errorf("%w: %s; parked until a lookup, a callback or an operator settles it", ErrUnknownOutcome, found.Note)
	}
	// Parked, the message comes back until the effect is settled: each
	// return is a debug line (the call that left it unknown warned once).
	fields := a.fields().Add(map[string]any{"policy": a.e.policy.String(), "note": found.Note})
	if a.e.policy == DeadLetter {
		kitlog.Warn(a.e.r.cfg.logger, "Effect outcome unknown; not called again, dead-lettered", err, fields)
	} else {
		a.e.r.cfg.logger.Debug("Effect outcome unknown; not called again, parked", fields)
	}
	a.escalate(ctx, found, err)
	return nil, err
}

func (a *attempt) exhausted(ctx context.Context, found stores.Effect, why string) error {
	a.decision = DecisionExhausted
	err := a.errorf("%w: %s", ErrBudgetExhausted, why)
	kitlog.Warn(a.e.r.cfg.logger, "Effect retry budget exhausted; left unknown for an operator", err, a.fields())
	a.e.r.obs.exhausted(ctx, a)
	a.escalate(ctx, found, err)
	return err
}

func (a *attempt) escalate(ctx context.Context, e stores.Effect, err error) {
	if a.e.escalate != nil {
		a.e.escalate(ctx, e, err)
	}
}

// reconcile asks the Resolver; an error is Unknown.
func (a *attempt) reconcile(ctx context.Context) Outcome {
	ctx, cancel := context.WithTimeout(ctx, a.e.r.cfg.callTimeout)
	defer cancel()
	ctx, span := a.e.r.obs.startChild(ctx, a, "reconcile")
	o, err := a.e.resolver(ctx, a.key)
	if err != nil {
		o = Unknown(err.Error())
	}
	a.e.r.obs.endReconcile(span, o, err)
	return o
}

// send calls the provider and records what it said. The effect is pending
// and held by this attempt, whose lease is renewed while the call runs; a
// lost lease cancels the call's context.
func (a *attempt) send(ctx context.Context, call Call, decision string) ([]byte, error) {
	r := a.e.r
	a.decision = decision
	attemptNo := a.now.Attempts
	var sent atomic.Bool
	lease := r.keeper.KeepFrom(ctx, a.taken, r.cfg.lease, func(ctx context.Context, lease time.Duration) (bool, error) {
		ctx, cancel := r.storeContext(ctx)
		defer cancel()
		held, err := r.store.Extend(ctx, a.key, lease)
		if err != nil || held || !sent.Load() {
			return held, err
		}
		// Settled while its call runs (an operator's forced resolution, a
		// callback): no attempt can take a final effect over, so the call
		// runs on, and its answer is recorded against the settlement.
		now, err := r.store.Lookup(ctx, a.key)
		return err == nil && now.State.Final(), err
	})
	defer lease.Stop() // a panicking call
	var o Outcome
	var err error
	if cerr := lease.Confirm(); cerr != nil {
		// Paused or starved past the lease since it was taken: another
		// attempt may hold the effect now. Not sent; whoever holds it next
		// sends it, or reconciles what this attempt left.
		o = NotSent("not sent: " + cerr.Error() + " before the call")
	} else {
		sent.Store(true)
		o, err = a.call(lease.Context(), call, attemptNo)
	}
	lost := lease.Stop()
	if lost != nil {
		r.cfg.logger.Error("Effect lease lost while its call ran; the call's context was cancelled", lost, a.fields())
		r.obs.leaseLost(ctx, a)
	}
	t := stores.EffectTransition{From: stores.EffectPending, To: stores.EffectUnknown, Evidence: EvidenceCall}
	switch {
	case err != nil && lost != nil:
		t.Note = err.Error() + " (" + lost.Error() + ")"
	case err != nil:
		t.Note = err.Error()
	case o.State.Final():
		t = stores.EffectTransition{To: o.State, Result: o.Result, Note: o.Reason, Evidence: EvidenceCall}
	case o.notSent:
		t.Note, t.Evidence = o.Reason, EvidenceNotSent
	default:
		t.Note = o.Reason
	}
	if t.Note == "" && t.To == stores.EffectUnknown {
		t.Note = "no definitive answer"
	}
	record := a.record
	if t.To.Final() {
		record = a.settle // the provider's answer, over an operator's resolution made meanwhile
	}
	moved, now, rerr := record(ctx, t)
	if rerr != nil {
		// The call happened; its outcome could not be written. The record
		// stays pending: once its lease passes, a later attempt reconciles.
		a.e.r.cfg.logger.Error("Effect outcome could not be recorded; a later attempt will reconcile it", rerr, a.fields())
		a.e.r.obs.recordFailed(ctx, a)
		switch t.To {
		case stores.EffectSucceeded:
			return o.Result, nil
		case stores.EffectFailed:
			return nil, &FailedError{Effect: a.e.name, ProviderKey: a.key, Reason: o.Reason}
		}
		return nil, a.errorf("%w: %s (and it could not be recorded: %w)", ErrUnknownOutcome, t.Note, errors.Join(rerr, leaseLost(lost)))
	}
	a.now = now
	if moved || now.State.Final() {
		switch {
		case now.State == stores.EffectSucceeded && moved: // what was just recorded, however short its lifetime
			return o.Result, nil
		case now.State == stores.EffectSucceeded && now.ResultDropped:
			return a.refetch(ctx), nil
		case now.State == stores.EffectSucceeded:
			return now.Result, nil
		case now.State == stores.EffectFailed:
			return nil, &FailedError{Effect: a.e.name, ProviderKey: a.key, Reason: now.Note}
		}
	}
	if t.Evidence == EvidenceNotSent {
		return nil, a.errorf("not sent, to be sent again: %s", t.Note)
	}
	if a.decision == DecisionCall {
		a.decision = DecisionUnknown
	}
	kitlog.Warn(a.e.r.cfg.logger, "Effect call got no definitive answer; its outcome is unknown", nil, a.fields().Add(map[string]any{"note": t.Note}))
	if lost != nil {
		return nil, a.errorf("%w (%w): %s; a later attempt reconciles before acting", ErrUnknownOutcome, ErrLeaseLost, t.Note)
	}
	return nil, a.errorf("%w: %s; a later attempt reconciles before acting", ErrUnknownOutcome, t.Note)
}

// leaseLost is ErrLeaseLost when lost is not nil.
func leaseLost(lost error) error {
	if lost == nil {
		return nil
	}
	return ErrLeaseLost
}

// call runs the user's call under the call timeout, in a span; a panic is
// an unknown outcome, recorded before it goes on.
func (a *attempt) call(ctx context.Context, call Call, attemptNo int) (o Outcome, err error) {
	r := a.e.r
	cctx, cancel := context.WithTimeout(ctx, r.cfg.callTimeout)
	defer cancel()
	cctx, span := r.obs.startChild(cctx, a, "call")
	start := time.Now()
	defer func() {
		if p := recover(); p != nil {
			_, _, _ = a.record(ctx, stores.EffectTransition{From: stores.EffectPending, To: stores.EffectUnknown,
				Note: fmt.Sprintf("the call panicked: %v", p), Evidence: EvidenceCall})
			r.obs.endCall(ctx, span, a, Unknown("panic"), errors.New("panic"), attemptNo, time.Since(start))
			panic(p)
		}
	}()
	o, err = call(cctx, a.key)
	r.obs.endCall(ctx, span, a, o, err, attemptNo, time.Since(start))
	return o, err
}

// record writes a transition after the call, retrying, on a context that
// outlives the delivery's cancellation: the call happened.
func (a *attempt) record(ctx context.Context, t stores.EffectTransition) (bool, stores.Effect, error) {
	r := a.e.r
	ctx = context.WithoutCancel(ctx)
	backoff := r.cfg.recordBackoff
	for n := 1; ; n++ {
		moved, now, err := a.move(ctx, t)
		if err == nil || n >= r.cfg.recordAttempts {
			return moved, now, err
		}
		time.Sleep(backoff)
		backoff = min(backoff, math.MaxInt64/2) * 2
	}
}

func (a *attempt) move(ctx context.Context, t stores.EffectTransition) (bool, stores.Effect, error) {
	sctx, cancel := a.e.r.storeContext(ctx)
	defer cancel()
	moved, now, err := a.e.r.store.Transition(sctx, a.key, t)
	if err != nil {
		return false, now, a.errorf("record %s: %w: %w", t.To, idempotency.ErrStore, err)
	}
	return moved, now, nil
}

func (a *attempt) fields() watermill.LogFields {
	return watermill.LogFields{"effect": a.e.name, "provider_key": a.key, "message_id": a.d.ID, "handler": a.d.Handler}
}

// fingerprint is the default request fingerprint.
func fingerprint(request any) (uint64, error) {
	switch v := request.(type) {
	case nil:
		return 0, nil
	case []byte:
		if fp, err := envelope.FingerprintJSON(v); err == nil {
			return fp, nil
		}
		return fnv64(v), nil
	case json.RawMessage:
		return envelope.FingerprintJSON(v)
	}
	b, err := json.Marshal(request)
	if err != nil {
		return 0, err
	}
	return envelope.FingerprintJSON(b)
}

func fnv64(b []byte) uint64 {
	h := uint64(14695981039346656037)
	for _, c := range b {
		h ^= uint64(c)
		h *= 1099511628211
	}
	return h | 1 // never 0: 0 means none
}
