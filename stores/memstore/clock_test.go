package memstore_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// TestWallClockStepKeepsLiveClaims: the wall clock steps an hour forward
// (NTP, a resumed VM) while a delivery holds a claim. The claim has not
// lived its lease: another delivery must still find it in flight, not
// take it over and run the message a second time; and its holder still
// extends it.
func TestWallClockStepKeepsLiveClaims(t *testing.T) {
	t.Parallel()
	s := memstore.New(memstore.WithTTL(time.Hour))
	var step atomic.Int64
	memstore.SetWallClock(s, func() time.Time { return time.Now().Add(time.Duration(step.Load())) })
	ctx := context.Background()
	first, second := stores.WithClaimToken(ctx, "first"), stores.WithClaimToken(ctx, "second")
	if claimed, _, err := s.Claim(first, "k", time.Minute); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	if err := s.Remember(stores.WithClaimToken(ctx, "other"), "remembered", 0, nil); err != nil {
		t.Fatal(err)
	}
	step.Store(int64(time.Hour + time.Minute))
	if claimed, found, err := s.Claim(second, "k", time.Minute); err != nil || claimed {
		t.Fatalf("Claim by another delivery a second after the first, across a step of the wall clock = %v (%v), %v; want refused: the first's claim is live", claimed, found.State, err)
	}
	if held, err := s.Extend(first, "k", time.Minute); err != nil || !held {
		t.Fatalf("Extend by the holder across the step = %v, %v; want held", held, err)
	}
	if r, err := s.Lookup(ctx, "remembered"); err != nil || r.State != stores.StateRemembered {
		t.Fatalf("a record remembered a second ago, kept an hour, after the step: %v, %v; want remembered", r.State, err)
	}
}

// TestWallClockStepKeepsLiveEffectLeases: the wall clock steps an hour
// forward while an effect attempt holds its lease. The attempt has not
// lived its lease: a second attempt must find the effect held (its lease
// not lapsed), not take it over and send the call a second time; the
// holder still extends it.
func TestWallClockStepKeepsLiveEffectLeases(t *testing.T) {
	t.Parallel()
	var step atomic.Int64
	e := memstore.NewEffectsWithWallClock(func() time.Time { return time.Now().Add(time.Duration(step.Load())) })
	ctx := context.Background()
	first, second := stores.WithClaimToken(ctx, "first"), stores.WithClaimToken(ctx, "second")
	intent := stores.EffectIntent{Key: "charge-1", Name: "charge", Scope: "payments", MessageID: "m-1"}
	if began, _, err := e.Begin(first, intent, time.Minute); err != nil || !began {
		t.Fatalf("Begin = %v, %v", began, err)
	}
	step.Store(int64(time.Hour + time.Minute))
	began, found, err := e.Begin(second, intent, time.Minute)
	if err != nil || began || found.LeaseLapsed {
		t.Fatalf("a second attempt a moment after the first, across a step of the wall clock: began %v, lease lapsed %v, %v; want the effect held by the first", began, found.LeaseLapsed, err)
	}
	if held, err := e.Extend(first, intent.Key, time.Minute); err != nil || !held {
		t.Fatalf("Extend by the holder across the step = %v, %v; want held", held, err)
	}
}
