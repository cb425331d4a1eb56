package storetest

import (
	"context"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
)

// PurgeableEffects is an effect store with the cleanup every shipped one
// has: Purge removes the final effects (succeeded, failed) that entered
// their state before a time, and the provider events recorded before it;
// it never removes a pending or unknown effect.
type PurgeableEffects interface {
	stores.EffectStore
	Purge(ctx context.Context, before time.Time) (int64, error)
}

// RunEffectsPurge checks the cleanup of the stores newStore returns (each
// of its own, as RunEffects's, built without a retention option): a final
// effect is kept for stores.DefaultEffectsTTL, a pending or unknown one
// with no expiry; Purge removes nothing before its time, then the final
// effects and the events, the pending and unknown effects staying as they
// were, and a purged effect begins afresh.
func RunEffectsPurge(t *testing.T, newStore func(t *testing.T) PurgeableEffects) {
	t.Run("DefaultRetention", func(t *testing.T) {
		t.Parallel()
		k := keys{run: randomHex(6)}
		s := newStore(t)
		ctx := ctxWithTimeout(t)
		done, unsure := intent(t, k, "done"), intent(t, k, "unsure")
		for _, in := range []stores.EffectIntent{done, unsure} {
			begin1(t, s, ctx, in, time.Minute, true)
		}
		move(t, s, ctx, done.Key, stores.EffectTransition{To: stores.EffectSucceeded}, true, "to succeeded")
		move(t, s, ctx, unsure.Key, stores.EffectTransition{To: stores.EffectUnknown}, true, "to unknown")
		want := time.Now().Add(stores.DefaultEffectsTTL)
		if e := lookupEffect(t, s, ctx, done.Key); e.ExpiresAt.Before(want.Add(-time.Minute)) || e.ExpiresAt.After(want.Add(time.Minute)) {
			t.Fatalf("a succeeded effect of a store built without a retention expires at %v, want about %v (stores.DefaultEffectsTTL from now)", e.ExpiresAt, want)
		}
		if e := lookupEffect(t, s, ctx, unsure.Key); !e.ExpiresAt.IsZero() {
			t.Fatalf("an unknown effect expires at %v, want never", e.ExpiresAt)
		}
	})
	t.Run("Purge", func(t *testing.T) {
		t.Parallel()
		k := keys{run: randomHex(6)}
		s := newStore(t)
		ctx := ctxWithTimeout(t)
		done, lost, open, unsure := intent(t, k, "done"), intent(t, k, "lost"), intent(t, k, "open"), intent(t, k, "unsure")
		for _, in := range []stores.EffectIntent{done, lost, open, unsure} {
			begin1(t, s, ctx, in, time.Minute, true)
		}
		move(t, s, ctx, done.Key, stores.EffectTransition{To: stores.EffectSucceeded, Result: []byte("ch_1")}, true, "to succeeded")
		move(t, s, ctx, lost.Key, stores.EffectTransition{To: stores.EffectFailed}, true, "to failed")
		move(t, s, ctx, unsure.Key, stores.EffectTransition{To: stores.EffectUnknown}, true, "to unknown")
		evt := k.of(t, "evt")
		if r, err := s.ApplyEvent(ctx, evt, done.Key, stores.EffectTransition{To: stores.EffectSucceeded}); err != nil || !r.First {
			t.Fatalf("ApplyEvent: %+v, %v", r, err)
		}
		if n, err := s.Purge(ctx, time.Now().Add(-time.Hour)); err != nil || n != 0 {
			t.Fatalf("Purge of what entered its state an hour ago removed %d (%v), want 0", n, err)
		}
		if e := lookupEffect(t, s, ctx, done.Key); e.State != stores.EffectSucceeded {
			t.Fatalf("a succeeded effect after a Purge of older ones: %s", e.State)
		}
		n, err := s.Purge(ctx, time.Now().Add(time.Minute))
		if err != nil || n != 3 {
			t.Fatalf("Purge of everything before a minute from now removed %d (%v), want 3 (succeeded, failed, the event)", n, err)
		}
		for key, want := range map[string]stores.EffectState{done.Key: stores.EffectNone, lost.Key: stores.EffectNone,
			open.Key: stores.EffectPending, unsure.Key: stores.EffectUnknown} {
			if e := lookupEffect(t, s, ctx, key); e.State != want {
				t.Fatalf("after Purge %s is %s, want %s", key, e.State, want)
			}
		}
		stats, err := s.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if stats[stores.EffectSucceeded].Count+stats[stores.EffectFailed].Count != 0 || stats[stores.EffectPending].Count != 1 || stats[stores.EffectUnknown].Count != 1 {
			t.Fatalf("Stats after Purge: %v; want one pending, one unknown", stats)
		}
		if r, err := s.ApplyEvent(ctx, evt, open.Key, stores.EffectTransition{To: stores.EffectUnknown}); err != nil || !r.First {
			t.Fatalf("a purged event, received again: %+v, %v; want first again", r, err)
		}
		begin1(t, s, ctx, done, time.Minute, true)
	})
}
