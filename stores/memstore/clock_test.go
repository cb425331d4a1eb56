package memstore_test

import (
	"context"
	"strings"
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

// TestEffectLeasesRunOnTheMonotonicClock: an effect's lease (and every
// time the store computes from now) keeps the monotonic reading of the
// clock it was taken on, so that comparing it with the store's now uses
// the monotonic clock: a step of the wall clock (NTP, a resumed VM) neither
// lapses a running attempt's lease at once nor keeps a lapsed one alive.
// The wall clock itself cannot be stepped by a test; the monotonic
// reading is what time.Time documents comparisons to use ("m=" in its
// String form).
func TestEffectLeasesRunOnTheMonotonicClock(t *testing.T) {
	t.Parallel()
	e := memstore.NewEffects()
	ctx := stores.WithClaimToken(context.Background(), "first")
	intent := stores.EffectIntent{Key: "charge-1", Name: "charge", Scope: "payments", MessageID: "m-1"}
	began, found, err := e.Begin(ctx, intent, time.Minute)
	if err != nil || !began {
		t.Fatalf("Begin = %v, %v", began, err)
	}
	for name, at := range map[string]time.Time{"LeaseUntil": found.LeaseUntil, "StateSince": found.StateSince} {
		if !strings.Contains(at.String(), " m=") {
			t.Fatalf("%s %v carries no monotonic reading: compared on the wall clock, a step of it moves the lease", name, at)
		}
	}
	if _, err := e.Extend(ctx, intent.Key, time.Minute); err != nil {
		t.Fatal(err)
	}
	now, err := e.Lookup(context.Background(), intent.Key)
	if err != nil || !strings.Contains(now.LeaseUntil.String(), " m=") {
		t.Fatalf("after Extend: LeaseUntil %v, %v; want a monotonic reading", now.LeaseUntil, err)
	}
}
