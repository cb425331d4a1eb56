package redisstore_test

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
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// proxiedClient returns a client of the real Redis through a fault proxy.
func proxiedClient(t *testing.T, opts func(*redis.Options)) (*redis.Client, *testenv.FaultProxy) {
	direct := testenv.Redis(t)
	p := testenv.NewFaultProxy(t, direct.Options().Addr)
	o := direct.Options()
	o.Addr = p.Addr()
	if opts != nil {
		opts(o)
	}
	client := redis.NewClient(o)
	t.Cleanup(func() { _ = client.Close() })
	testenv.TrackKeys(t, client, direct)
	return client, p
}

// TestCallsReturnByTheirDeadline: against a Redis that accepts connections
// and never answers (pooled connections stall, new ones get no reply),
// every call returns its error at its own context's deadline, pipelined or
// not, even though the client's own read timeout is far longer (2 s, ten
// times the deadline). Then the server answers again and the same store
// serves.
func TestCallsReturnByTheirDeadline(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts []redisstore.Option
	}{{"pipelined", nil}, {"unpipelined", []redisstore.Option{redisstore.WithoutPipelining()}}} {
		for _, contextTimeout := range []bool{false, true} {
			if testing.Short() && (tc.opts != nil || contextTimeout) {
				continue // -short: the default client and store only; each case waits out stalled connections
			}
			t.Run(fmt.Sprintf("%s/ContextTimeoutEnabled=%v", tc.name, contextTimeout), func(t *testing.T) {
				testCallsReturnByTheirDeadline(t, contextTimeout, tc.opts...)
			})
		}
	}
}

// stallingClient returns a client of the real Redis through a fault
// proxy, with read and write timeouts of 2 s (ten times the deadlines the
// tests give their calls) and ContextTimeoutEnabled as contextTimeout, and
// the proxy's switch: stall(true) keeps every answer back (connections
// are still accepted), stall(false) lets answers through again.
func stallingClient(t *testing.T, contextTimeout bool) (client *redis.Client, stall func(stalled bool)) {
	client, proxy := proxiedClient(t, func(o *redis.Options) {
		o.ReadTimeout, o.WriteTimeout, o.ContextTimeoutEnabled = 2*time.Second, 2*time.Second, contextTimeout
	})
	return client, func(stalled bool) {
		proxy.Silent.Store(stalled)
		if stalled {
			proxy.Delay.Store(int64(time.Hour))
		} else {
			proxy.Delay.Store(0)
		}
	}
}

func testCallsReturnByTheirDeadline(t *testing.T, contextTimeout bool, opts ...redisstore.Option) {
	client, stall := stallingClient(t, contextTimeout)
	store := newStore(t, client, opts...)
	if err := store.Remember(context.Background(), "warm-up", 0, nil); err != nil { // a pooled connection
		t.Fatal(err)
	}
	stall(true)

	const callers, rounds, deadline = 16, 3, 200 * time.Millisecond
	calls := []func(ctx context.Context, key string) error{
		func(ctx context.Context, key string) error { _, err := stores.Seen(ctx, store, key); return err },
		func(ctx context.Context, key string) error { return store.Remember(ctx, key, 0, nil) },
		func(ctx context.Context, key string) error {
			_, _, err := store.Claim(ctx, key, time.Minute)
			return err
		},
		func(ctx context.Context, key string) error { return store.Forget(ctx, key) },
		func(ctx context.Context, key string) error { return store.Release(ctx, key) },
		func(ctx context.Context, key string) error { _, err := store.Lookup(ctx, key); return err },
	}
	testenv.RequireDeadlines(t, callers, rounds, deadline, func(ctx context.Context, c, r int) error {
		return calls[(c+r)%len(calls)](ctx, fmt.Sprintf("k-%d-%d", c, r))
	})

	// The server answers again: the same store serves every caller.
	stall(false)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for c := range callers {
		wg.Go(func() {
			key := fmt.Sprintf("after-%d", c)
			if err := store.Remember(ctx, key, 0, nil); err != nil {
				t.Errorf("Remember after the server came back: %v", err)
				return
			}
			if seen, err := stores.Seen(ctx, store, key); err != nil || !seen {
				t.Errorf("Seen after the server came back = %v, %v", seen, err)
			}
		})
	}
	wg.Wait()
}

// TestAbandonedCallsNeverGetAnotherCallersAnswer: replies are slow, and
// half the callers give up before theirs come back; every answer a caller
// does get is its own command's.
func TestAbandonedCallsNeverGetAnotherCallersAnswer(t *testing.T) {
	t.Parallel()
	client, proxy := proxiedClient(t, nil)
	store := newStore(t, client, redisstore.WithTTL(time.Hour))
	const keys = 64
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i := range keys {
		if err := store.Remember(ctx, fmt.Sprintf("k-%d", i), uint64(i+1), nil); err != nil {
			t.Fatal(err)
		}
	}
	proxy.Delay.Store(int64(60 * time.Millisecond))
	var answered, gaveUp, wrong atomic.Int32
	var wg sync.WaitGroup
	for c := range 32 {
		wg.Go(func() {
			for r := range 12 {
				i := (c*7 + r*13) % keys
				timeout := 300 * time.Millisecond
				if (c+r)%2 == 0 {
					timeout = 20 * time.Millisecond
				}
				cctx, ccancel := context.WithTimeout(ctx, timeout)
				seen, kept, err := testenv.LookupFingerprint(store, cctx, fmt.Sprintf("k-%d", i))
				ccancel()
				switch {
				case err != nil:
					gaveUp.Add(1)
				case !seen || kept != store.Capabilities().KeptFingerprint(uint64(i+1)):
					wrong.Add(1)
				default:
					answered.Add(1)
				}
			}
		})
	}
	wg.Wait()
	t.Logf("%d answered, %d gave up, %d wrong", answered.Load(), gaveUp.Load(), wrong.Load())
	if wrong.Load() != 0 {
		t.Fatalf("%d callers got an answer that was not their command's", wrong.Load())
	}
	if answered.Load() == 0 || gaveUp.Load() == 0 {
		t.Fatalf("want both answered and abandoned calls, got %d and %d", answered.Load(), gaveUp.Load())
	}
	proxy.Delay.Store(0)
	for i := range keys {
		seen, kept, err := testenv.LookupFingerprint(store, ctx, fmt.Sprintf("k-%d", i))
		if err != nil || !seen || kept != store.Capabilities().KeptFingerprint(uint64(i+1)) {
			t.Fatalf("k-%d after the faults: seen %v, kept %d, %v; want %d", i, seen, kept, err, store.Capabilities().KeptFingerprint(uint64(i+1)))
		}
	}
}

// panicHook makes the client panic in its next armed calls, as a faulty
// hook (tracing, metrics) would.
type panicHook struct{ armed atomic.Int32 }

func (h *panicHook) trip() bool {
	for {
		n := h.armed.Load()
		if n <= 0 {
			return false
		}
		if h.armed.CompareAndSwap(n, n-1) {
			return true
		}
	}
}

func (*panicHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *panicHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.trip() {
			panic("hook exploded")
		}
		return next(ctx, cmd)
	}
}

func (h *panicHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if h.trip() {
			panic("hook exploded")
		}
		return next(ctx, cmds)
	}
}

// TestPanicInClientDoesNotWedgeTheStore: a panic inside the client fails
// the commands of that round trip with ErrClientPanic; every later call is
// served.
func TestPanicInClientDoesNotWedgeTheStore(t *testing.T) {
	t.Parallel()
	for _, contextTimeout := range []bool{false, true} {
		t.Run(fmt.Sprintf("ContextTimeoutEnabled=%v", contextTimeout), func(t *testing.T) {
			testPanicInClient(t, contextTimeout)
		})
	}
}

func testPanicInClient(t *testing.T, contextTimeout bool) {
	direct := testenv.Redis(t)
	o := direct.Options()
	o.ContextTimeoutEnabled = contextTimeout
	client := redis.NewClient(o)
	t.Cleanup(func() { _ = client.Close() })
	testenv.TrackKeys(t, client, direct)
	hook := &panicHook{}
	client.AddHook(hook)
	store := newStore(t, client)

	// call runs one store call, turning a panic that escapes into an error
	// and a call that never returns into a failure.
	call := func(key string) error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		done := make(chan error, 1)
		go func() {
			defer func() {
				if r := recover(); r != nil {
					done <- fmt.Errorf("the panic escaped the store: %v", r)
				}
			}()
			done <- store.Remember(ctx, key, 0, nil)
		}()
		select {
		case err := <-done:
			return err
		case <-time.After(6 * time.Second):
			return errors.New("the call never returned: the store is wedged")
		}
	}

	hook.armed.Store(1)
	if err := call("alone"); !errors.Is(err, redisstore.ErrClientPanic) {
		t.Fatalf("a call alone through a panicking client: %v, want ErrClientPanic", err)
	}
	// Concurrent callers, so that pipelines form; three of their round
	// trips panic.
	for round := range 3 {
		hook.armed.Store(3)
		var panicked atomic.Int32
		var wg sync.WaitGroup
		for c := range 32 {
			wg.Go(func() {
				err := call(fmt.Sprintf("r%d-c%d", round, c))
				switch {
				case errors.Is(err, redisstore.ErrClientPanic):
					panicked.Add(1)
				case err != nil:
					t.Error(err)
				}
			})
		}
		wg.Wait()
		if panicked.Load() == 0 {
			t.Fatal("no call saw the client panic")
		}
	}
	hook.armed.Store(0)
	var wg sync.WaitGroup
	for c := range 32 {
		wg.Go(func() {
			if err := call(fmt.Sprintf("after-%d", c)); err != nil {
				t.Errorf("after the panics: %v", err)
			}
		})
	}
	wg.Wait()
}

// TestLostClaimReplyFindsItsOwnClaim: the reply to a claim is lost and
// go-redis sends the command again; the second sending finds the claim the
// first one took, and the holder gets it instead of being parked behind
// itself until the lease lapses.
func TestLostClaimReplyFindsItsOwnClaim(t *testing.T) {
	t.Parallel()
	client, proxy := proxiedClient(t, func(o *redis.Options) { o.MaxRetries = 3 })
	for _, tc := range []struct {
		name  string
		claim func(s *redisstore.Store, ctx context.Context, key string) (bool, error)
	}{
		{"Claim", func(s *redisstore.Store, ctx context.Context, key string) (bool, error) {
			claimed, _, err := s.Claim(ctx, key, time.Minute)
			return claimed, err
		}},
	} {
		for _, named := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/named-holder=%v", tc.name, named), func(t *testing.T) {
				store := newStore(t, client)
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				holder := ctx
				if named {
					holder = stores.WithClaimToken(ctx, "delivery-1")
				}
				if _, err := stores.Seen(ctx, store, "warm-up"); err != nil { // a connection in the pool
					t.Fatal(err)
				}
				before := proxy.Dropped.Load()
				proxy.DropReply.Store(true)
				claimed, err := tc.claim(store, holder, "order-1")
				if proxy.Dropped.Load() != before+1 {
					t.Fatalf("the proxy dropped %d replies, want 1", proxy.Dropped.Load()-before)
				}
				if err != nil || !claimed {
					t.Fatalf("claim whose first reply was lost = %v, %v; want claimed by its holder", claimed, err)
				}
				other := stores.WithClaimToken(ctx, "delivery-2")
				if ok, _, err := store.Claim(other, "order-1", time.Minute); err != nil || ok {
					t.Fatalf("claim by another holder = %v, %v; want in flight", ok, err)
				}
				if err := store.Release(holder, "order-1"); err != nil {
					t.Fatal(err)
				}
				if ok, _, err := store.Claim(other, "order-1", time.Minute); err != nil || !ok {
					t.Fatalf("claim by another holder after the release = %v, %v; want claimed", ok, err)
				}
			})
		}
	}
}

// TestLostClaimReplyStillRunsTheDelivery: through the middleware under
// WithClaim, the reply to the delivery's claim is lost and go-redis sends
// it again; the delivery runs (it is not parked behind its own claim).
func TestLostClaimReplyStillRunsTheDelivery(t *testing.T) {
	t.Parallel()
	client, proxy := proxiedClient(t, func(o *redis.Options) { o.MaxRetries = 3 })
	store := newStore(t, client)
	var runs atomic.Int32
	h := idempotency.Middleware(store, idempotency.WithClaim(time.Minute))(func(*message.Message) ([]*message.Message, error) {
		runs.Add(1)
		return nil, nil
	})
	if _, err := stores.Seen(context.Background(), store, "warm-up"); err != nil { // a connection in the pool
		t.Fatal(err)
	}
	msg := message.NewMessage(watermill.NewUUID(), testenv.NewEnvelope(t).Payload)
	proxy.DropReply.Store(true)
	_, err := h(msg)
	if proxy.Dropped.Load() != 1 {
		t.Fatalf("the proxy dropped %d replies, want 1", proxy.Dropped.Load())
	}
	if err != nil || runs.Load() != 1 {
		t.Fatalf("delivery whose claim reply was lost: %v, the handler ran %d times; want it run once", err, runs.Load())
	}
	msg.Ack()
}

// TestCancelWithoutDeadline: with go-redis's default client and a server
// that stalls, a caller whose context is cancelled without a deadline
// (Watermill's message contexts at shutdown) leaves at once while its
// command waits for a pipeline; a lone command its caller sent itself
// returns within the client's own read timeout, as go-redis itself does.
func TestCancelWithoutDeadline(t *testing.T) {
	const readTimeout = 600 * time.Millisecond
	client, proxy := proxiedClient(t, func(o *redis.Options) {
		o.ReadTimeout, o.WriteTimeout, o.MaxRetries = readTimeout, readTimeout, -1
	})
	store := newStore(t, client)
	if err := store.Remember(context.Background(), "warm-up", 0, nil); err != nil { // a pooled connection
		t.Fatal(err)
	}
	proxy.Delay.Store(int64(time.Hour))

	// The first caller finds nothing in flight and sends its command itself.
	first, cancelFirst := context.WithCancel(context.Background())
	defer cancelFirst()
	lone := make(chan time.Duration, 1)
	start := time.Now()
	go func() {
		_, _ = stores.Seen(first, store, "lone")
		lone <- time.Since(start)
	}()
	time.Sleep(100 * time.Millisecond) // the lone command is on the wire
	// The second waits for a pipeline behind it and is cancelled.
	queued, cancelQueued := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { _, err := stores.Seen(queued, store, "queued"); errc <- err }()
	time.Sleep(50 * time.Millisecond)
	cancelled := time.Now()
	cancelQueued()
	cancelFirst()
	select {
	case err := <-errc:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("queued call cancelled: %v, want context.Canceled", err)
		}
		if took := time.Since(cancelled); took > 100*time.Millisecond {
			t.Fatalf("the queued call returned %v after its cancellation", took)
		}
	case <-time.After(readTimeout):
		t.Fatal("the queued call did not return at its cancellation")
	}
	select {
	case took := <-lone:
		if took > readTimeout+300*time.Millisecond {
			t.Fatalf("the lone call returned after %v, beyond the client's read timeout of %v", took, readTimeout)
		}
		t.Logf("the lone call returned after %v (client read timeout %v)", took.Round(time.Millisecond), readTimeout)
	case <-time.After(3 * readTimeout):
		t.Fatal("the lone call did not return within the client's read timeout")
	}
	proxy.Delay.Store(0)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := store.Remember(ctx, "after", 0, nil); err != nil {
		t.Fatalf("Remember after the server came back: %v", err)
	}
}

// TestAbandonedClaimIsReleased: the Redis server's replies are slow (a
// proxy holds each one 400 ms) and a delivery gives up on its claim at the
// store timeout (100 ms): it fails with ErrStore, and the release it sends
// then gives up too. The claim was taken all the same, and its reply comes
// back after the delivery left: the store releases it then, so the
// redelivery runs instead of being parked (ErrInFlight) for the whole
// lease behind a claim that no delivery holds. Pipelined or not, with
// go-redis's default client (the store waits for the answer) or with
// ContextTimeoutEnabled (the client cuts the call at its deadline and the
// reply is lost: the store releases what the call may have taken).
func TestAbandonedClaimIsReleased(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name           string
		contextTimeout bool
		opts           []redisstore.Option
	}{
		{"pipelined", false, nil},
		{"unpipelined", false, []redisstore.Option{redisstore.WithoutPipelining()}},
		{"pipelined/ContextTimeoutEnabled", true, nil},
		{"unpipelined/ContextTimeoutEnabled", true, []redisstore.Option{redisstore.WithoutPipelining()}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			testAbandonedClaimIsReleased(t, tc.contextTimeout, tc.opts...)
		})
	}
}

func testAbandonedClaimIsReleased(t *testing.T, contextTimeout bool, opts ...redisstore.Option) {
	const lease, timeout, delay = time.Minute, 100 * time.Millisecond, 400 * time.Millisecond
	client, proxy := proxiedClient(t, func(o *redis.Options) { o.ContextTimeoutEnabled = contextTimeout })
	store := newStore(t, client, opts...)
	if err := store.Remember(context.Background(), "warm-up", 0, nil); err != nil { // a pooled connection
		t.Fatal(err)
	}
	var runs atomic.Int32
	h := idempotency.Middleware(store, idempotency.WithClaim(lease), idempotency.WithStoreTimeout(timeout),
		idempotency.WithLogger(watermill.NopLogger{}))(func(*message.Message) ([]*message.Message, error) {
		runs.Add(1)
		return nil, nil
	})
	payload := testenv.NewEnvelope(t).Payload

	proxy.Delay.Store(int64(delay))
	start := time.Now()
	if _, err := h(message.NewMessage(watermill.NewUUID(), payload)); !errors.Is(err, idempotency.ErrStore) {
		t.Fatalf("the delivery whose claim reply is late: %v, want ErrStore at the store timeout", err)
	}
	gaveUp := time.Since(start)
	proxy.Delay.Store(0)

	// The broker redelivers, again and again while the delivery is parked,
	// until it runs: long before the lease would lapse.
	deadline := time.Now().Add(15 * time.Second)
	redeliveries := 0
	for {
		redeliveries++
		_, err := h(message.NewMessage(watermill.NewUUID(), payload))
		if err == nil {
			break
		}
		if !errors.Is(err, idempotency.ErrInFlight) && !errors.Is(err, idempotency.ErrStore) {
			t.Fatalf("redelivery %d: %v", redeliveries, err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("redelivery %d, %v after the first delivery gave up (after %v): %v; the abandoned claim was never released, the message waits for its lease of %v",
				redeliveries, time.Since(start), gaveUp, err, lease)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("the handler ran %d times, want once", n)
	}
	t.Logf("the redelivery ran %v after the first delivery gave up (%d deliveries)", time.Since(start)-gaveUp, redeliveries)
}

// slowScriptHook holds back, by delay, the answer of every EVALSHA sent
// for the claim value holder (the command runs on the server at once).
type slowScriptHook struct {
	holder string
	delay  time.Duration
}

func (h *slowScriptHook) slow(cmd redis.Cmder) bool {
	if cmd.Name() != "evalsha" {
		return false
	}
	for _, a := range cmd.Args() {
		if a == h.holder {
			return true
		}
	}
	return false
}

func (*slowScriptHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *slowScriptHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if h.slow(cmd) {
			time.Sleep(h.delay)
		}
		return err
	}
}

func (h *slowScriptHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		for _, cmd := range cmds {
			if h.slow(cmd) {
				time.Sleep(h.delay)
				break
			}
		}
		return err
	}
}

// TestAbandonedClaimOfAFailingKeyIsReleased: a claim that finds a failing
// record takes it over with a script; the script's answer comes back after
// its caller gave up. The store releases the claim then, leaving the count
// behind as a Release does: the next delivery runs with it at once.
func TestAbandonedClaimOfAFailingKeyIsReleased(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		opts []redisstore.Option
	}{{"pipelined", nil}, {"unpipelined", []redisstore.Option{redisstore.WithoutPipelining()}}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			direct := testenv.Redis(t)
			client := redis.NewClient(direct.Options())
			t.Cleanup(func() { _ = client.Close() })
			testenv.TrackKeys(t, client, direct)
			client.AddHook(&slowScriptHook{holder: "cgives-up", delay: 400 * time.Millisecond})
			s := newStore(t, client, tc.opts...)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			f := failure(1)
			if err := s.Fail(ctx, "k", 0, f); err != nil {
				t.Fatal(err)
			}
			short, cancelShort := context.WithTimeout(stores.WithClaimToken(ctx, "gives-up"), 100*time.Millisecond)
			_, _, err := s.Claim(short, "k", time.Minute)
			cancelShort()
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("the claim whose answer is late: %v, want its deadline", err)
			}
			deadline := time.Now().Add(10 * time.Second)
			for {
				r, err := s.Lookup(ctx, "k")
				if err != nil {
					t.Fatal(err)
				}
				if r.State == stores.StateFailing {
					if r.Failure.Attempts != 1 || !r.Failure.FirstFailure.Equal(f.FirstFailure) {
						t.Fatalf("after the release: %+v, want the count of 1 left behind", r.Failure)
					}
					break
				}
				if r.State != stores.StateInFlight || time.Now().After(deadline) {
					t.Fatalf("the failing key %v after its claim was abandoned: %+v; want failing again (released) long before the lease of a minute", time.Since(deadline.Add(-10*time.Second)), r)
				}
				time.Sleep(20 * time.Millisecond)
			}
			if ok, found, err := s.Claim(stores.WithClaimToken(ctx, "next"), "k", time.Minute); err != nil || !ok || found.Failure.Attempts != 1 {
				t.Fatalf("the next delivery's claim = %v, %+v, %v; want taken with the count", ok, found, err)
			}
		})
	}
}
