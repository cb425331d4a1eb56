package idempotency

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// A message's end. When the guard fails a delivery for good (its budget
// spent, a permanent rejection, a conflict, a message too old) and the
// router then acks it, something outside the guard took the failure over:
// the dead-letter middleware published the dead letter (a nack would have
// meant it could not). The guard then remembers the message's end under
// its key (stores.Store.Fail with an End), so that a redelivery of it is
// acked without running and without a second dead letter (OutcomeEnded).
// A copy an operator sent back on purpose carries a redrive mark
// (envelope.MetadataRedrive) other than the end's: it reopens the end and
// runs with a fresh budget.

// atEnd answers a delivery whose key holds an end: a redriven copy (a
// redrive mark other than the end's) reopens it, and again reports true
// (claim again); anything else is skipped as ended (nil, acked), or
// rejected as a conflict when its content differs. reopens bounds the
// reopens of one delivery.
func (g *Guard) atEnd(d delivery, found stores.Record, reopens *int) (again bool, err error) {
	if err := g.conflict(d, found.Fingerprint); err != nil {
		return false, g.refuse(d, conflictKey(d), err)
	}
	if !redriven(d, found) || *reopens >= 3 {
		g.observe(d.ctx, d.msg, d.event(OutcomeEnded, nil))
		return false, nil
	}
	*reopens++
	return true, g.reopen(d, found)
}

// redriven reports whether d is a copy an operator sent back after found,
// its end: it carries a redrive mark other than the end's.
func redriven(d delivery, found stores.Record) bool {
	mark := d.msg.Metadata.Get(envelope.MetadataRedrive)
	return mark != "" && found.Failure.End != nil && mark != found.Failure.End.Marker
}

// reopen drops found, d's end, for d, a redriven copy; nil when it was
// dropped, by d or by a concurrent delivery (look again).
func (g *Guard) reopen(d delivery, found stores.Record) error {
	ctx, cancel := g.storeContext(d.ctx)
	start := g.obs.startStore(ctx)
	reopened, err := g.store.Reopen(ctx, d.key, found.Failure.End.Marker)
	g.obs.endStore(ctx, start, d.ev.Handler, "reopen")
	cancel()
	if err != nil {
		return g.storeError(d, "reopen", err)
	}
	if reopened {
		g.observe(d.ctx, d.msg, d.event(OutcomeReopen, nil))
	}
	return nil
}

// reopenError is what a transactional attempt returns when it found the
// message's end and the delivery is a redriven copy: the end is reopened
// once the attempt's transaction is over, and the attempt begins again.
type reopenError struct{ found stores.Record }

func (e *reopenError) Error() string { return "idempotency: a redriven copy found its message's end" }

// refuse answers a delivery rejected before it could run (a conflict under
// key, a message too old): skipped as ended when that rejection ended it
// before, else rejected with err, whose end is remembered once the router
// acked the dead letter.
func (g *Guard) refuse(d delivery, key string, err error) error {
	if !g.caps.Failures {
		return err
	}
	ctx, cancel := g.storeContext(d.ctx)
	start := g.obs.startStore(ctx)
	found, lerr := g.store.Lookup(ctx, key)
	g.obs.endStore(ctx, start, d.ev.Handler, "lookup")
	cancel()
	if lerr == nil && found.Ended() {
		g.observe(d.ctx, d.msg, d.event(OutcomeEnded, nil))
		return nil
	}
	g.awaitEnd(d, key, err, stores.Failure{}, false)
	return err
}

// conflictKey is the key a conflict's end is kept under: the message's
// key and its content's fingerprint, apart from the record of the content
// that ran (U+001E never appears in a key: identities refuse control
// characters).
func conflictKey(d delivery) string {
	return d.key + "\x1e" + strconv.FormatUint(d.fp, 16)
}

// endWatch is what a delivery that failed waits on: the router's ack (its
// end is then remembered) or nack. One per message: a later run of the
// same message in the same delivery (Watermill's Retry outside the guard)
// replaces what the first reported.
type endWatch struct {
	mu      sync.Mutex
	d       delivery
	key     string
	err     error
	f       stores.Failure
	holding bool // d's claim is held until the ack or nack
	done    bool
}

type endWatchKey struct{}

// awaitEnd makes d wait for the router's verdict on its failure err (f
// being its count): an ack remembers the end under key, a nack (or no
// verdict within WithAckTimeout) lets the claim go, when holding, with
// its count. It does nothing for a message the guard cannot remember ends
// of.
func (g *Guard) awaitEnd(d delivery, key string, err error, f stores.Failure, holding bool) {
	if !g.caps.Failures || IsTransient(err) {
		if holding {
			g.release(d)
		}
		return
	}
	if w, ok := d.msg.Context().Value(endWatchKey{}).(*endWatch); ok {
		w.mu.Lock()
		if !w.done {
			w.d, w.key, w.err, w.f, w.holding = d, key, err, f, holding
			w.mu.Unlock()
			return
		}
		w.mu.Unlock()
	}
	w := &endWatch{d: d, key: key, err: err, f: f, holding: holding}
	d.msg.SetContext(context.WithValue(d.msg.Context(), endWatchKey{}, w))
	go g.settleEnd(w)
}

// letGoOfEarlierRun releases the claim an earlier run of msg in this very
// delivery still holds while it waits for the router's verdict (a Retry
// outside the guard that runs a message the guard failed for good): the
// new run claims the message itself.
func (g *Guard) letGoOfEarlierRun(msg *message.Message) {
	w, ok := msg.Context().Value(endWatchKey{}).(*endWatch)
	if !ok {
		return
	}
	w.mu.Lock()
	held, d := w.holding, w.d
	w.holding = false
	w.mu.Unlock()
	if held {
		g.release(d)
	}
}

// settleEnd waits for the router's verdict on w's delivery and settles it.
func (g *Guard) settleEnd(w *endWatch) {
	w.mu.Lock()
	msg := w.d.msg
	w.mu.Unlock()
	timer := time.NewTimer(g.cfg.ackTimeout)
	defer timer.Stop()
	acked := false
	select {
	case <-msg.Acked():
		acked = true
	case <-msg.Nacked():
	case <-timer.C:
	}
	w.mu.Lock()
	w.done = true
	d, key, err, f, holding := w.d, w.key, w.err, w.f, w.holding
	w.mu.Unlock()
	if !acked {
		if holding {
			g.release(d) // the count stays with the store
		}
		return
	}
	if holding {
		if lost := d.stopLease(); lost != nil {
			g.claimLost(d, lost, errors.New("while its dead letter was published: its end was not written"))
			g.letGo(d)
			return
		}
		defer g.letGo(d)
	}
	f.NotBefore = time.Time{}
	f.End = &stores.End{Reason: endReason(msg, err), At: time.Now().Truncate(time.Millisecond),
		Topic: msg.Metadata.Get(envelope.MetadataDeadLetterTopic), Marker: msg.Metadata.Get(envelope.MetadataRedrive)}
	g.recordEnd(d, key, f)
}

// recordEnd writes f, an end, under key, retrying as remember does;
// detached from the message's cancellation.
func (g *Guard) recordEnd(d delivery, key string, f stores.Failure) {
	ctx := context.WithoutCancel(d.ctx)
	backoff := g.cfg.rememberBackoff
	for attempt := 1; ; attempt++ {
		sctx, cancel := g.storeContext(ctx)
		start := g.obs.startStore(sctx)
		err := g.store.Fail(sctx, key, d.fp, f)
		g.obs.endStore(sctx, start, d.ev.Handler, "end")
		cancel()
		switch {
		case err == nil:
			return
		case errors.Is(err, stores.ErrClaimTaken):
			// Another delivery runs the message now: what becomes of it is
			// that delivery's.
			g.cfg.logger.Info("The message's end was not written: another delivery holds it now",
				g.fields(d.ev).Add(watermill.LogFields{"reason": f.End.Reason}))
			return
		case attempt >= g.cfg.rememberAttempts:
			err = fmt.Errorf("idempotency: remember the end (%s) of message %q after %d attempts; a redelivery is dead-lettered again: %w",
				f.End.Reason, d.ev.MessageID, attempt, err)
			g.observe(d.ctx, d.msg, d.event(OutcomeRememberFailed, err))
			return
		}
		time.Sleep(backoff)
		backoff *= 2
	}
}

// endReason is the dead_letter reason of a message that ended with err:
// the one the dead-letter middleware noted on it, else the guard's own
// reading of err.
func endReason(msg *message.Message, err error) string {
	if r := msg.Metadata.Get(envelope.MetadataDeadLetterReason); r != "" {
		return r
	}
	switch {
	case errors.Is(err, ErrConflict):
		return envelope.ReasonConflict
	case errors.Is(err, ErrTooOld):
		return envelope.ReasonTooOld
	case errors.Is(err, ErrExhausted):
		return envelope.ReasonFailed
	case IsPermanent(err):
		return envelope.ReasonRejected
	}
	return envelope.ReasonFailed
}
