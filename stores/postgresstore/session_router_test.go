package postgresstore_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// sessionRouterLease is the claims' lease of the session router tests:
// short, so that a broker redelivery and a lapse both come within seconds.
const sessionRouterLease = time.Second

// outcomes counts the middleware's events of one consumer by outcome.
type outcomes struct {
	mu   sync.Mutex
	seen map[idempotency.Outcome]int
	errs []error
}

func (o *outcomes) Observe(_ context.Context, e idempotency.Event) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.seen == nil {
		o.seen = map[idempotency.Outcome]int{}
	}
	o.seen[e.Outcome]++
	if e.Err != nil {
		o.errs = append(o.errs, e.Err)
	}
}

// counts returns a copy of the counts so far, safe to print while events
// still arrive.
func (o *outcomes) counts() map[idempotency.Outcome]int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return maps.Clone(o.seen)
}

func (o *outcomes) of(outcome idempotency.Outcome) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.seen[outcome]
}

// sessionFleet is two workers consuming one Redis stream through the
// middleware, each with a Store of session claims (on a pool of its own)
// on one table. The broker hands a message idle for half a second to the
// other worker, so a handler longer than that is delivered twice while it
// runs.
type sessionFleet struct {
	topic  string
	stores [2]*postgresstore.Store
	obs    [2]*outcomes
	pub    message.Publisher
}

// startSessionFleet starts the two workers with handler (told which worker
// runs it) and the middleware's options opts besides the claim and the
// observer. Everything stops, and the table is dropped, when the test ends.
func startSessionFleet(t *testing.T, handler func(worker int, msg *message.Message) error, opts ...idempotency.Option) *sessionFleet {
	t.Helper()
	rdb := testenv.Redis(t)
	a, b := sessionPair(t)
	f := &sessionFleet{topic: "bq_sess_" + testenv.RandomHex(4), stores: [2]*postgresstore.Store{a, b}}
	t.Cleanup(func() { rdb.Del(context.Background(), f.topic) })
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: rdb}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	f.pub = pub
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	for i := range 2 {
		f.obs[i] = &outcomes{}
		sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
			Client: rdb, ConsumerGroup: "g", Consumer: fmt.Sprintf("w%d", i), OldestId: "0",
			BlockTime: 100 * time.Millisecond, DisableIndefiniteInitialBlock: true,
			ClaimInterval: 100 * time.Millisecond, MaxIdleTime: 500 * time.Millisecond,
		}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		router.AddMiddleware(idempotency.Middleware(f.stores[i],
			append([]idempotency.Option{idempotency.WithClaim(sessionRouterLease), idempotency.WithObserver(f.obs[i])}, opts...)...))
		router.AddConsumerHandler("h", f.topic, sub, func(msg *message.Message) error { return handler(i, msg) })
		wg.Go(func() { _ = router.Run(ctx) })
		select {
		case <-router.Running():
		case <-time.After(10 * time.Second):
			t.Fatal("the router did not start")
		}
	}
	return f
}

// publish sends one message of id and returns its idempotency key as the
// stores see it.
func (f *sessionFleet) publish(t *testing.T, id string) {
	t.Helper()
	e, err := envelope.New("urn:babel:test:session", map[string]any{"n": 1})
	if err != nil {
		t.Fatal(err)
	}
	e.Meta.ID = id
	payload, err := e.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if err := f.pub.Publish(f.topic, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
		t.Fatal(err)
	}
}

// remembered reports whether a record of the delivery whose key is key
// was written (seen from the second worker's Store).
func (f *sessionFleet) remembered(t *testing.T, key string) bool {
	r, err := f.stores[1].Lookup(context.Background(), key)
	return err == nil && r.Remembered()
}

// waitCond polls cond until it holds, failing t after within.
func waitCond(t *testing.T, what string, within time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", within, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A handler three and a half leases long, redelivered by the broker to the
// other worker while it runs: the renewed session claim holds throughout,
// the other worker parks the redeliveries, and the message runs once.
func TestSessionClaimSlowHandlerRunsOnceThroughABroker(t *testing.T) {
	if testing.Short() {
		t.Skip("a handler of 3.5 seconds")
	}
	t.Parallel()
	var runs [2]atomic.Int32
	keys := make(chan string, 4)
	f := startSessionFleet(t, func(w int, msg *message.Message) error {
		runs[w].Add(1)
		d, _ := idempotency.DeliveryFromContext(msg.Context())
		keys <- d.Key
		select {
		case <-time.After(sessionRouterLease * 7 / 2):
			return nil
		case <-msg.Context().Done():
			return context.Cause(msg.Context())
		}
	})
	f.publish(t, "slow-"+testenv.RandomHex(4))
	var key string
	select {
	case key = <-keys:
	case <-time.After(30 * time.Second):
		t.Fatal("the message never ran")
	}
	waitCond(t, "the record", 30*time.Second, func() bool { return f.remembered(t, key) })
	parks := f.obs[0].of(idempotency.OutcomePark) + f.obs[1].of(idempotency.OutcomePark)
	lost := f.obs[0].of(idempotency.OutcomeClaimLost) + f.obs[1].of(idempotency.OutcomeClaimLost)
	t.Logf("runs %d+%d, parks %d, claims lost %d", runs[0].Load(), runs[1].Load(), parks, lost)
	if n := runs[0].Load() + runs[1].Load(); n != 1 || lost != 0 {
		t.Fatalf("runs %d, claims lost %d; want one run, none lost", n, lost)
	}
	if parks == 0 {
		t.Fatal("the broker never redelivered the running message: the test proved nothing")
	}
}

// The holder's session is terminated (pg_terminate_backend) while its
// handler runs: the handler's context ends with ErrClaimLost within about
// a lease, the message runs once more (on either worker: the holder's own
// redelivery may come first, on a new session), and one record is written.
func TestSessionTerminatedWhileTheHandlerRuns(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for a lost claim and a redelivery")
	}
	t.Parallel()
	var runs [2]atomic.Int32
	started := make(chan int, 4)
	var cause atomic.Value
	f := startSessionFleet(t, func(w int, msg *message.Message) error {
		first := runs[0].Add(0)+runs[1].Add(0) == 0
		runs[w].Add(1)
		started <- w
		if !first {
			return nil
		}
		select {
		case <-msg.Context().Done():
			cause.Store(context.Cause(msg.Context()))
			return context.Cause(msg.Context())
		case <-time.After(20 * time.Second):
			cause.Store(errors.New("the handler's context never ended"))
			return nil
		}
	})
	id := "terminated-" + testenv.RandomHex(4)
	f.publish(t, id)
	var holder int
	select {
	case holder = <-started:
	case <-time.After(30 * time.Second):
		t.Fatal("the message never ran")
	}
	db := testenv.Postgres(t)
	pid := f.stores[holder].SessionPID()
	var ok bool
	if err := db.QueryRow(`SELECT pg_terminate_backend($1)`, pid).Scan(&ok); err != nil || !ok {
		t.Fatalf("terminating the holder's session %d: %v, %v", pid, ok, err)
	}
	terminated := time.Now()
	waitCond(t, "the holder's handler context to end", 10*time.Second, func() bool { return cause.Load() != nil })
	took := time.Since(terminated)
	if c, _ := cause.Load().(error); !errors.Is(c, idempotency.ErrClaimLost) {
		t.Fatalf("the holder's handler context ended with %v, want ErrClaimLost", c)
	}
	// The message runs again once, on either worker: the holder's own
	// redelivery may come first, on a session of its own opened anew.
	deadline := time.Now().Add(30 * time.Second)
	for runs[0].Load()+runs[1].Load() != 2 {
		if time.Now().After(deadline) {
			for w := range f.obs {
				f.obs[w].mu.Lock()
				t.Logf("worker %d: runs %d, outcomes %v, errors %v", w, runs[w].Load(), f.obs[w].seen, f.obs[w].errs)
				f.obs[w].mu.Unlock()
			}
			t.Fatal("timed out after 30s waiting for the message to run again")
		}
		time.Sleep(10 * time.Millisecond)
	}
	ranAfter := time.Since(terminated)
	var records int
	waitCond(t, "one record", 10*time.Second, func() bool {
		return db.QueryRow(`SELECT count(*) FROM `+f.stores[0].Table()+` WHERE claim IS NULL`).Scan(&records) == nil && records == 1
	})
	t.Logf("holder's context ended %v after its session was terminated; the message ran again %v after (runs: holder %d, other %d)",
		took.Round(10*time.Millisecond), ranAfter.Round(10*time.Millisecond), runs[holder].Load(), runs[1-holder].Load())
	time.Sleep(time.Second) // a third run would come within the redelivery's half second
	if n := runs[0].Load() + runs[1].Load(); n != 2 {
		t.Fatalf("runs %d, want 2: the holder's cut short and one more", n)
	}
}

// A handler whose first three runs fail, on either worker, and whose
// fourth would succeed: with WithRetries (Max 2: three runs at most) the
// count of failures is carried from run to run, across workers, by the
// failing record the session claims keep, so the message ends after its
// third run and never runs a fourth time.
func TestSessionClaimFailuresAreCountedAcrossWorkers(t *testing.T) {
	if testing.Short() {
		t.Skip("retries through a broker")
	}
	t.Parallel()
	var runs atomic.Int32
	var perWorker [2]atomic.Int32
	boom := errors.New("boom")
	f := startSessionFleet(t, func(w int, msg *message.Message) error {
		perWorker[w].Add(1)
		if runs.Add(1) <= 3 {
			return boom
		}
		return nil
	}, idempotency.WithRetries(idempotency.Retries{Max: 2, Backoff: 50 * time.Millisecond, Jitter: -1}))
	id := "retries-" + testenv.RandomHex(4)
	f.publish(t, id)
	waitCond(t, "the message to end after three failed runs", 30*time.Second, func() bool {
		return f.obs[0].of(idempotency.OutcomeExhausted)+f.obs[1].of(idempotency.OutcomeExhausted) >= 1
	})
	t.Logf("runs %d (worker 0: %d, worker 1: %d)", runs.Load(), perWorker[0].Load(), perWorker[1].Load())
	// Give the broker a redelivery's worth of time to prove nothing runs again.
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		if n := runs.Load(); n != 3 {
			t.Fatalf("%d runs, want 3 (Max 2): the count of failures was not carried", n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// A handler that panics: the claim is given back (the other worker may
// take it at once, without waiting a lease), and the panic goes on to the
// caller.
func TestSessionClaimPanickingHandlerGivesTheClaimBack(t *testing.T) {
	t.Parallel()
	a, b := sessionPair(t)
	var key string
	h := idempotency.Middleware(a, idempotency.WithClaim(time.Minute))(func(msg *message.Message) ([]*message.Message, error) {
		d, _ := idempotency.DeliveryFromContext(msg.Context())
		key = d.Key
		panic("handler panics")
	})
	e, err := envelope.New("urn:babel:test:session", map[string]any{"n": 1})
	if err != nil {
		t.Fatal(err)
	}
	e.Meta.ID = "panic-" + testenv.RandomHex(4)
	payload, _ := e.Marshal()
	msg := message.NewMessage(watermill.NewUUID(), payload)
	func() {
		defer func() {
			if r := recover(); r == nil {
				t.Fatal("the panic did not go on to the caller")
			}
		}()
		_, _ = h(msg)
	}()
	claimed, found, err := b.Claim(stores.WithClaimToken(context.Background(), "other"), key, time.Minute)
	if err != nil || !claimed {
		t.Fatalf("the other worker's Claim after the panic = %v, %v, %v; want claimed at once", claimed, found.State, err)
	}
}
