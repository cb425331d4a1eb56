package effects_test

import (
	"context"
	"errors"
	"sync/atomic"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
)

// failingTransitions is an effect store whose transitions fail while fail
// is set, as when its server went away after the intent was written.
type failingTransitions struct {
	stores.EffectStore
	fail atomic.Bool
}

func (s *failingTransitions) Transition(ctx context.Context, key string, t stores.EffectTransition) (bool, stores.Effect, error) {
	if s.fail.Load() {
		return false, stores.Effect{}, errors.New("connection refused")
	}
	return s.EffectStore.Transition(ctx, key, t)
}

// failingBegin is an effect store that cannot record intents.
type failingBegin struct{ stores.EffectStore }

func (failingBegin) Begin(context.Context, stores.EffectIntent, time.Duration) (bool, stores.Effect, error) {
	return false, stores.Effect{}, errors.New("connection refused")
}

// takenOver is an effect store that holds no lease for anyone: every
// renewal finds the effect taken over by another attempt.
type takenOver struct{ stores.EffectStore }

func (takenOver) Extend(context.Context, string, time.Duration) (bool, error) { return false, nil }
