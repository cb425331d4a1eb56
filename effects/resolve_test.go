package effects_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/babelqueue/watermill-idempotency/effects"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// resolveBackends are the effect stores the operator's resolution is
// proven on: memstore, Redis and PostgreSQL.
var resolveBackends = []string{"memory", "redis", "postgres"}

// effectStoreOn returns an effect store of the test's own on backend.
func effectStoreOn(t *testing.T, backend string) stores.EffectStore {
	t.Helper()
	if backend == "memory" {
		return memstore.NewEffects()
	}
	s, _ := twoEffectStores(t, backend)
	return s
}

// onEveryBackend runs test in parallel on an effect store of its own on
// each of resolveBackends.
func onEveryBackend(t *testing.T, test func(t *testing.T, store stores.EffectStore)) {
	t.Helper()
	for _, backend := range resolveBackends {
		t.Run(backend, func(t *testing.T) {
			t.Parallel()
			test(t, effectStoreOn(t, backend))
		})
	}
}

// countedRenewals counts the lease renewals (Extend) a store is asked for.
type countedRenewals struct {
	stores.EffectStore
	n atomic.Int64
}

func (s *countedRenewals) Extend(ctx context.Context, key string, lease time.Duration) (bool, error) {
	s.n.Add(1)
	return s.EffectStore.Extend(ctx, key, lease)
}

// blockedCall is a call that has reached the provider and waits for its
// answer: its context is sent on started, and it answers what answer
// receives (or an error when its context ends first).
type blockedCall struct {
	started chan context.Context
	answer  chan effects.Outcome
}

func newBlockedCall() *blockedCall {
	return &blockedCall{started: make(chan context.Context, 1), answer: make(chan effects.Outcome, 1)}
}

func (b *blockedCall) call(ctx context.Context, _ string) (effects.Outcome, error) {
	b.started <- ctx
	select {
	case o := <-b.answer:
		return o, nil
	case <-ctx.Done():
		return effects.Outcome{}, context.Cause(ctx)
	}
}

type doResult struct {
	result []byte
	err    error
}

// doInBackground runs charge.Do for message id with call, and returns
// where its result comes.
func doInBackground(charge *effects.Effect, id string, call effects.Call) <-chan doResult {
	out := make(chan doResult, 1)
	go func() {
		res, err := charge.Do(delivery(id, "worker-1"), nil, call)
		out <- doResult{res, err}
	}()
	return out
}

// TestResolveRefusesAnEffectInFlight: an operator resolves a charge whose
// call is under way (pending, its lease live and renewed). Without force
// Resolve is refused (ErrEffectInFlight, with ErrNotResolved) and says
// until when; forced, it is recorded, the call runs on (a renewal after
// the resolution does not cancel it), and the provider's success that then
// comes overrules the resolution: Do returns the charge id, not ErrFailed,
// the record keeps it, and the conflict is counted. On memstore, Redis and
// PostgreSQL.
func TestResolveRefusesAnEffectInFlight(t *testing.T) {
	t.Parallel()
	onEveryBackend(t, func(t *testing.T, backing stores.EffectStore) {
		store := &countedRenewals{EffectStore: backing}
		f := newFixture(t, store, effects.WithCallTimeout(3*time.Second), effects.WithLease(3300*time.Millisecond))
		charge := f.fx.Effect("charge")
		b := newBlockedCall()
		done := doInBackground(charge, "m-live", b.call)
		callCtx := <-b.started
		key := effects.ProviderKey("billing", "m-live", "charge")
		ctx := context.Background()

		e, err := f.fx.Resolve(ctx, key, effects.Failed("not in the ledger"), "ops: not in the provider's ledger")
		if !errors.Is(err, effects.ErrEffectInFlight) || !errors.Is(err, effects.ErrNotResolved) || !strings.Contains(err.Error(), "until "+e.LeaseUntil.UTC().Format(effects.TimeFormat)) {
			t.Fatalf("Resolve of an effect whose call is under way: %v (effect %s until %v); want ErrEffectInFlight saying until when", err, e.State, e.LeaseUntil)
		}
		if e.State != stores.EffectPending || !e.LeaseUntil.After(time.Now()) {
			t.Fatalf("refused: the effect is %s until %v; want pending, its lease running", e.State, e.LeaseUntil)
		}

		e, err = f.fx.Resolve(ctx, key, effects.Failed("not in the ledger"), "ops: forced", effects.WithForce())
		if err != nil || e.State != stores.EffectFailed || e.Evidence != effects.EvidenceOperator {
			t.Fatalf("forced Resolve: %+v, %v; want failed by operator", e, err)
		}
		renewals := store.n.Load()
		waitFor(t, 10*time.Second, "a renewal of the lease after the forced resolution", func() (bool, string) {
			return store.n.Load() > renewals, "none yet"
		})
		if cause := context.Cause(callCtx); cause != nil {
			t.Fatalf("the forced resolution ended the call's context: %v", cause)
		}
		b.answer <- effects.Succeeded([]byte("ch_1"))
		got := <-done
		if got.err != nil || string(got.result) != "ch_1" {
			t.Fatalf("Do after the provider charged: %q, %v (ErrFailed: %v); want ch_1, no error", got.result, got.err, errors.Is(got.err, effects.ErrFailed))
		}
		e = effectOf(t, store, "m-live", "charge")
		if e.State != stores.EffectSucceeded || string(e.Result) != "ch_1" || e.Evidence != effects.EvidenceCall ||
			!strings.Contains(e.Note, "overruled an operator's resolution (failed: ops: forced)") {
			t.Fatalf("the record after the provider's success: %s %q by %q, note %q; want succeeded ch_1 by call, the overruled resolution noted", e.State, e.Result, e.Evidence, e.Note)
		}
		if n := sum(t, f.reader, effects.MetricOperatorConflicts, attribute.String("outcome", "overruled"), attribute.String("evidence", effects.EvidenceCall)); n != 1 {
			t.Fatalf("%s{outcome=overruled, evidence=call} = %d, want 1", effects.MetricOperatorConflicts, n)
		}
		p := newProvider()
		if res, err := charge.Do(delivery("m-live", "b"), nil, p.charge("ok")); err != nil || string(res) != "ch_1" {
			t.Fatalf("a later attempt: %q, %v; want ch_1", res, err)
		}
		wantCalls(t, p, 0, 0)
	})
}

// TestResolveRefusesAnEffectStillLanding: an unknown charge whose request
// may still reach the provider (within its attempt's lease) is not
// resolved unless forced, and the refusal says until when.
func TestResolveRefusesAnEffectStillLanding(t *testing.T) {
	t.Parallel()
	onEveryBackend(t, func(t *testing.T, store stores.EffectStore) {
		f := newFixture(t, store, effects.WithLease(time.Minute))
		charge := f.fx.Effect("charge")
		if _, err := charge.Do(delivery("m-landing", "a"), nil, newProvider().charge("timeout")); !errors.Is(err, effects.ErrUnknownOutcome) {
			t.Fatalf("a call without an answer: %v, want ErrUnknownOutcome", err)
		}
		key := effects.ProviderKey("billing", "m-landing", "charge")
		e, err := f.fx.Resolve(context.Background(), key, effects.Failed("not in the ledger"), "ops: not found")
		if !errors.Is(err, effects.ErrEffectInFlight) || !errors.Is(err, effects.ErrNotResolved) ||
			!strings.Contains(err.Error(), "may still reach the provider until "+e.LeaseUntil.UTC().Format(effects.TimeFormat)) {
			t.Fatalf("Resolve of an effect still landing: %v; want ErrEffectInFlight saying until when", err)
		}
		if e.State != stores.EffectUnknown || !e.Landing {
			t.Fatalf("refused: %s, landing %v; want unknown, landing", e.State, e.Landing)
		}
		if e, err := f.fx.Resolve(context.Background(), key, effects.Succeeded([]byte("ch_seen")), "ops: in the dashboard", effects.WithForce()); err != nil || e.State != stores.EffectSucceeded {
			t.Fatalf("forced: %+v, %v", e, err)
		}
	})
}

// TestCallbackSuccessOverrulesAnOperatorsFailed: an operator forced an
// unknown charge to failed; the provider's callback then says it
// succeeded: the effect is succeeded with the charge id, reported as
// overruled. A callback whose event was recorded while the overrule was not
// applied (a crash in between) overrules when it is delivered again.
func TestCallbackSuccessOverrulesAnOperatorsFailed(t *testing.T) {
	t.Parallel()
	onEveryBackend(t, func(t *testing.T, store stores.EffectStore) {
		f := newFixture(t, store, effects.WithLease(time.Minute))
		charge := f.fx.Effect("charge")
		ctx := context.Background()
		for i, id := range []string{"m-cb-1", "m-cb-2"} {
			_, _ = charge.Do(delivery(id, "a"), nil, newProvider().charge("timeout"))
			key := effects.ProviderKey("billing", id, "charge")
			if _, err := f.fx.Resolve(ctx, key, effects.Failed("not in the ledger"), "ops: gave up", effects.WithForce()); err != nil {
				t.Fatal(err)
			}
			event := "evt-" + id
			if i == 1 { // recorded, not applied: as if the process died after the event's record
				if _, err := store.ApplyEvent(ctx, event, key, stores.EffectTransition{To: stores.EffectSucceeded, Result: []byte("ch_" + id), Evidence: effects.EvidenceCallback}); err != nil {
					t.Fatal(err)
				}
			}
			res, err := f.fx.ApplyCallback(ctx, effects.Callback{EventID: event, ProviderKey: key, Outcome: effects.Succeeded([]byte("ch_" + id))})
			if err != nil || res.Outcome != effects.CallbackOverruled || res.Effect.State != stores.EffectSucceeded || string(res.Effect.Result) != "ch_"+id {
				t.Fatalf("%s: a success callback after an operator's failed: %+v, %v; want overruled, succeeded ch_%s", id, res, err, id)
			}
			p := newProvider()
			if got, err := charge.Do(delivery(id, "b"), nil, p.charge("ok")); err != nil || string(got) != "ch_"+id {
				t.Fatalf("%s: a later attempt: %q, %v", id, got, err)
			}
			wantCalls(t, p, 0, 0)
		}
		if n := sum(t, f.reader, effects.MetricOperatorConflicts, attribute.String("outcome", "overruled"), attribute.String("evidence", effects.EvidenceCallback)); n != 2 {
			t.Fatalf("%s{outcome=overruled, evidence=callback} = %d, want 2", effects.MetricOperatorConflicts, n)
		}
	})
}

// TestProviderFailureKeepsAnOperatorsSuccess: an operator forced a charge
// whose call was under way to succeeded; the provider then declines it.
// The operator's resolution stands (Do returns its result), and the
// contradiction is counted for the operator.
func TestProviderFailureKeepsAnOperatorsSuccess(t *testing.T) {
	t.Parallel()
	onEveryBackend(t, func(t *testing.T, store stores.EffectStore) {
		f := newFixture(t, store, effects.WithCallTimeout(3*time.Second), effects.WithLease(3300*time.Millisecond))
		charge := f.fx.Effect("charge")
		b := newBlockedCall()
		done := doInBackground(charge, "m-kept", b.call)
		<-b.started
		key := effects.ProviderKey("billing", "m-kept", "charge")
		if _, err := f.fx.Resolve(context.Background(), key, effects.Succeeded([]byte("ch_manual")), "ops: charged by hand", effects.WithForce()); err != nil {
			t.Fatal(err)
		}
		b.answer <- effects.Failed("card_declined")
		if got := <-done; got.err != nil || string(got.result) != "ch_manual" {
			t.Fatalf("Do: %q, %v; want the operator's ch_manual", got.result, got.err)
		}
		if e := effectOf(t, store, "m-kept", "charge"); e.State != stores.EffectSucceeded || string(e.Result) != "ch_manual" || e.Evidence != effects.EvidenceOperator {
			t.Fatalf("the record: %s %q by %q; want the operator's succeeded ch_manual", e.State, e.Result, e.Evidence)
		}
		if n := sum(t, f.reader, effects.MetricOperatorConflicts, attribute.String("outcome", "kept")); n != 1 {
			t.Fatalf("%s{outcome=kept} = %d, want 1", effects.MetricOperatorConflicts, n)
		}
	})
}
