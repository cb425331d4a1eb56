package redisstore_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func failure(attempts int) stores.Failure {
	now := time.Now()
	return stores.Failure{Attempts: attempts, FirstFailure: now.Add(-time.Minute).Truncate(time.Millisecond),
		NotBefore: now.Add(time.Second).Truncate(time.Millisecond)}
}

// TestClaimThatCarriesACount: a holder's claim that carries a count (Fail
// without an end) is the holder's, as a plain claim is, for as long as its
// lease lasts: its holder extends it and remembers over it, another holder
// neither remembers, fails nor extends over it; once its lease lapses,
// Lookup reports the failing record it carries, with the failure's expiry,
// and another holder's Remember takes the key.
func TestClaimThatCarriesACount(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	const lease = 300 * time.Millisecond
	s := newStore(t, client, redisstore.WithTTL(time.Hour))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	holder, other := stores.WithClaimToken(ctx, "holder"), stores.WithClaimToken(ctx, "other")
	f := failure(2)

	if ok, _, err := s.Claim(holder, "k", lease); err != nil || !ok {
		t.Fatalf("Claim = %v, %v", ok, err)
	}
	if err := s.Fail(holder, "k", 42, f); err != nil {
		t.Fatal(err)
	}
	if v, _ := client.Get(ctx, s.RedisKey("k")).Result(); !strings.HasPrefix(v, "k") || !strings.Contains(v, ":cholder"+"f{") {
		t.Fatalf("the claim that carries a count is %q, want k<lease>:<expires>:<n>:cholder f{…}", v)
	}
	if pttl, _ := client.PTTL(ctx, s.RedisKey("k")).Result(); pttl < 59*time.Minute {
		t.Fatalf("the key of a claim that carries a count expires in %v, want the failure's hour", pttl)
	}
	r, err := s.Lookup(ctx, "k")
	if err != nil || r.State != stores.StateInFlight || r.Failure.Attempts != 2 || r.ExpiresAt.IsZero() || time.Until(r.ExpiresAt) > lease {
		t.Fatalf("Lookup of a claim that carries a count = %+v, %v; want in flight with 2 runs, expiring within the lease", r, err)
	}
	if held, err := s.Extend(other, "k", time.Minute); err != nil || held {
		t.Fatalf("Extend by another holder = %v, %v; want false", held, err)
	}
	if err := s.Remember(other, "k", 0, nil); !errors.Is(err, stores.ErrClaimTaken) {
		t.Fatalf("Remember by another holder = %v, want ErrClaimTaken", err)
	}
	if err := s.Fail(other, "k", 42, failure(3)); !errors.Is(err, stores.ErrClaimTaken) {
		t.Fatalf("Fail by another holder = %v, want ErrClaimTaken", err)
	}
	if held, err := s.Extend(holder, "k", lease); err != nil || !held {
		t.Fatalf("Extend by the holder = %v, %v; want true", held, err)
	}
	r, _ = s.Lookup(ctx, "k")
	if r.State != stores.StateInFlight || r.Failure.Attempts != 2 || !r.Failure.FirstFailure.Equal(f.FirstFailure) {
		t.Fatalf("after Extend: %+v, want in flight with the count kept", r)
	}

	// The holder dies: its lease lapses, the count stays.
	deadline := time.Now().Add(10 * time.Second)
	for {
		r, err = s.Lookup(ctx, "k")
		if err != nil {
			t.Fatal(err)
		}
		if r.State != stores.StateInFlight {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a claim of %v still in flight after 10 s", lease)
		}
		time.Sleep(lease / 4)
	}
	if r.State != stores.StateFailing || r.Failure.Attempts != 2 || r.ExpiresAt.IsZero() || time.Until(r.ExpiresAt) < 59*time.Minute ||
		!s.Capabilities().Matches(r.Fingerprint, 42) {
		t.Fatalf("Lookup after the lease lapsed = %+v; want failing with 2 runs, fingerprint 42, expiring in about an hour", r)
	}
	if held, err := s.Extend(holder, "k", time.Minute); err != nil || held {
		t.Fatalf("Extend of a lapsed claim = %v, %v; want false", held, err)
	}
	if err := s.Release(holder, "k"); err != nil {
		t.Fatal(err)
	}
	if r, _ := s.Lookup(ctx, "k"); r.State != stores.StateFailing || r.Failure.Attempts != 2 {
		t.Fatalf("after the dead holder's late Release: %+v, want the count left behind", r)
	}
	if err := s.Fail(holder, "k", 42, failure(2)); err != nil {
		t.Fatal(err)
	}
	if ok, _, err := s.Claim(holder, "k", lease); err != nil || !ok {
		t.Fatalf("Claim of the failing key = %v, %v", ok, err)
	}
	if err := s.Fail(holder, "k", 42, failure(3)); err != nil {
		t.Fatal(err)
	}
	for r, _ := s.Lookup(ctx, "k"); r.State == stores.StateInFlight; r, _ = s.Lookup(ctx, "k") {
		if time.Now().After(deadline) {
			t.Fatal("the claim never lapsed")
		}
		time.Sleep(lease / 4)
	}
	if err := s.Remember(other, "k", 7, nil); err != nil {
		t.Fatalf("Remember over a lapsed claim that carries a count: %v", err)
	}
	if r, _ := s.Lookup(ctx, "k"); !r.Remembered() || r.Failure.Attempts != 0 {
		t.Fatalf("after Remember: %+v, want remembered without a count", r)
	}
}

// TestFailureRecordLayout: a failing record and an ended one are readable
// with redis-cli, expire with the store's TTL, and a key that never failed
// keeps its layout ("1", a claim "c<token>").
func TestFailureRecordLayout(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	s := newStore(t, client, redisstore.WithTTL(time.Hour))
	ctx := context.Background()
	f := failure(3)
	if err := s.Fail(ctx, "failing", 0, f); err != nil {
		t.Fatal(err)
	}
	v, _ := client.Get(ctx, s.RedisKey("failing")).Result()
	if want := `f{"n":3,"first":` + itoa(f.FirstFailure.UnixMilli()) + `,"next":` + itoa(f.NotBefore.UnixMilli()) + `}`; v != want {
		t.Fatalf("failing record %q, want %q", v, want)
	}
	f.End = &stores.End{Reason: "failed", At: f.FirstFailure, Topic: "orders.dlq", Marker: "rd:7"}
	f.NotBefore = time.Time{}
	if err := s.Fail(ctx, "ended", 0, f); err != nil {
		t.Fatal(err)
	}
	v, _ = client.Get(ctx, s.RedisKey("ended")).Result()
	if !strings.HasPrefix(v, `e4:rd:7{"n":3,`) || !strings.Contains(v, `"reason":"failed"`) || !strings.Contains(v, `"topic":"orders.dlq"`) {
		t.Fatalf("ended record %q, want e4:rd:7{…}", v)
	}
	for _, key := range []string{"failing", "ended"} {
		if ttl, _ := client.PTTL(ctx, s.RedisKey(key)).Result(); ttl <= 59*time.Minute || ttl > time.Hour {
			t.Fatalf("%s: PTTL %v, want about an hour", key, ttl)
		}
	}
	if ok, _, err := s.Claim(stores.WithClaimToken(ctx, "d1"), "fresh", time.Minute); err != nil || !ok {
		t.Fatal(ok, err)
	}
	if v, _ := client.Get(ctx, s.RedisKey("fresh")).Result(); v != "cd1" {
		t.Fatalf("a claim of a key that never failed is %q, want \"cd1\"", v)
	}
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

// deadLetters collects the dead letters the dead-letter middleware
// publishes.
type deadLetters struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (l *deadLetters) Publish(_ string, msgs ...*message.Message) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.msgs = append(l.msgs, msgs...)
	return nil
}

func (*deadLetters) Close() error { return nil }

func (l *deadLetters) len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.msgs)
}

// TestABudgetIsOnePerMessageOnRedis: the production wiring (the
// dead-letter middleware around the guard with WithRetries) on redisstore,
// two workers on one key space. A message that always fails runs 1+Max
// times in all and is dead-lettered once, however often it comes back, on
// either worker; the copies after its end are acked without running; a
// redriven copy (another redrive mark) reopens the end and runs again.
func TestABudgetIsOnePerMessageOnRedis(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	first := newStore(t, client)
	second := redisstore.New(client, redisstore.WithPrefix(first.Prefix()))
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{})
	var dl deadLetters
	var runs, acked atomic.Int64
	worker := func(store stores.Store, topic string) {
		r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		dlq, err := deadletter.Middleware(&dl, deadletter.WithLogger(watermill.NopLogger{}))
		if err != nil {
			t.Fatal(err)
		}
		r.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				go func() {
					select {
					case <-msg.Acked():
						acked.Add(1)
					case <-msg.Nacked():
					case <-time.After(10 * time.Second):
					}
				}()
				return h(msg)
			}
		}, dlq, idempotency.Middleware(store, idempotency.WithLogger(watermill.NopLogger{}),
			idempotency.WithRetries(idempotency.Retries{Max: 2, Backoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond})))
		r.AddConsumerHandler("charge", topic, ps, func(*message.Message) error {
			runs.Add(1)
			return errors.New("card service down")
		})
		testenv.RunRouter(t, r)
	}
	worker(first, "payments-a")
	worker(second, "payments-b")

	payload := testenv.NewEnvelope(t).Payload
	publish := func(topic string, metadata ...string) {
		msg := message.NewMessage(watermill.NewUUID(), payload)
		for i := 0; i+1 < len(metadata); i += 2 {
			msg.Metadata.Set(metadata[i], metadata[i+1])
		}
		if err := ps.Publish(topic, msg); err != nil {
			t.Fatal(err)
		}
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s (runs %d, dead letters %d, acked %d)", what, runs.Load(), dl.len(), acked.Load())
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	publish("payments-a")
	waitFor("the dead letter", func() bool { return dl.len() == 1 && acked.Load() == 1 })
	for i := range 4 {
		publish([]string{"payments-a", "payments-b"}[i%2])
	}
	waitFor("5 copies acked", func() bool { return acked.Load() == 5 })
	if n := runs.Load(); n != 3 {
		t.Fatalf("the handler ran %d times, want 3 (1+Max) across every delivery and worker", n)
	}
	if n := dl.len(); n != 1 {
		t.Fatalf("%d dead letters, want 1", n)
	}
	r, err := second.Lookup(context.Background(), idempotency.Key("charge", "00000000-0000-4000-8000-000000000000"))
	if err != nil || r.State != stores.StateEnded || r.Failure.Attempts != 3 || r.Failure.End == nil || r.Failure.End.Reason != envelope.ReasonFailed {
		t.Fatalf("the message's record: %+v, %v; want ended (failed) after 3 runs", r, err)
	}

	// An operator redrives it: the marked copy runs again, with a fresh
	// budget, and is dead-lettered again.
	publish("payments-b", envelope.MetadataRedrive, "redrive-1")
	waitFor("the redriven copy's dead letter", func() bool { return dl.len() == 2 && acked.Load() == 6 })
	if n := runs.Load(); n != 6 {
		t.Fatalf("the handler ran %d times, want 6 (the redriven copy's own budget of 3)", n)
	}
}

// TestHugeLeaseCarriesACount: a claim of the longest lease (292 years)
// that carries a count keeps its lease, in flight, and its count.
func TestHugeLeaseCarriesACount(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	s := newStore(t, client)
	ctx := stores.WithClaimToken(context.Background(), "long")
	const huge = time.Duration(1<<63 - 1)
	if ok, _, err := s.Claim(ctx, "k", huge); err != nil || !ok {
		t.Fatalf("Claim = %v, %v", ok, err)
	}
	if err := s.Fail(ctx, "k", 0, failure(1)); err != nil {
		t.Fatal(err)
	}
	if held, err := s.Extend(ctx, "k", huge); err != nil || !held {
		t.Fatalf("Extend = %v, %v", held, err)
	}
	r, err := s.Lookup(ctx, "k")
	if err != nil || r.State != stores.StateInFlight || r.Failure.Attempts != 1 || r.ExpiresAt.Before(time.Now().AddDate(290, 0, 0)) {
		t.Fatalf("Lookup = %+v, %v; want in flight for 292 years with 1 failed run", r, err)
	}
}
