package idempotency

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/babelqueue/watermill-idempotency/envelope"
)

// Metric names, recorded with the OpenTelemetry metric API.
const (
	// MetricDeliveries counts deliveries by decision: attributes "handler"
	// and "outcome" (run, skip, park, fail_open, reject, conflict,
	// store_error, remember_failed, claim_lost).
	MetricDeliveries = "bq.idempotency.deliveries"
	// MetricStoreDuration is the latency of store calls in seconds:
	// attributes "handler" and "operation" (lookup, claim, remember,
	// release, record).
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

	meterName = "github.com/babelqueue/watermill-idempotency/middleware/idempotency"
)

// WithMeterProvider records the middleware's metrics with mp instead of the
// global meter provider (otel.GetMeterProvider, which forwards to whatever
// SDK the program installs, or records nothing).
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(c *config) { c.meterProvider = mp }
}

// observers is the one chain every decision goes through: the metrics, the
// logger, then the Observers of WithObserver, all fed from one Event.
type observers struct {
	metrics *metrics
	logger  *logObserver // nil when nothing is logged
	user    []Observer
}

func newObservers(c *config) (observers, error) {
	m, err := newMetrics(c.meterProvider)
	if err != nil {
		return observers{}, err
	}
	o := observers{metrics: m, user: c.observers}
	if _, nop := c.logger.(watermill.NopLogger); !nop && c.logger != nil {
		o.logger = &logObserver{logger: c.logger}
	}
	return o, nil
}

// observe reports a decision to the chain, and returns the event's error so
// that callers can return it in one line.
func (g *Guard) observe(ctx context.Context, msg *message.Message, e Event) error {
	g.obs.metrics.count(ctx, e.Handler, e.Outcome)
	if g.obs.logger != nil {
		g.obs.logger.log(msg, e)
	}
	for _, o := range g.obs.user {
		o.Observe(ctx, e)
	}
	return e.Err
}

func (o observers) startStore(ctx context.Context) time.Time { return o.metrics.startStore(ctx) }

func (o observers) endStore(ctx context.Context, start time.Time, handler, operation string) {
	o.metrics.endStore(ctx, start, handler, operation)
}

func (g *Guard) fields(e Event) watermill.LogFields {
	return watermill.LogFields{"message_id": e.MessageID, "handler": e.Handler}
}

// logObserver logs decisions other than running the handler. A message
// without identity is logged at info the first time it is seen, at debug
// on its later attempts (a redelivered message would otherwise log one
// line per attempt); one without a UUID, which cannot be told from
// another, at info every time.
type logObserver struct {
	logger   watermill.LoggerAdapter
	failOpen recentSet
}

func (l *logObserver) log(msg *message.Message, e Event) {
	if e.Outcome == OutcomeRun {
		return
	}
	fields := watermill.LogFields{"message_id": e.MessageID, "handler": e.Handler,
		"message_uuid": msg.UUID, "decision": string(e.Outcome), "trace_id": envelope.ReadTraceID(msg.Payload)}
	switch e.Outcome {
	case OutcomeSkip:
		l.logger.Debug("Duplicate delivery skipped", fields)
	case OutcomePark:
		l.logger.Info("Delivery parked: the message is in flight in another delivery", fields)
	case OutcomeFailOpen:
		fields["reason"] = e.Err.Error()
		// A message without a UUID cannot be told from another: each is
		// logged at info.
		if msg.UUID == "" || l.failOpen.add(msg.UUID) {
			l.logger.Info("Message has no usable identity; handled without deduplication", fields)
		} else {
			l.logger.Debug("Message has no usable identity; handled without deduplication (again)", fields)
		}
	case OutcomeClaimLost:
		fields["error"] = e.Err.Error()
		if w, ok := l.logger.(warner); ok {
			w.Warn("Delivery lost its idempotency claim; another delivery may run the message", fields)
		} else {
			l.logger.Error("Delivery lost its idempotency claim; another delivery may run the message", e.Err, fields)
		}
	default:
		l.logger.Error("Idempotency decision failed", e.Err, fields)
	}
}

// warner is a logger with a warning level. Watermill's LoggerAdapter has
// none: a lost claim is logged at warn by a logger that has one, at error
// by one that has not (the nearest level that is not hidden by default).
type warner interface {
	Warn(msg string, fields watermill.LogFields)
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
	deliveries    metric.Int64Counter
	storeDuration metric.Float64Histogram
	options       sync.Map // attrKey -> metric.MeasurementOption
	claims        claimsHeld
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
	m := &metrics{deliveries: deliveries, storeDuration: storeDuration}
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

func (m *metrics) count(ctx context.Context, handler string, o Outcome) {
	if m.deliveries.Enabled(ctx) {
		m.deliveries.Add(ctx, 1, m.option(handler, "outcome", string(o)))
	}
}

// startStore returns the start time of a store call, or the zero time when
// latencies are not recorded.
func (m *metrics) startStore(ctx context.Context) time.Time {
	if !m.storeDuration.Enabled(ctx) {
		return time.Time{}
	}
	return time.Now()
}

func (m *metrics) endStore(ctx context.Context, start time.Time, handler, operation string) {
	if start.IsZero() {
		return
	}
	m.storeDuration.Record(ctx, time.Since(start).Seconds(), m.option(handler, "operation", operation))
}
