package idempotency_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// handOut is a subscriber the test hands each delivery to itself: a
// nacked message is not handed out again unless the test does so, which
// lets a test order the deliveries of copies as a broker may.
type handOut struct{ ch chan *message.Message }

func newHandOut() *handOut { return &handOut{ch: make(chan *message.Message)} }

// Subscribe forwards what deliver hands out until ctx ends (the router
// closing), then closes its channel.
func (h *handOut) Subscribe(ctx context.Context, _ string) (<-chan *message.Message, error) {
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		for {
			select {
			case m := <-h.ch:
				select {
				case out <- m:
				case <-ctx.Done():
					return
				}
			case <-ctx.Done():
				return
			}
		}
	}()
	return out, nil
}

func (*handOut) Close() error { return nil }

// deliver hands out a copy of payload (with the redrive mark, if any) and
// reports whether the router acked it.
func (h *handOut) deliver(t *testing.T, payload []byte, mark string) bool {
	t.Helper()
	m := msgOf(payload)
	if mark != "" {
		m.Metadata.Set(envelope.MetadataRedrive, mark)
	}
	select {
	case h.ch <- m:
	case <-time.After(10 * time.Second):
		t.Fatal("the router took no delivery within 10s")
	}
	select {
	case <-m.Acked():
		return true
	case <-m.Nacked():
		return false
	case <-time.After(20 * time.Second):
		t.Fatal("the delivery was neither acked nor nacked within 20s")
	}
	return false
}

// endedIn waits for key's end in store.
func endedIn(t *testing.T, store stores.Store, key string) stores.Record {
	t.Helper()
	var rec stores.Record
	eventually(t, "the end of "+key+" in the store", func() bool {
		var err error
		rec, err = store.Lookup(context.Background(), key)
		return err == nil && rec.Ended()
	})
	return rec
}

// TestAttackForgetThenRedeliveryRunsAgain: `forget` clears an end; the
// next delivery of the message runs with a fresh budget (the documented
// way to replay it), and ends once more.
func TestAttackForgetThenRedeliveryRunsAgain(t *testing.T) {
	t.Parallel()
	sub := newHandOut()
	var dl letters
	var runs atomic.Int64
	store := memstore.New()
	r := newRouter(t)
	production(t, r, &dl, store, fastRetries(1))
	r.AddConsumerHandler("charge", "payments", sub, func(*message.Message) error {
		runs.Add(1)
		return errors.New("card service down")
	})
	testenv.RunRouter(t, r)
	key := idempotency.Key("charge", "pay-forget-1")
	payload := envelopeWithID(t, "pay-forget-1")

	if !sub.deliver(t, payload, "") {
		t.Fatal("the failing message was not dead-lettered and acked")
	}
	endedIn(t, store, key)
	if !sub.deliver(t, payload, "") || runs.Load() != 2 {
		t.Fatalf("a redelivery of an ended message: %d runs in all, want 2 (not run)", runs.Load())
	}
	if err := store.Forget(context.Background(), key); err != nil {
		t.Fatal(err)
	}
	if !sub.deliver(t, payload, "") {
		t.Fatal("the forgotten message's redelivery was not dead-lettered and acked")
	}
	endedIn(t, store, key)
	if n, d := runs.Load(), dl.len(); n != 4 || d != 2 {
		t.Fatalf("after forget: %d runs, %d dead letters in all; want 4 and 2 (a fresh budget)", n, d)
	}
	if !sub.deliver(t, payload, "") || runs.Load() != 4 || dl.len() != 2 {
		t.Fatalf("a redelivery after the second end ran or was dead-lettered: %d runs, %d dead letters", runs.Load(), dl.len())
	}
}

// skewFailure rewrites key's failing record in store as a worker whose
// wall clock is off by skew would have written it (or as this worker's
// own, after its clock stepped by -skew).
func skewFailure(t *testing.T, store stores.Store, key string, skew time.Duration) {
	t.Helper()
	ctx := context.Background()
	rec, err := store.Lookup(ctx, key)
	if err != nil || rec.Failure.Attempts != 1 || rec.Ended() {
		t.Fatalf("the failing record before the skew: %+v, %v; want 1 attempt, no end", rec, err)
	}
	f := rec.Failure
	f.FirstFailure = f.FirstFailure.Add(skew)
	f.NotBefore = f.NotBefore.Add(skew)
	if err := store.Fail(ctx, key, rec.Fingerprint, f); err != nil {
		t.Fatal(err)
	}
}

// TestAttackBackoffReadsTheWallClockOfAnotherWorker: the same with a
// worker an hour ahead: the next run is not due for an hour by this
// worker's clock, so every delivery holds the message to its limit and
// hands it back, for an hour, though its backoff was a millisecond.
func TestAttackBackoffReadsTheWallClockOfAnotherWorker(t *testing.T) {
	t.Parallel()
	sub := newHandOut()
	var dl letters
	var runs atomic.Int64
	store := memstore.New()
	r := newRouter(t)
	production(t, r, &dl, store, idempotency.WithRetries(idempotency.Retries{Max: 3, Backoff: time.Millisecond}),
		idempotency.WithDeliveryLimit(300*time.Millisecond))
	r.AddConsumerHandler("charge", "payments", sub, func(msg *message.Message) error {
		if runs.Add(1) == 1 {
			time.Sleep(160 * time.Millisecond)
			return errors.New("card service down")
		}
		return nil
	})
	testenv.RunRouter(t, r)
	key := idempotency.Key("charge", "pay-skew-2")
	payload := envelopeWithID(t, "pay-skew-2")

	if sub.deliver(t, payload, "") {
		t.Fatal("the first delivery was acked; want it handed back after one failed run")
	}
	skewFailure(t, store, key, time.Hour)
	var acked bool
	for range 5 {
		if acked = sub.deliver(t, payload, ""); acked {
			break
		}
	}
	if n := runs.Load(); !acked || n != 2 {
		t.Fatalf("a message whose 1ms backoff passed: %d runs after 5 deliveries (acked %v); want it run again at once", n, acked)
	}
}

// cutOnPublish is a dead-letter publisher that takes the store down as it
// publishes: the dead letter gets out, the end cannot be written.
type cutOnPublish struct {
	letters
	proxy *testenv.FaultProxy
	cut   atomic.Bool
}

func (c *cutOnPublish) Publish(topic string, msgs ...*message.Message) error {
	if c.cut.CompareAndSwap(false, true) {
		c.proxy.Cut()
	}
	return c.letters.Publish(topic, msgs...)
}

// TestAttackStoreDownWhileTheEndIsRecorded: Redis goes down right as the
// dead letter is published, so the end cannot be written (nor the claim
// let go). Once Redis is back, a redelivery must not run the handler again
// (its count is spent in the store); it may be dead-lettered a second time
// (documented), then its end is remembered and later copies are skipped.
func TestAttackStoreDownWhileTheEndIsRecorded(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out a claim's lease")
	}
	t.Parallel()
	through, direct, proxy := redisBehindProxy(t)
	sub := newHandOut()
	dl := &cutOnPublish{proxy: proxy}
	var runs atomic.Int64
	r := newRouter(t)
	production(t, r, dl, through, fastRetries(1), idempotency.WithClaim(time.Second),
		idempotency.WithStoreTimeout(200*time.Millisecond))
	r.AddConsumerHandler("charge", "payments", sub, func(*message.Message) error {
		runs.Add(1)
		return errors.New("card service down")
	})
	testenv.RunRouter(t, r)
	key := idempotency.Key("charge", "pay-down-1")
	payload := envelopeWithID(t, "pay-down-1")

	if !sub.deliver(t, payload, "") {
		t.Fatal("the dead-lettered delivery was not acked")
	}
	time.Sleep(time.Second) // the end's writes fail and are given up
	proxy.Restore()
	acked := 0
	deadline := time.Now().Add(15 * time.Second)
	for acked < 2 && time.Now().Before(deadline) {
		if sub.deliver(t, payload, "") {
			acked++
		} else {
			time.Sleep(100 * time.Millisecond)
		}
	}
	rec := endedIn(t, direct, key)
	if n, d := runs.Load(), dl.len(); acked < 2 || n != 2 || d > 2 || d < 1 {
		t.Fatalf("after the store came back: %d redeliveries acked, %d runs, %d dead letters, end %+v; want 2 acked, 2 runs (1+Max), 1 or 2 dead letters",
			acked, n, d, rec.Failure.End)
	}
}

// TestAttackClaimLostOnARetryPublishesNothing: issue 36.1 under
// WithRetries: the first run fails, the retry in place runs while another
// holder takes the claim, and returns a produced message. The delivery
// must publish nothing and fail with a transient ErrClaimLost.
func TestAttackClaimLostOnARetryPublishesNothing(t *testing.T) {
	t.Parallel()
	store := newShared()
	g, err := idempotency.New(store, idempotency.WithClaim(90*time.Millisecond), fastRetries(3))
	if err != nil {
		t.Fatal(err)
	}
	key := idempotency.Key("", "order-retry-1")
	var runs atomic.Int64
	h := g.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if runs.Add(1) == 1 {
			return nil, errors.New("timeout talking to the stock service")
		}
		ctx := context.Background()
		_ = store.Forget(ctx, key)
		if ok, _, err := store.Claim(stores.WithClaimToken(ctx, "other"), key, time.Minute); err != nil || !ok {
			return nil, errors.New("the other holder could not claim")
		}
		<-msg.Context().Done()
		time.Sleep(50 * time.Millisecond)
		return []*message.Message{msgOf([]byte(`{"child":1}`))}, nil
	})
	produced, err := h(msgOf(envelopeWithID(t, "order-retry-1")))
	if !errors.Is(err, idempotency.ErrClaimLost) || !idempotency.IsTransient(err) || produced != nil {
		t.Fatalf("a retry whose claim was taken returned %d messages, %v; want none and a transient ErrClaimLost", len(produced), err)
	}
}
