package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// waitUntil polls cond until it holds, or fails the test after 10 seconds
// saying what it waited for.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// eventLog keeps the middleware's events by outcome.
type eventLog struct {
	mu   sync.Mutex
	seen map[idempotency.Outcome][]idempotency.Event
}

func (o *eventLog) Observe(_ context.Context, e idempotency.Event) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.seen == nil {
		o.seen = map[idempotency.Outcome][]idempotency.Event{}
	}
	o.seen[e.Outcome] = append(o.seen[e.Outcome], e)
}

func (o *eventLog) of(outcome idempotency.Outcome) []idempotency.Event {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]idempotency.Event(nil), o.seen[outcome]...)
}

// shared is memstore dressed as a store other processes share, as Redis or
// PostgreSQL are (Capabilities().Local false): the guard keeps its claims
// alive by renewals, which these tests exercise.
type shared struct{ *memstore.Store }

func (s shared) Capabilities() stores.Capabilities {
	c := s.Store.Capabilities()
	c.Local = false
	return c
}

// newShared returns an empty memstore dressed as a shared store.
func newShared() shared { return shared{memstore.New()} }

// extendCounter counts the renewals (Extend) a store is asked for.
type extendCounter struct {
	stores.Store
	extends atomic.Int64
}

func (s *extendCounter) Extend(ctx context.Context, key string, lease time.Duration) (bool, error) {
	s.extends.Add(1)
	return s.Store.Extend(ctx, key, lease)
}

// TestALocalStoreKeepsNothingAlive: on a store whose claims die with the
// process (memstore), a run four times longer than the lease sends no
// renewal (the store is asked once, when the handler returned) and keeps
// its claim all the same: a copy delivered meanwhile is
// parked, and the message runs once. On a shared store the same run is
// renewed.
func TestALocalStoreKeepsNothingAlive(t *testing.T) {
	t.Parallel()
	// A shared store's renewals come every third of the lease: a lease of
	// 60 ms lapsed on a loaded machine (a renewal 40 ms late), and the copy
	// ran beside the first run.
	const lease = 300 * time.Millisecond
	for _, local := range []bool{true, false} {
		var store stores.Store = memstore.New()
		if !local {
			store = newShared()
		}
		counted := &extendCounter{Store: store}
		var runs atomic.Int32
		release := make(chan struct{})
		h := idempotency.Middleware(counted, idempotency.WithClaim(lease), idempotency.WithParkWait(0))(
			func(msg *message.Message) ([]*message.Message, error) {
				runs.Add(1)
				<-release
				return nil, msg.Context().Err()
			})
		payload := envelopeWithID(t, "local-1")
		done := make(chan error, 1)
		go func() { _, err := h(msgOf(payload)); done <- err }()
		waitUntil(t, "the first run", func() bool { return runs.Load() == 1 })
		time.Sleep(4 * lease) // the handler outlives its lease
		// The copy in a goroutine of its own: one that runs the handler
		// waits for release, and must fail the test, not hang it.
		copied := make(chan error, 1)
		go func() { _, err := h(msgOf(payload)); copied <- err }()
		var err error
		waitUntil(t, "the copy's answer", func() bool {
			select {
			case err = <-copied:
				return true
			default:
				return runs.Load() > 1
			}
		})
		if n := runs.Load(); n > 1 || !errors.Is(err, idempotency.ErrInFlight) {
			close(release)
			t.Fatalf("local=%v: a copy while the first runs = %v with %d runs, want parked", local, err, n)
		}
		close(release)
		if err := <-done; err != nil {
			t.Fatalf("local=%v: the long run = %v, want success with its context intact", local, err)
		}
		if _, err := h(msgOf(payload)); err != nil || runs.Load() != 1 {
			t.Fatalf("local=%v: a copy after the run = %v with %d runs, want skipped after 1", local, err, runs.Load())
		}
		switch n := counted.extends.Load(); {
		case local && n != 1:
			t.Fatalf("a local store was asked for %d renewals, want none while the handler ran and one check when it returned", n)
		case !local && n == 0:
			t.Fatal("a shared store's claim was never renewed over four leases")
		}
	}
}

// TestHandlerOutlivingItsLease: a run four times longer than its claim's
// lease keeps the claim (it is renewed while the handler runs): a copy
// delivered meanwhile is parked, not run, and a copy after the run is
// skipped. One run, however long the handler takes.
func TestHandlerOutlivingItsLease(t *testing.T) {
	t.Parallel()
	const lease = 300 * time.Millisecond
	var runs atomic.Int32
	obs := &eventLog{}
	h := idempotency.Middleware(memstore.New(), idempotency.WithClaim(lease), idempotency.WithParkWait(0), idempotency.WithObserver(obs))(
		func(msg *message.Message) ([]*message.Message, error) {
			if runs.Add(1) == 1 {
				time.Sleep(4 * lease)
			}
			return nil, msg.Context().Err()
		})
	payload := envelopeWithID(t, "slow-1")
	done := make(chan error, 1)
	go func() {
		_, err := h(msgOf(payload))
		done <- err
	}()
	waitUntil(t, "the first run to start", func() bool { return runs.Load() == 1 })
	time.Sleep(2 * lease) // past the lease the claim was taken for
	if _, err := h(msgOf(payload)); !errors.Is(err, idempotency.ErrInFlight) {
		t.Fatalf("a copy delivered while the first ran past its lease = %v, want parked (ErrInFlight): the claim was not kept alive", err)
	}
	if err := <-done; err != nil {
		t.Fatalf("the slow run: %v (its context ended: the claim was lost)", err)
	}
	if _, err := h(msgOf(payload)); err != nil {
		t.Fatalf("a copy after the run: %v", err)
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("runs = %d, want 1", n)
	}
	if lost := obs.of(idempotency.OutcomeClaimLost); len(lost) != 0 {
		t.Fatalf("claims lost: %v", lost)
	}
}

// untilItsContextEnds is a handler that sends its delivery's key on
// started, waits for its context to end (10 seconds at most) and keeps the
// cause in cause; it then finishes its work regardless.
func untilItsContextEnds(started chan<- string, cause *atomic.Value) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		d, _ := idempotency.DeliveryFromContext(msg.Context())
		started <- d.Key
		select {
		case <-msg.Context().Done():
			cause.Store(context.Cause(msg.Context()))
		case <-time.After(10 * time.Second):
			cause.Store(errors.New("the handler's context never ended"))
		}
		return nil, nil
	}
}

// TestClaimTakenOverCancelsTheHandler: a claim taken by another holder
// while the handler runs (an operator's Forget and another delivery's
// Claim) ends the handler's context with ErrClaimLost at the next renewal;
// the delivery is counted as claim_lost, does not write its record over
// the other holder's claim, and is not acked.
func TestClaimTakenOverCancelsTheHandler(t *testing.T) {
	t.Parallel()
	const lease = 90 * time.Millisecond
	store := newShared()
	obs := &eventLog{}
	started := make(chan string, 1)
	var cause atomic.Value
	h := idempotency.Middleware(store, idempotency.WithClaim(lease), idempotency.WithObserver(obs))(untilItsContextEnds(started, &cause))
	done := make(chan error, 1)
	go func() {
		_, err := h(msgOf(envelopeWithID(t, "taken-1")))
		done <- err
	}()
	key := <-started
	ctx := context.Background()
	other := stores.WithClaimToken(ctx, "the-other-delivery")
	if err := store.Forget(ctx, key); err != nil {
		t.Fatal(err)
	}
	if claimed, _, err := store.Claim(other, key, time.Minute); err != nil || !claimed {
		t.Fatalf("the other delivery's Claim = %v, %v", claimed, err)
	}
	// It does not own the run any more: it is not acked as if it did (a
	// transient error: the router nacks, and the redelivery finds the
	// other holder's outcome).
	if err := <-done; !errors.Is(err, idempotency.ErrClaimLost) || !idempotency.IsTransient(err) {
		t.Fatalf("delivery: %v, want a transient error matching ErrClaimLost", err)
	}
	if c, _ := cause.Load().(error); !errors.Is(c, idempotency.ErrClaimLost) {
		t.Fatalf("the handler's context ended with %v, want a cause matching ErrClaimLost", c)
	}
	lost := obs.of(idempotency.OutcomeClaimLost)
	if len(lost) != 1 || !errors.Is(lost[0].Err, idempotency.ErrClaimLost) || lost[0].MessageID != "taken-1" {
		t.Fatalf("claim_lost events = %v, want one for taken-1", lost)
	}
	if r, err := store.Lookup(ctx, key); err != nil || r.State != stores.StateInFlight {
		t.Fatalf("the key after the loser finished = %v, %v; want the other holder's claim, not a record", r.State, err)
	}
	if held, err := store.Extend(other, key, time.Minute); err != nil || !held {
		t.Fatalf("the other holder's claim after the loser finished: held %v, %v", held, err)
	}
}

// TestProducedMessagesAwaitingTheAckKeepTheClaim: a handler that returns
// messages is remembered once the router acks; while the ack is awaited
// (here four leases) the claim is kept alive, so a copy delivered
// meanwhile is parked, and the message runs once.
func TestProducedMessagesAwaitingTheAckKeepTheClaim(t *testing.T) {
	t.Parallel()
	const lease = 300 * time.Millisecond
	var runs atomic.Int32
	h := idempotency.Middleware(newShared(), idempotency.WithClaim(lease), idempotency.WithParkWait(0))(
		func(msg *message.Message) ([]*message.Message, error) {
			runs.Add(1)
			return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("out"))}, nil
		})
	payload := envelopeWithID(t, "producing-1")
	first := msgOf(payload)
	if _, err := h(first); err != nil {
		t.Fatal(err)
	}
	time.Sleep(4 * lease) // the router's publisher is slow: no ack yet
	if _, err := h(msgOf(payload)); !errors.Is(err, idempotency.ErrInFlight) {
		t.Fatalf("a copy while the produced messages await the ack = %v, want parked", err)
	}
	first.Ack()
	waitUntil(t, "the record written after the ack", func() bool {
		_, err := h(msgOf(payload))
		return err == nil
	})
	if n := runs.Load(); n != 1 {
		t.Fatalf("runs = %d, want 1", n)
	}
}

// claimGivesUp is a store whose Claim takes the claim and then reports its
// caller's deadline, as a reply landing after the deadline does.
type claimGivesUp struct{ *memstore.Store }

func (s claimGivesUp) Claim(ctx context.Context, key string, lease time.Duration) (bool, stores.Record, error) {
	if _, _, err := s.Store.Claim(ctx, key, lease); err != nil {
		return false, stores.Record{}, err
	}
	<-ctx.Done()
	return false, stores.Record{}, ctx.Err()
}

// TestGivenUpClaimIsReleased: a delivery whose Claim gave up at the store
// timeout, the claim taken all the same, releases it: the redelivery runs
// at once instead of waiting for the lease.
func TestGivenUpClaimIsReleased(t *testing.T) {
	t.Parallel()
	store := memstore.New()
	var runs atomic.Int32
	run := func(*message.Message) ([]*message.Message, error) { runs.Add(1); return nil, nil }
	slow := idempotency.Middleware(claimGivesUp{store}, idempotency.WithStoreTimeout(20*time.Millisecond), idempotency.WithClaim(time.Minute))(run)
	payload := envelopeWithID(t, "given-up-1")
	if _, err := slow(msgOf(payload)); !errors.Is(err, idempotency.ErrStore) {
		t.Fatalf("delivery whose claim gave up = %v, want ErrStore", err)
	}
	fine := idempotency.Middleware(store, idempotency.WithClaim(time.Minute), idempotency.WithParkWait(0))(run)
	if _, err := fine(msgOf(payload)); err != nil {
		t.Fatalf("the redelivery = %v, want it run at once (the given-up claim released)", err)
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("runs = %d, want 1", n)
	}
}

// TestALocalClaimTakenOverIsFoundOnReturn: on memstore, where nothing
// renews a claim, a claim taken over by hand while the handler runs (a
// Release, then another holder's Claim) is found when the handler returns:
// the delivery fails with a transient ErrClaimLost and hands none of its
// produced messages to the router; one released and taken by nobody is
// taken back, and the delivery goes on.
func TestALocalClaimTakenOverIsFoundOnReturn(t *testing.T) {
	t.Parallel()
	for _, taken := range []bool{true, false} {
		store := memstore.New()
		h := idempotency.Middleware(store)(func(msg *message.Message) ([]*message.Message, error) {
			d, _ := idempotency.DeliveryFromContext(msg.Context())
			ctx := context.Background()
			if err := store.Release(msg.Context(), d.Key); err != nil {
				return nil, err
			}
			if taken {
				if ok, _, err := store.Claim(stores.WithClaimToken(ctx, "other"), d.Key, time.Minute); err != nil || !ok {
					return nil, fmt.Errorf("the other holder's claim: %v, %v", ok, err)
				}
			}
			return []*message.Message{msgOf([]byte(`{"child":1}`))}, nil
		})
		produced, err := h(msgOf(envelopeWithID(t, "local-taken-1")))
		switch {
		case taken && (!errors.Is(err, idempotency.ErrClaimLost) || !idempotency.IsTransient(err) || produced != nil):
			t.Fatalf("a delivery whose local claim was taken returned %d messages, %v; want none and a transient ErrClaimLost", len(produced), err)
		case !taken && (err != nil || len(produced) != 1):
			t.Fatalf("a delivery whose local claim was released returned %d messages, %v; want 1, nil", len(produced), err)
		}
	}
}
