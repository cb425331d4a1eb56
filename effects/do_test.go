package effects_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/babelqueue/watermill-idempotency/effects"
	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/internal/keepalive"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// fixture is a Runner on a memstore with metrics and spans recorded.
type fixture struct {
	store  stores.EffectStore
	fx     *effects.Runner
	reader *sdkmetric.ManualReader
	spans  *tracetest.SpanRecorder
}

func newFixture(t *testing.T, store stores.EffectStore, opts ...effects.Option) *fixture {
	t.Helper()
	if store == nil {
		store = memstore.NewEffects()
	}
	f := &fixture{store: store, reader: sdkmetric.NewManualReader(), spans: tracetest.NewSpanRecorder()}
	opts = append([]effects.Option{
		effects.WithMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(f.reader))),
		effects.WithTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(f.spans))),
		effects.WithCallTimeout(200 * time.Millisecond), effects.WithLease(400 * time.Millisecond),
		effects.WithRecordRetry(2, time.Millisecond),
	}, opts...)
	fx, err := effects.New(store, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = fx.Close() })
	f.fx = fx
	return f
}

// delivery is the context a handler of message id under scope billing
// gets from the middleware, with a claim token of its own.
func delivery(id, token string) context.Context {
	ctx := idempotency.ContextWithDelivery(context.Background(), idempotency.Delivery{
		Key: idempotency.Key("billing", id), Scope: "billing", ID: id, Handler: "billing"})
	return stores.WithClaimToken(ctx, token)
}

// provider is a payment provider in the test's memory: a ledger of charges
// by key, and what the next calls do.
type provider struct {
	mu      sync.Mutex
	charges map[string]int // charges made per key
	calls   int
	keys    []string
}

func newProvider() *provider { return &provider{charges: map[string]int{}} }

// charge charges under key and answers as told: "ok", "timeout" (charged,
// reply lost), "declined", "refused" (not sent).
func (p *provider) charge(answer string) effects.Call {
	return func(ctx context.Context, key string) (effects.Outcome, error) {
		p.mu.Lock()
		defer p.mu.Unlock()
		p.calls++
		p.keys = append(p.keys, key)
		switch answer {
		case "refused":
			return effects.NotSent("connection refused"), nil
		case "declined":
			return effects.Failed("card_declined"), nil
		}
		p.charges[key]++
		if answer == "timeout" {
			return effects.Outcome{}, context.DeadlineExceeded
		}
		return effects.Succeeded([]byte("ch_" + key[:8])), nil
	}
}

func (p *provider) status(ctx context.Context, key string) (effects.Outcome, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.charges[key] > 0 {
		return effects.Succeeded([]byte("ch_" + key[:8])), nil
	}
	return effects.NotFound(), nil
}

func (p *provider) total() (calls, charges int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, n := range p.charges {
		charges += n
	}
	return p.calls, charges
}

func wantCalls(t *testing.T, p *provider, calls, charges int) {
	t.Helper()
	if c, ch := p.total(); c != calls || ch != charges {
		t.Fatalf("provider saw %d calls and made %d charges, want %d and %d", c, ch, calls, charges)
	}
}

func effectOf(t *testing.T, s stores.EffectStore, id, name string) stores.Effect {
	t.Helper()
	e, err := s.Lookup(context.Background(), effects.ProviderKey("billing", id, name))
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func TestProviderKeyIsStable(t *testing.T) {
	t.Parallel()
	k := effects.ProviderKey("billing", "m-1", "charge")
	if k != effects.ProviderKey("billing", "m-1", "charge") {
		t.Fatal("the provider key changed between two derivations")
	}
	for _, other := range []string{effects.ProviderKey("shipping", "m-1", "charge"), effects.ProviderKey("billing", "m-2", "charge"),
		effects.ProviderKey("billing", "m-1", "refund"), effects.ProviderKey("", "billing\x1fm-1", "charge2")} {
		if other == k {
			t.Fatalf("another scope, message or name gave the same key %s", k)
		}
	}
	if len(k) != 36 {
		t.Fatalf("provider key %q is not a UUID", k)
	}
}

// TestSucceededIsReplayed: the first attempt calls once; every later
// attempt (a retry, another worker, a replay) gets the kept result without
// a call, under the same key.
func TestSucceededIsReplayed(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	p := newProvider()
	charge := f.fx.Effect("charge", effects.WithResolver(p.status))
	var first []byte
	for i, token := range []string{"a", "a", "b", "c"} {
		res, err := charge.Do(delivery("m-1", token), map[string]any{"amount": 1299}, p.charge("ok"))
		if err != nil {
			t.Fatalf("attempt %d: %v", i+1, err)
		}
		if i == 0 {
			first = res
		} else if string(res) != string(first) {
			t.Fatalf("attempt %d got %q, the first %q", i+1, res, first)
		}
	}
	wantCalls(t, p, 1, 1)
	if e := effectOf(t, f.store, "m-1", "charge"); e.State != stores.EffectSucceeded || e.Evidence != effects.EvidenceCall || string(e.Result) != string(first) {
		t.Fatalf("effect %+v", e)
	}
}

// TestTimeoutIsUnknownThenReconciled is the charge whose reply was
// lost: the provider charged, the reply timed out. The effect is unknown,
// not failed; the retry asks the resolver, which finds the charge: no
// second charge, the provider's result kept.
func TestTimeoutIsUnknownThenReconciled(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	p := newProvider()
	charge := f.fx.Effect("charge", effects.WithResolver(p.status))
	ctx := delivery("m-2", "a")
	_, err := charge.Do(ctx, nil, p.charge("timeout"))
	if !errors.Is(err, effects.ErrUnknownOutcome) || idempotency.IsPermanent(err) || errors.Is(err, effects.ErrFailed) {
		t.Fatalf("a lost reply: %v; want a retryable ErrUnknownOutcome, not failed", err)
	}
	if e := effectOf(t, f.store, "m-2", "charge"); e.State != stores.EffectUnknown || e.Note == "" {
		t.Fatalf("after a lost reply the effect is %s (%q), want unknown with the error", e.State, e.Note)
	}
	res, err := charge.Do(delivery("m-2", "b"), nil, p.charge("ok"))
	if err != nil || len(res) == 0 {
		t.Fatalf("the retry: %q, %v", res, err)
	}
	wantCalls(t, p, 1, 1)
	if e := effectOf(t, f.store, "m-2", "charge"); e.State != stores.EffectSucceeded || e.Evidence != effects.EvidenceLookup {
		t.Fatalf("after the retry: %s by %s, want succeeded by lookup", e.State, e.Evidence)
	}
}

// TestNotFoundIsSentAgainUnderTheSameKey: the lookup says the provider never
// got the request: sent again, with the same key, once.
func TestNotFoundIsSentAgainUnderTheSameKey(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	p := newProvider()
	charge := f.fx.Effect("charge", effects.WithResolver(p.status))
	lost := func(ctx context.Context, key string) (effects.Outcome, error) { // the request died on the way
		p.mu.Lock()
		p.calls++
		p.keys = append(p.keys, key)
		p.mu.Unlock()
		return effects.Outcome{}, errors.New("connection reset by peer")
	}
	if _, err := charge.Do(delivery("m-3", "a"), nil, lost); !errors.Is(err, effects.ErrUnknownOutcome) {
		t.Fatal(err)
	}
	if _, err := charge.Do(delivery("m-3", "b"), nil, p.charge("ok")); err != nil {
		t.Fatal(err)
	}
	wantCalls(t, p, 2, 1)
	if p.keys[0] != p.keys[1] || p.keys[0] != effects.ProviderKey("billing", "m-3", "charge") {
		t.Fatalf("keys sent %v; want the provider key twice", p.keys)
	}
	if e := effectOf(t, f.store, "m-3", "charge"); e.State != stores.EffectSucceeded || e.Attempts != 2 {
		t.Fatalf("effect %s after %d sends", e.State, e.Attempts)
	}
}

// TestParkNeverCallsTwice: a provider without idempotent keys or a status
// lookup: the unknown charge is parked (retryable, no call), and after the
// park limit the budget is exhausted (permanent, for the dead-letter
// topic).
func TestParkNeverCallsTwice(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	p := newProvider()
	var escalated []error
	const limit = 700 * time.Millisecond // past the lease (400ms), which the first parked attempt waits out
	charge := f.fx.Effect("charge", effects.WithParkLimit(limit),
		effects.WithEscalation(func(_ context.Context, e stores.Effect, err error) { escalated = append(escalated, err) }))
	if _, err := charge.Do(delivery("m-4", "a"), nil, p.charge("timeout")); !errors.Is(err, effects.ErrUnknownOutcome) {
		t.Fatal(err)
	}
	for i := range 3 {
		_, err := charge.Do(delivery("m-4", "b"), nil, p.charge("ok"))
		if !errors.Is(err, effects.ErrUnknownOutcome) || idempotency.IsPermanent(err) {
			t.Fatalf("parked attempt %d: %v; want a retryable ErrUnknownOutcome", i+1, err)
		}
	}
	time.Sleep(time.Until(effectOf(t, f.store, "m-4", "charge").StateSince.Add(limit + 50*time.Millisecond)))
	_, err := charge.Do(delivery("m-4", "c"), nil, p.charge("ok"))
	if !errors.Is(err, effects.ErrBudgetExhausted) || !errors.Is(err, effects.ErrUnknownOutcome) || !idempotency.IsPermanent(err) {
		t.Fatalf("past the park limit: %v; want ErrBudgetExhausted, permanent", err)
	}
	wantCalls(t, p, 1, 1)
	if len(escalated) != 4 {
		t.Fatalf("escalated %d times, want 4 (3 parked, 1 exhausted)", len(escalated))
	}
	if e := effectOf(t, f.store, "m-4", "charge"); e.State != stores.EffectUnknown {
		t.Fatalf("the parked effect is %s, want unknown", e.State)
	}
}

// TestDeadLetterPolicy: unknown after reconciling: a permanent error
// matching ErrUnknownOutcome, no second call.
func TestDeadLetterPolicy(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	p := newProvider()
	unsure := func(context.Context, string) (effects.Outcome, error) { return effects.Unknown("processing"), nil }
	charge := f.fx.Effect("charge", effects.WithPolicy(effects.DeadLetter), effects.WithResolver(unsure))
	if _, err := charge.Do(delivery("m-5", "a"), nil, p.charge("timeout")); !errors.Is(err, effects.ErrUnknownOutcome) || idempotency.IsPermanent(err) {
		t.Fatalf("right after the call: %v; want retryable (a later attempt reconciles first)", err)
	}
	_, err := charge.Do(delivery("m-5", "b"), nil, p.charge("ok"))
	if !errors.Is(err, effects.ErrUnknownOutcome) || !idempotency.IsPermanent(err) {
		t.Fatalf("after reconciling: %v; want a permanent ErrUnknownOutcome", err)
	}
	wantCalls(t, p, 1, 1)
}

// TestResubmitWithinBudget: a provider that deduplicates keys is sent the
// same key again, up to WithMaxCalls, then the budget is exhausted.
func TestResubmitWithinBudget(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	p := newProvider()
	charge := f.fx.Effect("charge", effects.WithPolicy(effects.Resubmit), effects.WithMaxCalls(3))
	for i := range 3 {
		if _, err := charge.Do(delivery("m-6", "a"), nil, p.charge("timeout")); !errors.Is(err, effects.ErrUnknownOutcome) || idempotency.IsPermanent(err) {
			t.Fatalf("send %d: %v", i+1, err)
		}
	}
	_, err := charge.Do(delivery("m-6", "a"), nil, p.charge("ok"))
	if !errors.Is(err, effects.ErrBudgetExhausted) {
		t.Fatalf("a fourth send: %v; want ErrBudgetExhausted", err)
	}
	if c, _ := p.total(); c != 3 || p.keys[0] != p.keys[2] {
		t.Fatalf("%d calls with keys %v; want 3 under one key", c, p.keys)
	}
	if got := sum(t, f.reader, effects.MetricBudgetExhausted, attribute.String("effect", "charge")); got != 1 {
		t.Fatalf("%s = %d, want 1", effects.MetricBudgetExhausted, got)
	}
}

// TestFailedIsFinal: a declined card is failed, returned as ErrFailed to
// every attempt, never sent again; the error is permanent (Retry does not
// retry it) and dead-lettered as rejected, not failed.
func TestFailedIsFinal(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	p := newProvider()
	charge := f.fx.Effect("charge", effects.WithPolicy(effects.Resubmit))
	for i := range 3 {
		_, err := charge.Do(delivery("m-7", "a"), nil, p.charge("declined"))
		var failed *effects.FailedError
		if !errors.As(err, &failed) || !errors.Is(err, effects.ErrFailed) || failed.Reason != "card_declined" {
			t.Fatalf("attempt %d: %v; want FailedError card_declined", i+1, err)
		}
		if idempotency.Retryable(err) || !idempotency.IsPermanent(err) {
			t.Fatalf("attempt %d: a declined charge is retryable (%v); want permanent: a retry finds the same answer", i+1, err)
		}
		if reason := deadletter.Reason(fmt.Errorf("charge: %w", err)); reason != envelope.ReasonRejected {
			t.Fatalf("attempt %d: dead-letter reason %q; want %q", i+1, reason, envelope.ReasonRejected)
		}
	}
	wantCalls(t, p, 1, 0)
}

// TestNotSentIsSentAgain: a refused connection is not an unknown outcome:
// the next attempt sends it, under the same key, without reconciling.
func TestNotSentIsSentAgain(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	p := newProvider()
	charge := f.fx.Effect("charge") // Park, no resolver
	_, err := charge.Do(delivery("m-8", "a"), nil, p.charge("refused"))
	if err == nil || errors.Is(err, effects.ErrUnknownOutcome) {
		t.Fatalf("not sent: %v; want a plain retryable error", err)
	}
	if _, err := charge.Do(delivery("m-8", "a"), nil, p.charge("ok")); err != nil {
		t.Fatal(err)
	}
	wantCalls(t, p, 2, 1)
}

// TestInFlightWhileTheCallRuns: another attempt's pending effect is left
// alone while its call runs, however long past the lease it began with (its
// lease renewed meanwhile): a second attempt waits for it (WithParkWait,
// here two and a half leases), then is parked. Once the call ended without
// an answer, the request it sent may still land until its last lease
// passes: the next attempt waits that out, then reconciles, without a
// second call.
func TestInFlightWhileTheCallRuns(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil, effects.WithParkWait(time.Second))
	p := newProvider()
	charge := f.fx.Effect("charge", effects.WithResolver(p.status))
	entered, release := make(chan struct{}), make(chan struct{})
	slow := func(ctx context.Context, key string) (effects.Outcome, error) {
		p.charge("ok")(ctx, key) // charged at once; the reply waits, past the call timeout
		close(entered)
		<-release
		return effects.Outcome{}, ctx.Err()
	}
	done := make(chan error, 1)
	go func() { _, err := charge.Do(delivery("m-9", "a"), nil, slow); done <- err }()
	<-entered
	start := time.Now()
	_, err := charge.Do(delivery("m-9", "b"), nil, p.charge("ok"))
	if !errors.Is(err, idempotency.ErrInFlight) {
		t.Fatalf("while the other attempt's call runs: %v; want ErrInFlight", err)
	}
	if waited := time.Since(start); waited < 900*time.Millisecond {
		t.Fatalf("parked after %v; want after the park wait (1s)", waited)
	}
	if e := effectOf(t, f.store, "m-9", "charge"); e.State != stores.EffectPending || e.Holder != "a" || e.LeaseLapsed {
		t.Fatalf("two and a half leases into the call: %s held by %q, lapsed %v; want pending, held by a, live", e.State, e.Holder, e.LeaseLapsed)
	}
	close(release)
	if err := <-done; !errors.Is(err, effects.ErrUnknownOutcome) || errors.Is(err, effects.ErrLeaseLost) {
		t.Fatalf("the slow call: %v; want ErrUnknownOutcome, its lease held", err)
	}
	if e := effectOf(t, f.store, "m-9", "charge"); e.State != stores.EffectUnknown || !e.Landing {
		t.Fatalf("right after the call: %s, landing %v; want unknown, landing", e.State, e.Landing)
	}
	res, err := charge.Do(delivery("m-9", "b"), nil, p.charge("ok"))
	if err != nil || len(res) == 0 {
		t.Fatalf("after the landing: %q, %v", res, err)
	}
	wantCalls(t, p, 1, 1)
	if e := effectOf(t, f.store, "m-9", "charge"); e.State != stores.EffectSucceeded || e.Evidence != effects.EvidenceLookup || e.Attempts != 1 {
		t.Fatalf("settled: %s by %s after %d send(s); want succeeded by lookup after one", e.State, e.Evidence, e.Attempts)
	}
}

// TestLostLeaseCancelsTheCall: an attempt whose lease the store no longer
// holds for it (another attempt took the effect over) has its call's
// context cancelled, with a cause matching keepalive.ErrLost, before the
// call timeout; Do's error matches ErrLeaseLost and ErrUnknownOutcome, and
// the loss is counted.
func TestLostLeaseCancelsTheCall(t *testing.T) {
	t.Parallel()
	store := &takenOver{EffectStore: memstore.NewEffects()}
	f := newFixture(t, store, effects.WithCallTimeout(2*time.Second), effects.WithLease(3*time.Second))
	charge := f.fx.Effect("charge")
	var cause error
	start := time.Now()
	_, err := charge.Do(delivery("m-14", "a"), nil, func(ctx context.Context, key string) (effects.Outcome, error) {
		<-ctx.Done()
		cause = context.Cause(ctx)
		return effects.Outcome{}, ctx.Err()
	})
	if took := time.Since(start); took >= 2*time.Second {
		t.Fatalf("the call ran %v: its context ended with the call timeout, not with the lost lease", took)
	}
	if !errors.Is(cause, keepalive.ErrLost) {
		t.Fatalf("the call's context ended with %v; want keepalive.ErrLost", cause)
	}
	if !errors.Is(err, effects.ErrLeaseLost) || !errors.Is(err, effects.ErrUnknownOutcome) || idempotency.IsPermanent(err) {
		t.Fatalf("Do: %v; want a retryable ErrLeaseLost and ErrUnknownOutcome", err)
	}
	if got := sum(t, f.reader, effects.MetricLeasesLost, attribute.String("effect", "charge")); got != 1 {
		t.Fatalf("%s = %d, want 1", effects.MetricLeasesLost, got)
	}
}

// TestPayloadConflict: the same effect of the same message with another
// request is refused before anything is sent.
func TestPayloadConflict(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	p := newProvider()
	charge := f.fx.Effect("charge")
	if _, err := charge.Do(delivery("m-10", "a"), map[string]any{"amount": 1299, "currency": "EUR"}, p.charge("ok")); err != nil {
		t.Fatal(err)
	}
	if _, err := charge.Do(delivery("m-10", "a"), map[string]any{"currency": "EUR", "amount": 1299.0}, p.charge("ok")); err != nil {
		t.Fatalf("the same request spelled otherwise: %v", err)
	}
	_, err := charge.Do(delivery("m-10", "a"), map[string]any{"amount": 1300, "currency": "EUR"}, p.charge("ok"))
	if !errors.Is(err, effects.ErrPayloadConflict) || !idempotency.IsPermanent(err) {
		t.Fatalf("another amount: %v; want ErrPayloadConflict", err)
	}
	wantCalls(t, p, 1, 1)
}

// TestIntentIsDurableBeforeTheCall: the call finds its effect recorded,
// pending, with its key and fingerprint.
func TestIntentIsDurableBeforeTheCall(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	charge := f.fx.Effect("charge")
	var seen stores.Effect
	_, err := charge.Do(delivery("m-11", "a"), map[string]int{"amount": 5}, func(ctx context.Context, key string) (effects.Outcome, error) {
		var err error
		seen, err = f.store.Lookup(ctx, key)
		return effects.Succeeded(nil), err
	})
	if err != nil {
		t.Fatal(err)
	}
	if seen.State != stores.EffectPending || seen.Fingerprint == 0 || seen.MessageID != "m-11" || seen.Scope != "billing" || seen.Name != "charge" {
		t.Fatalf("during the call the record was %+v; want pending with the intent", seen)
	}
}

// TestNoDelivery: outside the middleware there is no identity to key on.
func TestNoDelivery(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	if _, err := f.fx.Effect("charge").Do(context.Background(), nil, newProvider().charge("ok")); !errors.Is(err, effects.ErrNoDelivery) || !idempotency.IsPermanent(err) {
		t.Fatalf("%v, want ErrNoDelivery", err)
	}
}

// TestRefundIsAnEffectOfItsOwn: a compensation has its own key and state.
func TestRefundIsAnEffectOfItsOwn(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	p := newProvider()
	charge, refund := f.fx.Effect("charge"), f.fx.Effect("refund")
	if _, err := charge.Do(delivery("m-12", "a"), nil, p.charge("ok")); err != nil {
		t.Fatal(err)
	}
	if _, err := refund.Do(delivery("m-12", "a"), nil, p.charge("timeout")); !errors.Is(err, effects.ErrUnknownOutcome) {
		t.Fatal(err)
	}
	if c, r := effectOf(t, f.store, "m-12", "charge"), effectOf(t, f.store, "m-12", "refund"); c.State != stores.EffectSucceeded || r.State != stores.EffectUnknown || c.Key == r.Key {
		t.Fatalf("charge %s (%s), refund %s (%s)", c.State, c.Key, r.State, r.Key)
	}
}

// TestOperatorResolves: a parked effect resolved by hand with a note;
// the next attempt gets the operator's result without a call.
func TestOperatorResolves(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	p := newProvider()
	charge := f.fx.Effect("charge")
	_, _ = charge.Do(delivery("m-13", "a"), nil, p.charge("timeout"))
	key := effects.ProviderKey("billing", "m-13", "charge")
	// Once the request it sent can no longer land (its attempt's lease):
	// before, Resolve is refused (TestResolveRefusesAnEffectStillLanding).
	waitFor(t, 10*time.Second, "the request to have landed", func() (bool, string) {
		e := effectOf(t, f.store, "m-13", "charge")
		return !e.Landing, fmt.Sprintf("%s, landing until %v", e.State, e.LeaseUntil)
	})
	e, err := f.fx.Resolve(context.Background(), key, effects.Succeeded([]byte("ch_manual")), "found in the dashboard by ops")
	if err != nil || e.State != stores.EffectSucceeded || e.Evidence != effects.EvidenceOperator || e.Note != "found in the dashboard by ops" {
		t.Fatalf("Resolve: %+v, %v", e, err)
	}
	if _, err := f.fx.Resolve(context.Background(), key, effects.Failed("x"), "again"); !errors.Is(err, effects.ErrNotResolved) {
		t.Fatalf("resolving a final effect: %v; want ErrNotResolved", err)
	}
	if res, err := charge.Do(delivery("m-13", "b"), nil, p.charge("ok")); err != nil || string(res) != "ch_manual" {
		t.Fatalf("after the resolution: %q, %v", res, err)
	}
	wantCalls(t, p, 1, 1)
}

// sum adds up an Int64 sum metric's points carrying attr.
func sum(t *testing.T, r *sdkmetric.ManualReader, name string, attrs ...attribute.KeyValue) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var total int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			if s, ok := m.Data.(metricdata.Sum[int64]); ok {
				for _, dp := range s.DataPoints {
					if hasAll(dp.Attributes, attrs) {
						total += dp.Value
					}
				}
			}
		}
	}
	return total
}

func hasAll(set attribute.Set, attrs []attribute.KeyValue) bool {
	for _, a := range attrs {
		if v, ok := set.Value(a.Key); !ok || v != a.Value {
			return false
		}
	}
	return true
}

// TestStoreDownSendsNothing: no intent, no call: the delivery fails with the
// transient ErrStore.
func TestStoreDownSendsNothing(t *testing.T) {
	t.Parallel()
	f := newFixture(t, failingBegin{memstore.NewEffects()})
	p := newProvider()
	_, err := f.fx.Effect("charge").Do(delivery("s-1", "a"), nil, p.charge("ok"))
	if !errors.Is(err, idempotency.ErrStore) || !idempotency.IsTransient(err) {
		t.Fatalf("%v; want ErrStore", err)
	}
	wantCalls(t, p, 0, 0)
}
