package idempotency_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/conformance"
)

func TestConformanceWithMemstore(t *testing.T) {
	t.Parallel()
	conformance.RunIdempotency(t, "", func(t *testing.T) stores.Store { return memstore.New() })
}

// envelopeWithID returns an envelope payload with the given meta.id.
func envelopeWithID(t testing.TB, id string) []byte {
	t.Helper()
	e, err := envelope.New("urn:babel:orders:created", map[string]any{"order_id": 1042}, envelope.WithID(id), envelope.WithQueue("orders"))
	if err != nil {
		t.Fatal(err)
	}
	b, err := e.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func msgOf(payload []byte) *message.Message { return message.NewMessage(watermill.NewUUID(), payload) }

// recorder is an Observer that keeps the outcomes it saw.
type recorder struct {
	mu     sync.Mutex
	events []idempotency.Event
}

func (r *recorder) Observe(_ context.Context, e idempotency.Event) {
	r.mu.Lock()
	r.events = append(r.events, e)
	r.mu.Unlock()
}

func (r *recorder) outcomes() []idempotency.Outcome {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]idempotency.Outcome, len(r.events))
	for i, e := range r.events {
		out[i] = e.Outcome
	}
	return out
}

func counting(runs *int, err error) message.HandlerFunc {
	return func(*message.Message) ([]*message.Message, error) {
		*runs++
		return nil, err
	}
}

func TestDecisions(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("x", idempotency.MaxIDBytes+1)
	schema2 := []byte(`{"job":"j","trace_id":"t","data":{},"meta":{"id":"a","schema_version":2},"attempts":0}`)
	cases := []struct {
		name      string
		payload   []byte
		wantRuns  int // after three deliveries
		wantErr   error
		permanent bool
		outcomes  []idempotency.Outcome
	}{
		{"redelivery runs once", envelopeWithID(t, "id-1"), 1, nil, false,
			[]idempotency.Outcome{"run", "skip", "skip"}},
		{"not JSON fails open", []byte("plain text"), 3, nil, false,
			[]idempotency.Outcome{"fail_open", "fail_open", "fail_open"}},
		{"JSON array fails open", []byte(`[{"meta":{"id":"a"}}]`), 3, nil, false, nil},
		{"no meta.id fails open", []byte(`{"job":"j","meta":{"schema_version":1}}`), 3, nil, false, nil},
		{"blank meta.id fails open", []byte(`{"job":"urn:babel:orders:created","trace_id":"t","data":{},"meta":{"id":"  ","schema_version":1}}`), 3, nil, false, nil},
		{"schema_version 2 rejected", schema2, 0, envelope.ErrUnsupportedSchemaVersion, true,
			[]idempotency.Outcome{"reject", "reject", "reject"}},
		{"id over 256 bytes rejected", envelopeWithID(t, long), 0, idempotency.ErrInvalidID, true, nil},
		{"id with control character rejected", envelopeWithID(t, "a\x07b"), 0, idempotency.ErrInvalidID, true, nil},
		{"id with invalid UTF-8 rejected", []byte("{\"meta\":{\"id\":\"a\xffb\"}}"), 0, idempotency.ErrInvalidID, true, nil},
		{"id of exactly 256 bytes accepted", envelopeWithID(t, long[:256]), 1, nil, false, nil},
		{"unicode id accepted", envelopeWithID(t, "заказ-☕-1042"), 1, nil, false, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rec := &recorder{}
			runs := 0
			h := idempotency.Middleware(memstore.New(), idempotency.WithObserver(rec))(counting(&runs, nil))
			for range 3 {
				produced, err := h(msgOf(c.payload))
				if produced != nil {
					t.Fatalf("produced = %v", produced)
				}
				if c.wantErr == nil && err != nil {
					t.Fatalf("err = %v", err)
				}
				if c.wantErr != nil && !errors.Is(err, c.wantErr) {
					t.Fatalf("err = %v, want %v", err, c.wantErr)
				}
				if idempotency.IsPermanent(err) != c.permanent {
					t.Fatalf("IsPermanent(%v) = %v, want %v", err, idempotency.IsPermanent(err), c.permanent)
				}
			}
			if runs != c.wantRuns {
				t.Fatalf("handler ran %d times, want %d", runs, c.wantRuns)
			}
			if c.outcomes != nil && strings.Join(toStrings(rec.outcomes()), ",") != strings.Join(toStrings(c.outcomes), ",") {
				t.Fatalf("outcomes = %v, want %v", rec.outcomes(), c.outcomes)
			}
		})
	}
}

func toStrings(o []idempotency.Outcome) []string {
	s := make([]string, len(o))
	for i := range o {
		s[i] = string(o[i])
	}
	return s
}

func TestRejectionErrorsSayWhatIsWrong(t *testing.T) {
	t.Parallel()
	h := idempotency.Middleware(memstore.New())(counting(new(int), nil))
	_, err := h(msgOf(envelopeWithID(t, strings.Repeat("x", 300))))
	if err == nil || !strings.Contains(err.Error(), "300 bytes, over the 256-byte limit") {
		t.Fatalf("err = %v", err)
	}
	_, err = h(msgOf([]byte(`{"meta":{"id":"a","schema_version":3}}`)))
	if err == nil || !strings.Contains(err.Error(), "meta.schema_version 3") {
		t.Fatalf("err = %v", err)
	}
}

func TestHandlerErrorLeavesMessageUnmarked(t *testing.T) {
	t.Parallel()
	store := memstore.New()
	fail := errors.New("payment gateway down")
	runs := 0
	var failing bool
	h := idempotency.Middleware(store)(func(*message.Message) ([]*message.Message, error) {
		runs++
		if failing {
			return nil, fail
		}
		return nil, nil
	})
	payload := envelopeWithID(t, "id-1")
	failing = true
	if _, err := h(msgOf(payload)); !errors.Is(err, fail) {
		t.Fatalf("err = %v, want the handler's error", err)
	}
	if seen, _ := stores.Seen(context.Background(), store, "id-1"); seen {
		t.Fatal("a failed message was remembered")
	}
	failing = false
	if _, err := h(msgOf(payload)); err != nil || runs != 2 {
		t.Fatalf("redelivery after failure: runs=%d err=%v", runs, err)
	}
	if _, err := h(msgOf(payload)); err != nil || runs != 2 {
		t.Fatalf("redelivery after success: runs=%d err=%v", runs, err)
	}
}

// seenSetOf is a store of the BabelQueue three-method contract.
type seenSetOf struct{ m *memstore.Store }

func (s seenSetOf) Seen(ctx context.Context, k string) (bool, error) { return stores.Seen(ctx, s.m, k) }
func (s seenSetOf) Remember(ctx context.Context, k string) error     { return s.m.Remember(ctx, k, 0, nil) }
func (s seenSetOf) Forget(ctx context.Context, k string) error       { return s.m.Forget(ctx, k) }

// faultyStore fails the calls it is told to fail, to drive the middleware's
// failure paths. Real-server outages are exercised by the store packages.
type faultyStore struct {
	*memstore.Store
	mu             sync.Mutex
	failSeen       error
	failRemember   int // how many Remember calls fail
	rememberCalls  int
	failClaim      error
	releaseInvoked int
}

func (f *faultyStore) Lookup(ctx context.Context, key string) (stores.Record, error) {
	if f.failSeen != nil {
		return stores.Record{}, f.failSeen
	}
	return f.Store.Lookup(ctx, key)
}

func (f *faultyStore) Remember(ctx context.Context, key string, fp uint64, value []byte) error {
	f.mu.Lock()
	f.rememberCalls++
	failing := f.rememberCalls <= f.failRemember
	f.mu.Unlock()
	if failing {
		return errors.New("connection reset by peer")
	}
	return f.Store.Remember(ctx, key, fp, value)
}

func (f *faultyStore) Claim(ctx context.Context, key string, lease time.Duration) (bool, stores.Record, error) {
	if f.failClaim != nil {
		return false, stores.Record{}, f.failClaim
	}
	return f.Store.Claim(ctx, key, lease)
}

func (f *faultyStore) Release(ctx context.Context, key string) error {
	f.mu.Lock()
	f.releaseInvoked++
	f.mu.Unlock()
	return f.Store.Release(ctx, key)
}

func TestStoreUnreadableRetriesWithoutRunning(t *testing.T) {
	t.Parallel()
	down := errors.New("dial tcp 127.0.0.1:6379: connect: connection refused")
	for name, store := range map[string]*faultyStore{
		"seen":  {Store: memstore.New(), failSeen: down},
		"claim": {Store: memstore.New(), failClaim: down},
	} {
		t.Run(name, func(t *testing.T) {
			runs := 0
			rec := &recorder{}
			opts := []idempotency.Option{idempotency.WithObserver(rec)}
			if name == "seen" {
				opts = append(opts, idempotency.WithoutClaim())
			}
			h := idempotency.Middleware(store, opts...)(counting(&runs, nil))
			_, err := h(msgOf(envelopeWithID(t, "id-1")))
			if !errors.Is(err, idempotency.ErrStore) || !errors.Is(err, down) || idempotency.IsPermanent(err) {
				t.Fatalf("err = %v, want a retryable ErrStore wrapping the cause", err)
			}
			if runs != 0 {
				t.Fatal("the handler ran although the store could not be read")
			}
			if got := rec.outcomes(); len(got) != 1 || got[0] != idempotency.OutcomeStoreError {
				t.Fatalf("outcomes = %v", got)
			}
		})
	}
}

func TestRememberFailureIsRetriedThenAcked(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		failures   int
		remembered bool
	}{{2, true}, {3, false}} {
		store := &faultyStore{Store: memstore.New(), failRemember: c.failures}
		rec := &recorder{}
		runs := 0
		h := idempotency.Middleware(store, idempotency.WithRememberRetry(3, time.Millisecond), idempotency.WithObserver(rec))(counting(&runs, nil))
		if _, err := h(msgOf(envelopeWithID(t, "id-1"))); err != nil {
			t.Fatalf("%d failures: err = %v; the handler ran, so the delivery must be acked", c.failures, err)
		}
		if store.rememberCalls != 3 {
			t.Fatalf("%d failures: Remember called %d times, want 3", c.failures, store.rememberCalls)
		}
		seen, _ := stores.Seen(context.Background(), store, "id-1")
		if seen != c.remembered {
			t.Fatalf("%d failures: remembered = %v, want %v", c.failures, seen, c.remembered)
		}
		last := rec.outcomes()[len(rec.outcomes())-1]
		if c.remembered == (last == idempotency.OutcomeRememberFailed) {
			t.Fatalf("%d failures: last outcome %q", c.failures, last)
		}
	}
}

func TestClaimDirect(t *testing.T) {
	t.Parallel()
	store := &faultyStore{Store: memstore.New()}
	ctx := context.Background()
	fail := errors.New("boom")
	h := idempotency.Middleware(store, idempotency.WithClaim(time.Minute))(func(msg *message.Message) ([]*message.Message, error) {
		if string(msg.Metadata.Get("fail")) == "1" {
			return nil, fail
		}
		return nil, nil
	})
	payload := envelopeWithID(t, "id-1")

	// Another delivery holds the claim: park with a retryable error.
	if ok, _, _ := store.Claim(stores.WithClaimToken(ctx, "other"), "id-1", time.Minute); !ok {
		t.Fatal("setup claim failed")
	}
	_, err := h(msgOf(payload))
	if !errors.Is(err, idempotency.ErrInFlight) || idempotency.IsPermanent(err) {
		t.Fatalf("err = %v, want retryable ErrInFlight", err)
	}
	_ = store.Store.Release(stores.WithClaimToken(ctx, "other"), "id-1")

	// A failing handler releases its claim; the redelivery runs at once.
	m := msgOf(payload)
	m.Metadata.Set("fail", "1")
	if _, err := h(m); !errors.Is(err, fail) {
		t.Fatalf("err = %v", err)
	}
	if store.releaseInvoked != 1 {
		t.Fatalf("Release called %d times, want 1", store.releaseInvoked)
	}
	if _, err := h(msgOf(payload)); err != nil {
		t.Fatalf("redelivery after a failure: %v", err)
	}
	if seen, _ := stores.Seen(ctx, store, "id-1"); !seen {
		t.Fatal("not remembered after success")
	}
	if _, err := h(msgOf(payload)); err != nil {
		t.Fatalf("duplicate after success: %v, want skip", err)
	}
}

func TestClaimReleasedOnPanic(t *testing.T) {
	t.Parallel()
	store := memstore.New()
	h := idempotency.Middleware(store, idempotency.WithClaim(time.Minute))(func(*message.Message) ([]*message.Message, error) {
		panic("handler bug")
	})
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("the panic was swallowed")
			}
		}()
		_, _ = h(msgOf(envelopeWithID(t, "id-1")))
	}()
	ok, _, err := store.Claim(context.Background(), "id-1", time.Minute)
	if err != nil || !ok {
		t.Fatalf("claim still held after the handler panicked: ok=%v err=%v", ok, err)
	}
}

func TestOptionsAreValidated(t *testing.T) {
	t.Parallel()
	seenSet := stores.FromSeenSet(seenSetOf{memstore.New()}, 0)
	if _, err := idempotency.New(seenSet); !errors.Is(err, idempotency.ErrNoClaims) {
		t.Fatalf("a store that cannot claim, without WithoutClaim: err = %v, want ErrNoClaims", err)
	}
	if _, err := idempotency.New(seenSet, idempotency.WithClaim(time.Second)); !errors.Is(err, idempotency.ErrNoClaims) {
		t.Fatalf("WithClaim on a store that cannot claim: err = %v, want ErrNoClaims", err)
	}
	if _, err := idempotency.New(seenSet, idempotency.WithoutClaim()); err != nil {
		t.Fatalf("a seen-set with WithoutClaim: %v", err)
	}
	if _, err := idempotency.New(memstore.New(), idempotency.WithoutClaim(), idempotency.WithClaim(time.Second)); err == nil {
		t.Fatal("WithClaim and WithoutClaim together accepted")
	}
	if _, err := idempotency.New(memstore.New(), idempotency.WithClaim(0)); err == nil {
		t.Fatal("a zero lease accepted")
	}
	if _, err := idempotency.New(memstore.New(), idempotency.WithParkWait(-1)); err == nil {
		t.Fatal("a negative park wait accepted")
	}
	if _, err := idempotency.New(nil); err == nil {
		t.Fatal("nil store accepted")
	}
	if _, err := idempotency.New(memstore.New(), idempotency.WithRememberRetry(0, 0)); err == nil {
		t.Fatal("zero remember attempts accepted")
	}
	if _, err := idempotency.New(memstore.New(), idempotency.WithStoreTimeout(-1)); err == nil {
		t.Fatal("negative timeout accepted")
	}
	defer func() {
		if recover() == nil {
			t.Fatal("Middleware did not panic on invalid options")
		}
	}()
	idempotency.Middleware(seenSet, idempotency.WithClaim(time.Second))
}

func TestStoreTimeout(t *testing.T) {
	t.Parallel()
	slow := &slowStore{Store: memstore.New()}
	h := idempotency.Middleware(slow, idempotency.WithStoreTimeout(20*time.Millisecond))(counting(new(int), nil))
	start := time.Now()
	_, err := h(msgOf(envelopeWithID(t, "id-1")))
	if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, idempotency.ErrStore) {
		t.Fatalf("err = %v, want ErrStore wrapping a deadline", err)
	}
	if time.Since(start) > 2*time.Second {
		t.Fatal("store call not bounded by WithStoreTimeout")
	}
}

// slowStore's Claim blocks until its context is done, like a hung server.
type slowStore struct{ *memstore.Store }

func (s *slowStore) Claim(ctx context.Context, key string, lease time.Duration) (bool, stores.Record, error) {
	<-ctx.Done()
	return false, stores.Record{}, ctx.Err()
}

func TestKey(t *testing.T) {
	t.Parallel()
	if idempotency.Key("", "id") != "id" {
		t.Fatal("empty scope must key on meta.id verbatim")
	}
	if idempotency.Key("a:b", "c") == idempotency.Key("a", "b:c") {
		t.Fatal("distinct (scope, id) pairs share a key")
	}
}
