// Package wiring_test runs every wiring the README documents against every
// fault a consumer meets, on Redis Streams with redisstore, and checks the
// promise each time: no message lost, no effect repeated where the kit
// promises it once, nothing transient dead-lettered.
package wiring_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// A wiring is the middleware chain of one documented setup.
type wiring struct {
	name string
	// concurrent: the wiring has a claim, so every message is published
	// twice at once and consumed by two workers: concurrent duplicates are
	// parked (ErrInFlight) rather than run twice.
	concurrent bool
	chain      func(store stores.Store, dlq message.Publisher, dlqTopic string, opts ...idempotency.Option) []message.HandlerMiddleware
}

func retry() message.HandlerMiddleware {
	return middleware.Retry{MaxRetries: 3, InitialInterval: 10 * time.Millisecond,
		ShouldRetry: func(p middleware.RetryParams) bool { return !idempotency.IsPermanent(p.Err) }}.Middleware
}

var wirings = []wiring{
	{"plain", false, func(store stores.Store, _ message.Publisher, _ string, opts ...idempotency.Option) []message.HandlerMiddleware {
		return []message.HandlerMiddleware{idempotency.Middleware(store, opts...)}
	}},
	{"claim", true, func(store stores.Store, _ message.Publisher, _ string, opts ...idempotency.Option) []message.HandlerMiddleware {
		return []message.HandlerMiddleware{idempotency.Middleware(store, append(opts, idempotency.WithClaim(30*time.Second))...)}
	}},
	{"retry", true, func(store stores.Store, _ message.Publisher, _ string, opts ...idempotency.Option) []message.HandlerMiddleware {
		return []message.HandlerMiddleware{retry(), idempotency.Middleware(store, append(opts, idempotency.WithClaim(30*time.Second))...)}
	}},
	// The README's "Adopting it".
	{"poison-queue", true, func(store stores.Store, pub message.Publisher, dlqTopic string, opts ...idempotency.Option) []message.HandlerMiddleware {
		poison, err := middleware.PoisonQueueWithFilter(pub, dlqTopic, idempotency.IsPermanent)
		if err != nil {
			panic(err)
		}
		return []message.HandlerMiddleware{middleware.Recoverer, poison, retry(),
			idempotency.Middleware(store, append(opts, idempotency.WithClaim(30*time.Second))...)}
	}},
	// The README's "Dead letters".
	{"dead-letter", false, func(store stores.Store, pub message.Publisher, dlqTopic string, opts ...idempotency.Option) []message.HandlerMiddleware {
		dlq, err := deadletter.Middleware(pub, deadletter.WithTopic(func(string) string { return dlqTopic }))
		if err != nil {
			panic(err)
		}
		return []message.HandlerMiddleware{dlq, retry(), deadletter.CountAttempts, idempotency.Middleware(store, opts...)}
	}},
	// The same with a claim: parked duplicates reach the dead-letter
	// middleware once Retry gives up.
	{"dead-letter-claim", true, func(store stores.Store, pub message.Publisher, dlqTopic string, opts ...idempotency.Option) []message.HandlerMiddleware {
		dlq, err := deadletter.Middleware(pub, deadletter.WithTopic(func(string) string { return dlqTopic }))
		if err != nil {
			panic(err)
		}
		return []message.HandlerMiddleware{dlq, retry(), deadletter.CountAttempts,
			idempotency.Middleware(store, append(opts, idempotency.WithClaim(30*time.Second))...)}
	}},
}

type fault string

const (
	faultHandlerError fault = "handler-error"
	faultPanic        fault = "panic"
	faultStoreDown    fault = "store-down"
	faultSlowPublish  fault = "slow-publish"
	faultFailPublish  fault = "failed-publish"
	faultShutdown     fault = "shutdown"
)

var faults = []fault{faultHandlerError, faultPanic, faultStoreDown, faultSlowPublish, faultFailPublish, faultShutdown}

// TestWiringByFault: for every documented wiring and every fault, 16
// messages (every other one producing a follow-up message) are consumed
// from Redis Streams with redisstore behind a proxy the test can cut (with
// a claim: each published twice at once, two workers), then all 16 are
// published again as redeliveries. Each time: every entry is
// acked (nothing lost), every message's effect happened exactly once (or,
// when the publication of its follow-up failed, once more for that
// failure: the kit promises the follow-up, not a single run), every
// follow-up was published once, and the dead-letter topic is empty.
func TestWiringByFault(t *testing.T) {
	if testing.Short() {
		t.Skip("runs 36 cells of routers on Redis")
	}
	broker := testenv.Redis(t)
	for _, w := range wirings {
		for _, f := range faults {
			t.Run(w.name+"/"+string(f), func(t *testing.T) {
				t.Parallel()
				runMatrixCell(t, broker, w, f)
			})
		}
	}
}

// cell is one (wiring, fault) run.
type cell struct {
	t              *testing.T
	f              fault
	broker         *redis.Client
	topic, out     string
	dlqTopic       string
	n              int
	index          map[string]int // meta.id -> message number
	fx             testenv.Effects
	mu             sync.Mutex
	runs           map[string]int // handler runs (effect or not) per meta.id
	failedPublish  map[string]int // failed publications per parent meta.id
	failedOnce     map[string]bool
	effects        atomic.Int64
	storeErrs      atomic.Int64
	rememberFailed atomic.Int64
	parks          atomic.Int64
}

func (c *cell) produces(id string) bool { return c.index[id]%2 == 0 }

func (c *cell) handler(msg *message.Message) ([]*message.Message, error) {
	e, err := envelope.Parse(msg.Payload)
	if err != nil {
		return nil, err
	}
	id := e.Meta.ID
	c.mu.Lock()
	run := c.runs[id]
	c.runs[id]++
	c.mu.Unlock()
	switch {
	case c.f == faultHandlerError && run == 0:
		return nil, errors.New("payment gateway timeout")
	case c.f == faultPanic && run == 0:
		panic("handler bug on first run")
	case c.f == faultShutdown:
		time.Sleep(50 * time.Millisecond) // in flight when the worker stops
	}
	c.fx.Add(id)
	c.effects.Add(1)
	if !c.produces(id) {
		return nil, nil
	}
	child, err := envelope.NewChild(e, "receipt", "urn:babel:receipts:sent", map[string]any{"for": id})
	if err != nil {
		return nil, err
	}
	payload, err := child.Marshal()
	if err != nil {
		return nil, err
	}
	return []*message.Message{message.NewMessage(watermill.NewUUID(), payload)}, nil
}

// publisher publishes produced messages, slowly or failing the first time
// for each parent, as the fault says, and counts every failed publication
// per parent (Watermill's router also closes it at shutdown while handlers
// are still in flight, which fails their publications).
// Close and Publish are serialised: watermill-redisstream's publisher does
// not guard its closed flag, and the router closes it while handlers may
// still publish.
type publisher struct {
	message.Publisher
	c *cell

	mu     sync.RWMutex
	closed bool
}

func (p *publisher) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	return p.Publisher.Close()
}

func (p *publisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	err := errors.New("publisher closed")
	if !p.closed {
		err = p.publish(topic, msgs...)
	}
	if err != nil {
		p.c.mu.Lock()
		for _, m := range msgs {
			p.c.failedPublish[p.c.parentOf(m)]++
		}
		p.c.mu.Unlock()
	}
	return err
}

func (p *publisher) publish(topic string, msgs ...*message.Message) error {
	switch p.c.f {
	case faultSlowPublish:
		time.Sleep(300 * time.Millisecond)
	case faultFailPublish:
		for _, m := range msgs {
			parent := p.c.parentOf(m)
			p.c.mu.Lock()
			first := !p.c.failedOnce[parent]
			p.c.failedOnce[parent] = true
			p.c.mu.Unlock()
			if first {
				return fmt.Errorf("publish to %s: broker unavailable", topic)
			}
		}
	}
	return p.Publisher.Publish(topic, msgs...)
}

// parentOf finds the parent meta.id of a follow-up by its data.
func (c *cell) parentOf(m *message.Message) string {
	e, err := envelope.Parse(m.Payload)
	if err != nil {
		return ""
	}
	for id := range c.index {
		if envelope.DeriveID(id, "receipt") == e.Meta.ID {
			return id
		}
	}
	return ""
}

func runMatrixCell(t *testing.T, broker *redis.Client, w wiring, f fault) {
	ctx := context.Background()
	run := "bq-mx-" + testenv.RandomHex(4)
	c := &cell{t: t, f: f, broker: broker, topic: run, out: run + ".receipts", dlqTopic: run + ".dlq", n: 16,
		index: map[string]int{}, runs: map[string]int{}, failedPublish: map[string]int{}, failedOnce: map[string]bool{}}
	prefix := run + ":"
	t.Cleanup(func() {
		broker.Del(ctx, c.topic, c.out, c.dlqTopic)
		_ = testenv.DropKeys(ctx, broker, prefix+"*")
	})

	// The store talks to Redis through a proxy the test can cut.
	px := testenv.NewFaultProxy(t, broker.Options().Addr)
	storeOpts := *broker.Options()
	storeOpts.Addr = px.Addr()
	storeOpts.MaxRetries = -1
	storeOpts.DialTimeout = 300 * time.Millisecond
	storeOpts.ReadTimeout = 500 * time.Millisecond
	storeOpts.WriteTimeout = 500 * time.Millisecond
	storeClient := redis.NewClient(&storeOpts)
	t.Cleanup(func() { _ = storeClient.Close() })
	store := redisstore.New(storeClient, redisstore.WithPrefix(prefix), redisstore.WithTTL(10*time.Minute))

	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: redis.NewClient(broker.Options())}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })

	opts := []idempotency.Option{
		idempotency.WithStoreTimeout(time.Second),
		idempotency.WithRememberRetry(8, 50*time.Millisecond), // rides out the outage
		idempotency.WithObserver(idempotency.ObserverFunc(func(_ context.Context, e idempotency.Event) {
			switch e.Outcome {
			case idempotency.OutcomeStoreError:
				c.storeErrs.Add(1)
			case idempotency.OutcomeRememberFailed:
				c.rememberFailed.Add(1)
			case idempotency.OutcomePark:
				c.parks.Add(1)
			}
		})),
	}
	chain := w.chain(store, pub, c.dlqTopic, opts...)

	payloads := make([][]byte, c.n)
	for i := range c.n {
		e, err := envelope.New("urn:babel:orders:charge", map[string]any{"i": i}, envelope.WithQueue(c.topic))
		if err != nil {
			t.Fatal(err)
		}
		if payloads[i], err = e.Marshal(); err != nil {
			t.Fatal(err)
		}
		c.index[e.Meta.ID] = i
	}
	copies := 1
	if w.concurrent {
		copies = 2
	}
	publishAll := func(copies int) {
		for _, p := range payloads {
			for range copies {
				if err := pub.Publish(c.topic, message.NewMessage(watermill.NewUUID(), p)); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	publishAll(copies)

	workers := func(names ...string) (stop func()) {
		var stops []func()
		for _, name := range names[:copies] {
			stops = append(stops, c.consumer(chain, name))
		}
		return func() {
			for _, stop := range stops {
				stop()
			}
		}
	}
	stop := workers("c1", "c1b")
	switch f {
	case faultStoreDown:
		c.waitEffects(int64(c.n / 3))
		px.Cut()
		time.Sleep(time.Second)
		px.Restore()
	case faultShutdown:
		c.waitEffects(int64(c.n / 3))
		stop()
		stop = workers("c2", "c2b") // claim what c1 left pending
	}
	c.waitDrained(copies * c.n)
	// A record is written once the delivery is acked: wait for every one
	// before the redeliveries (a redelivery racing its record's write is a
	// concurrent duplicate, which only WithClaim keeps apart).
	c.waitRecords(prefix)
	publishAll(1) // every message again: redeliveries
	c.waitDrained((copies + 1) * c.n)
	stop()
	if c.parks.Load() > 0 {
		t.Logf("%d deliveries parked behind a concurrent duplicate", c.parks.Load())
	}

	if f == faultStoreDown && c.storeErrs.Load() == 0 && c.rememberFailed.Load() == 0 {
		t.Log("no store call met the outage")
	}
	if n := c.rememberFailed.Load(); n != 0 {
		t.Errorf("%d records given up", n)
	}
	c.checkEffects()
	c.checkFollowUps()
	if n := broker.XLen(ctx, c.dlqTopic).Val(); n != 0 {
		t.Errorf("%d messages dead-lettered, want none: %v", n, c.deadLetterReasons())
	}
}

func (c *cell) consumer(chain []message.HandlerMiddleware, name string) (stop func()) {
	t := c.t
	var logger watermill.LoggerAdapter = watermill.NopLogger{}
	if testing.Verbose() && os.Getenv("WIRING_LOG") != "" {
		logger = watermill.NewStdLogger(true, false)
	}
	sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
		Client: redis.NewClient(c.broker.Options()), ConsumerGroup: "workers", Consumer: name, OldestId: "0",
		NackResendSleep: 20 * time.Millisecond, BlockTime: 100 * time.Millisecond, DisableIndefiniteInitialBlock: true,
		ClaimInterval: 200 * time.Millisecond, MaxIdleTime: 500 * time.Millisecond,
	}, logger)
	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(chain...)
	// The router closes the publisher of produced messages: one each.
	out, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: redis.NewClient(c.broker.Options())}, logger)
	if err != nil {
		t.Fatal(err)
	}
	r.AddHandler("charge", c.topic, sub, c.out, &publisher{Publisher: out, c: c}, c.handler)
	return testenv.RunRouter(t, r)
}

func (c *cell) waitEffects(n int64) {
	deadline := time.Now().Add(time.Minute)
	for c.effects.Load() < n {
		if time.Now().After(deadline) {
			c.t.Fatalf("no progress: %d effects", c.effects.Load())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (c *cell) waitDrained(entries int) {
	deadline := time.Now().Add(2 * time.Minute)
	for !testenv.StreamDrained(context.Background(), c.broker, c.topic, "workers", entries) {
		if time.Now().After(deadline) {
			c.t.Fatalf("not drained: %d effects, %d store errors, dead letters %v", c.effects.Load(), c.storeErrs.Load(), c.deadLetterReasons())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (c *cell) waitRecords(prefix string) {
	deadline := time.Now().Add(time.Minute)
	for {
		keys, err := c.broker.Keys(context.Background(), prefix+"*").Result()
		if err == nil && len(keys) >= c.n {
			return
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("%d records written, want %d; dead letters: %v", len(keys), c.n, c.deadLetterReasons())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (c *cell) checkEffects() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for id, i := range c.index {
		want := 1 + c.failedPublish[id] // a failed publication makes the router run it again
		if got := c.fx.Count(id); got != want {
			c.t.Errorf("message %d (%s, produces %v): effect ran %d times, want %d", i, id, c.produces(id), got, want)
		}
	}
}

func (c *cell) checkFollowUps() {
	entries, err := c.broker.XRange(context.Background(), c.out, "-", "+").Result()
	if err != nil {
		c.t.Fatal(err)
	}
	got := map[string]int{}
	for _, e := range entries {
		payload, _ := e.Values["payload"].(string)
		id, err := envelope.ReadIdentity([]byte(payload))
		if err != nil {
			c.t.Fatalf("follow-up %q: %v", payload, err)
		}
		got[id.ID]++
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for id, i := range c.index {
		n := got[envelope.DeriveID(id, "receipt")]
		switch {
		case !c.produces(id) && n != 0:
			c.t.Errorf("message %d produces nothing, yet %d follow-ups", i, n)
		case c.produces(id) && n == 0:
			c.t.Errorf("message %d: its follow-up was lost", i)
		case n > 1+c.failedPublish[id]:
			// A publication that reported a failure may still have reached
			// the broker; the follow-up's derived meta.id makes the copy a
			// duplicate its consumer skips.
			c.t.Errorf("message %d: follow-up published %d times, want once (%d failed publications)", i, n, c.failedPublish[id])
		}
	}
}

func (c *cell) deadLetterReasons() []string {
	entries, _ := c.broker.XRange(context.Background(), c.dlqTopic, "-", "+").Result()
	var reasons []string
	for _, e := range entries {
		payload, _ := e.Values["payload"].(string)
		if dl, err := envelope.Parse([]byte(payload)); err == nil && dl.DeadLetter != nil && dl.DeadLetter.Error != nil {
			reasons = append(reasons, dl.DeadLetter.Reason+": "+*dl.DeadLetter.Error)
		} else {
			reasons = append(reasons, fmt.Sprint(e.Values))
		}
	}
	return reasons
}
