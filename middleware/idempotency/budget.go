package idempotency

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/babelqueue/watermill-idempotency/stores"
)

// runBudget runs h for d, and again after a failure while the message's
// budget allows (WithRetries), f being what the store kept of its earlier
// failures. In the claim mode, after a successful run the claim is still
// held and h's produced messages are returned; after a failure the claim
// is settled here: held until the router acked the dead letter of a
// message that failed for good (its end is then remembered), released
// otherwise (the count it carries stays in the store). The seen-set holds
// no claim, and counts the same way.
//
// The handler runs below this frame and the two under it: they keep to
// small frames (the delivery by pointer, the failure's handling in
// afterFailure), so that the handler's goroutine does not outgrow its
// stack and have it copied for the kit's sake.
func (g *Guard) runBudget(d delivery, h message.HandlerFunc, f stores.Failure) ([]*message.Message, error) {
	for {
		if g.cfg.retriesSet && f.Attempts > 0 {
			if err := g.due(d, &f); err != nil {
				return nil, err
			}
		}
		started := time.Now()
		produced, err := g.runReleasingOnPanic(&d, h)
		if !d.unrecorded { // a message without identity was reported as fail_open
			g.observed(&d, OutcomeRun, err)
		}
		if err == nil {
			g.runs.forget(d.key)
			return produced, nil
		}
		if again, err := g.afterFailure(&d, &f, started, err); !again {
			return nil, err
		}
	}
}

// observed reports d's outcome o (err: its error), as observe does.
//
//go:noinline
func (g *Guard) observed(d *delivery, o Outcome, err error) {
	g.observe(d.ctx, d.msg, d.event(o, err))
}

// afterFailure settles a failed run of d (err) under its budget f: again
// when the message runs once more within this delivery, otherwise the
// delivery's error.
//
//go:noinline
func (g *Guard) afterFailure(dp *delivery, f *stores.Failure, started time.Time, err error) (again bool, _ error) {
	d := *dp
	switch {
	case d.lost() != nil:
		// Another delivery may run the message now: this failure is
		// not the message's, and must not end it.
		g.release(d)
		return false, fmt.Errorf("idempotency: message %q: %w: %w", d.ev.MessageID, ErrClaimLost, err)
	case !g.cfg.retriesSet:
		g.release(d)
		g.awaitEnd(d, d.key, err, *f, false)
		return false, err
	case g.interrupted(d, started):
		g.release(d)
		return false, err
	}
	took := time.Since(started)
	wait, final, lost := g.failedRun(d, f, err)
	g.noteRun(d, took, final == nil && lost == nil)
	switch {
	case lost != nil:
		g.release(d)
		return false, lost
	case final != nil:
		g.awaitEnd(d, d.key, final, *f, d.held != 0) // the claim is held until the ack
		return false, final
	case !g.fits(d, wait+time.Since(started)):
		g.release(d)
		return false, g.retryLater(d, *f, err)
	case !g.pause(d, wait):
		return false, g.cutShort(d, err)
	}
	return true, nil
}

// due checks, before a run under WithRetries, that the message's budget
// is not spent already and waits out the rest of its backoff (f.NotBefore)
// within the delivery. A spent budget fails the delivery for good without
// running (a delivery before this one failed it, but its dead letter was
// not published, or its end not written); a backoff that does not end
// within the delivery ends it with ErrRetryLater, as late as fits.
func (g *Guard) due(d delivery, f *stores.Failure) error {
	if !g.cfg.retriesSet || f.Attempts == 0 {
		return nil
	}
	r := g.cfg.retries
	spent := f.Attempts >= 1+r.Max
	if !spent && r.Deadline > 0 && time.Now().After(f.FirstFailure.Add(r.Deadline)) {
		spent = true
	}
	if spent {
		err := &failedError{kind: ErrExhausted, attempts: f.Attempts,
			why: " (spent by earlier deliveries: its dead letter was not published, or its end not written)",
			err: errors.New("not run again")}
		g.observe(d.ctx, d.msg, d.event(OutcomeExhausted, err))
		g.awaitEnd(d, d.key, err, *f, d.held != 0)
		return err
	}
	// A next run due later than the longest backoff after this many
	// failures was written by a worker whose clock is ahead of this one's:
	// the wait is that backoff at most.
	wait := min(time.Until(f.NotBefore), r.longest(f.Attempts))
	if wait <= 0 {
		if w, held := g.heldBack(d); held {
			wait = w // longer than fits: held, then handed back
		}
	}
	if wait <= 0 {
		return nil
	}
	if g.fits(d, wait) {
		if g.pause(d, wait) {
			return nil
		}
		return g.cutShort(d, context.Cause(d.ctx))
	}
	// The wait does not end within this delivery: hold the message as long
	// as fits (a broker that hands a nacked message straight back would
	// otherwise bring it back at once, again and again), then hand it back.
	if !g.pause(d, time.Until(g.limitAt(d))) {
		return g.cutShort(d, context.Cause(d.ctx))
	}
	g.release(d)
	return g.retryLater(d, *f, errors.New("waiting for its next run"))
}

// noteRun remembers how long the failed run of d took (took) when the
// message runs again (again) and the run ended by itself (its delivery's
// context is not done: a run the broker cut short says nothing of its
// length); otherwise it forgets the message.
func (g *Guard) noteRun(d delivery, took time.Duration, again bool) {
	if again && d.ctx.Err() == nil {
		g.runs.put(d.key, took)
		return
	}
	g.runs.forget(d.key)
}

// heldBack reports whether d must not run now, as the message's last
// failed run took longer than d has left (a message handed back under its
// first delivery's deadline: see runLengths), with a wait past d's limit,
// which holds d as long as fits and then hands it back.
func (g *Guard) heldBack(d delivery) (wait time.Duration, held bool) {
	if !g.runs.hold(d.key, g.hardEnd(d)) {
		return 0, false
	}
	return max(time.Until(g.limitAt(d)), 0) + time.Millisecond, true
}

// hardEnd is when d's broker ends it: its context's deadline, or its
// delivery limit (WithDeliveryLimit), whichever comes first; zero when
// neither is set.
func (g *Guard) hardEnd(d delivery) time.Time {
	return g.endOf(d, func(time.Duration) time.Duration { return 0 })
}

// failedRun counts a failed run of d in f and records it in the store (the
// claim, if any, kept), and returns the wait before the next run, or, when
// the message failed for good, the final error. lost is set when the store
// says another delivery holds the claim now.
func (g *Guard) failedRun(d delivery, f *stores.Failure, err error) (wait time.Duration, final, lost error) {
	r := g.cfg.retries
	now := time.Now()
	f.Attempts++
	if f.FirstFailure.IsZero() {
		f.FirstFailure = now.Truncate(time.Millisecond)
	}
	wait = r.wait(f.Attempts)
	f.NotBefore = now.Add(wait).Truncate(time.Millisecond)
	switch {
	case !r.Retryable(err):
		final = &failedError{attempts: f.Attempts, err: err}
	case f.Attempts >= 1+r.Max:
		final = &failedError{kind: ErrExhausted, attempts: f.Attempts, err: err}
	case r.Deadline > 0 && f.NotBefore.After(f.FirstFailure.Add(r.Deadline)):
		final = &failedError{kind: ErrExhausted, attempts: f.Attempts, err: err,
			why: fmt.Sprintf(" (the next would start past the retries' deadline, %v after the first failure)", r.Deadline)}
	}
	if final != nil {
		f.NotBefore = time.Time{}
		if errors.Is(final, ErrExhausted) {
			g.observe(d.ctx, d.msg, d.event(OutcomeExhausted, final))
		}
	}
	if !g.caps.Failures || d.unrecorded {
		return wait, final, nil
	}
	ctx, cancel := g.storeContext(context.WithoutCancel(d.ctx))
	start := g.obs.startStore(ctx)
	ferr := g.store.Fail(ctx, d.key, d.fp, *f)
	g.obs.endStore(ctx, start, d.ev.Handler, "fail")
	cancel()
	switch {
	case errors.Is(ferr, stores.ErrClaimTaken):
		return wait, final, fmt.Errorf("idempotency: message %q: %w: its failure was not written over the other holder's claim: %w", d.ev.MessageID, ErrClaimLost, err)
	case ferr != nil:
		// The run is counted in this delivery; a crash before the next
		// count reaches the store would run the message once more.
		g.cfg.logger.Error("Could not record a failed run; counted in this delivery only", ferr,
			g.fields(d.ev).Add(watermill.LogFields{"attempts": f.Attempts}))
	}
	return wait, final, nil
}

// retryLater ends d before the broker's deadline, its budget kept in the
// store: ErrRetryLater (transient), reported as OutcomeRetryLater.
func (g *Guard) retryLater(d delivery, f stores.Failure, err error) error {
	e := &failedError{kind: ErrRetryLater, attempts: f.Attempts, err: err,
		why: " (the next run would not fit in the time the broker gives a delivery)"}
	return g.observe(d.ctx, d.msg, d.event(OutcomeRetryLater, e))
}

// cutShort ends d whose wait between runs was cut short: its claim was
// lost (ErrClaimLost), or its message's context ended (shutdown). The
// count stays in the store.
func (g *Guard) cutShort(d delivery, err error) error {
	if d.lost() != nil {
		g.release(d)
		return fmt.Errorf("idempotency: message %q: %w: %w", d.ev.MessageID, ErrClaimLost, err)
	}
	g.release(d)
	if err == nil {
		err = d.ctx.Err()
	}
	return fmt.Errorf("idempotency: message %q: the delivery ended while it waited for its next run: %w", d.ev.MessageID, err)
}

// interrupted reports whether the run of d that started at started failed
// because its delivery was cancelled (the consumer shutting down), which
// does not count against the budget. A context cancelled at the broker's
// deadline counts: the broker cut a run that was too long, and counting it
// is what stops a message that always runs too long from looping for ever.
// That is a cancellation at or after the delivery's limit (watermill-nats
// cancels at its AckWaitTimeout), or at the deadline of the message's
// context (watermill-sql's AckDeadline: its context may end cancelled
// rather than past its deadline, as its own cancel races the deadline's).
// The broker's clock starts when it hands the message out, a little before
// the guard's: a cancellation within the margin the guard keeps before
// either (limitAt) is the broker's too.
func (g *Guard) interrupted(d delivery, started time.Time) bool {
	if !errors.Is(d.ctx.Err(), context.Canceled) {
		return false
	}
	at := g.limitAt(d)
	return at.IsZero() || time.Now().Before(at)
}

// pause waits for wait, and reports false when the delivery's claim was
// lost or its message's context ended first.
func (g *Guard) pause(d delivery, wait time.Duration) bool {
	if wait <= 0 {
		return true
	}
	done := d.ctx.Done()
	if d.lease != nil {
		done = d.lease.Context().Done()
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-done:
		return false
	}
}

// limitAt is when d must have ended what the guard decides on its own
// (waits, retries): before the delivery limit (WithDeliveryLimit) and the
// deadline of the message's context, whichever comes first, less a margin
// to hand the message back; zero when neither is set.
func (g *Guard) limitAt(d delivery) time.Time { return g.endOf(d, margin) }

// endOf is the earlier of d's delivery limit and its context's deadline,
// each less keep of its window (from d's start); zero when neither is set.
func (g *Guard) endOf(d delivery, keep func(window time.Duration) time.Duration) time.Time {
	var at time.Time
	if limit := g.cfg.deliveryLimit; limit > 0 {
		at = d.started.Add(limit - keep(limit))
	}
	if deadline, ok := d.ctx.Deadline(); ok {
		if c := deadline.Add(-keep(deadline.Sub(d.started))); at.IsZero() || c.Before(at) {
			at = c
		}
	}
	return at
}

// margin is the part of a delivery's window kept to hand it back: a tenth,
// between 50ms and 2s.
func margin(window time.Duration) time.Duration {
	return min(max(window/10, 50*time.Millisecond), 2*time.Second)
}

// fits reports whether d can go on for another dur within its limit.
func (g *Guard) fits(d delivery, dur time.Duration) bool {
	at := g.limitAt(d)
	return at.IsZero() || time.Now().Add(dur).Before(at)
}

// within returns t, or d's limit when that comes first.
func (g *Guard) within(d delivery, t time.Time) time.Time {
	if at := g.limitAt(d); !at.IsZero() && at.Before(t) {
		return at
	}
	return t
}

// runReleasingOnPanic calls h with the claim's context. Under WithRetries a
// panic is a failed run like an error (Watermill's RecoveredPanicError,
// with the stack); otherwise it releases the claim before it goes on.
func (g *Guard) runReleasingOnPanic(d *delivery, h message.HandlerFunc) (produced []*message.Message, err error) {
	defer func() {
		if r := recover(); r != nil {
			produced, err = g.recovered(d, r)
		}
	}()
	if d.unrecorded {
		return h(d.msg) // no identity to put in its context
	}
	ctx := d.ctx
	if d.lease != nil {
		ctx = d.lease.Context() // the handler's context ends if the claim is lost
	}
	return g.runWithDelivery(d, ctx, h)
}

// recovered is what a run of d that panicked with r returns: under
// WithRetries a failed run (Watermill's RecoveredPanicError, with the
// stack); otherwise the claim is released and the panic goes on.
//
//go:noinline
func (g *Guard) recovered(d *delivery, r any) ([]*message.Message, error) {
	if g.cfg.retriesSet {
		return nil, middleware.RecoveredPanicError{V: r, Stacktrace: string(debug.Stack())}
	}
	g.release(*d)
	panic(r)
}

// txRun is the transactional mode's account of one attempt, for its
// budget (WithRetries): what the record's statement found of earlier
// failures, and whether the handler ran, when, and how it ended.
type txRun struct {
	failure stores.Failure
	notDue  time.Duration // > 0: the next run was not due yet by that much
	ran     bool
	started time.Time
	err     error // the handler's
}

// errNotDue is what an attempt of the transactional mode returns when the
// message's next run is not due yet (its backoff): it was rolled back
// without running, to wait outside the transaction.
var errNotDue = errors.New("idempotency: the message's next run is not due yet")

// txBudget runs attempt, a transaction of the transactional mode, and
// again after the handler failed while the message's budget allows
// (WithRetries). The count is written outside the rolled-back
// transaction (stores.Store.Fail); the next attempt's record statement
// finds it. A message whose end it finds and that an operator sent back on
// purpose is reopened between attempts.
func (g *Guard) txBudget(d delivery, attempt func(d delivery) error) error {
	d.started = time.Now()
	var f stores.Failure
	for reopens := 0; ; {
		var run txRun
		if g.cfg.retriesSet && !d.unrecorded {
			d.run = &run
		}
		err := attempt(d)
		var reopen *reopenError
		switch {
		case errors.As(err, &reopen) && reopens < 3:
			reopens++
			if err := g.reopen(d, reopen.found); err != nil {
				return err
			}
			continue
		case errors.As(err, &reopen):
			g.observe(d.ctx, d.msg, d.event(OutcomeEnded, nil))
			return nil
		case errors.Is(err, errNotDue):
			if !g.fits(d, run.notDue) {
				if !g.pause(d, time.Until(g.limitAt(d))) {
					return g.cutShort(d, d.ctx.Err())
				}
				return g.retryLater(d, run.failure, errors.New("waiting for its next run"))
			}
			if !g.pause(d, run.notDue) {
				return g.cutShort(d, d.ctx.Err())
			}
			continue
		case err == nil && run.ran:
			g.runs.forget(d.key)
			return nil
		case err == nil || d.unrecorded || IsTransient(err):
			return err
		case !g.cfg.retriesSet:
			g.awaitEnd(d, d.key, err, stores.Failure{}, false)
			return err
		case !run.ran && errors.Is(err, ErrExhausted): // spent before this delivery (txDue)
			g.awaitEnd(d, d.key, err, run.failure, false)
			return err
		case !run.ran, g.interrupted(d, run.started):
			return err
		}
		f = run.failure
		took := time.Since(run.started)
		wait, final, _ := g.failedRun(d, &f, err)
		g.noteRun(d, took, final == nil)
		switch {
		case final != nil:
			g.awaitEnd(d, d.key, final, f, false)
			return final
		case !g.fits(d, wait+time.Since(run.started)):
			return g.retryLater(d, f, err)
		case !g.pause(d, wait):
			return g.cutShort(d, err)
		}
	}
}

// txDue checks, in an attempt of the transactional mode whose record
// statement found found, that the message's budget is not spent and its
// next run is due: a spent budget fails the delivery for good (the
// handler does not run), a run not due yet returns errNotDue.
func (g *Guard) txDue(d delivery, found stores.Record) error {
	if d.run == nil {
		return nil
	}
	d.run.failure = found.Failure
	f := found.Failure
	if f.Attempts == 0 {
		return nil
	}
	r := g.cfg.retries
	if f.Attempts >= 1+r.Max || (r.Deadline > 0 && time.Now().After(f.FirstFailure.Add(r.Deadline))) {
		err := &failedError{kind: ErrExhausted, attempts: f.Attempts,
			why: " (spent by earlier deliveries: its dead letter was not published, or its end not written)",
			err: errors.New("not run again")}
		g.observe(d.ctx, d.msg, d.event(OutcomeExhausted, err))
		return err
	}
	if wait := min(time.Until(f.NotBefore), r.longest(f.Attempts)); wait > 0 { // no longer than a backoff: see due
		d.run.notDue = wait
		return errNotDue
	}
	if wait, held := g.heldBack(d); held {
		d.run.notDue = wait
		return errNotDue
	}
	return nil
}

// runTx runs h for an attempt of the transactional mode, noting the run
// for its budget; under WithRetries a panic is a failed run (the
// transaction is rolled back as for an error).
func (g *Guard) runTx(d delivery, h message.HandlerFunc) (produced []*message.Message, err error) {
	if d.run == nil {
		return h(d.msg)
	}
	d.run.ran, d.run.started = true, time.Now()
	defer func() {
		if r := recover(); r != nil {
			produced, err = nil, middleware.RecoveredPanicError{V: r, Stacktrace: string(debug.Stack())}
		}
		d.run.err = err
	}()
	return h(d.msg)
}
