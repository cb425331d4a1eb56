package watermillsql_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency/watermillsql"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// The transactional wirings against the faults a deployment meets. Each case
// consumes messages (each published twice) with a handler that records an
// effect in PostgreSQL and produces one follow-up message, and asserts the
// promise: every message's effect exactly once with its record, every
// follow-up relayed (at least once, under its derived id), nothing
// dead-lettered but the messages that failed for good, and those run once
// after their redrive.

const (
	matrixMessages = 4
	matrixHandler  = "credit"
)

type wiring string

const (
	ownTx      wiring = "WithTransaction/redis-streams"
	subscriber wiring = "WithSubscriberTx/watermill-sql"
)

type outer string

const (
	retry      outer = "Retry"
	poison     outer = "PoisonQueue+Retry"
	deadLetter outer = "deadletter+Retry"
)

type fault string

const (
	handlerError  fault = "handler-error"     // writes, then fails on its first run
	handlerPanic  fault = "handler-panic"     // writes, then panics on its first run
	failsForGood  fault = "fails-for-good"    // fails its first 4 runs: more than Retry's 3
	commitFails   fault = "commit-fails"      // a deferred constraint trigger fails its first two checks (COMMIT; under WithSubscriberTx the attempt's own)
	slowPublish   fault = "slow-publish"      // publishing a follow-up takes 4x WithAckTimeout
	failedPublish fault = "failed-publish"    // publishing a follow-up fails twice
	smallPool     fault = "small-pool"        // one connection: a publisher on the pool waits for the open transaction
	shutdown      fault = "shutdown-midway"   // the router stops while a handler runs; a new one takes over
	deferred      fault = "deferred-for-good" // its write violates a deferred foreign key in its first 4 runs
	conflict      fault = "conflict"          // the first run meets a serialization failure (40001) in a REPEATABLE READ transaction
)

func TestTransactionalWiringsUnderFaults(t *testing.T) {
	t.Parallel()
	faults := []fault{handlerError, handlerPanic, failsForGood, commitFails, slowPublish, failedPublish, smallPool, shutdown, deferred, conflict}
	for wi, w := range []wiring{ownTx, subscriber} {
		for oi, o := range []outer{retry, poison, deadLetter} {
			for fi, f := range faults {
				if f == smallPool && w == subscriber {
					continue // the subscriber's own transaction holds the only connection: it cannot consume at all
				}
				if testing.Short() && (wi != fi%2 || oi != fi%3) {
					continue // -short: each fault once, the wirings and outer middlewares taken in turn
				}
				t.Run(fmt.Sprintf("%s/%s/%s", w, o, f), func(t *testing.T) {
					t.Parallel()
					newMatrixCase(t, w, o, f).run(t)
				})
			}
		}
	}
}

type matrixCase struct {
	w wiring
	o outer
	f fault

	db      *sql.DB // the handler's database (one connection under smallPool)
	side    *sql.DB // brokers, relay and checks
	rdb     *redis.Client
	store   *postgresstore.Store
	suffix  string
	input   string // topic consumed
	follow  string // the handler's publish topic
	effects string // table of effects

	mu         sync.Mutex
	runs       map[string]int // handler runs by meta.id
	relayed    map[string]int // follow-ups accepted by the broker, by meta.id
	deadLetter [][]byte       // dead-lettered payloads, to redrive
	entries    int            // messages put on the input topic

	inHandler chan struct{} // shutdown: a handler is running
	release   chan struct{} // shutdown: let it finish
	once      sync.Once
	conflicts sync.Once // conflict: the first run meets one
}

func newMatrixCase(t *testing.T, w wiring, o outer, f fault) *matrixCase {
	side := testenv.PostgresForSubscriber(t)
	ctx := context.Background()
	c := &matrixCase{w: w, o: o, f: f, side: side, db: side, suffix: testenv.RandomHex(4),
		runs: map[string]int{}, relayed: map[string]int{}, inHandler: make(chan struct{}), release: make(chan struct{})}
	c.input, c.follow, c.effects = "bq_mx_in_"+c.suffix, "bq_mx_follow_"+c.suffix, "bq_mx_fx_"+c.suffix
	if w == ownTx {
		c.rdb = testenv.Redis(t)
		t.Cleanup(func() { c.rdb.Del(context.Background(), c.input, c.follow) })
	}
	if f == smallPool {
		c.db = testenv.PostgresForSubscriber(t)
		c.db.SetMaxOpenConns(1)
	}
	store, err := postgresstore.New(side, postgresstore.WithTable("bq_mx_idem_"+c.suffix))
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	c.store = store
	exec(t, side, `CREATE TABLE `+c.effects+` (id text NOT NULL)`)
	if f == commitFails {
		exec(t, side, fmt.Sprintf(`CREATE SEQUENCE %[1]s_seq;
			CREATE FUNCTION %[1]s_check() RETURNS trigger LANGUAGE plpgsql AS $$
			BEGIN IF nextval('%[1]s_seq') <= 2 THEN RAISE EXCEPTION 'deferred check failed'; END IF; RETURN NULL; END $$;
			CREATE CONSTRAINT TRIGGER %[1]s_ct AFTER INSERT ON %[1]s DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION %[1]s_check()`, c.effects))
	}
	switch f {
	case deferred:
		exec(t, side, fmt.Sprintf(`CREATE TABLE %[1]s_parent (id int PRIMARY KEY);
			CREATE TABLE %[1]s_child (parent int REFERENCES %[1]s_parent DEFERRABLE INITIALLY DEFERRED)`, c.effects))
	case conflict:
		exec(t, side, fmt.Sprintf(`CREATE TABLE %[1]s_hot (v int NOT NULL); INSERT INTO %[1]s_hot VALUES (0)`, c.effects))
	}
	t.Cleanup(func() {
		ctx := context.Background()
		var tables []string
		for _, topic := range []string{c.input, c.follow, c.outboxTopic()} {
			tables = append(tables, fmt.Sprintf(`"watermill_%s", "watermill_offsets_%s"`, topic, topic))
		}
		_, _ = side.ExecContext(ctx, fmt.Sprintf(`DROP TABLE IF EXISTS %[1]s_child, %[1]s_parent, %[1]s_hot`, c.effects))
		_, _ = side.ExecContext(ctx, `DROP TABLE IF EXISTS `+c.effects+`, bq_mx_idem_`+c.suffix+`, `+strings.Join(tables, ", "))
		_, _ = side.ExecContext(ctx, fmt.Sprintf(`DROP FUNCTION IF EXISTS %[1]s_check() CASCADE; DROP SEQUENCE IF EXISTS %[1]s_seq`, c.effects))
	})
	return c
}

func exec(t *testing.T, db *sql.DB, q string) {
	t.Helper()
	if _, err := db.ExecContext(context.Background(), q); err != nil {
		t.Fatal(err)
	}
}

func (c *matrixCase) outboxTopic() string { return "bq_mx_outbox_" + c.suffix }

// brokerPublisher publishes to the broker of the wiring.
func (c *matrixCase) brokerPublisher(t *testing.T) message.Publisher {
	t.Helper()
	var pub message.Publisher
	var err error
	if c.w == ownTx {
		pub, err = redisstream.NewPublisher(redisstream.PublisherConfig{Client: c.rdb}, watermill.NopLogger{})
	} else {
		pub, err = wsql.NewPublisher(wsql.BeginnerFromStdSQL(c.side), wsql.PublisherConfig{
			SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, AutoInitializeSchema: true}, watermill.NopLogger{})
	}
	if err != nil {
		t.Fatal(err)
	}
	return pub
}

func (c *matrixCase) subscriber(t *testing.T, consumer string) message.Subscriber {
	t.Helper()
	var sub message.Subscriber
	var err error
	if c.w == ownTx {
		sub, err = redisstream.NewSubscriber(redisstream.SubscriberConfig{
			Client: c.rdb, ConsumerGroup: "mx", Consumer: consumer, OldestId: "0",
			NackResendSleep: 10 * time.Millisecond, BlockTime: 50 * time.Millisecond, DisableIndefiniteInitialBlock: true,
			ClaimInterval: 100 * time.Millisecond, MaxIdleTime: 500 * time.Millisecond,
		}, watermill.NopLogger{})
	} else {
		sub, err = wsql.NewSubscriber(wsql.BeginnerFromStdSQL(c.side), wsql.SubscriberConfig{
			ConsumerGroup: "mx", PollInterval: 20 * time.Millisecond, ResendInterval: 10 * time.Millisecond,
			SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{}, InitializeSchema: true,
		}, watermill.NopLogger{})
	}
	if err != nil {
		t.Fatal(err)
	}
	return sub
}

// faultyPublisher is the broker publisher follow-ups go through, with the
// case's publication fault; it counts what the broker accepted.
type faultyPublisher struct {
	c     *matrixCase
	inner message.Publisher
	fails map[string]int
}

func (p *faultyPublisher) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		ident, err := envelope.ReadIdentity(m.Payload)
		if err != nil {
			return err
		}
		switch p.c.f {
		case slowPublish:
			time.Sleep(4 * ackTimeout)
		case failedPublish:
			p.c.mu.Lock()
			p.fails[ident.ID]++
			n := p.fails[ident.ID]
			p.c.mu.Unlock()
			if n <= 2 {
				return errors.New("broker refused the follow-up")
			}
		}
		if err := p.inner.Publish(topic, m); err != nil {
			return err
		}
		p.c.mu.Lock()
		p.c.relayed[ident.ID]++
		p.c.mu.Unlock()
	}
	return nil
}

func (p *faultyPublisher) Close() error { return nil }

// capturePublisher stands for the dead-letter topic: the test redrives what
// lands there.
type capturePublisher struct{ c *matrixCase }

func (p capturePublisher) Publish(_ string, msgs ...*message.Message) error {
	p.c.mu.Lock()
	defer p.c.mu.Unlock()
	for _, m := range msgs {
		p.c.deadLetter = append(p.c.deadLetter, m.Payload)
	}
	return nil
}

func (capturePublisher) Close() error { return nil }

const ackTimeout = 100 * time.Millisecond

// handler records the effect in the delivery's transaction, applies the
// case's handler fault and produces one follow-up with a derived id.
func (c *matrixCase) handler(msg *message.Message) ([]*message.Message, error) {
	e, err := envelope.Parse(msg.Payload)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.runs[e.Meta.ID]++
	run := c.runs[e.Meta.ID]
	c.mu.Unlock()
	tx, ok := postgresstore.TxFromContext(msg.Context())
	if !ok {
		return nil, errors.New("no transaction in the handler's context")
	}
	if _, err := tx.ExecContext(msg.Context(), `INSERT INTO `+c.effects+` VALUES ($1)`, e.Meta.ID); err != nil {
		return nil, err
	}
	switch {
	case c.f == deferred && run <= 4:
		// No parent 0: the violation shows only when deferred constraints
		// are checked.
		if _, err := tx.ExecContext(msg.Context(), `INSERT INTO `+c.effects+`_child VALUES (0)`); err != nil {
			return nil, err
		}
	case c.f == conflict:
		first := false
		c.conflicts.Do(func() { first = true })
		if first { // another transaction updates the row after this one's snapshot
			if _, err := c.side.ExecContext(msg.Context(), `UPDATE `+c.effects+`_hot SET v = v + 1`); err != nil {
				return nil, err
			}
		}
		if _, err := tx.ExecContext(msg.Context(), `UPDATE `+c.effects+`_hot SET v = v + 1`); err != nil {
			return nil, err
		}
	case c.f == handlerError && run == 1, c.f == failsForGood && run <= 4:
		return nil, fmt.Errorf("run %d of %s fails after its write", run, e.Meta.ID)
	case c.f == handlerPanic && run == 1:
		panic("bug after the write")
	case c.f == shutdown && run == 1:
		first := false
		c.once.Do(func() { first = true })
		if first {
			close(c.inHandler)
			<-c.release // the router is being stopped meanwhile
		}
	}
	child, err := envelope.NewChild(e, "follow-up", "urn:babel:orders:follow-up", map[string]any{"of": e.Meta.ID})
	if err != nil {
		return nil, err
	}
	payload, err := child.Marshal()
	if err != nil {
		return nil, err
	}
	return []*message.Message{message.NewMessage(watermill.NewUUID(), payload)}, nil
}

// router builds the router of the wiring, its middleware and its relay.
func (c *matrixCase) router(t *testing.T, consumer string, outbox *watermillsql.Outbox, routerPub message.Publisher) *message.Router {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 300 * time.Millisecond}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	opts := []idempotency.Option{idempotency.WithTransaction(c.db), idempotency.WithAckTimeout(ackTimeout)}
	if c.w == subscriber {
		opts = append(opts, idempotency.WithSubscriberTx(watermillsql.Tx))
	} else if c.f == conflict { // watermill-sql's transaction is REPEATABLE READ already
		opts = append(opts, idempotency.WithTxOptions(&sql.TxOptions{Isolation: sql.LevelRepeatableRead}))
	}
	opts = append(opts, c.outboxOptions(outbox)...)
	guard := idempotency.Middleware(c.store, opts...)
	rt := middleware.Retry{MaxRetries: 2, InitialInterval: 5 * time.Millisecond,
		ShouldRetry: func(p middleware.RetryParams) bool { return !idempotency.IsPermanent(p.Err) }}.Middleware
	switch c.o {
	case retry:
		r.AddMiddleware(middleware.Recoverer, rt, guard)
	case poison:
		pq, err := middleware.PoisonQueueWithFilter(capturePublisher{c}, "dlq", idempotency.IsPermanent)
		if err != nil {
			t.Fatal(err)
		}
		r.AddMiddleware(middleware.Recoverer, pq, rt, guard)
	case deadLetter:
		dlq, err := deadletter.Middleware(capturePublisher{c})
		if err != nil {
			t.Fatal(err)
		}
		r.AddMiddleware(middleware.Recoverer, dlq, rt, deadletter.CountAttempts, guard)
	}
	r.AddHandler(matrixHandler, c.input, c.subscriber(t, consumer), c.follow, routerPub, c.handler)
	return r
}

func (c *matrixCase) run(t *testing.T) {
	ctx := context.Background()
	broker := c.brokerPublisher(t)
	follow := &faultyPublisher{c: c, inner: broker, fails: map[string]int{}}
	outbox, routerPub := c.relay(t, follow)

	r := c.router(t, "c1", outbox, routerPub)
	stop := testenv.RunRouter(t, r)
	ids, entries := testenv.PublishCopies(t, broker, c.input, "urn:babel:orders:created", matrixMessages, func(int) int { return 2 })
	c.entries = entries

	if c.f == shutdown {
		select {
		case <-c.inHandler:
		case <-time.After(60 * time.Second): // watermill-sql's subscriber waits out other tests' open transactions
			t.Fatal("no delivery reached the handler in 60 s")
		}
		stop() // mid-delivery: gives up on the handler after CloseTimeout
		close(c.release)
		testenv.RunRouter(t, c.router(t, "c2", outbox, routerPub))
	}

	children := make([]string, len(ids))
	for i, id := range ids {
		children[i] = envelope.DeriveID(id, "follow-up")
	}
	deadline := time.Now().Add(120 * time.Second) // as above: a loaded server's subscribers stall for seconds at a time
	for !c.settled(ctx, t, ids, children, broker) {
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond) // a late repeat would show now
	c.check(t, ids, children)
}

// settled redrives dead letters and reports whether the input topic is
// drained and every effect and follow-up is in.
func (c *matrixCase) settled(ctx context.Context, t *testing.T, ids, children []string, broker message.Publisher) bool {
	c.mu.Lock()
	redrive := c.deadLetter
	c.deadLetter = nil
	c.mu.Unlock()
	for _, payload := range redrive {
		// Sent back as an operator does (bq-idempotency redrive): marked,
		// so that the guard reopens the message's end rather than skip the
		// copy as ended.
		msg := message.NewMessage(watermill.NewUUID(), payload)
		msg.Metadata.Set(envelope.MetadataRedrive, watermill.NewUUID())
		if err := broker.Publish(c.input, msg); err != nil {
			t.Fatal(err)
		}
		c.mu.Lock()
		c.entries++
		c.redriven(payload)
		c.mu.Unlock()
	}
	if c.w == ownTx {
		if !testenv.StreamDrained(ctx, c.rdb, c.input, "mx", c.entries) {
			return false
		}
	} else if !testenv.SQLTopicDrained(ctx, c.side, c.input, "mx") {
		return false
	}
	var n int
	if err := c.side.QueryRowContext(ctx, `SELECT count(DISTINCT id) FROM `+c.effects).Scan(&n); err != nil || n < len(ids) {
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, child := range children {
		if c.relayed[child] == 0 {
			return false
		}
	}
	return true
}

// redriven counts the dead letters per message (under c.mu).
func (c *matrixCase) redriven(payload []byte) {
	ident, err := envelope.ReadIdentity(payload)
	if err == nil {
		c.runs["dead-lettered:"+ident.ID]++
	}
}

func (c *matrixCase) check(t *testing.T, ids, children []string) {
	t.Helper()
	ctx := context.Background()
	effects := testenv.CountsByKey(t, c.side, `SELECT id, count(*) FROM `+c.effects+` GROUP BY id`)
	c.mu.Lock()
	defer c.mu.Unlock()
	var problems []string
	for i, id := range ids {
		seen, err := stores.Seen(ctx, c.store, idempotency.Key(matrixHandler, id))
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case effects[id] != 1:
			problems = append(problems, fmt.Sprintf("message %d: effect applied %d times (want 1; %d handler runs)", i, effects[id], c.runs[id]))
		case !seen:
			problems = append(problems, fmt.Sprintf("message %d: effect committed without its record", i))
		}
		if c.relayed[children[i]] == 0 {
			problems = append(problems, fmt.Sprintf("message %d: follow-up never reached the broker (lost)", i))
		}
		dead := c.runs["dead-lettered:"+id]
		switch want := c.o == deadLetter && (c.f == failsForGood || c.f == deferred); {
		case c.f == shutdown && dead > 0:
			// The handler's writes fail once the message context is
			// cancelled; whether the dead-letter middleware takes such a
			// transient error is its filter's business. Either way the
			// redrive ran it once (asserted above).
			t.Logf("message %d: dead-lettered %d times during shutdown, redriven", i, dead)
		case (dead == 1) != want || dead > 1:
			problems = append(problems, fmt.Sprintf("message %d: dead-lettered %d times", i, dead))
		}
	}
	if len(effects) != len(ids) {
		problems = append(problems, fmt.Sprintf("%d messages have effects, want %d", len(effects), len(ids)))
	}
	if c.f == conflict {
		// The conflicting run, then once more in a fresh transaction; every
		// other message once (nothing runs in a doomed snapshot).
		total := 0
		for _, id := range ids {
			total += c.runs[id]
		}
		if total != len(ids)+1 {
			problems = append(problems, fmt.Sprintf("%d handler runs for %d messages, want %d (one conflict, run again once)", total, len(ids), len(ids)+1))
		}
	}
	if len(problems) > 0 {
		t.Fatalf("promise broken:\n  %s", strings.Join(problems, "\n  "))
	}
}
