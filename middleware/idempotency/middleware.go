package idempotency

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/internal/keepalive"
	"github.com/babelqueue/watermill-idempotency/internal/parkwait"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// Guard is the idempotency middleware for one store and configuration. Its
// Middleware method is a message.HandlerMiddleware; one Guard may wrap any
// number of handlers. It holds no goroutine of its own: the claims its
// deliveries hold are kept alive by one timer of the Guard's, armed only
// while a claim is held, which renews together every claim due within half
// a renewal period (see WithClaim).
//
// The mode is chosen once, by New, from the options: the claim mode (the
// default), the seen-set (WithoutClaim) or the transactional mode
// (WithTransaction, or WithPgxTransaction on a pgx pool). Each reads top to
// bottom in a function of its own: claimed, seenSet, inTransaction and
// inPgxTransaction.
type Guard struct {
	cfg        config
	store      stores.Store
	caps       stores.Capabilities
	txStore    stores.TxStore // the transactional mode's store
	pgxStore   PgxTxStore     // the same, under WithPgxTransaction
	txBeginner TxBeginner     // txStore, when it can begin with the record
	decide     func(g *Guard, d delivery, h message.HandlerFunc) ([]*message.Message, error)
	obs        observers
	keeper     *keepalive.Keeper // keeps the claims held alive, renewing those due together
	runs       runLengths        // the last failed run's length, per message with runs left

	tokenPrefix string
	tokens      atomic.Uint64
}

// Middleware returns the idempotency middleware for store. It panics when
// the options are invalid (see New); use New to get an error instead.
func Middleware(store stores.Store, opts ...Option) message.HandlerMiddleware {
	g, err := New(store, opts...)
	if err != nil {
		panic(err)
	}
	return g.Middleware
}

// New returns a Guard for store, or an error when the options are invalid:
// a negative duration, a claim lease under a millisecond, a store that
// cannot claim without WithoutClaim, WithTransaction on a store that is not
// a stores.TxStore or combined with WithClaim, WithoutClaim or
// WithParkWait, WithClaim or WithParkWait with WithoutClaim, options of the
// transactional mode (WithSubscriberTx, WithOutbox, WithTxRetries,
// WithTxOptions) without it, options of key sources without one, a clock
// skew not shorter than the replay horizon.
func New(store stores.Store, opts ...Option) (*Guard, error) {
	if store == nil {
		return nil, errors.New("idempotency: nil store")
	}
	g := &Guard{cfg: defaultConfig(), store: store, caps: store.Capabilities(), keeper: new(keepalive.Keeper)}
	for _, opt := range opts {
		opt(&g.cfg)
	}
	c := &g.cfg
	switch {
	case c.lease < 0, c.storeTimeout < 0, c.rememberBackoff < 0, c.ackTimeout < 0, c.txRetries < 0,
		c.horizon < 0, c.skew < 0, c.parkWait < 0:
		return nil, errors.New("idempotency: negative duration in options")
	case c.rememberAttempts < 1:
		return nil, fmt.Errorf("idempotency: WithRememberRetry needs at least 1 attempt, got %d", c.rememberAttempts)
	case c.lease < time.Millisecond:
		// The stores keep leases in milliseconds and refuse shorter ones:
		// every delivery would fail with the transient ErrStore, for ever.
		return nil, fmt.Errorf("idempotency: WithClaim(%v): the lease must be at least 1ms", c.lease)
	case c.ackTimeout == 0:
		c.ackTimeout = time.Minute
	}
	if c.retriesSet {
		r := c.retries
		switch {
		case r.Max < 0:
			return nil, fmt.Errorf("idempotency: WithRetries: Max %d is negative", r.Max)
		case r.Backoff < 0, r.MaxBackoff < 0, r.Deadline < 0:
			return nil, errors.New("idempotency: WithRetries: negative duration")
		}
		c.retries = r.withDefaults()
	}
	if c.deliveryLimit < 0 {
		return nil, errors.New("idempotency: WithDeliveryLimit: negative duration")
	}
	if err := c.keys.check(); err != nil {
		return nil, err
	}
	if !c.horizonSet {
		c.horizon = max(g.caps.TTL, 0)
	}
	if c.horizon > 0 && c.skew >= c.horizon {
		return nil, fmt.Errorf("idempotency: the clock skew (%v) is not shorter than the replay horizon (%v): every message would be too old; lower it with WithClockSkew or turn the horizon off with WithReplayHorizon(0)", c.skew, c.horizon)
	}
	if err := g.chooseMode(); err != nil {
		return nil, err
	}
	var err error
	if g.obs, err = newObservers(c); err != nil {
		return nil, err
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	g.tokenPrefix = hex.EncodeToString(b[:]) + "-"
	return g, nil
}

// chooseMode picks the decision of every delivery from the options and the
// store, or says why the combination cannot work.
func (g *Guard) chooseMode() error {
	c := &g.cfg
	switch {
	case c.txDB != nil && c.pgxPool != nil:
		return errors.New("idempotency: WithTransaction and WithPgxTransaction cannot be combined")
	case c.txDB != nil:
		txStore, ok := g.store.(stores.TxStore)
		switch {
		case !ok:
			return fmt.Errorf("idempotency: WithTransaction: %T: %w", g.store, ErrNotTxStore)
		case c.leaseSet || c.noClaim || c.parkWaitSet:
			return errors.New("idempotency: WithTransaction cannot be combined with WithClaim, WithoutClaim or WithParkWait: the record's row lock keeps concurrent duplicates apart")
		}
		g.txStore, g.decide = txStore, (*Guard).inTransaction
		g.txBeginner, _ = txStore.(TxBeginner)
	case c.pgxPool != nil:
		pgxStore, ok := g.store.(PgxTxStore)
		switch {
		case !ok:
			return fmt.Errorf("idempotency: WithPgxTransaction: %T: %w", g.store, ErrNotTxStore)
		case c.leaseSet || c.noClaim || c.parkWaitSet:
			return errors.New("idempotency: WithPgxTransaction cannot be combined with WithClaim, WithoutClaim or WithParkWait: the record's row lock keeps concurrent duplicates apart")
		case c.subscriberTx != nil || c.outbox != nil || c.txOptions != nil:
			return errors.New("idempotency: WithPgxTransaction cannot be combined with WithSubscriberTx, WithOutbox or WithTxOptions, which are database/sql's (WithPgxTxOptions sets its transactions' options)")
		}
		g.pgxStore, g.decide = pgxStore, (*Guard).inPgxTransaction
	case c.subscriberTx != nil || c.outbox != nil || c.txRetriesSet || c.txOptions != nil || c.pgxTxOptionsSet:
		return errors.New("idempotency: WithSubscriberTx, WithOutbox, WithTxRetries, WithTxOptions and WithPgxTxOptions need WithTransaction (WithTxRetries and WithPgxTxOptions: or WithPgxTransaction)")
	case c.noClaim && (c.leaseSet || c.parkWaitSet):
		return errors.New("idempotency: WithClaim and WithParkWait cannot be combined with WithoutClaim, which takes no claim")
	case c.noClaim:
		g.decide = (*Guard).seenSet
	case !g.caps.Claims:
		return fmt.Errorf("idempotency: %T: %w; pass WithoutClaim() to run it as a post-success seen-set, where two concurrent deliveries of one message may both run", g.store, ErrNoClaims)
	default:
		g.decide = (*Guard).claimed
	}
	return nil
}

// Middleware wraps h with the idempotency decision (see the package
// documentation):
//
//  1. Read the identity (meta.id, without decoding the body, or the key
//     sources of WithKeySource). None: run h without deduplication (fail
//     open), or reject it under WithRequireIdentity. An unsupported
//     schema_version, an unusable identity or a message older than the
//     replay horizon: reject with a permanent error.
//  2. Take the claim (the default), look the record up (WithoutClaim) or
//     record it in the handler's transaction (WithTransaction). Remembered
//     already: skip; h does not run and nil, nil is returned so the router
//     acks and the broker stops redelivering. In flight in another
//     delivery: park it (ErrInFlight, transient).
//  3. Run h. On error the message stays unmarked, the claim is released and
//     the error propagates. On success it is remembered, or, when h
//     returned messages for the router to publish, remembered once the
//     router acked the delivery.
//
// A store that cannot be read makes the delivery fail with ErrStore, to be
// retried; h does not run.
func (g *Guard) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return g.traced(func(msg *message.Message) ([]*message.Message, error) {
		markReplay(msg)
		d, identified, err := g.identify(msg)
		switch {
		case err != nil && d.key != "":
			// Too old, under a usable key: a message it ended before is
			// skipped, not dead-lettered again.
			return nil, g.refuse(d, d.key, err)
		case err != nil:
			return nil, err
		case !identified && g.txStore != nil:
			// Fail open in the transactional mode: no record, but the
			// handler still gets its transaction (and outbox), as it
			// does for every identified message.
			return g.inTransaction(d, h)
		case !identified && g.pgxStore != nil:
			return g.inPgxTransaction(d, h)
		case !identified && g.cfg.retriesSet:
			// No key to count under: the budget holds within this delivery.
			d.started = time.Now()
			return g.runBudget(d, h, stores.Failure{})
		case !identified:
			return h(msg)
		case awaitingAck(msg, d.key):
			// This very message already ran and succeeded; its record
			// waits for the router's ack (Watermill's Duplicator calls
			// the handler twice with one message).
			return nil, g.skip(d, stores.Record{})
		}
		return g.decide(g, d, h)
	})
}

// identify is step 1: the message's identity, scoped key and fingerprint.
// A message without an identity is not identified (it runs without
// deduplication), or rejected under WithRequireIdentity; one that cannot be
// trusted is rejected with a permanent error. Both are observed here.
func (g *Guard) identify(msg *message.Message) (d delivery, identified bool, err error) {
	ctx := msg.Context()
	handler := message.HandlerNameFromCtx(ctx)
	id, also, none, err := g.cfg.keys.identity(msg, g.caps.Fingerprint != nil)
	switch {
	case err != nil:
		return d, false, g.observe(ctx, msg, Event{Outcome: OutcomeReject, Handler: handler, MessageID: id.ID, Err: err})
	case none != "":
		if g.cfg.requireIdentity {
			err := fmt.Errorf("idempotency: message %s: %w: %s", msg.UUID, ErrNoIdentity, none)
			return d, false, g.observe(ctx, msg, Event{Outcome: OutcomeReject, Handler: handler, Err: err})
		}
		g.observe(ctx, msg, Event{Outcome: OutcomeFailOpen, Handler: handler, Err: errors.New(none)})
		return delivery{msg: msg, ctx: ctx, unrecorded: true, ev: Event{Handler: handler}}, false, nil
	}
	if err := ValidateID(id.ID); err != nil {
		err = fmt.Errorf("idempotency: %w", err)
		return d, false, g.observe(ctx, msg, Event{Outcome: OutcomeReject, Handler: handler, Err: err})
	}
	scope := handler
	if g.cfg.fixedScope {
		scope = g.cfg.scope
	}
	d = delivery{msg: msg, ctx: ctx, key: Key(scope, id.ID), fp: id.Fingerprint, fpAlso: also,
		ev: Event{Handler: handler, MessageID: id.ID}}
	if err := g.checkHorizon(msg, id); err != nil {
		return d, false, g.observe(ctx, msg, Event{Outcome: OutcomeReject, Handler: handler, MessageID: id.ID, Err: err})
	}
	return d, true, nil
}

// delivery is one identified message on its way through the decision.
type delivery struct {
	msg *message.Message
	ctx context.Context // the message context, with the claim token in the claim mode
	key string
	fp  uint64 // content fingerprint, when the store keeps them
	// fpAlso: other fingerprints a record of this content may keep (one
	// kept before WithSensitiveFields, or under a previous key).
	fpAlso []uint64
	ev     Event
	// unrecorded: a message without identity (fail open), run in the
	// transactional mode's transaction without a record.
	unrecorded bool

	held  uint64           // the claim's id among the claims held (claimsHeld); 0: none
	lease *keepalive.Lease // keeps the claim alive while the delivery holds it; nil: no claim

	started time.Time // when the delivery reached the decision, for its limit (WithDeliveryLimit)
	run     *txRun    // the transactional mode's account of an attempt, under WithRetries; nil otherwise
}

func (d delivery) event(o Outcome, err error) Event {
	e := d.ev
	e.Outcome, e.Err = o, err
	return e
}

// claimed is the claim mode, the default: take the claim, run, remember.
// Two concurrent deliveries of one message never both run.
func (g *Guard) claimed(d delivery, h message.HandlerFunc) ([]*message.Message, error) {
	d.ctx = stores.WithClaimToken(d.ctx, g.nextToken())
	d.started = time.Now()
	g.letGoOfEarlierRun(d.msg)

	// 2. Take the claim, or find out why not: remembered (skip), ended
	// (skip: it was dead-lettered for good), or in flight in another
	// delivery (wait a little for it, then park).
	claimed, taken, found, err := g.claim(d)
	if err != nil || !claimed {
		return nil, err
	}
	d.held = g.obs.metrics.claims.take()
	d.lease = g.keep(d, taken)

	// 3. Run, and again after a failure while the message's budget
	// allows (WithRetries). A failure settles the claim: released, or
	// held until the router acked the dead letter, whose end is then
	// remembered.
	produced, err := g.runBudget(d, h, found.Failure)
	if err != nil {
		return nil, err
	}

	// A delivery that lost its claim while the handler ran does not own
	// the run any more: another delivery may be running the message. It
	// takes the claim back if nobody took it meanwhile; otherwise its
	// produced messages are not handed to the router (the other delivery
	// publishes its own) and it is not acked as if it owned the run.
	if d, err = g.stillHolding(d); err != nil {
		return nil, err
	}

	// 4. Remember: now, or once the router acked the delivery, that is once
	// the messages the handler produced were published.
	if len(produced) == 0 {
		g.remember(d)
		return nil, nil
	}
	g.awaitAck(d)
	return produced, nil
}

// keep starts keeping d's claim, taken at taken, alive: renewed every
// third of the lease for as long as the delivery holds it, while the
// handler runs and while its produced messages await the ack. The handler
// runs with the lease's context, which ends if the claim is lost.
//
// A store whose claims die with this process (Capabilities().Local) has
// nothing kept alive: its claim was taken for as long as the delivery
// holds it (claimLease), and keep returns nil.
func (g *Guard) keep(d delivery, taken time.Time) *keepalive.Lease {
	if g.caps.Local {
		return nil
	}
	key, store, handler := d.key, g.store, d.ev.Handler
	return g.keeper.KeepFrom(d.ctx, taken, g.cfg.lease, func(ctx context.Context, lease time.Duration) (bool, error) {
		start := g.obs.startStore(ctx)
		held, err := store.Extend(ctx, key, lease)
		if err != nil {
			if m := g.obs.metrics; m.renewalFailures.Enabled(ctx) {
				m.renewalFailures.Add(ctx, 1, m.handlerOption(handler))
			}
			return held, err
		}
		g.obs.endStore(ctx, start, handler, "extend")
		return held, nil
	})
}

// stillHolding checks, after a successful run, that d still holds its
// claim. A claim lost while nobody took it over (renewals that did not get
// through in time) is taken back, with a fresh lease; one another delivery
// holds fails d with an error matching ErrClaimLost (transient: nacked,
// never acked nor dead-lettered), and d's produced messages are dropped.
//
// On a store local to this process nothing renews the claim, so nothing
// found out while the handler ran; the store is asked here instead (an
// in-memory lookup): a claim released or taken over by hand meanwhile is
// found now.
func (g *Guard) stillHolding(d delivery) (delivery, error) {
	lost := d.lost()
	if d.lease == nil && g.caps.Local {
		held, err := g.store.Extend(d.ctx, d.key, g.claimLease())
		if err == nil && !held {
			lost = fmt.Errorf("%w: the store holds it for another holder, or no longer at all", ErrClaimLost)
		}
	}
	if lost == nil {
		return d, nil
	}
	d.stopLease()
	sent := time.Now()
	ctx, cancel := g.storeContext(context.WithoutCancel(d.ctx))
	start := g.obs.startStore(ctx)
	again, _, err := g.store.Claim(ctx, d.key, g.claimLease())
	g.obs.endStore(ctx, start, d.ev.Handler, "claim")
	cancel()
	if err == nil && again {
		d.lease = g.keep(d, sent)
		return d, nil
	}
	g.letGo(d)
	what := errors.New("another delivery holds it now: its produced messages are not published and it is not acked")
	if err != nil {
		what = fmt.Errorf("it could not be taken back (%w): its produced messages are not published and it is not acked", err)
	}
	return d, g.claimLost(d, lost, what)
}

// seenSet is the post-success seen-set (WithoutClaim): look the record up,
// run, remember. Two concurrent deliveries of one message may both run.
func (g *Guard) seenSet(d delivery, h message.HandlerFunc) ([]*message.Message, error) {
	d.started = time.Now()

	// 2. Remembered already, or ended?
	var found stores.Record
	for reopens := 0; ; {
		ctx, cancel := g.storeContext(d.ctx)
		start := g.obs.startStore(ctx)
		var err error
		found, err = g.store.Lookup(ctx, d.key)
		g.obs.endStore(ctx, start, d.ev.Handler, "lookup")
		cancel()
		if err != nil {
			return nil, g.storeError(d, "check", err)
		}
		if found.Remembered() {
			return nil, g.skip(d, found)
		}
		if !found.Ended() {
			break
		}
		if again, err := g.atEnd(d, found, &reopens); err != nil || !again {
			return nil, err
		}
	}

	// 3. Run, and again while the message's budget allows.
	produced, err := g.runBudget(d, h, found.Failure)
	if err != nil {
		return nil, err
	}

	// 4. Remember, now or after the ack.
	if len(produced) == 0 {
		g.remember(d)
		return nil, nil
	}
	g.awaitAck(d)
	return produced, nil
}

// claim takes the claim, and reports when the call that took it was sent
// (its lease runs from then at the latest). A remembered message is skipped
// (false, nil) or a conflict; one in flight elsewhere is waited for,
// re-checking with a growing pause, for up to WithParkWait: the other
// delivery usually ends meanwhile, and this one is then skipped or runs.
// Only after that wait is it parked (ErrInFlight), so a broker that hands a
// nacked message straight back is not asked again and again. A claim that
// failed (a store error, its deadline passed) may still have been taken,
// its reply lost: it is released, so that the redelivery does not wait for
// its lease to pass.
func (g *Guard) claim(d delivery) (bool, time.Time, stores.Record, error) {
	wait := parkwait.Until(g.within(d, time.Now().Add(g.cfg.parkWait)))
	reopens := 0
	for {
		sent := time.Now()
		ctx, cancel := g.storeContext(d.ctx)
		start := g.obs.startStore(ctx)
		claimed, found, err := g.store.Claim(ctx, d.key, g.claimLease())
		g.obs.endStore(ctx, start, d.ev.Handler, "claim")
		cancel()
		switch {
		case err != nil:
			err = g.storeError(d, "claim", err)
			g.releaseGivenUp(d)
			return false, sent, found, err
		case claimed:
			return true, sent, found, nil
		case found.Remembered():
			return false, sent, found, g.skip(d, found)
		case found.Ended():
			again, err := g.atEnd(d, found, &reopens)
			if err != nil || !again {
				return false, sent, found, err
			}
		case !wait.Pause(d.ctx):
			err := fmt.Errorf("idempotency: message %q: %w", d.ev.MessageID, ErrInFlight)
			return false, sent, found, g.observe(d.ctx, d.msg, d.event(OutcomePark, err))
		}
	}
}

// releaseGivenUp releases, best effort, the claim a failed Claim may have
// taken for d (only d's: the release names d's holder), bounded by the
// store timeout, or by the lease when there is none.
func (g *Guard) releaseGivenUp(d delivery) {
	timeout := g.cfg.storeTimeout
	if timeout <= 0 {
		timeout = g.cfg.lease
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(d.ctx), timeout)
	defer cancel()
	start := g.obs.startStore(ctx)
	err := g.store.Release(ctx, d.key)
	g.obs.endStore(ctx, start, d.ev.Handler, "release")
	if err != nil {
		g.cfg.logger.Debug("Could not release the claim of a delivery that gave up on it; it lapses with its lease",
			g.fields(d.ev).Add(watermill.LogFields{"error": err.Error()}))
	}
}

// skip reports a delivery of a remembered message: a duplicate (nil: the
// router acks it), or a conflict when its content differs from the
// remembered message's.
func (g *Guard) skip(d delivery, found stores.Record) error {
	if err := g.conflict(d, found.Fingerprint); err != nil {
		return g.refuse(d, conflictKey(d), err)
	}
	g.observe(d.ctx, d.msg, d.event(OutcomeSkip, nil))
	return nil
}

// conflict returns the rejection of a delivery whose message was remembered
// with fingerprint kept and now arrives with different content.
func (g *Guard) conflict(d delivery, kept uint64) error {
	mine := g.caps.KeptFingerprint(d.fp)
	if kept == 0 || mine == 0 || kept == mine {
		return nil
	}
	for _, fp := range d.fpAlso {
		if g.caps.KeptFingerprint(fp) == kept {
			return nil
		}
	}
	err := fmt.Errorf("idempotency: message %q: %w: its content (fingerprint %016x, kept as %d) differs from the remembered message's (kept as %d)",
		d.ev.MessageID, ErrConflict, d.fp, mine, kept)
	return g.observe(d.ctx, d.msg, d.event(OutcomeConflict, err))
}

// remember records the message after a successful handler run, retrying a
// few times. The handler already ran, so a failure is logged and counted,
// not returned: the delivery is acked (the documented narrow window).
// Shutdown must not stop the record of an effect that happened: every
// attempt, the first included, runs on a context detached from the
// message's cancellation, bounded by the store timeout.
func (g *Guard) remember(d delivery) {
	defer g.letGo(d)
	lost := d.stopLease()
	ctx := d.ctx
	if ctx.Done() != nil { // a context that is never cancelled needs no detaching
		ctx = context.WithoutCancel(ctx)
	}
	backoff := g.cfg.rememberBackoff
	for attempt := 1; ; attempt++ {
		sctx, cancel := g.storeContext(ctx)
		start := g.obs.startStore(sctx)
		err := g.store.Remember(sctx, d.key, d.fp, nil)
		g.obs.endStore(sctx, start, d.ev.Handler, "remember")
		cancel()
		if errors.Is(err, stores.ErrClaimTaken) {
			// Another delivery took the claim this one lost, and runs the
			// message: its outcome is not this delivery's to write.
			g.claimLost(d, lost, fmt.Errorf("the record was not written over the other holder's claim: %w", err))
			return
		}
		if err == nil {
			if lost != nil {
				// Its renewals did not get through in time, but nobody took
				// the claim: the record is written, and nothing ran twice.
				// Not a lost claim (no page), a note.
				g.cfg.logger.Info("Claim lapsed before the record was written, but no other delivery took it: the record is written",
					g.fields(d.ev).Add(watermill.LogFields{"lapse": lost.Error()}))
			}
			return
		}
		if attempt >= g.cfg.rememberAttempts {
			err = fmt.Errorf("idempotency: remember message %q after %d attempts: %w", d.ev.MessageID, attempt, err)
			g.observe(d.ctx, d.msg, d.event(OutcomeRememberFailed, err))
			return
		}
		time.Sleep(backoff)
		backoff = min(backoff, math.MaxInt64/2) * 2 // saturates instead of wrapping
	}
}

// release drops the claim of a delivery whose handler failed, so that a
// redelivery can run at once. A failure only delays the redelivery until
// the lease passes. The seen-set holds no claim.
func (g *Guard) release(d delivery) {
	if g.cfg.noClaim {
		return
	}
	defer g.letGo(d)
	if lost := d.stopLease(); lost != nil {
		g.claimLost(d, lost, errors.New("the handler's error released nothing another delivery holds"))
	}
	ctx, cancel := g.storeContext(context.WithoutCancel(d.ctx))
	defer cancel()
	start := g.obs.startStore(ctx)
	err := g.store.Release(ctx, d.key)
	g.obs.endStore(ctx, start, d.ev.Handler, "release")
	if err != nil {
		g.cfg.logger.Error("Could not release idempotency claim; a redelivery waits for the lease to pass", err, g.fields(d.ev))
	}
}

// awaitingAckKey marks, in a message's context, the key of a delivery whose
// handler succeeded and returned messages: its record waits for the
// router's ack.
type awaitingAckKey struct{}

// awaitAck remembers the message once the router acked the delivery
// (rememberAfterAck), and marks the message meanwhile, so that a second
// run of the very same message (Watermill's Duplicator calls the handler
// twice) is skipped as the duplicate it is, instead of finding the claim
// of the first in flight and being parked, which would make the router
// nack the delivery and the first's claim be released: the message would
// come back, and run, for ever.
func (g *Guard) awaitAck(d delivery) {
	d.msg.SetContext(context.WithValue(d.msg.Context(), awaitingAckKey{}, d.key))
	go g.rememberAfterAck(d)
}

// awaitingAck reports whether msg ran under key and waits for its ack.
func awaitingAck(msg *message.Message, key string) bool {
	k, ok := msg.Context().Value(awaitingAckKey{}).(string)
	return ok && k == key
}

// rememberAfterAck remembers the message once the router has acked the
// delivery, that is once the messages the handler produced were published.
// If the router nacks instead, the claim is released. It returns at the
// ack, the nack, or WithAckTimeout, whichever comes first.
func (g *Guard) rememberAfterAck(d delivery) {
	timer := time.NewTimer(g.cfg.ackTimeout)
	defer timer.Stop()
	// Subscribers may cancel the message context once it is acked
	// (watermill-redisstream does); the record must still be written.
	d.ctx = context.WithoutCancel(d.ctx)
	select {
	case <-d.msg.Acked():
		g.remember(d)
	case <-d.msg.Nacked():
		g.release(d)
	case <-timer.C:
		if lost := d.stopLease(); lost != nil {
			g.claimLost(d, lost, errors.New("while the delivery awaited its ack"))
		}
		g.letGo(d)
		g.cfg.logger.Info("Delivery was neither acked nor nacked in time; message not remembered", g.fields(d.ev).Add(
			watermill.LogFields{"ack_timeout": g.cfg.ackTimeout.String()}))
	}
}

// claimLease is the lease of the claims g takes: the configured one, or,
// on a store whose claims die with this process (Capabilities().Local),
// the longest there is, since nothing needs to notice a dead holder there
// and nothing renews the claim.
func (g *Guard) claimLease() time.Duration {
	if g.caps.Local {
		return time.Duration(math.MaxInt64)
	}
	return g.cfg.lease
}

// lost returns the cause of the loss of d's claim, or nil while it is held
// (or kept by nothing: no claim, or one on a store local to this process,
// which nobody else can take).
func (d delivery) lost() error {
	if d.lease == nil {
		return nil
	}
	return d.lease.Lost()
}

// stopLease stops keeping d's claim alive (it is remembered, released or
// given up on next) and returns the cause of its loss if it was lost
// before.
func (d delivery) stopLease() error {
	if d.lease == nil {
		return nil
	}
	return d.lease.Stop()
}

// claimLost reports a delivery that lost its claim while it held it: the
// lease's cause (nil when the store's refusal to remember told it first)
// and what became of the record.
func (g *Guard) claimLost(d delivery, lost, what error) error {
	err := fmt.Errorf("idempotency: message %q: %w: %w", d.ev.MessageID, ErrClaimLost, what)
	if lost != nil {
		err = fmt.Errorf("idempotency: message %q: %w (%w): %w", d.ev.MessageID, ErrClaimLost, lost, what)
	}
	return g.observe(d.ctx, d.msg, d.event(OutcomeClaimLost, err))
}

// letGo notes that the delivery no longer holds its claim (remembered,
// released, or given up on).
func (g *Guard) letGo(d delivery) {
	if d.held != 0 {
		g.obs.metrics.claims.drop(d.held)
	}
}

func (g *Guard) storeError(d delivery, op string, err error) error {
	err = fmt.Errorf("idempotency: %s message %q: %w: %w", op, d.ev.MessageID, ErrStore, err)
	return g.observe(d.ctx, d.msg, d.event(OutcomeStoreError, err))
}

func (g *Guard) storeContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if g.cfg.storeTimeout <= 0 {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, g.cfg.storeTimeout)
}

// nextToken returns the claim holder's token of a new delivery: the
// Guard's random prefix and a counter, in one allocation.
func (g *Guard) nextToken() string {
	var buf [32]byte
	b := append(buf[:0], g.tokenPrefix...)
	return string(strconv.AppendUint(b, g.tokens.Add(1), 36))
}
