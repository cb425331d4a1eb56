package idempotency_test

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestReplayBypassIsExemptFromTheHorizon: an operator forgot the record of
// an old message and replayed it with the marker, as the ErrTooOld message
// tells them to. The replay runs; the same old message without the marker is
// still rejected.
func TestReplayBypassIsExemptFromTheHorizon(t *testing.T) {
	t.Parallel()
	store := memstore.New(memstore.WithTTL(time.Hour))
	runs := 0
	h := idempotency.Middleware(store)(counting(&runs, nil))
	payload := envelopeCreated(t, "old-1", time.Now().Add(-3*time.Hour))

	if _, err := h(msgOf(payload)); !errors.Is(err, idempotency.ErrTooOld) || runs != 0 {
		t.Fatalf("without the marker: err=%v runs=%d, want ErrTooOld and no run", err, runs)
	}
	replay := msgOf(payload)
	replay.Metadata.Set(envelope.MetadataReplayBypass, "1")
	if _, err := h(replay); err != nil || runs != 1 {
		t.Fatalf("replay: err=%v runs=%d, want one run", err, runs)
	}
	// The replay is remembered like any run: a redelivery of it is skipped.
	again := msgOf(payload)
	again.Metadata.Set(envelope.MetadataReplayBypass, "1")
	if _, err := h(again); err != nil || runs != 1 {
		t.Fatalf("redelivered replay: err=%v runs=%d, want a skip", err, runs)
	}
	other := msgOf(envelopeCreated(t, "old-2", time.Now().Add(-3*time.Hour)))
	other.Metadata.Set(envelope.MetadataReplayBypass, "0")
	if _, err := h(other); !errors.Is(err, idempotency.ErrTooOld) {
		t.Fatalf("a marker other than \"1\": err=%v, want ErrTooOld", err)
	}
}

// TestClockSkewTightensTheHorizon: a producer whose clock runs ahead stamps
// created_at late, so a message may be older than it looks. With a one-hour
// record lifetime and one minute of skew, a message that looks 59m30s old
// may be 1h0m30s old: its record may be gone, and it is rejected.
func TestClockSkewTightensTheHorizon(t *testing.T) {
	t.Parallel()
	now := time.Now()
	cases := []struct {
		name    string
		opts    []idempotency.Option
		created time.Time
		reject  bool
	}{
		{"may be older than the lifetime", nil, now.Add(-time.Hour + 30*time.Second), true},
		{"past the lifetime by less than the skew", nil, now.Add(-time.Hour - 30*time.Second), true},
		{"younger than the lifetime minus the skew", nil, now.Add(-time.Hour + 90*time.Second), false},
		{"a smaller skew", []idempotency.Option{idempotency.WithClockSkew(time.Second)}, now.Add(-time.Hour + 30*time.Second), false},
		{"created in the future", nil, now.Add(time.Minute), false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			runs := 0
			h := idempotency.Middleware(memstore.New(memstore.WithTTL(time.Hour)), c.opts...)(counting(&runs, nil))
			_, err := h(msgOf(envelopeCreated(t, "id-1", c.created)))
			if c.reject != errors.Is(err, idempotency.ErrTooOld) || (c.reject == (runs == 1)) {
				t.Fatalf("err=%v runs=%d, want rejected=%v", err, runs, c.reject)
			}
		})
	}
}

// TestSkewLongerThanTheHorizonIsAConfigurationError: every message carrying
// created_at would be too old.
func TestSkewLongerThanTheHorizonIsAConfigurationError(t *testing.T) {
	t.Parallel()
	if _, err := idempotency.New(memstore.New(memstore.WithTTL(30 * time.Second))); err == nil {
		t.Fatal("New accepted a one-minute skew with a 30s horizon")
	}
	if _, err := idempotency.New(memstore.New(memstore.WithTTL(30*time.Second)), idempotency.WithClockSkew(time.Second)); err != nil {
		t.Fatalf("a skew shorter than the horizon: %v", err)
	}
	if _, err := idempotency.New(memstore.New(memstore.WithTTL(30*time.Second)), idempotency.WithReplayHorizon(0)); err != nil {
		t.Fatalf("the horizon turned off: %v", err)
	}
}

// TestHugeDurationsSaturate: a horizon, skew, backoff or timeout of
// math.MaxInt64 means "effectively forever", never a wrapped negative.
func TestHugeDurationsSaturate(t *testing.T) {
	t.Parallel()
	created := []time.Time{time.Now(), time.Now().Add(-200 * 365 * 24 * time.Hour), time.UnixMilli(1)}
	configs := map[string][]idempotency.Option{
		"horizon":              {idempotency.WithReplayHorizon(math.MaxInt64)},
		"horizon and skew":     {idempotency.WithReplayHorizon(math.MaxInt64), idempotency.WithClockSkew(math.MaxInt64 / 2)},
		"store TTL":            nil,
		"timeouts and backoff": {idempotency.WithReplayHorizon(math.MaxInt64), idempotency.WithStoreTimeout(math.MaxInt64), idempotency.WithAckTimeout(math.MaxInt64), idempotency.WithClaim(math.MaxInt64)},
	}
	for name, opts := range configs {
		t.Run(name, func(t *testing.T) {
			runs := 0
			// The horizon defaults to the store's TTL; the store's own
			// handling of a huge TTL is tested with the store.
			h := idempotency.Middleware(foreverStore{memstore.New()}, opts...)(counting(&runs, nil))
			for i, c := range created {
				id := "huge-" + string(rune('a'+i))
				if _, err := h(msgOf(envelopeCreated(t, id, c))); err != nil || runs != i+1 {
					t.Fatalf("created %v: err=%v runs=%d, want a run", c, err, runs)
				}
				if _, err := h(msgOf(envelopeCreated(t, id, c))); err != nil || runs != i+1 {
					t.Fatalf("redelivery created %v: err=%v runs=%d, want a skip", c, err, runs)
				}
			}
		})
	}
}

// foreverStore reports a TTL of math.MaxInt64.
type foreverStore struct{ *memstore.Store }

func (foreverStore) TTL() time.Duration { return math.MaxInt64 }

// TestRememberOutlivesTheMessageContext: the router cancels the message
// context at shutdown while the handler runs; the effect happened, so its
// record is written anyway, on the first attempt, against the real Redis.
func TestRememberOutlivesTheMessageContext(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	prefix := "t" + testenv.RandomHex(6) + ":"
	t.Cleanup(func() { _ = testenv.DropKeys(context.Background(), client, prefix+"*") })
	store := redisstore.New(client, redisstore.WithPrefix(prefix), redisstore.WithTTL(time.Hour))

	for _, opts := range map[string][]idempotency.Option{
		"plain": {idempotency.WithRememberRetry(1, 0), idempotency.WithStoreTimeout(2 * time.Second)},
		"claim": {idempotency.WithRememberRetry(1, 0), idempotency.WithStoreTimeout(2 * time.Second), idempotency.WithClaim(time.Minute)},
	} {
		rec := &recorder{}
		runs := 0
		var cancel context.CancelFunc
		h := idempotency.Middleware(store, append(opts, idempotency.WithObserver(rec))...)(func(*message.Message) ([]*message.Message, error) {
			runs++
			cancel() // shutdown while the handler runs
			return nil, nil
		})
		payload := envelopeWithID(t, testenv.RandomHex(8))
		for range 2 {
			msg := msgOf(payload)
			ctx, stop := context.WithCancel(context.Background())
			cancel = stop
			msg.SetContext(ctx)
			_, err := h(msg)
			stop()
			if err != nil {
				t.Fatal(err)
			}
		}
		if runs != 1 {
			t.Fatalf("the handler ran %d times, want once; outcomes %v", runs, rec.outcomes())
		}
		for _, o := range rec.outcomes() {
			if o == idempotency.OutcomeRememberFailed {
				t.Fatalf("remember failed: outcomes %v", rec.outcomes())
			}
		}
	}
}
