// Package brokersuite is one behaviour suite for the kit's router
// middleware, run against every broker the kit is used with: Redis Streams
// (watermill-redisstream), PostgreSQL (watermill-sql), the BabelQueue Redis
// list layouts (pubsub/redislist), RabbitMQ (watermill-amqp with
// marshal/amqpmarshal), NATS JetStream (watermill-nats) and Kafka
// (watermill-kafka with marshal/kafkamarshal, on KAFKA_BROKERS or an
// in-process kfake cluster).
//
// A Broker says how to get a topic, publishers and subscribers on one real
// server, how many messages of a topic are not acked yet, and how to read a
// dead-letter topic without consuming it. Run then proves, on that broker:
//
//   - duplicates are skipped and every copy is acked;
//   - a failing handler's delivery is redelivered, then runs once;
//   - copies delivered at once to two routers under WithClaim give one
//     effect;
//   - messages that fail for good land on the dead-letter topic as
//     envelopes;
//   - package redrive moves them back, and they run once.
//
// Each case is written so that it fails when the kit's middleware is taken
// out of the router (the package's own tests check that on one broker).
package brokersuite

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/redrive"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// Broker describes one broker to the suite.
type Broker struct {
	// Name names the broker in test names.
	Name string
	// Redelivers reports that a nacked message is delivered again. The
	// cases that need it are skipped otherwise.
	Redelivers bool
	// MergesIdenticalCopies reports that byte-identical copies of a
	// message handed out at the same time become one (Laravel's reserved
	// and delayed sorted sets hold a member once): the copies are not acked
	// one by one, and the claim case waits for an empty backlog instead.
	MergesIdenticalCopies bool
	// MaxMessage is the largest message, in bytes, the broker takes as
	// the suite sets it up (NATS's max_payload, headers included); 0 when
	// it is beyond what a test should publish.
	MaxMessage int
	// Setup prepares one test on the broker. Everything the test creates
	// there (queues, streams, keys, tables, consumer groups) is removed
	// when t ends.
	Setup func(t testing.TB) *Env
}

// Env is one test's view of a broker.
type Env struct {
	// Topic is a topic unique to the test.
	Topic string
	// DeadLetterTopic is where Topic's dead letters go.
	DeadLetterTopic string
	// NewPublisher returns a publisher, closed when the test ends.
	NewPublisher func(t testing.TB) message.Publisher
	// NewSubscriber returns a subscriber of the test's consumer group:
	// the subscribers of one test compete for a topic's messages. It is
	// closed by the router it is given to, or when the test ends.
	NewSubscriber func(t testing.TB) message.Subscriber
	// Backlog returns how many messages of topic the test's consumer group
	// has not acked (waiting or handed out). The suite calls it after the
	// subscribers reading topic are closed.
	Backlog func(t testing.TB, topic string) int
	// Browse returns the messages waiting on topic, in order, without
	// consuming them.
	Browse func(t testing.TB, topic string) []*message.Message
}

// Case names, in the order Run runs them.
const (
	CaseDuplicates  = "DuplicatesSkippedAndAcked"
	CaseFailure     = "FailureRedeliveredThenRunOnce"
	CaseClaim       = "ConcurrentCopiesUnderClaimOneEffect"
	CaseDeadLetters = "DeadLettersLandAsEnvelopes"
	CaseRedrive     = "RedriveRunsDeadLettersOnce"
	CaseLongError   = "LongErrorUnderTimeoutDeadLettersOnce"
	CaseNearLimit   = "NearLimitOriginalDeadLettersOnce"
)

// settings are the knobs of one run: the package's own tests take the kit
// out of the router to see each case fail.
type settings struct {
	withoutKit bool
	wait       time.Duration
}

type caseFunc func(t testing.TB, b Broker, s settings)

var cases = []struct {
	name       string
	redelivery bool // needs Broker.Redelivers
	limit      bool // needs Broker.MaxMessage
	run        caseFunc
}{
	{CaseDuplicates, false, false, duplicates},
	{CaseFailure, true, false, failure},
	{CaseClaim, true, false, claim},
	{CaseDeadLetters, false, false, deadLetters},
	{CaseRedrive, false, false, redriveOnce},
	{CaseLongError, false, false, longErrorUnderTimeout},
	{CaseNearLimit, false, true, nearLimitOriginal},
}

// Run runs every case of the suite against b, each as a subtest.
func Run(t *testing.T, b Broker) {
	t.Helper()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel() // each case sets up a topic of its own
			if c.redelivery && !b.Redelivers {
				t.Skipf("%s does not redeliver nacked messages", b.Name)
			}
			if c.limit && b.MaxMessage == 0 {
				t.Skipf("%s: no message limit a test can reach", b.Name)
			}
			c.run(t, b, settings{wait: 45 * time.Second})
		})
	}
}

const job = "urn:babel:payments:charge"

// deliveries counts how the router ended the deliveries it handed out.
// Added as the outermost middleware, it sees every delivery and waits for
// the router's ack or nack of it.
type deliveries struct {
	started, acked, nacked atomic.Int64
	wg                     sync.WaitGroup
	stop                   chan struct{}
}

func newDeliveries(t testing.TB) *deliveries {
	d := &deliveries{stop: make(chan struct{})}
	t.Cleanup(func() { close(d.stop); d.wg.Wait() })
	return d
}

func (d *deliveries) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		d.wg.Add(1)
		d.started.Add(1)
		go func() {
			defer d.wg.Done()
			select {
			case <-msg.Acked():
				d.acked.Add(1)
			case <-msg.Nacked():
				d.nacked.Add(1)
			case <-d.stop:
			}
		}()
		return h(msg)
	}
}

// eventually waits up to s.wait for cond, failing t with what and the
// state report says.
func (s settings) eventually(t testing.TB, what string, cond func() bool, report func() string) {
	t.Helper()
	deadline := time.Now().Add(s.wait)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s: %s", s.wait, what, report())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func newRouter(t testing.TB) *message.Router {
	t.Helper()
	var logger watermill.LoggerAdapter = watermill.NopLogger{}
	if os.Getenv("BROKERSUITE_LOG") != "" {
		logger = watermill.NewStdLogger(false, false)
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// guard is the kit's idempotency middleware, or nothing without the kit.
func (s settings) guard(store *memstore.Store, opts ...idempotency.Option) []message.HandlerMiddleware {
	if s.withoutKit {
		return nil
	}
	return []message.HandlerMiddleware{idempotency.Middleware(store, opts...)}
}

// idOf is the message's meta.id ("" for a body that is not an envelope).
func idOf(msg *message.Message) string {
	id, _ := envelope.ReadIdentity(msg.Payload)
	return id.ID
}

// drained waits until the broker reports nothing left unacked on each
// topic. The suite checks it twice: while the subscribers run (some commit
// an ack after handing it over: watermill-sql rolls back the offsets of a
// batch whose commit races with Close, and the messages come back later),
// then once they are closed (RabbitMQ counts a delivery held unacked by a
// consumer only once the consumer is gone).
func (s settings) drained(t testing.TB, env *Env, topics ...string) {
	t.Helper()
	for _, topic := range topics {
		var n int
		s.eventually(t, "an empty backlog on "+topic, func() bool { n = env.Backlog(t, topic); return n == 0 },
			func() string { return fmt.Sprintf("%d messages not acked", n) })
	}
}

// duplicates: payments published one to three times each are charged once,
// and every copy is acked.
func duplicates(t testing.TB, b Broker, s settings) {
	env := b.Setup(t)
	const n = 30
	var charges testenv.Effects
	d := newDeliveries(t)
	r := newRouter(t)
	r.AddMiddleware(d.middleware)
	r.AddMiddleware(s.guard(memstore.New())...)
	r.AddConsumerHandler("charge", env.Topic, env.NewSubscriber(t), func(msg *message.Message) error {
		charges.Add(idOf(msg))
		return nil
	})
	stop := testenv.RunRouter(t, r)
	ids, entries := testenv.PublishCopies(t, env.NewPublisher(t), env.Topic, job, n, func(i int) int { return 1 + i%3 })
	s.eventually(t, "every copy acked", func() bool { return d.acked.Load() >= int64(entries) },
		func() string {
			return fmt.Sprintf("%d of %d copies acked, %d nacked, %d charges", d.acked.Load(), entries, d.nacked.Load(), charges.Total())
		})
	s.drained(t, env, env.Topic)
	stop()
	if err := charges.ExactlyOnce(ids); err != nil {
		t.Fatalf("%d copies of %d payments: %v", entries, n, err)
	}
	if got := d.nacked.Load(); got != 0 {
		t.Fatalf("%d duplicates nacked; a skipped copy must be acked", got)
	}
	s.drained(t, env, env.Topic)
	t.Logf("%s: %d copies of %d payments, %d charges, %d acked, 0 nacked", b.Name, entries, n, charges.Total(), d.acked.Load())
}

// failure: each payment is published twice and its first delivery fails;
// the failed delivery is nacked and delivered again, the payment is
// charged once, and every delivery ends acked.
func failure(t testing.TB, b Broker, s settings) {
	env := b.Setup(t)
	const n = 20
	var charges testenv.Effects
	var mu sync.Mutex
	runs := map[string]int{}
	d := newDeliveries(t)
	r := newRouter(t)
	r.AddMiddleware(d.middleware)
	r.AddMiddleware(s.guard(memstore.New())...)
	r.AddConsumerHandler("charge", env.Topic, env.NewSubscriber(t), func(msg *message.Message) error {
		id := idOf(msg)
		mu.Lock()
		runs[id]++
		first := runs[id] == 1
		mu.Unlock()
		if first {
			return errors.New("payment gateway timeout")
		}
		charges.Add(id)
		return nil
	})
	stop := testenv.RunRouter(t, r)
	ids, entries := testenv.PublishCopies(t, env.NewPublisher(t), env.Topic, job, n, func(int) int { return 2 })
	// Every copy ends acked; the failed first deliveries come on top.
	s.eventually(t, "every payment charged and every copy acked", func() bool {
		return charges.Total() >= n && d.acked.Load() >= int64(entries)
	}, func() string {
		return fmt.Sprintf("%d charges for %d payments, %d of %d copies acked, %d nacked", charges.Total(), n, d.acked.Load(), entries, d.nacked.Load())
	})
	s.drained(t, env, env.Topic)
	stop()
	if err := charges.ExactlyOnce(ids); err != nil {
		t.Fatalf("%d copies of %d payments, each failing once: %v", entries, n, err)
	}
	if got := d.nacked.Load(); got != n {
		t.Fatalf("%d deliveries nacked, want %d (the first delivery of each payment)", got, n)
	}
	s.drained(t, env, env.Topic)
	t.Logf("%s: %d copies of %d payments, %d failed deliveries nacked and redelivered, %d charges", b.Name, entries, n, d.nacked.Load(), charges.Total())
}

// claim: two routers, each with a subscriber of the same consumer group,
// share a store under WithClaim; two or three copies of each payment give
// one charge, and every copy ends acked (a copy parked behind a claim is
// nacked, comes back and is skipped).
func claim(t testing.TB, b Broker, s settings) {
	env := b.Setup(t)
	const n = 40
	store := memstore.New()
	var charges testenv.Effects
	var parked atomic.Int64
	observer := idempotency.ObserverFunc(func(_ context.Context, e idempotency.Event) {
		if e.Outcome == idempotency.OutcomePark {
			parked.Add(1)
		}
	})
	d := newDeliveries(t)
	var stops []func()
	for range 2 {
		r := newRouter(t)
		r.AddMiddleware(d.middleware)
		r.AddMiddleware(s.guard(store, idempotency.WithClaim(30*time.Second), idempotency.WithObserver(observer))...)
		r.AddConsumerHandler("charge", env.Topic, env.NewSubscriber(t), func(msg *message.Message) error {
			time.Sleep(5 * time.Millisecond) // the charge: copies overlap
			charges.Add(idOf(msg))
			return nil
		})
		stops = append(stops, testenv.RunRouter(t, r))
	}
	ids, entries := testenv.PublishCopies(t, env.NewPublisher(t), env.Topic, job, n, func(i int) int { return 2 + i%2 })
	s.eventually(t, "every copy acked", func() bool {
		if charges.Total() < n {
			return false
		}
		if b.MergesIdenticalCopies {
			return d.started.Load() == d.acked.Load()+d.nacked.Load() && env.Backlog(t, env.Topic) == 0
		}
		return d.acked.Load() >= int64(entries)
	}, func() string {
		return fmt.Sprintf("%d charges for %d payments, %d of %d copies acked, %d parked", charges.Total(), n, d.acked.Load(), entries, parked.Load())
	})
	s.drained(t, env, env.Topic)
	for _, stop := range stops {
		stop()
	}
	if err := charges.ExactlyOnce(ids); err != nil {
		t.Fatalf("%d copies of %d payments over two routers: %v", entries, n, err)
	}
	s.drained(t, env, env.Topic)
	t.Logf("%s: %d copies of %d payments over two routers, %d charges, %d copies parked behind a claim and redelivered, %d deliveries acked", b.Name, entries, n, charges.Total(), parked.Load(), d.acked.Load())
}

// shop is a payment handler behind the dead-letter middleware: every
// fifth payment (data.i = 2, 7, 12, …) fails while the gateway is down.
type shop struct {
	charges testenv.Effects
	down    atomic.Bool
}

func isPoison(i int) bool { return i%5 == 2 }

func (p *shop) charge(msg *message.Message) error {
	var data struct{ I int }
	if e, err := envelope.Parse(msg.Payload); err != nil {
		return err
	} else if err := json.Unmarshal(e.Data, &data); err != nil {
		return err
	}
	if isPoison(data.I) && p.down.Load() {
		return errors.New("payment gateway: 503 service unavailable")
	}
	p.charges.Add(idOf(msg))
	return nil
}

// deadLetterRouter runs the router of the dead-letter cases with the
// README's production wiring: the dead-letter middleware outermost, the
// guard with a retry budget innermost (3 runs here, a short backoff). The
// suite's own check without the kit runs Watermill's Retry alone.
func deadLetterRouter(t testing.TB, env *Env, s settings, p *shop, d *deliveries) (stop func()) {
	t.Helper()
	r := newRouter(t)
	r.AddMiddleware(d.middleware)
	if s.withoutKit {
		r.AddMiddleware(middleware.Retry{MaxRetries: 2, InitialInterval: 5 * time.Millisecond}.Middleware)
	} else {
		dlq, err := deadletter.Middleware(env.NewPublisher(t), deadletter.WithTopic(func(string) string { return env.DeadLetterTopic }))
		if err != nil {
			t.Fatal(err)
		}
		r.AddMiddleware(dlq, idempotency.Middleware(memstore.New(),
			idempotency.WithRetries(idempotency.Retries{Max: 2, Backoff: 5 * time.Millisecond})))
	}
	r.AddConsumerHandler("charge", env.Topic, env.NewSubscriber(t), p.charge)
	return testenv.RunRouter(t, r)
}

// publishWithPoison publishes n payments, the poison ones poisonCopies
// times.
func publishWithPoison(t testing.TB, env *Env, n, poisonCopies int) (ids []string, poison map[string]bool, entries int) {
	t.Helper()
	ids, entries = testenv.PublishCopies(t, env.NewPublisher(t), env.Topic, job, n, func(i int) int {
		if isPoison(i) {
			return poisonCopies
		}
		return 1
	})
	poison = map[string]bool{}
	for i, id := range ids {
		if isPoison(i) {
			poison[id] = true
		}
	}
	return ids, poison, entries
}

// checkDeadLetters reads the dead-letter topic and checks that it holds
// want envelopes, each a poison payment with its dead_letter block.
func checkDeadLetters(t testing.TB, env *Env, s settings, poison map[string]bool, want int) {
	t.Helper()
	var dead []*message.Message
	s.eventually(t, fmt.Sprintf("%d dead letters on %s", want, env.DeadLetterTopic), func() bool {
		dead = env.Browse(t, env.DeadLetterTopic)
		return len(dead) >= want
	}, func() string { return fmt.Sprintf("%d found", len(dead)) })
	if len(dead) != want {
		t.Fatalf("%d dead letters on %s, want %d", len(dead), env.DeadLetterTopic, want)
	}
	for _, msg := range dead {
		e, err := envelope.Parse(msg.Payload)
		if err != nil {
			t.Fatalf("a dead letter is not an envelope (%v): %s", err, msg.Payload)
		}
		switch dl := e.DeadLetter; {
		case dl == nil:
			t.Fatalf("dead letter %s has no dead_letter block: %s", e.Meta.ID, msg.Payload)
		case !poison[e.Meta.ID]:
			t.Fatalf("payment %s was dead-lettered but never failed", e.Meta.ID)
		case e.Job != job || dl.Reason != envelope.ReasonFailed || dl.OriginalQueue != env.Topic || dl.Attempts != 3 || dl.Lang != "go" || dl.Error == nil || *dl.Error == "":
			t.Fatalf("dead letter %s: job %q, dead_letter %+v; want job %q, reason %q, original_queue %q, 3 attempts, lang go and the error",
				e.Meta.ID, e.Job, *dl, job, envelope.ReasonFailed, env.Topic)
		}
	}
}

// deadLetters: payments that fail for good land on the dead-letter topic
// as envelopes with their dead_letter block; the others are charged once;
// every delivery is acked.
func deadLetters(t testing.TB, b Broker, s settings) {
	env := b.Setup(t)
	const n = 20
	p := &shop{}
	p.down.Store(true)
	d := newDeliveries(t)
	stop := deadLetterRouter(t, env, s, p, d)
	ids, poison, entries := publishWithPoison(t, env, n, 1)
	checkDeadLetters(t, env, s, poison, len(poison))
	s.eventually(t, "every delivery acked", func() bool { return d.acked.Load() >= int64(entries) },
		func() string { return fmt.Sprintf("%d of %d acked", d.acked.Load(), entries) })
	s.drained(t, env, env.Topic)
	stop()
	var healthy []string
	for _, id := range ids {
		if !poison[id] {
			healthy = append(healthy, id)
		}
	}
	if err := p.charges.ExactlyOnce(healthy); err != nil {
		t.Fatal(err)
	}
	s.drained(t, env, env.Topic)
	t.Logf("%s: %d payments, %d dead-lettered as envelopes on %s after 3 attempts, %d charged", b.Name, n, len(poison), env.DeadLetterTopic, p.charges.Total())
}

// redriveOnce: poison payments, each published twice, are dead-lettered
// once (the second copy finds the message's end and is acked without
// running); once the gateway is back, package redrive moves every dead
// letter back to the topic, and each payment is charged once.
func redriveOnce(t testing.TB, b Broker, s settings) {
	env := b.Setup(t)
	const n = 20
	p := &shop{}
	p.down.Store(true)
	d := newDeliveries(t)
	stop := deadLetterRouter(t, env, s, p, d)
	ids, poison, entries := publishWithPoison(t, env, n, 2)
	checkDeadLetters(t, env, s, poison, len(poison))
	// Every copy is done with (the second of each poison skipped as ended)
	// before the gateway is fixed: a copy still parked behind its twin's
	// dead letter would otherwise run once the gateway is back.
	s.eventually(t, "every copy acked", func() bool { return d.acked.Load() >= int64(entries) },
		func() string { return fmt.Sprintf("%d of %d acked", d.acked.Load(), entries) })

	p.down.Store(false) // the gateway is fixed
	// A run ends after a second without a dead letter; one that saw fewer
	// than there are is run again until the deadline: a broker may hold
	// its messages back for longer (watermill-sql does not see rows
	// committed after an older transaction still open anywhere on the
	// server, which a loaded machine keeps open for seconds).
	ctx, cancel := context.WithTimeout(context.Background(), s.wait)
	defer cancel()
	var report redrive.Report
	var err error
	for runs := 1; ; runs++ {
		sub := env.NewSubscriber(t)
		var r redrive.Report
		r, err = redrive.Run(ctx, sub, env.NewPublisher(t), env.DeadLetterTopic, redrive.WithIdleTimeout(time.Second))
		time.Sleep(200 * time.Millisecond) // let the last ack reach the broker
		if cerr := sub.Close(); cerr != nil {
			t.Errorf("close the redrive subscriber: %v", cerr)
		}
		report.Moved += r.Moved
		report.PutBack += r.PutBack
		if err != nil || report.Moved >= len(poison) || report.PutBack != 0 || ctx.Err() != nil {
			break
		}
		t.Logf("redrive run %d moved %d of %d dead letters so far; running it again", runs, report.Moved, len(poison))
	}
	if err != nil || report.Moved != len(poison) || report.PutBack != 0 {
		t.Fatalf("redrive moved %d and put back %d (err %v), want %d moved", report.Moved, report.PutBack, err, len(poison))
	}
	want := int64(entries + len(poison))
	s.eventually(t, "every payment charged and every delivery acked", func() bool {
		return p.charges.Total() >= n && d.acked.Load() >= want
	}, func() string {
		return fmt.Sprintf("%d charges for %d payments, %d of %d deliveries acked", p.charges.Total(), n, d.acked.Load(), want)
	})
	s.drained(t, env, env.Topic, env.DeadLetterTopic)
	stop()
	if err := p.charges.ExactlyOnce(ids); err != nil {
		t.Fatalf("after the redrive of %d dead letters: %v", report.Moved, err)
	}
	s.drained(t, env, env.Topic, env.DeadLetterTopic)
	t.Logf("%s: %d payments (%d poison, published twice, dead-lettered once), %d dead letters redriven, %d charges", b.Name, n, len(poison), report.Moved, p.charges.Total())
}
