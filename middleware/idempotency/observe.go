package idempotency

import (
	"context"
	"fmt"
	"log/slog"
	"reflect"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/internal/kitlog"
	"github.com/babelqueue/watermill-idempotency/internal/msgtrace"
)

// Metric names, recorded with the OpenTelemetry metric API.
const (
	// MetricDeliveries counts deliveries by decision: attributes "handler"
	// and "outcome" (run, skip, park, fail_open, reject, conflict,
	// store_error, remember_failed, claim_lost, ended, reopen, exhausted,
	// retry_later).
	MetricDeliveries = "bq.idempotency.deliveries"
	// MetricStoreDuration is the latency of store calls in seconds:
	// attributes "handler" and "operation" (lookup, claim, remember,
	// release, record, extend, fail, end, reopen).
	MetricStoreDuration = "bq.idempotency.store.duration"
	// MetricClaimsInProgress is the number of claims this worker's
	// deliveries hold (the claim mode): taken, and not yet remembered or
	// released.
	MetricClaimsInProgress = "bq.idempotency.claims.in_progress"
	// MetricOldestClaimAge is the age, in seconds, of the oldest claim this
	// worker's deliveries hold (0 when none): a handler stuck, or slower
	// than its lease, shows here long before its claim lapses. Take the
	// maximum across the fleet's workers for the fleet's oldest; a claim
	// whose worker died is not counted (it lapses with its lease).
	MetricOldestClaimAge = "bq.idempotency.claims.oldest.age"
	// MetricRenewalFailures counts renewals of a held claim that failed
	// (the store unreachable or slower than the try's deadline): attribute
	// "handler". Each is tried again while the lease lasts, so a failure
	// alone loses nothing; a rate that keeps up says the store is failing
	// claims that will be lost (claim_lost) if it lasts a lease. Renewals
	// that succeeded are in MetricStoreDuration, operation "extend".
	MetricRenewalFailures = "bq.idempotency.claims.renewal_failures"

	meterName = "github.com/babelqueue/watermill-idempotency/middleware/idempotency"
)

// Span name and attributes of the trace the middleware records.
const (
	// SpanDelivery is the span of one delivery through the middleware,
	// from reading its identity to the decision's end (the handler's run
	// included: its own spans are children of it). It continues the trace
	// the message carries: the span already in the message's context, else
	// its W3C traceparent metadata, else the envelope's trace_id. Its
	// events are the store calls ("store.claim", "store.lookup",
	// "store.remember", "store.release", "store.record", "store.fail",
	// "store.end", "store.reopen", with AttrDuration) and the decisions,
	// named by their Outcome ("run", "skip", "park", "fail_open", "reject",
	// "conflict", "claim_lost", "store_error", "remember_failed",
	// "exhausted", "retry_later", "ended", "reopen", with AttrError when
	// there is one).
	// Its status is an error when the delivery returns one.
	SpanDelivery = "idempotency.delivery"

	AttrMessageID   = attribute.Key("bq.message.id")             // meta.id, or the key source's key
	AttrMessageUUID = attribute.Key("messaging.message.id")      // the Watermill message UUID
	AttrHandler     = attribute.Key("bq.handler")                // the Watermill handler name
	AttrOutcome     = attribute.Key("bq.idempotency.outcome")    // the last decision (an Outcome)
	AttrError       = attribute.Key("bq.idempotency.error")      // the error behind a decision
	AttrDuration    = attribute.Key("bq.store.duration_seconds") // of a store call

	tracerName = meterName
)

// WithMeterProvider records the middleware's metrics with mp instead of the
// global meter provider (otel.GetMeterProvider, which forwards to whatever
// SDK the program installs, or records nothing).
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(c *config) { c.meterProvider = mp }
}

// WithTracerProvider records the middleware's spans (SpanDelivery) with tp
// instead of the global tracer provider (otel.GetTracerProvider).
func WithTracerProvider(tp trace.TracerProvider) Option {
	return func(c *config) { c.tracerProvider = tp }
}

// observers is the one chain every decision goes through: the metrics, the
// span, the logger, then the Observers of WithObserver, all fed from one
// Event.
type observers struct {
	metrics     *metrics
	tracer      trace.Tracer
	tracerFixed bool         // WithTracerProvider was given
	logger      *logObserver // nil when nothing is logged
	user        []Observer
}

func newObservers(c *config) (observers, error) {
	m, err := newMetrics(c.meterProvider)
	if err != nil {
		return observers{}, err
	}
	// Without WithTracerProvider the global provider's tracer: OpenTelemetry
	// forwards it to the provider a program installs later.
	tp, fixed := c.tracerProvider, c.tracerProvider != nil
	if !fixed {
		tp = otel.GetTracerProvider()
	}
	o := observers{metrics: m, user: c.observers, tracer: tp.Tracer(tracerName), tracerFixed: fixed}
	if fixed && standIn(tp) {
		o.tracer = nil
	}
	if !kitlog.Silent(c.logger) {
		o.logger = &logObserver{logger: c.logger}
	}
	return o, nil
}

// observe reports a decision to the chain, and returns the event's error so
// that callers can return it in one line.
func (g *Guard) observe(ctx context.Context, msg *message.Message, e Event) error {
	g.obs.metrics.count(ctx, e.Handler, e.Outcome)
	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		traceEvent(span, e)
	}
	if g.obs.logger != nil {
		g.obs.logger.log(msg, e)
	}
	for _, o := range g.obs.user {
		o.Observe(ctx, e)
	}
	return e.Err
}

// traceEvent adds the decision to the delivery's span.
func traceEvent(span trace.Span, e Event) {
	if e.Err == nil {
		span.AddEvent(string(e.Outcome))
	} else {
		span.AddEvent(string(e.Outcome), trace.WithAttributes(AttrError.String(e.Err.Error())))
	}
	span.SetAttributes(AttrOutcome.String(string(e.Outcome)))
	if e.MessageID != "" {
		span.SetAttributes(AttrMessageID.String(e.MessageID))
	}
}

// deliverySpanKey holds, in the context of a message the middleware
// traces, the span that was current before it (the parent of the next
// attempt's span: Retry calls the middleware again with the same message).
type deliverySpanKey struct{}

// traced wraps the middleware's decision in SpanDelivery. The span is put
// in the message's context, so that the handler's spans are its children
// and the decisions become its events; the message's own context is put
// back when the middleware returns (unless the decision replaced it: a
// record waiting for the router's ack marks it). With no tracer SDK
// installed it costs a look at the global tracer provider.
func (g *Guard) traced(next message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		tracer := g.obs.tracing()
		if tracer == nil {
			return next(msg)
		}
		own := msg.Context()
		parent := own
		before, again := own.Value(deliverySpanKey{}).(trace.Span)
		if again {
			parent = trace.ContextWithSpan(own, before) // a sibling of the last attempt's span, not its child
		} else {
			before = trace.SpanFromContext(own)
		}
		ctx, span := tracer.Start(msgtrace.Context(parent, msg, "", envelope.ReadTraceID), SpanDelivery, trace.WithSpanKind(trace.SpanKindConsumer))
		defer span.End()
		if span.IsRecording() {
			span.SetAttributes(AttrHandler.String(message.HandlerNameFromCtx(own)), AttrMessageUUID.String(msg.UUID))
		}
		ctx = context.WithValue(ctx, deliverySpanKey{}, before)
		msg.SetContext(ctx)
		produced, err := next(msg)
		if msg.Context() == ctx {
			msg.SetContext(own)
		}
		if err != nil {
			span.SetStatus(codes.Error, err.Error())
		}
		return produced, err
	}
}

// tracing returns the tracer of the delivery spans, or nil when nothing
// would record them: WithTracerProvider's, else the global provider's
// once a program installed one (otel.SetTracerProvider, before or after
// New). Until then the global provider is OpenTelemetry's stand-in, whose
// spans cost allocations and record nothing.
func (o *observers) tracing() trace.Tracer {
	if o.tracerFixed {
		return o.tracer
	}
	if standIn(otel.GetTracerProvider()) {
		return nil
	}
	return o.tracer
}

// standIn reports whether tp records nothing: a no-op provider, or the
// global provider's stand-in before a program installs one.
func standIn(tp trace.TracerProvider) bool {
	switch tp.(type) {
	case noop.TracerProvider, *noop.TracerProvider:
		return true
	}
	return reflect.TypeOf(tp).String() == "*global.tracerProvider"
}

// startStore returns the start time of a store call, or the zero time when
// its latency is neither recorded nor traced.
func (o observers) startStore(ctx context.Context) time.Time {
	if !o.metrics.storeDuration.Enabled(ctx) && !trace.SpanFromContext(ctx).IsRecording() {
		return time.Time{}
	}
	return time.Now()
}

func (o observers) endStore(ctx context.Context, start time.Time, handler, operation string) {
	if start.IsZero() {
		return
	}
	took := time.Since(start).Seconds()
	if o.metrics.storeDuration.Enabled(ctx) {
		o.metrics.storeDuration.Record(ctx, took, o.metrics.option(handler, "operation", operation))
	}
	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		span.AddEvent("store."+operation, trace.WithAttributes(AttrDuration.Float64(took)))
	}
}

func (g *Guard) fields(e Event) watermill.LogFields {
	return watermill.LogFields{"message_id": e.MessageID, "handler": e.Handler}
}

// logObserver logs decisions other than running the handler (see
// WithLogger for the levels). A message without identity is logged at info
// the first time it is seen, at debug on its later attempts (a redelivered
// message would otherwise log one line per attempt); one without a UUID,
// which cannot be told from another, at info every time.
type logObserver struct {
	logger   watermill.LoggerAdapter
	failOpen recentSet
	outages  outages
}

func (l *logObserver) log(msg *message.Message, e Event) {
	if e.Outcome == OutcomeStoreError {
		if repeated, log := l.outages.failed(e.Handler, time.Now()); !log {
			return
		} else if repeated > 0 {
			e.Err = fmt.Errorf("%w (and %d more deliveries failed so since the last line)", e.Err, repeated)
		}
	} else if n, since := l.outages.answered(e.Handler); n > 0 {
		l.logger.Info("Idempotency store answers again", watermill.LogFields{"handler": e.Handler,
			"failed_deliveries": n, "outage": time.Since(since).Round(time.Millisecond).String()})
	}
	var level slog.Level
	switch e.Outcome {
	case OutcomeRun:
		return
	case OutcomeSkip, OutcomePark, OutcomeEnded:
		level = slog.LevelDebug
	case OutcomeReopen, OutcomeExhausted, OutcomeRetryLater:
		level = slog.LevelInfo
	case OutcomeFailOpen:
		// A message without a UUID cannot be told from another: each is
		// logged at info.
		level = slog.LevelInfo
		if msg.UUID != "" && !l.failOpen.add(msg.UUID) {
			level = slog.LevelDebug
		}
	case OutcomeReject, OutcomeConflict, OutcomeClaimLost:
		level = slog.LevelWarn
	default:
		level = slog.LevelError
	}
	if level == slog.LevelDebug && !kitlog.DebugEnabled(l.logger) {
		return
	}
	fields := watermill.LogFields{"message_id": e.MessageID, "handler": e.Handler,
		"message_uuid": msg.UUID, "decision": string(e.Outcome), "trace_id": envelope.ReadTraceID(msg.Payload)}
	if e.Outcome == OutcomeFailOpen || (level <= slog.LevelInfo && e.Err != nil) {
		fields["reason"] = e.Err.Error()
	}
	text := logText(e.Outcome, level == slog.LevelDebug)
	switch level {
	case slog.LevelDebug:
		l.logger.Debug(text, fields)
	case slog.LevelInfo:
		l.logger.Info(text, fields)
	case slog.LevelWarn:
		kitlog.Warn(l.logger, text, e.Err, fields)
	default:
		l.logger.Error(text, e.Err, fields)
	}
}

// logText is the line of a decision the middleware logs; again: a
// message without identity seen before.
func logText(o Outcome, again bool) string {
	switch o {
	case OutcomeSkip:
		return "Duplicate delivery skipped"
	case OutcomePark:
		return "Delivery parked: the message is in flight in another delivery"
	case OutcomeFailOpen:
		if again {
			return "Message has no usable identity; handled without deduplication (again)"
		}
		return "Message has no usable identity; handled without deduplication"
	case OutcomeReject:
		return "Message rejected: it cannot be handled safely"
	case OutcomeConflict:
		return "Message rejected: its content differs from the remembered message with its id"
	case OutcomeClaimLost:
		return "Delivery lost its claim while it held it"
	case OutcomeEnded:
		return "Delivery of a message that ended (dead-lettered for good) skipped"
	case OutcomeReopen:
		return "Message sent back on purpose after it ended: it runs again with a fresh budget"
	case OutcomeExhausted:
		return "Message's retry budget is spent: it fails for good"
	case OutcomeRetryLater:
		return "Delivery handed back before the broker's deadline; the message runs again at a later delivery"
	case OutcomeStoreError:
		return "Idempotency store unavailable; the delivery is retried"
	case OutcomeRememberFailed:
		return "Message's outcome could not be remembered; a redelivery would run it again (a success) or dead-letter it again (an end)"
	}
	return "Idempotency decision failed"
}

// outageLogEvery is how often a store outage is logged: the first failed
// delivery at once, then one line per period with the count of those in
// between, and a line when the store answers again.
const outageLogEvery = 10 * time.Second

// outages tracks, per handler, the deliveries a store outage failed, so
// that it is logged once with a count, not once per redelivery.
type outages struct {
	active atomic.Int32 // len(by), read without the lock on every delivery
	mu     sync.Mutex
	by     map[string]*outage
}

type outage struct {
	since, logged time.Time
	failed        int // in all, since the outage began
	unlogged      int // since the last line
}

// failed notes a delivery of handler the store failed at now, and reports
// whether to log it, with how many failed since the last line.
func (o *outages) failed(handler string, now time.Time) (repeated int, log bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.by == nil {
		o.by = make(map[string]*outage)
	}
	x, ok := o.by[handler]
	if !ok {
		o.by[handler] = &outage{since: now, logged: now, failed: 1}
		o.active.Add(1)
		return 0, true
	}
	x.failed++
	if now.Sub(x.logged) < outageLogEvery {
		x.unlogged++
		return 0, false
	}
	repeated, x.unlogged, x.logged = x.unlogged, 0, now
	return repeated, true
}

// answered ends handler's outage, if one was under way, and returns how
// many deliveries it failed and since when.
func (o *outages) answered(handler string) (failed int, since time.Time) {
	if o.active.Load() == 0 {
		return 0, time.Time{}
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	x, ok := o.by[handler]
	if !ok {
		return 0, time.Time{}
	}
	delete(o.by, handler)
	o.active.Add(-1)
	return x.failed, x.since
}

// recentSet remembers the last recentSetSize strings added to it.
type recentSet struct {
	mu   sync.Mutex
	seen map[string]struct{}
	ring [recentSetSize]string
	next int
}

const recentSetSize = 1024

// add adds s and reports whether it was not among the recent ones.
func (r *recentSet) add(s string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.seen[s]; ok {
		return false
	}
	if r.seen == nil {
		r.seen = make(map[string]struct{}, recentSetSize)
	}
	delete(r.seen, r.ring[r.next])
	r.ring[r.next] = s
	r.seen[s] = struct{}{}
	r.next = (r.next + 1) % recentSetSize
	return true
}

// metrics records deliveries and store latencies. When no SDK is installed
// the instruments report themselves disabled, and recording costs a check.
type metrics struct {
	deliveries      metric.Int64Counter
	renewalFailures metric.Int64Counter
	storeDuration   metric.Float64Histogram
	options         sync.Map // attrKey -> metric.MeasurementOption
	claims          claimsHeld
}

// claimsHeld are the claims this Guard's deliveries hold, by when each was
// taken, for MetricClaimsInProgress and MetricOldestClaimAge.
type claimsHeld struct {
	mu   sync.Mutex
	next uint64
	held map[uint64]int64 // id -> Unix nanoseconds the claim was taken
}

// take notes a claim taken now and returns its id for drop.
func (c *claimsHeld) take() uint64 {
	now := time.Now().UnixNano()
	c.mu.Lock()
	c.next++
	id := c.next
	if c.held == nil {
		c.held = make(map[uint64]int64)
	}
	c.held[id] = now
	c.mu.Unlock()
	return id
}

// drop notes the claim id remembered or released.
func (c *claimsHeld) drop(id uint64) {
	c.mu.Lock()
	delete(c.held, id)
	c.mu.Unlock()
}

// oldest returns how many claims are held and since when the oldest is.
func (c *claimsHeld) oldest() (n int, since int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, at := range c.held {
		if since == 0 || at < since {
			since = at
		}
	}
	return len(c.held), since
}

type attrKey struct{ handler, name, value string }

func newMetrics(mp metric.MeterProvider) (*metrics, error) {
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	meter := mp.Meter(meterName)
	deliveries, err := meter.Int64Counter(MetricDeliveries,
		metric.WithUnit("{delivery}"), metric.WithDescription("Deliveries seen by the idempotency middleware, by decision."))
	if err != nil {
		return nil, fmt.Errorf("idempotency: metric %s: %w", MetricDeliveries, err)
	}
	storeDuration, err := meter.Float64Histogram(MetricStoreDuration,
		metric.WithUnit("s"), metric.WithDescription("Latency of idempotency store calls."),
		metric.WithExplicitBucketBoundaries(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
	if err != nil {
		return nil, fmt.Errorf("idempotency: metric %s: %w", MetricStoreDuration, err)
	}
	renewalFailures, err := meter.Int64Counter(MetricRenewalFailures,
		metric.WithUnit("{renewal}"), metric.WithDescription("Renewals of held claims that failed (tried again while the lease lasts)."))
	if err != nil {
		return nil, fmt.Errorf("idempotency: metric %s: %w", MetricRenewalFailures, err)
	}
	m := &metrics{deliveries: deliveries, renewalFailures: renewalFailures, storeDuration: storeDuration}
	inProgress, err := meter.Int64ObservableGauge(MetricClaimsInProgress,
		metric.WithUnit("{claim}"), metric.WithDescription("Claims held by this worker's deliveries."))
	if err != nil {
		return nil, fmt.Errorf("idempotency: metric %s: %w", MetricClaimsInProgress, err)
	}
	oldestAge, err := meter.Float64ObservableGauge(MetricOldestClaimAge,
		metric.WithUnit("s"), metric.WithDescription("Age of the oldest claim held by this worker's deliveries."))
	if err != nil {
		return nil, fmt.Errorf("idempotency: metric %s: %w", MetricOldestClaimAge, err)
	}
	// The callback lives as long as the meter provider (a Guard is built
	// once per router, so there is one per Guard).
	if _, err := meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		n, since := m.claims.oldest()
		o.ObserveInt64(inProgress, int64(n))
		age := 0.0
		if n > 0 {
			age = time.Since(time.Unix(0, since)).Seconds()
		}
		o.ObserveFloat64(oldestAge, age)
		return nil
	}, inProgress, oldestAge); err != nil {
		return nil, fmt.Errorf("idempotency: claim metrics: %w", err)
	}
	return m, nil
}

// option returns the cached attribute option for handler and name=value, so
// that recording allocates nothing after the first time.
func (m *metrics) option(handler, name, value string) metric.MeasurementOption {
	k := attrKey{handler, name, value}
	if o, ok := m.options.Load(k); ok {
		return o.(metric.MeasurementOption)
	}
	o := metric.WithAttributeSet(attribute.NewSet(attribute.String("handler", handler), attribute.String(name, value)))
	m.options.Store(k, o)
	return o
}

// handlerOption is the measurement option of an instrument whose one
// attribute is the handler.
func (m *metrics) handlerOption(handler string) metric.MeasurementOption {
	k := attrKey{handler: handler}
	if o, ok := m.options.Load(k); ok {
		return o.(metric.MeasurementOption)
	}
	o := metric.WithAttributeSet(attribute.NewSet(attribute.String("handler", handler)))
	m.options.Store(k, o)
	return o
}

func (m *metrics) count(ctx context.Context, handler string, o Outcome) {
	if m.deliveries.Enabled(ctx) {
		m.deliveries.Add(ctx, 1, m.option(handler, "outcome", string(o)))
	}
}
