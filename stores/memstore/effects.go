package memstore

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
)

// Effects is the in-process reference implementation of
// [stores.EffectStore], safe for concurrent use. Build it with [NewEffects].
// Like Store, its records live in the process: use redisstore or
// postgresstore for a fleet.
type Effects struct {
	ttl      time.Duration
	rttl     time.Duration // the result lifetime; 0: the record's
	instance string        // the holder of calls whose context names none
	// now is time.Now: every end (a lease's, a result's, a record's) is
	// now.Add(d), which keeps the monotonic reading, so a step of the wall
	// clock moves neither an end nor the now it is compared with, and the
	// times handed out still read as the wall clock for their callers.
	now func() time.Time

	mu      sync.Mutex
	effects map[string]*stores.Effect
	events  map[string]event // by event id
}

var _ stores.EffectStore = (*Effects)(nil)

// event is a provider event recorded.
type event struct{ at, lapses time.Time } // lapses zero: never

// EffectsOption configures an Effects store.
type EffectsOption func(*Effects)

// WithEffectsTTL makes final effects (succeeded, failed) and recorded
// provider events lapse ttl after they were written (default
// stores.DefaultEffectsTTL; keep it at least as long as the replay
// horizon). Zero keeps them. Pending and unknown effects never lapse: an
// effect whose outcome nobody knows must not vanish.
func WithEffectsTTL(ttl time.Duration) EffectsOption { return func(e *Effects) { e.ttl = ttl } }

// WithResultTTL keeps the provider's result of a succeeded effect for d
// after it succeeded, and the rest of its record for the effects TTL: past
// d the result is dropped (freed), and the effect is reported with Result
// nil and ResultDropped set, still final. Zero (the default) keeps the
// result as long as the record. d may not be longer than the effects TTL
// (see stores.ValidResultTTL).
func WithResultTTL(d time.Duration) EffectsOption { return func(e *Effects) { e.rttl = d } }

// NewEffects returns an empty Effects store. It panics if the TTL is
// negative, or the result lifetime invalid (stores.ValidResultTTL).
func NewEffects(opts ...EffectsOption) *Effects {
	e := &Effects{ttl: stores.DefaultEffectsTTL, instance: stores.NewClaimToken(), now: time.Now,
		effects: map[string]*stores.Effect{}, events: map[string]event{}}
	for _, opt := range opts {
		opt(e)
	}
	if e.ttl < 0 {
		panic(fmt.Sprintf("memstore: negative effects TTL %v", e.ttl))
	}
	if err := stores.ValidResultTTL(e.rttl, e.ttl); err != nil {
		panic("memstore: " + err.Error())
	}
	return e
}

func (e *Effects) holder(ctx context.Context) string {
	if token := stores.ClaimToken(ctx); token != "" {
		return token
	}
	return e.instance
}

// liveLocked returns the record of key, or nil when there is none or it
// lapsed (and is then removed). A result past its lifetime is dropped.
func (e *Effects) liveLocked(key string, now time.Time) *stores.Effect {
	r, ok := e.effects[key]
	if !ok {
		return nil
	}
	if !r.ExpiresAt.IsZero() && !now.Before(r.ExpiresAt) {
		delete(e.effects, key)
		return nil
	}
	dropResult(r, now)
	return r
}

// dropResult frees the result of r when its lifetime passed.
func dropResult(r *stores.Effect, now time.Time) {
	if !r.ResultExpiresAt.IsZero() && !now.Before(r.ResultExpiresAt) {
		r.Result, r.ResultDropped = nil, true
	}
}

// view returns a copy of r as a caller sees it at now.
func view(r *stores.Effect, now time.Time) stores.Effect {
	out := *r
	out.Result = bytes.Clone(r.Result)
	out.LeaseLapsed = r.State == stores.EffectPending && !now.Before(r.LeaseUntil)
	out.Landing = r.State == stores.EffectUnknown && now.Before(r.LeaseUntil)
	return out
}

// Begin records intent as a pending effect held by the caller, or returns
// the effect that exists.
func (e *Effects) Begin(ctx context.Context, intent stores.EffectIntent, lease time.Duration) (bool, stores.Effect, error) {
	if err := ctx.Err(); err != nil {
		return false, stores.Effect{}, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	now := e.now()
	if r := e.liveLocked(intent.Key, now); r != nil {
		return false, view(r, now), nil
	}
	r := &stores.Effect{EffectIntent: intent, State: stores.EffectPending, Attempts: 1, Holder: e.holder(ctx),
		LeaseUntil: now.Add(lease), CreatedAt: now, StateSince: now, UpdatedAt: now}
	e.effects[intent.Key] = r
	return true, view(r, now), nil
}

// Transition moves the effect key as t says, when allowed.
func (e *Effects) Transition(ctx context.Context, key string, t stores.EffectTransition) (bool, stores.Effect, error) {
	if err := ctx.Err(); err != nil {
		return false, stores.Effect{}, err
	}
	sources := t.Sources()
	if len(sources) == 0 {
		return false, stores.Effect{}, fmt.Errorf("memstore: %s to %s: %w", t.From, t.To, stores.ErrEffectTransition)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	moved, now := e.transitionLocked(ctx, key, sources, t)
	return moved, now, nil
}

func (e *Effects) transitionLocked(ctx context.Context, key string, sources []stores.EffectState, t stores.EffectTransition) (bool, stores.Effect) {
	now := e.now()
	r := e.liveLocked(key, now)
	if r == nil {
		return false, stores.Effect{}
	}
	if !slices.Contains(sources, r.State) {
		return false, view(r, now)
	}
	holder := e.holder(ctx)
	live := (r.State == stores.EffectPending || r.State == stores.EffectUnknown) && now.Before(r.LeaseUntil)
	switch {
	case r.State == stores.EffectPending && (t.To == stores.EffectPending || t.To == stores.EffectUnknown) &&
		r.Holder != holder && live:
		return false, view(r, now) // another attempt is still calling
	case t.IfIdle && live: // an attempt is calling, or its request may still land
		return false, view(r, now)
	case t.Overrule && r.Evidence != stores.EffectEvidenceOperator: // only an operator's resolution is overruled
		return false, view(r, now)
	}
	if r.State != t.To {
		r.StateSince = now
	}
	r.State, r.UpdatedAt, r.Evidence = t.To, now, t.Evidence
	if t.Note != "" {
		r.Note = t.Note
	}
	switch t.To {
	case stores.EffectPending:
		r.Holder, r.LeaseUntil = holder, now.Add(t.Lease)
		r.Attempts++
	case stores.EffectSucceeded:
		r.Result = bytes.Clone(t.Result)
		if e.rttl > 0 {
			r.ResultExpiresAt = now.Add(e.rttl)
		}
	}
	switch {
	case t.To == stores.EffectUnknown: // the request sent may land until its lease passes
		r.Holder = ""
	case t.To != stores.EffectPending:
		r.Holder, r.LeaseUntil = "", time.Time{}
	}
	if t.To.Final() && e.ttl > 0 {
		r.ExpiresAt = now.Add(e.ttl)
	}
	return true, view(r, now)
}

// Extend renews the caller's lease of the pending effect key.
func (e *Effects) Extend(ctx context.Context, key string, lease time.Duration) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	now := e.now()
	r := e.liveLocked(key, now)
	if r == nil || r.State != stores.EffectPending || r.Holder != e.holder(ctx) {
		return false, nil
	}
	r.LeaseUntil = now.Add(lease)
	return true, nil
}

// Lookup returns the effect key.
func (e *Effects) Lookup(ctx context.Context, key string) (stores.Effect, error) {
	if err := ctx.Err(); err != nil {
		return stores.Effect{}, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	now := e.now()
	if r := e.liveLocked(key, now); r != nil {
		return view(r, now), nil
	}
	return stores.Effect{}, nil
}

// ApplyEvent records eventID once and, the first time, applies t to key.
func (e *Effects) ApplyEvent(ctx context.Context, eventID, key string, t stores.EffectTransition) (stores.EventResult, error) {
	if err := ctx.Err(); err != nil {
		return stores.EventResult{}, err
	}
	sources := t.Sources()
	if len(sources) == 0 {
		return stores.EventResult{}, fmt.Errorf("memstore: %s to %s: %w", t.From, t.To, stores.ErrEffectTransition)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	now := e.now()
	if ev, ok := e.events[eventID]; ok && (ev.lapses.IsZero() || now.Before(ev.lapses)) {
		var current stores.Effect
		if r := e.liveLocked(key, now); r != nil {
			current = view(r, now)
		}
		return stores.EventResult{Now: current}, nil
	}
	var lapses time.Time
	if e.ttl > 0 {
		lapses = now.Add(e.ttl)
	}
	e.events[eventID] = event{at: now, lapses: lapses}
	moved, current := e.transitionLocked(ctx, key, sources, t)
	return stores.EventResult{First: true, Moved: moved, Now: current}, nil
}

// List returns the effects q selects, oldest first.
func (e *Effects) List(ctx context.Context, q stores.EffectQuery) ([]stores.Effect, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	q = q.Normalized()
	limit := q.Limit
	e.mu.Lock()
	now := e.now()
	var out []stores.Effect
	for key := range e.effects {
		r := e.liveLocked(key, now)
		if r == nil || !slices.Contains(q.States, r.State) ||
			(!q.EnteredBefore.IsZero() && !r.StateSince.Before(q.EnteredBefore)) {
			continue
		}
		out = append(out, view(r, now))
	}
	e.mu.Unlock()
	slices.SortFunc(out, func(a, b stores.Effect) int {
		if c := a.StateSince.Compare(b.StateSince); c != 0 {
			return c
		}
		return bytes.Compare([]byte(a.Key), []byte(b.Key))
	})
	if len(out) > limit {
		out = out[:limit]
	}
	return out, nil
}

// Stats counts the effects in each state and finds the oldest.
func (e *Effects) Stats(ctx context.Context) (map[stores.EffectState]stores.EffectStat, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	now := e.now()
	out := map[stores.EffectState]stores.EffectStat{}
	for key := range e.effects {
		r := e.liveLocked(key, now)
		if r == nil {
			continue
		}
		s := out[r.State]
		s.Count++
		if s.Oldest.IsZero() || r.StateSince.Before(s.Oldest) {
			s.Oldest = r.StateSince
		}
		out[r.State] = s
	}
	return out, nil
}

// Forget removes the effect key.
func (e *Effects) Forget(ctx context.Context, key string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	e.mu.Lock()
	delete(e.effects, key)
	e.mu.Unlock()
	return nil
}

// Purge removes the final effects (succeeded, failed) that entered their
// state before before, the lapsed ones, and the provider events recorded
// before before or lapsed, and reports how many went; it also drops the
// results past their lifetime (WithResultTTL), which it does not count.
// Pending and unknown effects stay, whatever their age. A process's lapsed
// records are dropped when read; Purge frees the others' memory.
func (e *Effects) Purge(ctx context.Context, before time.Time) (int64, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	now := e.now()
	var n int64
	for key, r := range e.effects {
		if r.State.Final() && (r.StateSince.Before(before) || (!r.ExpiresAt.IsZero() && !now.Before(r.ExpiresAt))) {
			delete(e.effects, key)
			n++
			continue
		}
		dropResult(r, now)
	}
	for id, ev := range e.events {
		if ev.at.Before(before) || (!ev.lapses.IsZero() && !now.Before(ev.lapses)) {
			delete(e.events, id)
			n++
		}
	}
	return n, nil
}
