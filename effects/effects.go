package effects

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/internal/keepalive"
	"github.com/babelqueue/watermill-idempotency/internal/kitlog"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// Runner runs the effects of a service against one stores.EffectStore, and
// reports them (metrics, spans, logs). Build it with New, declare each
// effect once with Effect, and Close it when the service stops. It holds no
// goroutine of its own: the leases of the attempts whose calls run are kept
// alive by one timer of the Runner's, which renews together every lease
// due within half a renewal period (so a store that groups concurrent calls
// carries them in a round trip or two), and Do stops its attempt's lease
// before it returns.
type Runner struct {
	store  stores.EffectStore
	cfg    config
	obs    *observer
	keeper *keepalive.Keeper // keeps the leases of the attempts sending alive, renewing those due together
}

type config struct {
	callTimeout, lease, storeTimeout time.Duration
	parkWait                         time.Duration
	recordAttempts                   int
	recordBackoff                    time.Duration
	meterProvider                    metric.MeterProvider
	tracerProvider                   trace.TracerProvider
	logger                           watermill.LoggerAdapter
}

// Option configures a Runner.
type Option func(*config)

// WithCallTimeout bounds each call of an effect (default 10s): its context
// is cancelled then, and its outcome is unknown unless it answered.
func WithCallTimeout(d time.Duration) Option { return func(c *config) { c.callTimeout = d } }

// WithLease sets an attempt's lease on the effect it sends (default three
// times the call timeout). It does two things:
//
//   - While the attempt's call runs, its lease is renewed (every third of
//     it): another attempt (another worker, a redelivery) treats the effect
//     as in flight, and neither reconciles nor calls, however long the call
//     takes. A lease that cannot be renewed (another attempt took the
//     effect, or the store could not be reached before it ran out) is lost:
//     the call's context is cancelled, and the loss is logged, counted
//     (MetricLeasesLost) and matched by Do's error (ErrLeaseLost). Only when
//     the attempt died (a crash, a frozen process) does its lease pass, and
//     another attempt reconciles it then.
//   - An effect whose call got no answer (unknown) keeps the lease its
//     attempt last held, counted from the send: until it passes, the
//     request may still reach the provider and be acted on, so no attempt
//     looks it up, nor sends it again (a lookup made sooner could say
//     NotFound for a request on its way). An attempt that finds it so waits
//     (WithParkWait), then is parked with idempotency.ErrInFlight.
//
// So it must be longer than the call timeout, and should be longer than the
// provider may take to act on a request it received.
//
// It is not the message's claim lease (idempotency.WithClaim), which is
// renewed while the handler runs and bounds how long a dead delivery holds
// its message. A redelivery that takes a dead delivery's message over finds
// its effect held, or its request landing, until the effect's lease passes,
// and waits for it, then is parked until then: a crashed attempt's effect
// is taken over after the effect's lease, whatever the claim lease. Keep
// the claim lease short (a dead consumer is noticed quickly) and the
// effect's lease as long as the provider needs.
func WithLease(d time.Duration) Option { return func(c *config) { c.lease = d } }

// WithParkWait sets how long Do waits for an effect held by another attempt
// (its lease running) or whose request may still land (unknown within its
// lease), looking at it again with growing pauses (20ms up to 250ms), before
// the delivery is parked with idempotency.ErrInFlight (default
// idempotency.DefaultParkWait). The other attempt usually ends meanwhile,
// and Do goes on with what it left. Parking nacks the delivery, and a broker
// that hands a nacked message straight back would otherwise run the handler
// again at once, thousands of times a second for the rest of the lease; the
// wait bounds that to about one run per wait. Zero parks at once.
func WithParkWait(d time.Duration) Option { return func(c *config) { c.parkWait = d } }

// WithStoreTimeout bounds every store call (default 5s).
func WithStoreTimeout(d time.Duration) Option { return func(c *config) { c.storeTimeout = d } }

// WithRecordRetry sets how hard an outcome is recorded after the call
// (default 5 attempts, 50ms apart, doubling): the call happened, so its
// outcome is worth riding out a store failover for.
func WithRecordRetry(attempts int, backoff time.Duration) Option {
	return func(c *config) { c.recordAttempts, c.recordBackoff = attempts, backoff }
}

// WithMeterProvider records the metrics with mp instead of the global meter
// provider.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(c *config) { c.meterProvider = mp }
}

// WithTracerProvider records the spans with tp instead of the global tracer
// provider.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return func(c *config) { c.tracerProvider = tp }
}

// WithLogger sets where the Runner logs: at warning a call left without a
// definitive answer (its outcome unknown), an effect dead-lettered because
// its outcome is unknown, a retry budget exhausted and a request that
// differs from the recorded one; at error an outcome that could not be
// recorded and a callback contradicting a recorded outcome; at debug each
// return of a parked message whose effect is still unknown. Watermill's
// adapters have no warning level: warnings go to their Error.
//
// Without WithLogger (or with a nil logger) the Runner logs through
// slog.Default(), read at each line, so a later slog.SetDefault applies;
// watermill.NopLogger{} silences it.
func WithLogger(l watermill.LoggerAdapter) Option { return func(c *config) { c.logger = l } }

// New returns a Runner on store, or an error for an invalid option.
func New(store stores.EffectStore, opts ...Option) (*Runner, error) {
	if store == nil {
		return nil, errors.New("effects: nil store")
	}
	c := config{callTimeout: 10 * time.Second, storeTimeout: 5 * time.Second, recordAttempts: 5,
		recordBackoff: 50 * time.Millisecond, parkWait: idempotency.DefaultParkWait, logger: kitlog.Default()}
	for _, opt := range opts {
		opt(&c)
	}
	if c.lease == 0 {
		c.lease = 3 * c.callTimeout
	}
	switch {
	case c.callTimeout <= 0, c.storeTimeout < 0, c.recordBackoff < 0, c.parkWait < 0:
		return nil, errors.New("effects: the call timeout must be positive and no duration negative")
	case c.lease <= c.callTimeout:
		return nil, fmt.Errorf("effects: the lease (%v) must be longer than the call timeout (%v): another attempt would take over a call still running", c.lease, c.callTimeout)
	case c.recordAttempts < 1:
		return nil, fmt.Errorf("effects: WithRecordRetry needs at least 1 attempt, got %d", c.recordAttempts)
	case c.logger == nil:
		c.logger = kitlog.Default()
	}
	r := &Runner{store: store, cfg: c, keeper: new(keepalive.Keeper)}
	var err error
	if r.obs, err = newObserver(r); err != nil {
		return nil, err
	}
	return r, nil
}

// Close stops reporting the store's gauges. Effects already declared keep
// working.
func (r *Runner) Close() error { return r.obs.close() }

// Store returns the Runner's store.
func (r *Runner) Store() stores.EffectStore { return r.store }

// ProviderKey returns the provider key of the effect name of the message id
// under scope: a name-based UUID of the message's store key
// (idempotency.Key(scope, id)) and name, the same on every attempt, every
// worker and every replay of that message, and distinct for every other
// message, scope or name. Send it as the provider's idempotency key (or
// client reference); the webhook side and operators compute it with this
// function.
func ProviderKey(scope, id, name string) string {
	return envelope.DeriveID(idempotency.Key(scope, id), "effect:"+name)
}

func (r *Runner) storeContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if r.cfg.storeTimeout <= 0 {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, r.cfg.storeTimeout)
}

// Resolve records an operator's manual resolution of the effect key:
// outcome must be Succeeded (with the provider's result, if known) or
// Failed, note says who checked what. It moves only a pending or unknown
// effect; otherwise the error matches ErrNotResolved and names the state
// found.
//
// It waits for the attempts: an effect an attempt may still act on, pending
// while its holder's lease runs (its call under way: the lease is renewed
// while the call runs, so a slow call is never overridden) or unknown while
// the request its last attempt sent may still reach the provider (landing),
// is not resolved, and the error matches ErrEffectInFlight and
// ErrNotResolved and says until when (the returned effect's LeaseUntil).
// The store checks this in the same atomic step that would move the
// effect. WithForce resolves it anyway.
//
// A resolution is the operator's judgement, made without the provider's
// answer. If that answer comes later (the call under way returns, a
// callback, a status lookup) and says the effect succeeded, it overrules the
// resolution: the effect becomes succeeded with the provider's result
// (replacing a failed, or an operator's result), logged at error and
// counted (MetricOperatorConflicts, outcome "overruled"). A charge the
// provider made is thus never left recorded as failed, and Do returns its
// result rather than ErrFailed. The provider's failure does not undo an
// operator's succeeded (the operator may have had the effect done another
// way): the resolution is kept, logged at error and counted (outcome
// "kept").
func (r *Runner) Resolve(ctx context.Context, key string, outcome Outcome, note string, opts ...ResolveOption) (stores.Effect, error) {
	var c resolveConfig
	for _, opt := range opts {
		opt(&c)
	}
	if !outcome.State.Final() {
		return stores.Effect{}, fmt.Errorf("effects: resolve %s: %w: a resolution is succeeded or failed, not %q", key, ErrNotResolved, outcome.State)
	}
	if note == "" {
		note = outcome.Reason
	}
	ctx, cancel := r.storeContext(ctx)
	defer cancel()
	moved, now, err := r.store.Transition(ctx, key, stores.EffectTransition{To: outcome.State, Result: outcome.Result,
		Note: note, Evidence: EvidenceOperator, IfIdle: !c.force})
	switch {
	case err != nil:
		return now, fmt.Errorf("effects: resolve %s: %w: %w", key, idempotency.ErrStore, err)
	case !moved && now.State == stores.EffectNone:
		return now, fmt.Errorf("effects: resolve %s: %w: no such effect", key, ErrNotResolved)
	case !moved && now.State == stores.EffectPending && !now.LeaseLapsed:
		return now, fmt.Errorf("effects: resolve %s: %w: pending, an attempt holds it until %s (its call may be under way, "+
			"and its lease is renewed while the call runs); resolve it once the attempt is done, or force it",
			key, ErrEffectInFlight, now.LeaseUntil.UTC().Format(TimeFormat))
	case !moved && now.State == stores.EffectUnknown && now.Landing:
		return now, fmt.Errorf("effects: resolve %s: %w: unknown, the request its last attempt sent may still reach the provider "+
			"until %s; resolve it then (a status lookup sooner may miss it), or force it",
			key, ErrEffectInFlight, now.LeaseUntil.UTC().Format(TimeFormat))
	case !moved:
		return now, fmt.Errorf("effects: resolve %s: %w: it is %s already", key, ErrNotResolved, now.State)
	}
	r.obs.resolved(ctx, now)
	return now, nil
}

// TimeFormat is how the package's errors write a time (a lease's end):
// RFC 3339 in UTC, to the millisecond.
const TimeFormat = "2006-01-02T15:04:05.000Z07:00"

// ResolveOption configures Resolve.
type ResolveOption func(*resolveConfig)

type resolveConfig struct{ force bool }

// WithForce makes Resolve resolve an effect an attempt may still act on
// (pending within its holder's lease, or unknown and landing), which it
// otherwise refuses with ErrEffectInFlight: for an operator who knows the
// outcome for certain (the provider's dashboard shows it). A call under way
// is not stopped: it runs to its end (or the call timeout), and the
// provider's success that it may still answer overrules the resolution
// (see Resolve).
func WithForce() ResolveOption { return func(c *resolveConfig) { c.force = true } }
