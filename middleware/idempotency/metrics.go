package idempotency

import (
	"context"
	"fmt"
	"sync"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// Metric names, recorded with the OpenTelemetry metric API.
const (
	// MetricDeliveries counts deliveries by decision: attributes "handler"
	// and "outcome" (run, skip, park, fail_open, reject, conflict,
	// store_error, remember_failed).
	MetricDeliveries = "bq.idempotency.deliveries"
	// MetricStoreDuration is the latency of store calls in seconds:
	// attributes "handler" and "operation" (seen, claim, remember, release,
	// record).
	MetricStoreDuration = "bq.idempotency.store.duration"

	meterName = "github.com/babelqueue/watermill-idempotency/middleware/idempotency"
)

// WithMeterProvider records the middleware's metrics with mp instead of the
// global meter provider (otel.GetMeterProvider, which forwards to whatever
// SDK the program installs, or records nothing).
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(c *config) { c.meterProvider = mp }
}

// metrics records deliveries and store latencies. When no SDK is installed
// the instruments report themselves disabled, and recording costs a check.
type metrics struct {
	deliveries    metric.Int64Counter
	storeDuration metric.Float64Histogram
	options       sync.Map // attrKey -> metric.MeasurementOption
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
	return &metrics{deliveries: deliveries, storeDuration: storeDuration}, nil
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
