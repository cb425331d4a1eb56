package effects_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
)

// TestPausedWhileConfirmingSendsNothing: an attempt paused past its
// lease after it took the effect's lease and before it sends asks the store
// right before the call and sends nothing when another attempt took the
// effect over: one charge from a provider without idempotency keys.
//
// Here worker 1 is starved for three quarters of its lease after Begin (so
// Confirm does ask the store), and the process is then paused (SIGSTOP, a
// long GC pause) right after the store answered Confirm's renewal "held",
// before Confirm returned: still before the call. The pause outlasts the
// lease; worker 2 finds it lapsed, reconciles (not found) and charges.
// Worker 1 wakes: the "held" it read was answered more than two thirds of
// the lease after it was sent, too stale to act on, so Confirm asks again,
// learns the effect is another attempt's, and worker 1 sends nothing.
func TestPausedWhileConfirmingSendsNothing(t *testing.T) {
	// pause: Confirm's renewal answered; worker 1 paused before Confirm returns.
	pausedWorkerSendsNothing(t, func(first stores.EffectStore, pause func()) stores.EffectStore {
		return &pausedInConfirm{EffectStore: first, lease: time.Second, pause: pause}
	})
}

// pausedInConfirm is worker 1's effect store in the Confirm tests: its
// first Begin that takes an effect returns three quarters of the lease
// after it was sent (the process starved, not yet past the lease, so
// Confirm will ask), and the first renewal answered after that (Confirm's,
// or the timer's sent at the same moment) calls pause right after the
// answer arrived, as a process stopped then. Renewals arriving meanwhile
// wait for pause to return, as in a stopped process.
type pausedInConfirm struct {
	stores.EffectStore
	lease time.Duration
	pause func()
	once  sync.Once
	mu    sync.Mutex
	began bool
}

func (s *pausedInConfirm) Begin(ctx context.Context, intent stores.EffectIntent, lease time.Duration) (bool, stores.Effect, error) {
	sent := time.Now()
	began, e, err := s.EffectStore.Begin(ctx, intent, lease)
	if began {
		time.Sleep(time.Until(sent.Add(s.lease * 3 / 4))) // starved: the simulated pause's length, not a wait for a condition
		s.mu.Lock()
		s.began = true
		s.mu.Unlock()
	}
	return began, e, err
}

func (s *pausedInConfirm) Extend(ctx context.Context, key string, lease time.Duration) (bool, error) {
	held, err := s.EffectStore.Extend(ctx, key, lease)
	s.mu.Lock()
	armed := s.began
	s.mu.Unlock()
	if armed {
		s.once.Do(s.pause)
	}
	return held, err
}
