package idempotency_test

import (
	"context"
	"errors"
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

// TestClaimsAreTheDefault: with no option, two copies of one message
// handled at the same moment run once; the second waits for the first and
// is skipped, not parked.
func TestClaimsAreTheDefault(t *testing.T) {
	t.Parallel()
	var runs atomic.Int32
	release := make(chan struct{})
	rec := &recorder{}
	h := idempotency.Middleware(memstore.New(), idempotency.WithObserver(rec))(func(*message.Message) ([]*message.Message, error) {
		runs.Add(1)
		<-release
		return nil, nil
	})
	payload := envelopeWithID(t, "pay-1")
	errs := make(chan error, 2)
	go func() { _, err := h(msgOf(payload)); errs <- err }()
	for runs.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	go func() { _, err := h(msgOf(payload)); errs <- err }()
	time.Sleep(100 * time.Millisecond) // the copy waits on the claim
	close(release)
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatalf("a copy failed: %v", err)
		}
	}
	if runs.Load() != 1 {
		t.Fatalf("%d runs for two concurrent copies, want 1", runs.Load())
	}
	got := rec.outcomes()
	if len(got) != 2 || !contains(got, idempotency.OutcomeRun) || !contains(got, idempotency.OutcomeSkip) {
		t.Fatalf("outcomes %v, want one run and one skip (no park)", got)
	}
}

// TestParkWait: a copy whose message stays in flight longer than the park
// wait is parked with the transient ErrInFlight after that wait, not at
// once and not later; its context ending parks it at once.
func TestParkWait(t *testing.T) {
	t.Parallel()
	store := memstore.New()
	ctx := stores.WithClaimToken(context.Background(), "another-worker")
	if ok, _, err := store.Claim(ctx, "pay-1", time.Minute); err != nil || !ok {
		t.Fatal(ok, err)
	}
	runs := 0
	h := idempotency.Middleware(store, idempotency.WithParkWait(300*time.Millisecond))(counting(&runs, nil))
	start := time.Now()
	_, err := h(msgOf(envelopeWithID(t, "pay-1")))
	waited := time.Since(start)
	if !errors.Is(err, idempotency.ErrInFlight) || !idempotency.IsTransient(err) || runs != 0 {
		t.Fatalf("err = %v, runs = %d; want a transient ErrInFlight and no run", err, runs)
	}
	if waited < 250*time.Millisecond || waited > 2*time.Second {
		t.Fatalf("parked after %v, want about the 300ms park wait", waited)
	}

	cctx, cancel := context.WithCancel(context.Background())
	msg := msgOf(envelopeWithID(t, "pay-1"))
	msg.SetContext(cctx)
	time.AfterFunc(50*time.Millisecond, cancel)
	start = time.Now()
	// Parked (ErrInFlight) when the context ends during the wait, or a
	// store error when it ended before the first look (a slow machine):
	// transient either way, returned at once, the handler not run.
	if _, err := idempotency.Middleware(store, idempotency.WithParkWait(time.Minute))(counting(&runs, nil))(msg); !idempotency.IsTransient(err) || runs != 0 {
		t.Fatalf("err = %v, runs = %d; want a transient error once the context ended, and no run", err, runs)
	}
	if waited := time.Since(start); waited > 5*time.Second {
		t.Fatalf("a cancelled delivery waited %v", waited)
	}
}

// TestRequireIdentity: under WithRequireIdentity a message without a usable
// identity is rejected as permanent and the handler does not run; without
// it the message runs (fail open).
func TestRequireIdentity(t *testing.T) {
	t.Parallel()
	for _, payload := range []string{"not json", `{"job":"urn:x","data":{},"meta":{"schema_version":1}}`, `{"meta":{"id":"  "}}`} {
		runs := 0
		_, err := idempotency.Middleware(memstore.New(), idempotency.WithRequireIdentity())(counting(&runs, nil))(msgOf([]byte(payload)))
		if !errors.Is(err, idempotency.ErrNoIdentity) || !idempotency.IsPermanent(err) || runs != 0 {
			t.Fatalf("%s: err = %v, runs = %d; want a permanent ErrNoIdentity and no run", payload, err, runs)
		}
		if _, err := idempotency.Middleware(memstore.New())(counting(&runs, nil))(msgOf([]byte(payload))); err != nil || runs != 1 {
			t.Fatalf("%s without WithRequireIdentity: err = %v, runs = %d; want a run", payload, err, runs)
		}
	}
}

// TestKeySourcesInOrder: the first source that yields a key wins: an
// envelope by its meta.id, a plain message by its metadata key, the rest
// by their UUID.
func TestKeySourcesInOrder(t *testing.T) {
	t.Parallel()
	store := memstore.New()
	seen := map[string]int{}
	var mu sync.Mutex
	h := idempotency.Middleware(store, idempotency.WithKeySource(idempotency.KeyFromEnvelope(),
		idempotency.KeyFromMetadata("Idempotency-Key"), idempotency.KeyFromUUID()))(func(msg *message.Message) ([]*message.Message, error) {
		mu.Lock()
		seen[msg.UUID]++
		mu.Unlock()
		return nil, nil
	})
	deliver := func(uuid string, payload []byte, key string) {
		msg := message.NewMessage(uuid, payload)
		if key != "" {
			msg.Metadata.Set("Idempotency-Key", key)
		}
		if _, err := h(msg); err != nil {
			t.Fatal(err)
		}
	}
	envelopePayload := envelopeWithID(t, "order-1")
	deliver("a", envelopePayload, "k-1")   // envelope: keyed on meta.id
	deliver("b", envelopePayload, "other") // same meta.id: skipped, whatever the metadata says
	deliver("c", []byte(`{"x":1}`), "k-1") // plain, keyed on its metadata
	deliver("d", []byte(`{"x":1}`), "k-1") // same key: skipped
	deliver("e", []byte("bytes"), "")      // keyed on its UUID
	deliver("e", []byte("bytes"), "")      // redelivered: skipped
	deliver("f", []byte("bytes"), "")      // another message
	for uuid, want := range map[string]int{"a": 1, "b": 0, "c": 1, "d": 0, "e": 1, "f": 1} {
		if seen[uuid] != want {
			t.Fatalf("message %s ran %d times, want %d (runs: %v)", uuid, seen[uuid], want, seen)
		}
	}
	if _, err := idempotency.New(store, idempotency.WithKeySource()); err == nil {
		t.Fatal("WithKeySource with no source accepted")
	}
	if _, err := idempotency.New(store, idempotency.WithFingerprintMetadata("tenant")); err == nil {
		t.Fatal("WithFingerprintMetadata with the envelope alone accepted")
	}
}

// TestFailOpenLoggedOncePerMessage: a message without identity that is
// redelivered again and again (its handler fails) is logged at info once,
// then at debug, so that a redelivered body does not flood the log.
func TestFailOpenLoggedOncePerMessage(t *testing.T) {
	t.Parallel()
	logger := watermill.NewCaptureLogger()
	h := idempotency.Middleware(memstore.New(), idempotency.WithLogger(logger))(counting(new(int), errors.New("cannot decode")))
	msg := msgOf([]byte("not json"))
	for range 5 {
		_, _ = h(msg)
	}
	_, _ = h(msgOf([]byte("not json either")))
	count := func(level watermill.LogLevel) int {
		n := 0
		for _, l := range logger.Captured()[level] {
			if l.Msg == "Message has no usable identity; handled without deduplication" {
				n++
			}
		}
		return n
	}
	if info := count(watermill.InfoLogLevel); info != 2 {
		t.Fatalf("%d info lines for two messages without identity (one delivered 5 times), want 2", info)
	}
}

func contains(outcomes []idempotency.Outcome, o idempotency.Outcome) bool {
	for _, got := range outcomes {
		if got == o {
			return true
		}
	}
	return false
}
