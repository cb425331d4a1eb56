package effects_test

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/effects"
	"github.com/babelqueue/watermill-idempotency/internal/fakepay"
	"github.com/babelqueue/watermill-idempotency/internal/testenv"
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
	t.Parallel()
	const lease = time.Second
	for _, backend := range pauseBackends {
		t.Run(backend, func(t *testing.T) {
			t.Parallel()
			first, second := twoEffectStores(t, backend)
			provider, err := fakepay.Start(fakepay.Config{Lookups: true})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = provider.Close() })
			client := fakepay.Client{BaseURL: provider.URL(), HTTP: &http.Client{}}
			paused := &pausedInConfirm{EffectStore: first, lease: lease, extended: make(chan struct{}), wake: make(chan struct{})}
			worker := func(store stores.EffectStore) *effects.Effect { return pauseWorker(t, store, client) }
			charge := chargeOrder(client)
			id := "msg-" + testenv.RandomHex(4)
			delivery := func(token string) context.Context { return billingDelivery(id, token) }
			done1 := make(chan error, 1)
			var res1 []byte
			w1 := worker(paused)
			go func() {
				var err error
				res1, err = w1.Do(delivery("worker-1"), nil, charge)
				done1 <- err
			}()
			<-paused.extended // Confirm's renewal answered; worker 1 is paused before Confirm returns
			key := effects.ProviderKey("billing", id, "charge")
			testenv.Eventually(t, "worker 1's lease to pass while it is paused", func() bool {
				e, err := second.Lookup(context.Background(), key)
				return err == nil && e.LeaseLapsed
			})
			res2, err := worker(second).Do(delivery("worker-2"), nil, charge)
			if err != nil || len(res2) == 0 {
				t.Fatalf("worker 2 after worker 1's lease passed: %q, %v; want the charge made", res2, err)
			}
			close(paused.wake)
			err1 := <-done1
			if n := len(provider.Ledger()); n != 1 {
				t.Fatalf("the provider charged %d times (worker 1 got %q, %v; worker 2 %q); want once: worker 1 took a renewal answered more than a lease before as Confirm's go-ahead and sent", n, res1, err1, res2)
			}
		})
	}
}

// pausedInConfirm is an effect store that plays a starved, then paused
// process: its first Begin that takes an effect returns three quarters of
// the lease after it was sent (starved, not yet past the lease), and the
// renewals that follow it (Confirm's, and the one the timer sends at once)
// reach the store and are answered, then return only once wake is closed,
// as from a process stopped right after it read the answers.
type pausedInConfirm struct {
	stores.EffectStore
	lease          time.Duration
	extended, wake chan struct{}
	once           sync.Once
	mu             sync.Mutex
	began          bool
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
		s.once.Do(func() { close(s.extended) })
		<-s.wake
	}
	return held, err
}
