// Package idempotencytest runs a Watermill handler behind the production
// wiring of the idempotency kit, in process, and reports what became of
// each message: for the tests of a handler.
//
// The wiring is the quick start's: the dead-letter middleware outermost,
// bounded retries, the attempt counter, Recoverer, and the idempotency
// middleware innermost, on Watermill's GoChannel pub/sub and the in-memory
// store (memstore). A test delivers a message and gets its Result: the
// handler ran, the delivery was skipped as a duplicate, the message was
// dead-lettered after its retries or rejected for good without running
// the handler; with how many runs and deliveries it took, and how often it
// was parked behind another delivery of the same message.
//
//	h := idempotencytest.New(t, chargeHandler)
//	payment := idempotencytest.MustEnvelope("urn:babel:payments:requested", data, envelope.WithID("payment-1042"))
//	first, second := h.Deliver(payment), h.Deliver(payment) // the broker delivers it twice
//	// first.Outcome == idempotencytest.Ran, second.Outcome == idempotencytest.Skipped
//
// Deliver waits for the message's outcome, not for a while: it returns as
// soon as the router acked the message (run, skipped, dead-lettered or
// rejected), or when the harness's timeout ran out (WithTimeout, 10 seconds
// by default), then with the outcome Unfinished (or Parked) and the test
// failed. DeliverAll delivers messages all at once, as a broker may, so that
// copies of one message meet in the middleware: one runs, the others wait
// for it (past the park wait they are parked, and the pub/sub delivers
// them again) and are skipped once it is done. The handler then runs
// concurrently, as behind a real broker: it must be safe for that.
//
// New closes everything when the test ends (the router, the pub/sub); a
// harness started with Start, outside a test, is closed with Close.
package idempotencytest

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// Outcome is what became of a delivered message.
type Outcome string

const (
	// Ran: the handler ran and succeeded (with its retries), and the
	// message was acked. A message without identity that the middleware let
	// through (fail open) and that the handler handled counts as Ran too.
	Ran Outcome = "ran"
	// Skipped: the middleware recognised a message already handled and
	// acked it without running the handler.
	Skipped Outcome = "skipped"
	// DeadLettered: the handler failed for good (every retry failed, or
	// the error was permanent) and the message went to the dead-letter
	// topic, then was acked.
	DeadLettered Outcome = "dead_lettered"
	// Rejected: the middleware refused the message for good without running
	// the handler (an unknown schema_version, a meta.id unusable as a key,
	// older than the replay horizon), and it went to the dead-letter topic.
	Rejected Outcome = "rejected"
	// Parked: the wait ended while the message was parked, that is waiting
	// for another delivery of the same message, which holds its claim.
	Parked Outcome = "parked"
	// Unfinished: the wait ended before the message had an outcome (the
	// handler was still running, or its deliveries kept failing with
	// errors the wiring retries without end, such as a store outage).
	Unfinished Outcome = "unfinished"
)

// Result reports what became of one delivered message.
type Result struct {
	// Outcome is where the message ended: Ran, Skipped, DeadLettered,
	// Rejected, or Parked or Unfinished when the wait ended first.
	Outcome Outcome
	// ID is the message's meta.id (or the key of WithKeySource), as the
	// middleware read it; empty for a message without identity.
	ID string
	// Deliveries counts the times the router received the message: more
	// than one when a delivery failed with an error the broker redelivers
	// on (a parked copy, a store outage).
	Deliveries int
	// Runs counts the handler's runs, across retries and deliveries.
	Runs int
	// Parked counts the times the middleware parked the message because
	// another delivery of it held its claim for longer than the park wait
	// (idempotency.WithParkWait); a copy that waited less and was then
	// skipped was not parked.
	Parked int
	// Err is the last error: the handler's (DeadLettered: the error its
	// last run returned, or the dead letter's error text after a panic),
	// the rejection (Rejected), that of the last failed delivery, or why
	// the wait ended (Parked, Unfinished). nil when the message ran or was skipped at the
	// first attempt.
	Err error
	// DeadLetter is the message published to the dead-letter topic
	// (DeadLettered, Rejected): its metadata holds the reason
	// (deadletter.MetadataReason) and the error (deadletter.MetadataError).
	DeadLetter *message.Message
}

// String describes the result in one line, for test failures.
func (r Result) String() string {
	s := fmt.Sprintf("%s (id %q, %s, %s", r.Outcome, r.ID, count(r.Runs, "run"), count(r.Deliveries, "delivery"))
	if r.Parked > 0 {
		s += ", parked " + count(r.Parked, "time")
	}
	if r.Err != nil {
		s += ", error: " + r.Err.Error()
	}
	return s + ")"
}

func count(n int, what string) string {
	switch {
	case n == 1:
		return "1 " + what
	case strings.HasSuffix(what, "y"):
		return strconv.Itoa(n) + " " + what[:len(what)-1] + "ies"
	}
	return strconv.Itoa(n) + " " + what + "s"
}

// Defaults of the harness.
const (
	// Topic is the topic the handler consumes; its dead letters go to
	// Topic + ".dlq".
	Topic = "messages"
	// HandlerName is the Watermill handler name, by default the scope of
	// the message records.
	HandlerName = "handler"
	// DefaultTimeout bounds each wait of Deliver and DeliverAll.
	DefaultTimeout = 10 * time.Second
	// MetadataDelivery is the metadata key the harness tags each delivered
	// message with, to follow it through retries, redeliveries and the
	// dead-letter topic.
	MetadataDelivery = "bq-idempotencytest-delivery"
)

// Option configures a harness.
type Option func(*config)

type config struct {
	store      stores.Store
	guardOpts  []idempotency.Option
	handler    string
	timeout    time.Duration
	maxRetries int
	interval   time.Duration
}

// WithStore runs the middleware on store instead of a new memstore.
func WithStore(store stores.Store) Option { return func(c *config) { c.store = store } }

// WithMiddlewareOptions passes opts to idempotency.Middleware, e.g.
// idempotency.WithoutClaim() or idempotency.WithKeySource(...).
func WithMiddlewareOptions(opts ...idempotency.Option) Option {
	return func(c *config) { c.guardOpts = append(c.guardOpts, opts...) }
}

// WithHandlerName names the Watermill handler (default HandlerName), and
// so the scope the records are kept under.
func WithHandlerName(name string) Option { return func(c *config) { c.handler = name } }

// WithTimeout bounds each wait of Deliver and DeliverAll (default
// DefaultTimeout).
func WithTimeout(d time.Duration) Option { return func(c *config) { c.timeout = d } }

// WithRetries sets the retries after a failed run (default 3, as in the
// quick start) and the pause before the first (default 10ms, shorter than
// the quick start's 100ms so that tests stay fast).
func WithRetries(maxRetries int, initialInterval time.Duration) Option {
	return func(c *config) { c.maxRetries, c.interval = maxRetries, initialInterval }
}

// Harness is a handler running behind the production wiring. Its methods
// are safe for concurrent use.
type Harness struct {
	cfg     config
	tb      testing.TB // nil when started with Start
	ctx     context.Context
	stop    context.CancelFunc
	pubSub  *gochannel.GoChannel
	router  *message.Router
	runDone chan error

	mu       sync.Mutex
	next     int
	messages map[string]*tracked
	order    []*tracked
	closed   bool
}

// tracked is one delivered message, followed until its outcome.
type tracked struct {
	result     Result
	done       chan struct{} // closed at the outcome
	handlerErr error         // what the handler's last run returned (nil after a panic)
}

// delivery collects what happened during one delivery of a message.
type delivery struct {
	t      *tracked // nil for a message the harness did not deliver
	events []idempotency.Event
}

type deliveryKey struct{}

// New starts a harness running handler for the test t, and closes it when
// the test ends. It fails the test if the harness cannot start. A Deliver
// or DeliverAll whose message has no outcome in time fails the test too,
// saying what it saw.
func New(t testing.TB, handler message.NoPublishHandlerFunc, opts ...Option) *Harness {
	t.Helper()
	h, err := Start(t.Context(), handler, opts...)
	if err != nil {
		t.Fatalf("idempotencytest: %v", err)
	}
	h.tb = t
	t.Cleanup(func() {
		if err := h.Close(); err != nil {
			t.Errorf("idempotencytest: close: %v", err)
		}
	})
	return h
}

// Start starts a harness running handler, outside a test (an example, a
// program): close it with Close. It returns once the router runs. The
// harness stops when ctx is done.
func Start(ctx context.Context, handler message.NoPublishHandlerFunc, opts ...Option) (*Harness, error) {
	if handler == nil {
		return nil, errors.New("nil handler")
	}
	cfg := config{handler: HandlerName, timeout: DefaultTimeout, maxRetries: 3, interval: 10 * time.Millisecond}
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.store == nil {
		cfg.store = memstore.New()
	}
	logger := watermill.NopLogger{}
	h := &Harness{cfg: cfg, messages: map[string]*tracked{}, runDone: make(chan error, 1)}
	h.ctx, h.stop = context.WithCancel(ctx)
	h.pubSub = gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, logger)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		h.stop()
		_ = h.pubSub.Close()
		return nil, err
	}
	h.router = router
	dlq, err := deadletter.Middleware(deadLetters{h})
	if err != nil {
		h.stop()
		_ = h.pubSub.Close()
		return nil, err
	}
	router.AddMiddleware(
		h.follow, // the harness's own, outside the wiring: sees each delivery's end
		// The quick start's production wiring.
		dlq,
		middleware.Retry{
			MaxRetries:      cfg.maxRetries,
			InitialInterval: cfg.interval,
			ShouldRetry:     func(p middleware.RetryParams) bool { return idempotency.Retryable(p.Err) },
		}.Middleware,
		deadletter.CountAttempts,
		middleware.Recoverer,
		idempotency.Middleware(cfg.store, append(cfg.guardOpts, idempotency.WithObserver(idempotency.ObserverFunc(h.observe)))...),
	)
	router.AddConsumerHandler(cfg.handler, Topic, h.pubSub, func(msg *message.Message) error {
		h.ran(msg)
		err := handler(msg)
		h.returned(msg, err)
		return err
	})
	go func() { h.runDone <- router.Run(h.ctx) }()
	select {
	case <-router.Running():
		return h, nil
	case err := <-h.runDone:
		h.stop()
		_ = h.pubSub.Close()
		return nil, fmt.Errorf("router stopped before it ran: %w", err)
	}
}

// Close stops the router (waiting for the handlers running) and the
// pub/sub. It is safe to call more than once.
func (h *Harness) Close() error {
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		return nil
	}
	h.closed = true
	h.mu.Unlock()
	err := h.router.Close()
	h.stop()
	if runErr := <-h.runDone; err == nil {
		err = runErr
	}
	return errors.Join(err, h.pubSub.Close())
}

// Deliver publishes payload (usually an envelope: see MustEnvelope) to the
// handler's topic and returns what became of it, once it did.
func (h *Harness) Deliver(payload []byte) Result {
	if h.tb != nil {
		h.tb.Helper()
	}
	return h.DeliverAll(payload)[0]
}

// DeliverMessage is Deliver for a Watermill message of the caller's, for
// metadata (a key source reading it) or a UUID of its own. The harness
// adds MetadataDelivery to its metadata.
func (h *Harness) DeliverMessage(msg *message.Message) Result {
	if h.tb != nil {
		h.tb.Helper()
	}
	return h.deliver([]*message.Message{msg})[0]
}

// DeliverAll publishes every payload at once, as a broker delivering them
// to concurrent workers would, and returns what became of each, in the
// order given, once all have an outcome.
func (h *Harness) DeliverAll(payloads ...[]byte) []Result {
	if h.tb != nil {
		h.tb.Helper()
	}
	msgs := make([]*message.Message, len(payloads))
	for i, p := range payloads {
		msgs[i] = message.NewMessage(watermill.NewUUID(), p)
	}
	return h.deliver(msgs)
}

// Results returns what became of every message delivered so far, in the
// order they were delivered; a message still on its way shows as
// Unfinished (or Parked).
func (h *Harness) Results() []Result {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]Result, len(h.order))
	for i, m := range h.order {
		out[i] = h.resultLocked(m)
	}
	return out
}

func (h *Harness) deliver(msgs []*message.Message) []Result {
	if h.tb != nil {
		h.tb.Helper()
	}
	ts := make([]*tracked, len(msgs))
	h.mu.Lock()
	for i, msg := range msgs {
		h.next++
		tag := strconv.Itoa(h.next)
		msg.Metadata.Set(MetadataDelivery, tag)
		ts[i] = &tracked{done: make(chan struct{}), result: Result{Outcome: Unfinished}}
		h.messages[tag] = ts[i]
		h.order = append(h.order, ts[i])
	}
	h.mu.Unlock()
	unpublished := make([]bool, len(msgs)) // nothing to wait for
	for i, msg := range msgs {
		if err := h.pubSub.Publish(Topic, msg); err != nil {
			unpublished[i] = true
			h.mu.Lock()
			ts[i].result.Err = fmt.Errorf("publish: %w", err)
			h.mu.Unlock()
			if h.tb != nil {
				h.tb.Errorf("idempotencytest: publish: %v", err)
			}
		}
	}
	timer := time.NewTimer(h.cfg.timeout)
	defer timer.Stop()
	var why error
wait:
	for i, t := range ts {
		if unpublished[i] {
			continue
		}
		select {
		case <-t.done:
		case <-timer.C:
			why = fmt.Errorf("no outcome within %v", h.cfg.timeout)
			break wait
		case <-h.ctx.Done():
			why = fmt.Errorf("the harness stopped: %w", context.Cause(h.ctx))
			break wait
		}
	}
	h.mu.Lock()
	out := make([]Result, len(ts))
	for i, t := range ts {
		out[i] = h.resultLocked(t)
		if out[i].Outcome == Unfinished || out[i].Outcome == Parked {
			if out[i].Err == nil || why != nil {
				out[i].Err = errors.Join(why, out[i].Err)
			}
		}
	}
	h.mu.Unlock()
	if h.tb != nil && why != nil {
		h.tb.Errorf("idempotencytest: %v; what the messages came to: %v", why, out)
	}
	return out
}

// resultLocked is t's result as it stands: a message whose last delivery
// was parked and that has no outcome yet shows as Parked.
func (h *Harness) resultLocked(t *tracked) Result {
	r := t.result
	select {
	case <-t.done:
	default:
		if r.Outcome == Unfinished && errors.Is(r.Err, idempotency.ErrInFlight) {
			r.Outcome = Parked
		}
	}
	return r
}

func (h *Harness) tracked(msg *message.Message) *tracked {
	return h.messages[msg.Metadata.Get(MetadataDelivery)]
}

// follow is the outermost middleware: it gives each delivery a record of
// what happens in it, and sets the message's outcome once the wiring acks
// it.
func (h *Harness) follow(next message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		h.mu.Lock()
		d := &delivery{t: h.tracked(msg)}
		if d.t != nil {
			d.t.result.Deliveries++
		}
		h.mu.Unlock()
		msg.SetContext(context.WithValue(msg.Context(), deliveryKey{}, d))
		produced, err := next(msg)
		h.mu.Lock()
		defer h.mu.Unlock()
		t := d.t
		if t == nil || isDone(t) {
			return produced, err
		}
		if err != nil { // nacked: the broker delivers it again
			t.result.Err = err
			return produced, err
		}
		switch {
		case t.result.DeadLetter != nil && has(d.events, idempotency.OutcomeReject):
			t.result.Outcome = Rejected
			t.result.Err = lastErr(d.events, idempotency.OutcomeReject)
		case t.result.DeadLetter != nil:
			t.result.Outcome = DeadLettered
			if t.handlerErr != nil { // the handler's own error, for errors.Is
				t.result.Err = t.handlerErr
			}
		case has(d.events, idempotency.OutcomeSkip):
			t.result.Outcome, t.result.Err = Skipped, nil
		default:
			t.result.Outcome, t.result.Err = Ran, nil
		}
		close(t.done)
		return produced, err
	}
}

// ran counts a run of the handler.
func (h *Harness) ran(msg *message.Message) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if t := h.tracked(msg); t != nil {
		t.result.Runs++
		t.handlerErr = nil
	}
}

// returned keeps what a run of the handler returned.
func (h *Harness) returned(msg *message.Message, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if t := h.tracked(msg); t != nil {
		t.handlerErr = err
	}
}

// observe records the middleware's decisions in the delivery's record.
func (h *Harness) observe(ctx context.Context, e idempotency.Event) {
	d, ok := ctx.Value(deliveryKey{}).(*delivery)
	if !ok {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	d.events = append(d.events, e)
	if d.t == nil || isDone(d.t) {
		return
	}
	if e.MessageID != "" {
		d.t.result.ID = e.MessageID
	}
	if e.Outcome == idempotency.OutcomePark {
		d.t.result.Parked++
	}
}

// deadLetters is the dead-letter middleware's publisher: it notes each
// dead letter on its message, then publishes it on the pub/sub.
type deadLetters struct{ h *Harness }

func (p deadLetters) Publish(topic string, msgs ...*message.Message) error {
	p.h.mu.Lock()
	for _, m := range msgs {
		if t := p.h.tracked(m); t != nil {
			t.result.DeadLetter = m
			t.result.Err = errors.New(m.Metadata.Get(deadletter.MetadataError))
		}
	}
	p.h.mu.Unlock()
	return p.h.pubSub.Publish(topic, msgs...)
}

func (p deadLetters) Close() error { return nil }

func isDone(t *tracked) bool {
	select {
	case <-t.done:
		return true
	default:
		return false
	}
}

func has(events []idempotency.Event, o idempotency.Outcome) bool {
	for _, e := range events {
		if e.Outcome == o {
			return true
		}
	}
	return false
}

func lastErr(events []idempotency.Event, o idempotency.Outcome) error {
	var err error
	for _, e := range events {
		if e.Outcome == o {
			err = e.Err
		}
	}
	return err
}

// MustEnvelope returns the JSON of an envelope of job urn carrying data,
// built by envelope.New with opts (envelope.WithID for a business key). It
// panics when envelope.New refuses them, as regexp.MustCompile does: for
// test data.
func MustEnvelope(urn string, data any, opts ...envelope.Option) []byte {
	e, err := envelope.New(urn, data, opts...)
	if err != nil {
		panic(fmt.Sprintf("idempotencytest.MustEnvelope: %v", err))
	}
	payload, err := e.Marshal()
	if err != nil {
		panic(fmt.Sprintf("idempotencytest.MustEnvelope: %v", err))
	}
	return payload
}
