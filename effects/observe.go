package effects

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/internal/msgtrace"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// Metric names, recorded with the OpenTelemetry metric API.
const (
	// MetricAttempts counts Do calls by "effect" and "decision" (call,
	// replay, reconciled, resend, resubmit, in_flight, park, unknown,
	// dead_letter, budget_exhausted, conflict, store_error). The duplicate
	// resolution rate is (replay + reconciled) over all decisions but call;
	// payload conflicts are decision="conflict".
	MetricAttempts = "bq.effects.attempts"
	// MetricCalls counts calls to providers by "effect" and "outcome"
	// (succeeded, failed, unknown, not_sent).
	MetricCalls = "bq.effects.calls"
	// MetricCallDuration is the latency of calls to providers, in seconds,
	// by "effect".
	MetricCallDuration = "bq.effects.call.duration"
	// MetricBudgetExhausted counts effects whose retry budget ran out, by
	// "effect".
	MetricBudgetExhausted = "bq.effects.budget_exhausted"
	// MetricResolutions counts effects settled after the fact, by "effect"
	// and "evidence" (lookup, callback, operator).
	MetricResolutions = "bq.effects.resolutions"
	// MetricRecordFailed counts outcomes that could not be recorded after
	// the call, by "effect".
	MetricRecordFailed = "bq.effects.record_failed"
	// MetricLeasesLost counts attempts that lost their lease on an effect
	// while its call ran (another attempt took it over, or it could not be
	// renewed in time), by "effect".
	MetricLeasesLost = "bq.effects.leases_lost"
	// MetricOperatorConflicts counts the provider's answers (a call's, a
	// lookup's, a callback's) that met an operator's contrary resolution,
	// by "effect", "evidence" (call, lookup, callback) and "outcome":
	// overruled (a success replaced the resolution) or kept (a failure met
	// an operator's succeeded, which stands). Each is logged at error too.
	MetricOperatorConflicts = "bq.effects.operator_conflicts"
	// MetricCallbacks counts provider callbacks by "outcome" (applied,
	// confirmed, duplicate, contradicted, no_effect, store_error).
	MetricCallbacks = "bq.effects.callbacks"
	// MetricEffects is the number of effects in the store, by "state",
	// read from the store at each collection.
	MetricEffects = "bq.effects.effects"
	// MetricOldestAge is how long the effect longest in its state has been
	// there, in seconds, by "state": for "pending" the oldest in-progress
	// claim on an effect, for "unknown" the oldest outcome nobody knows.
	// Read from the store at each collection.
	MetricOldestAge = "bq.effects.oldest.age"

	instrumentationName = "github.com/babelqueue/watermill-idempotency/effects"
)

// Span names and attributes.
const (
	SpanDo        = "effects.do"        // one Do, the decision
	SpanCall      = "effects.call"      // one call to the provider
	SpanReconcile = "effects.reconcile" // one status lookup

	AttrEffect      = attribute.Key("bq.effect.name")
	AttrProviderKey = attribute.Key("bq.effect.provider_key")
	AttrDecision    = attribute.Key("bq.effect.decision")
	AttrState       = attribute.Key("bq.effect.state")
	AttrAttempt     = attribute.Key("bq.effect.attempt")
	AttrOutcome     = attribute.Key("bq.effect.outcome")
	AttrMessageID   = attribute.Key("bq.message.id")
	AttrHandler     = attribute.Key("bq.handler")
)

type observer struct {
	r                                                                 *Runner
	tracer                                                            trace.Tracer
	attempts, calls, exhaustedN, resolutions, recordFailedN, callback metric.Int64Counter
	leasesLost, conflicts                                             metric.Int64Counter
	callDuration                                                      metric.Float64Histogram
	registration                                                      metric.Registration
}

func newObserver(r *Runner) (*observer, error) {
	mp := r.cfg.meterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	tp := r.cfg.tracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	o := &observer{r: r, tracer: tp.Tracer(instrumentationName)}
	m := mp.Meter(instrumentationName)
	var errs []error
	counter := func(name, unit, desc string) metric.Int64Counter {
		c, err := m.Int64Counter(name, metric.WithUnit(unit), metric.WithDescription(desc))
		errs = append(errs, err)
		return c
	}
	o.attempts = counter(MetricAttempts, "{attempt}", "Attempts to perform an external effect, by decision.")
	o.calls = counter(MetricCalls, "{call}", "Calls to effect providers, by outcome.")
	o.exhaustedN = counter(MetricBudgetExhausted, "{effect}", "Effects whose retry budget ran out.")
	o.resolutions = counter(MetricResolutions, "{effect}", "Effects settled after the fact, by evidence.")
	o.recordFailedN = counter(MetricRecordFailed, "{effect}", "Effect outcomes that could not be recorded after the call.")
	o.leasesLost = counter(MetricLeasesLost, "{attempt}", "Attempts that lost their lease on an effect while its call ran.")
	o.conflicts = counter(MetricOperatorConflicts, "{answer}", "Provider answers that met an operator's contrary resolution.")
	o.callback = counter(MetricCallbacks, "{callback}", "Provider callbacks, by outcome.")
	var err error
	o.callDuration, err = m.Float64Histogram(MetricCallDuration, metric.WithUnit("s"), metric.WithDescription("Latency of calls to effect providers."))
	errs = append(errs, err)
	count, err := m.Int64ObservableGauge(MetricEffects, metric.WithUnit("{effect}"), metric.WithDescription("Effects in the store, by state."))
	errs = append(errs, err)
	age, err := m.Float64ObservableGauge(MetricOldestAge, metric.WithUnit("s"), metric.WithDescription("Time the oldest effect of each state has been in it."))
	errs = append(errs, err)
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("effects: metrics: %w", err)
	}
	o.registration, err = m.RegisterCallback(func(ctx context.Context, obs metric.Observer) error {
		ctx, cancel := r.storeContext(ctx)
		defer cancel()
		stats, err := r.store.Stats(ctx)
		if err != nil {
			return fmt.Errorf("effects: read the store's stats: %w", err)
		}
		now := time.Now()
		for _, s := range stores.EffectStates {
			st := stats[s]
			attrs := metric.WithAttributes(attribute.String("state", string(s)))
			obs.ObserveInt64(count, st.Count, attrs)
			var seconds float64
			if st.Count > 0 {
				seconds = max(now.Sub(st.Oldest).Seconds(), 0)
			}
			obs.ObserveFloat64(age, seconds, attrs)
		}
		return nil
	}, count, age)
	if err != nil {
		return nil, fmt.Errorf("effects: metrics: %w", err)
	}
	return o, nil
}

func (o *observer) close() error { return o.registration.Unregister() }

func effectAttr(name string) metric.MeasurementOption {
	return metric.WithAttributes(attribute.String("effect", name))
}

// startDo starts the decision's span, continuing the message's trace: the
// span in ctx, else the message's W3C traceparent, else the envelope's
// trace_id when it is a UUID or 32 hex digits.
func (o *observer) startDo(ctx context.Context, a *attempt) (context.Context, trace.Span) {
	ctx = msgtrace.Context(ctx, a.d.Message, a.d.ID, envelope.ReadTraceID)
	attrs := []attribute.KeyValue{AttrEffect.String(a.e.name), AttrProviderKey.String(a.key),
		AttrMessageID.String(a.d.ID), AttrHandler.String(a.d.Handler)}
	return o.tracer.Start(ctx, SpanDo, trace.WithAttributes(attrs...), trace.WithSpanKind(trace.SpanKindInternal))
}

func (o *observer) endDo(ctx context.Context, a *attempt, err error) {
	o.attempts.Add(ctx, 1, metric.WithAttributes(attribute.String("effect", a.e.name), attribute.String("decision", a.decision)))
	a.span.SetAttributes(AttrDecision.String(a.decision), AttrState.String(string(a.now.State)), AttrAttempt.Int(a.now.Attempts))
	if err != nil {
		a.span.SetStatus(codes.Error, err.Error())
	}
	a.span.End()
}

func (o *observer) startChild(ctx context.Context, a *attempt, what string) (context.Context, trace.Span) {
	name := SpanCall
	if what == "reconcile" {
		name = SpanReconcile
	}
	return o.tracer.Start(ctx, name, trace.WithAttributes(AttrEffect.String(a.e.name), AttrProviderKey.String(a.key)),
		trace.WithSpanKind(trace.SpanKindClient))
}

// outcomeName names an outcome for metrics and spans.
func outcomeName(out Outcome, err error) string {
	switch {
	case err != nil:
		return string(stores.EffectUnknown)
	case out.notSent:
		return "not_sent"
	case out.notFound:
		return "not_found"
	case out.State.Final():
		return string(out.State)
	}
	return string(stores.EffectUnknown)
}

func (o *observer) endCall(ctx context.Context, span trace.Span, a *attempt, out Outcome, err error, attemptNo int, took time.Duration) {
	name := outcomeName(out, err)
	o.calls.Add(ctx, 1, metric.WithAttributes(attribute.String("effect", a.e.name), attribute.String("outcome", name)))
	o.callDuration.Record(ctx, took.Seconds(), effectAttr(a.e.name))
	span.SetAttributes(AttrOutcome.String(name), AttrAttempt.Int(attemptNo))
	if err != nil {
		span.RecordError(err)
	}
	if name != string(stores.EffectSucceeded) {
		span.SetStatus(codes.Error, name)
	}
	span.End()
}

func (o *observer) endReconcile(span trace.Span, out Outcome, err error) {
	span.SetAttributes(AttrOutcome.String(outcomeName(out, err)))
	if err != nil {
		span.RecordError(err)
	}
	span.End()
}

func (o *observer) reconciled(ctx context.Context, a *attempt) {
	o.resolutions.Add(ctx, 1, metric.WithAttributes(attribute.String("effect", a.e.name), attribute.String("evidence", EvidenceLookup)))
}

func (o *observer) resolved(ctx context.Context, e stores.Effect) {
	o.resolutions.Add(ctx, 1, metric.WithAttributes(attribute.String("effect", e.Name), attribute.String("evidence", e.Evidence)))
}

func (o *observer) exhausted(ctx context.Context, a *attempt) {
	o.exhaustedN.Add(ctx, 1, effectAttr(a.e.name))
}

func (o *observer) recordFailed(ctx context.Context, a *attempt) {
	o.recordFailedN.Add(ctx, 1, effectAttr(a.e.name))
}

func (o *observer) leaseLost(ctx context.Context, a *attempt) {
	o.leasesLost.Add(ctx, 1, effectAttr(a.e.name))
}

func (o *observer) callbackOutcome(ctx context.Context, outcome string) {
	o.callback.Add(ctx, 1, metric.WithAttributes(attribute.String("outcome", outcome)))
}

func (o *observer) operatorConflict(ctx context.Context, effect, evidence, outcome string) {
	o.conflicts.Add(ctx, 1, metric.WithAttributes(attribute.String("effect", effect), attribute.String("evidence", evidence),
		attribute.String("outcome", outcome)))
}
