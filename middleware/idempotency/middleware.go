package idempotency

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// Guard is the idempotency middleware for one store and configuration. Its
// Middleware method is a message.HandlerMiddleware; one Guard may wrap any
// number of handlers. It holds no goroutine of its own.
type Guard struct {
	cfg     config
	store   stores.Store
	claimer stores.Claimer         // set under WithClaim
	reports stores.ClaimReporter   // set under WithClaim when the store tells why a claim failed
	txStore stores.TxRememberer    // set under WithTransaction
	fp      stores.Fingerprinter   // set when the store keeps fingerprints
	txFP    stores.TxFingerprinter // set under WithTransaction when it does
	metrics *metrics

	tokenPrefix string
	tokens      atomic.Uint64
}

// Middleware returns the idempotency middleware for store. It panics when
// the options are invalid (WithClaim on a store that is not a
// stores.Claimer, a negative duration); use New to get an error instead.
func Middleware(store stores.Store, opts ...Option) message.HandlerMiddleware {
	g, err := New(store, opts...)
	if err != nil {
		panic(err)
	}
	return g.Middleware
}

// New returns a Guard for store, or an error when the options are invalid.
func New(store stores.Store, opts ...Option) (*Guard, error) {
	if store == nil {
		return nil, fmt.Errorf("idempotency: nil store")
	}
	g := &Guard{cfg: defaultConfig(), store: store}
	for _, opt := range opts {
		opt(&g.cfg)
	}
	c := &g.cfg
	switch {
	case c.lease < 0, c.storeTimeout < 0, c.rememberBackoff < 0, c.ackTimeout < 0, c.txRetries < 0, c.horizon < 0, c.skew < 0:
		return nil, fmt.Errorf("idempotency: negative duration in options")
	case c.rememberAttempts < 1:
		return nil, fmt.Errorf("idempotency: WithRememberRetry needs at least 1 attempt, got %d", c.rememberAttempts)
	case c.ackTimeout == 0:
		c.ackTimeout = time.Minute
	}
	if err := c.keys.check(); err != nil {
		return nil, err
	}
	if c.logger == nil {
		c.logger = watermill.NopLogger{}
	}
	var err error
	if g.metrics, err = newMetrics(c.meterProvider); err != nil {
		return nil, err
	}
	if !c.horizonSet {
		if e, ok := store.(stores.Expiring); ok {
			c.horizon = max(e.TTL(), 0)
		}
	}
	if c.horizon > 0 && c.skew >= c.horizon {
		return nil, fmt.Errorf("idempotency: the clock skew (%v) is not shorter than the replay horizon (%v): every message would be too old; lower it with WithClockSkew or turn the horizon off with WithReplayHorizon(0)", c.skew, c.horizon)
	}
	g.fp, _ = store.(stores.Fingerprinter)
	if c.txDB != nil {
		g.txFP, _ = store.(stores.TxFingerprinter)
		txStore, ok := store.(stores.TxRememberer)
		if !ok {
			return nil, fmt.Errorf("idempotency: WithTransaction: %T: %w", store, ErrNotTxRememberer)
		}
		if c.lease > 0 {
			return nil, fmt.Errorf("idempotency: WithTransaction and WithClaim cannot be combined: the record's row lock keeps concurrent duplicates apart")
		}
		g.txStore = txStore
	} else if c.subscriberTx != nil || c.outbox != nil {
		return nil, fmt.Errorf("idempotency: WithSubscriberTx and WithOutbox need WithTransaction")
	}
	if c.lease > 0 {
		claimer, ok := store.(stores.Claimer)
		if !ok {
			return nil, fmt.Errorf("idempotency: WithClaim: %T: %w", store, ErrNotClaimer)
		}
		g.claimer = claimer
		g.reports, _ = store.(stores.ClaimReporter)
		var b [6]byte
		_, _ = rand.Read(b[:])
		g.tokenPrefix = hex.EncodeToString(b[:]) + "-"
	}
	return g, nil
}

// Middleware wraps h with the idempotency decision (see the package
// documentation):
//
//  1. Read meta.id (without decoding the body). Not a JSON object, or no
//     meta.id: run h without deduplication (fail open). An unsupported
//     schema_version or an unusable meta.id: reject with a permanent error.
//  2. Already remembered: skip. h does not run; nil, nil is returned so the
//     router acks and the broker stops redelivering.
//  3. Run h. On error the message stays unmarked and the error propagates.
//     On success it is remembered, or, when h returned messages for the
//     router to publish, remembered once the router acked the delivery.
//
// A store that cannot be read makes the delivery fail with ErrStore, to be
// retried; h does not run.
func (g *Guard) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		return g.handle(msg, h)
	}
}

func (g *Guard) handle(msg *message.Message, h message.HandlerFunc) ([]*message.Message, error) {
	markReplay(msg)
	ctx := msg.Context()
	handler := message.HandlerNameFromCtx(ctx)

	// 1. Identity (and, when the store keeps them, the content fingerprint,
	// in the same pass).
	var id envelope.Identity
	var err error
	if g.cfg.keys.source.key != nil {
		id, err = g.cfg.keys.identity(msg, g.fp != nil)
	} else if g.fp != nil {
		id, err = envelope.ReadIdentityFingerprint(msg.Payload)
	} else {
		id, err = envelope.ReadIdentity(msg.Payload)
	}
	if err != nil {
		g.observe(ctx, msg, Event{Outcome: OutcomeFailOpen, Handler: handler, Err: err})
		return h(msg)
	}
	if id.HasSchemaVersion && id.SchemaVersion != envelope.SchemaVersion {
		err := fmt.Errorf("idempotency: %w: meta.schema_version %d, this consumer reads %d",
			ErrUnsupportedSchemaVersion, id.SchemaVersion, envelope.SchemaVersion)
		return nil, g.observe(ctx, msg, Event{Outcome: OutcomeReject, Handler: handler, MessageID: id.ID, Err: err})
	}
	if strings.TrimSpace(id.ID) == "" {
		g.observe(ctx, msg, Event{Outcome: OutcomeFailOpen, Handler: handler, Err: errNoID})
		return h(msg)
	}
	if err := ValidateID(id.ID); err != nil {
		err = fmt.Errorf("idempotency: %w", err)
		return nil, g.observe(ctx, msg, Event{Outcome: OutcomeReject, Handler: handler, Err: err})
	}
	if err := g.checkHorizon(msg, id); err != nil {
		return nil, g.observe(ctx, msg, Event{Outcome: OutcomeReject, Handler: handler, MessageID: id.ID, Err: err})
	}
	scope := handler
	if g.cfg.fixedScope {
		scope = g.cfg.scope
	}
	d := delivery{msg: msg, key: Key(scope, id.ID), fp: id.Fingerprint, ev: Event{Handler: handler, MessageID: id.ID}}

	// 2. Already remembered? Under WithTransaction the record's insert in the
	// handler's transaction decides; under WithClaim, take the claim or find
	// out why not.
	if g.txStore != nil {
		d.ctx = ctx
		return g.handleInTx(d, h)
	}
	if g.claimer != nil {
		d.ctx = stores.WithClaimToken(ctx, g.nextToken())
		claimed, err := g.claim(d)
		if err != nil || !claimed {
			return nil, err
		}
	} else {
		d.ctx = ctx
		seen, err := g.seen(d)
		if err != nil || seen {
			return nil, err
		}
	}

	// 3. Run, then remember.
	var start time.Time
	if g.claimer != nil {
		start = time.Now()
	}
	produced, err := g.run(d, h)
	if g.claimer != nil {
		if took := time.Since(start); took > g.cfg.lease {
			g.cfg.logger.Error("Handler outlived its idempotency claim lease; another delivery may have run it too",
				fmt.Errorf("handler took %v, lease is %v", took, g.cfg.lease), g.fields(d.ev))
		}
	}
	g.observe(ctx, msg, d.event(OutcomeRun, err))
	if err != nil {
		g.release(d)
		return produced, err
	}
	if len(produced) == 0 {
		g.remember(d)
		return nil, nil
	}
	go g.commitAfterAck(d)
	return produced, nil
}

var errNoID = fmt.Errorf("no meta.id")

// delivery is one message on its way through the decision.
type delivery struct {
	msg *message.Message
	ctx context.Context // the message context, with the claim token under WithClaim
	key string
	fp  uint64 // content fingerprint, when the store keeps them
	ev  Event
}

func (d delivery) event(o Outcome, err error) Event {
	e := d.ev
	e.Outcome, e.Err = o, err
	return e
}

// seen asks the store whether the message was remembered; it returns the
// error to fail the delivery with. A message remembered with different
// content is a conflict.
func (g *Guard) seen(d delivery) (bool, error) {
	ctx, cancel := g.storeContext(d.ctx)
	start := g.metrics.startStore(ctx)
	var seen bool
	var kept uint64
	var err error
	if g.fp != nil {
		seen, kept, err = g.fp.SeenFingerprint(ctx, d.key)
	} else {
		seen, err = g.store.Seen(ctx, d.key)
	}
	g.metrics.endStore(ctx, start, d.ev.Handler, "seen")
	cancel()
	if err != nil {
		return false, g.storeError(d, "check", err)
	}
	if !seen {
		return false, nil
	}
	if err := g.conflict(d, kept); err != nil {
		return false, err
	}
	g.observe(d.ctx, d.msg, d.event(OutcomeSkip, nil))
	return true, nil
}

// conflict returns the rejection of a delivery whose message was remembered
// with fingerprint kept and now arrives with different content.
func (g *Guard) conflict(d delivery, kept uint64) error {
	if kept == 0 || d.fp == 0 || kept == g.fp.KeptFingerprint(d.fp) {
		return nil
	}
	err := fmt.Errorf("idempotency: message %q: %w: its content (fingerprint %016x, kept as %d) differs from the remembered message's (kept as %d)",
		d.ev.MessageID, ErrConflict, d.fp, g.fp.KeptFingerprint(d.fp), kept)
	return g.observe(d.ctx, d.msg, d.event(OutcomeConflict, err))
}

// claim takes the claim, or tells a remembered message (skip, nil error)
// from one in flight elsewhere (park, ErrInFlight).
func (g *Guard) claim(d delivery) (bool, error) {
	ctx, cancel := g.storeContext(d.ctx)
	start := g.metrics.startStore(ctx)
	var claimed, seen bool
	var kept uint64
	var err error
	if g.reports != nil {
		claimed, seen, kept, err = g.reports.ClaimOrSeen(ctx, d.key, g.cfg.lease)
	} else {
		claimed, err = g.claimer.Claim(ctx, d.key, g.cfg.lease)
	}
	g.metrics.endStore(ctx, start, d.ev.Handler, "claim")
	cancel()
	if err != nil {
		return false, g.storeError(d, "claim", err)
	}
	if claimed {
		return true, nil
	}
	if g.reports != nil {
		if seen {
			if g.fp == nil {
				kept = 0
			}
			if err := g.conflict(d, kept); err != nil {
				return false, err
			}
			g.observe(d.ctx, d.msg, d.event(OutcomeSkip, nil))
			return false, nil
		}
	} else if seen, err := g.seen(d); err != nil || seen {
		return false, err
	}
	err = fmt.Errorf("idempotency: message %q: %w", d.ev.MessageID, ErrInFlight)
	return false, g.observe(d.ctx, d.msg, d.event(OutcomePark, err))
}

// run calls h; under WithClaim a panic releases the claim before it goes on.
func (g *Guard) run(d delivery, h message.HandlerFunc) ([]*message.Message, error) {
	if g.claimer != nil {
		defer func() {
			if r := recover(); r != nil {
				g.release(d)
				panic(r)
			}
		}()
	}
	return h(d.msg)
}

// remember records the message after a successful handler run, retrying a
// few times. The handler already ran, so a failure is logged and counted,
// not returned: the delivery is acked (the documented narrow window).
// Shutdown must not stop the record of an effect that happened: every
// attempt, the first included, runs on a context detached from the
// message's cancellation, bounded by the store timeout.
func (g *Guard) remember(d delivery) {
	ctx := d.ctx
	if ctx.Done() != nil { // a context that is never cancelled needs no detaching
		ctx = context.WithoutCancel(ctx)
	}
	backoff := g.cfg.rememberBackoff
	for attempt := 1; ; attempt++ {
		sctx, cancel := g.storeContext(ctx)
		start := g.metrics.startStore(sctx)
		var err error
		if g.fp != nil && d.fp != 0 {
			err = g.fp.RememberFingerprint(sctx, d.key, d.fp)
		} else {
			err = g.store.Remember(sctx, d.key)
		}
		g.metrics.endStore(sctx, start, d.ev.Handler, "remember")
		cancel()
		if err == nil {
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
// the lease passes.
func (g *Guard) release(d delivery) {
	if g.claimer == nil {
		return
	}
	ctx, cancel := g.storeContext(context.WithoutCancel(d.ctx))
	defer cancel()
	start := g.metrics.startStore(ctx)
	err := g.claimer.Release(ctx, d.key)
	g.metrics.endStore(ctx, start, d.ev.Handler, "release")
	if err != nil {
		g.cfg.logger.Error("Could not release idempotency claim; a redelivery waits for the lease to pass", err, g.fields(d.ev))
	}
}

// commitAfterAck remembers the message once the router has acked the
// delivery, that is once the messages the handler produced were published.
// If the router nacks instead, the claim (if any) is released. It returns
// at the ack, the nack, or WithAckTimeout, whichever comes first.
func (g *Guard) commitAfterAck(d delivery) {
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
		g.cfg.logger.Info("Delivery was neither acked nor nacked in time; message not remembered", g.fields(d.ev).Add(
			watermill.LogFields{"ack_timeout": g.cfg.ackTimeout.String()}))
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

func (g *Guard) nextToken() string {
	return g.tokenPrefix + strconv.FormatUint(g.tokens.Add(1), 36)
}
