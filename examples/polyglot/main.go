// Command polyglot runs a Go payment worker beside BabelQueue services in
// other languages: it puts messages on Redis and RabbitMQ exactly as the
// Python, Go and PHP SDKs put them on the wire, without the kit, then
// consumes them with the kit.
//
//		docker compose up -d --wait redis rabbitmq   # REDIS_URL and AMQP_URL override
//		go run ./examples/polyglot
//
//	 1. Redis, the SDKs' reliable list: a bare envelope (RPUSH of its bytes,
//	    as the Python SDK does), a __bq_frame frame carrying a W3C
//	    traceparent (the Go SDK with tracing on), the first one again (a
//	    producer retry), and a payment whose card is declined, framed with a
//	    traceparent that stays on its dead letter and its redriven copy.
//	 2. RabbitMQ: the same story published with amqp091-go as the SDKs do:
//	    durable queue, default exchange, persistent, message_id / type /
//	    correlation_id properties and native integer x-attempts and
//	    x-schema-version headers.
//
// On each broker the kit charges each payment once, skips the duplicate,
// dead-letters the declined payment to <queue>.dlq as an envelope any SDK
// can read, and, once the card issuer is back, redrives it: it is charged
// once. It exits 0 when every check holds, and removes what it wrote (its
// lists, queues and idempotency records).
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/marshal/amqpmarshal"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/pubsub/redislist"
	"github.com/babelqueue/watermill-idempotency/redrive"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
)

func main() {
	redisURL := getenv("REDIS_URL", "redis://localhost:6379/0")
	amqpURL := getenv("AMQP_URL", "amqp://guest:guest@localhost:5672/")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := run(ctx, os.Stdout, redisURL, amqpURL); err != nil {
		fmt.Fprintln(os.Stderr, "polyglot:", err)
		os.Exit(1)
	}
}

func getenv(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// traceparent is the W3C trace header a traced SDK service sends out of band.
const traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

// payment is one message from another service.
type payment struct {
	order, lang, card string
	env               envelope.Envelope
	body              []byte
}

func newPayment(queue, order, lang, card string) (payment, error) {
	e, err := envelope.New("urn:babel:payments:charge", map[string]any{"order": order, "amount_cents": 4200, "card": card},
		envelope.WithQueue(queue))
	if err != nil {
		return payment{}, err
	}
	e.Meta.Lang = lang
	body, err := e.Marshal()
	return payment{order: order, lang: lang, card: card, env: e, body: body}, err
}

// billing is the Go worker's handler: a declined card fails until the
// card issuer is back.
type billing struct {
	out     io.Writer
	fixed   atomic.Bool
	mu      sync.Mutex
	orders  map[string]string // meta.id → order
	charges map[string]int
	skipped int
}

func newBilling(out io.Writer) *billing {
	return &billing{out: out, orders: map[string]string{}, charges: map[string]int{}}
}

func (b *billing) expect(payments ...payment) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, p := range payments {
		b.orders[p.env.Meta.ID] = p.order
	}
}

func (b *billing) charge(msg *message.Message) error {
	e, err := envelope.Parse(msg.Payload)
	if err != nil {
		return err
	}
	var data struct{ Order, Card string }
	if err := json.Unmarshal(e.Data, &data); err != nil {
		return err
	}
	if data.Card == "declined" && !b.fixed.Load() {
		return errors.New("card issuer: 503 service unavailable")
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.charges[e.Meta.ID]++
	tp := msg.Metadata.Get("traceparent")
	if tp == "" {
		tp = "none"
	}
	fmt.Fprintf(b.out, "  charged %s (sent by %s, attempts %d, UUID = meta.id: %t, traceparent %s)\n",
		data.Order, e.Meta.Lang, e.Attempts, msg.UUID == e.Meta.ID, tp)
	return nil
}

// observe prints the duplicates the guard skips.
func (b *billing) observe(_ context.Context, e idempotency.Event) {
	if e.Outcome != idempotency.OutcomeSkip {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.skipped++
	fmt.Fprintf(b.out, "  skipped a duplicate of %s: already charged\n", b.orders[e.MessageID])
}

// charged reports whether every payment was charged exactly once.
func (b *billing) charged(payments ...payment) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, p := range payments {
		if b.charges[p.env.Meta.ID] != 1 {
			return false
		}
	}
	return true
}

func (b *billing) check(payments ...payment) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	total := 0
	for _, n := range b.charges {
		total += n
	}
	for _, p := range payments {
		if b.charges[p.env.Meta.ID] != 1 {
			return fmt.Errorf("%s was charged %d times", p.order, b.charges[p.env.Meta.ID])
		}
	}
	if total != len(payments) {
		return fmt.Errorf("%d charges for %d payments", total, len(payments))
	}
	return nil
}

// newRouter is the worker's router: dead letters outside Retry, the attempt
// counter inside it, the idempotency guard innermost.
func newRouter(b *billing, store *redisstore.Store, dlqPublisher message.Publisher) (*message.Router, error) {
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return nil, err
	}
	dlq, err := deadletter.Middleware(dlqPublisher)
	if err != nil {
		return nil, err
	}
	router.AddMiddleware(dlq,
		middleware.Retry{MaxRetries: 2, InitialInterval: 10 * time.Millisecond,
			ShouldRetry: func(p middleware.RetryParams) bool { return !idempotency.IsPermanent(p.Err) }}.Middleware,
		deadletter.CountAttempts,
		idempotency.Middleware(store, idempotency.WithClaim(time.Minute), idempotency.WithObserver(idempotency.ObserverFunc(b.observe))))
	return router, nil
}

// start runs router until the returned stop is called (stop may be called
// more than once).
func start(ctx context.Context, router *message.Router) (stop func() error) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	<-router.Running()
	var once sync.Once
	var err error
	return func() error {
		once.Do(func() { cancel(); err = <-done })
		return err
	}
}

// waitFor polls cond every 20 ms until it holds or ctx is done.
func waitFor(ctx context.Context, what string, cond func() (bool, error)) error {
	for {
		ok, err := cond()
		if err != nil || ok {
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w", what, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// describe prints a dead letter as an SDK's triage tool would.
func describe(out io.Writer, where string, body []byte) error {
	e, err := envelope.Parse(body)
	if err != nil {
		return fmt.Errorf("the dead letter on %s is not an envelope: %w", where, err)
	}
	if e.DeadLetter == nil {
		return fmt.Errorf("the message on %s has no dead_letter block", where)
	}
	var data struct{ Order string }
	_ = json.Unmarshal(e.Data, &data)
	msg := ""
	if e.DeadLetter.Error != nil {
		msg = *e.DeadLetter.Error
	}
	fmt.Fprintf(out, "  dead letter on %s: %s reason=%s attempts=%d original_queue=%s lang=%s error=%q\n",
		where, data.Order, e.DeadLetter.Reason, e.DeadLetter.Attempts, e.DeadLetter.OriginalQueue, e.DeadLetter.Lang, msg)
	return nil
}

func run(ctx context.Context, out io.Writer, redisURL, amqpURL string) error {
	opts, err := redis.ParseURL(redisURL)
	if err != nil {
		return fmt.Errorf("REDIS_URL: %w", err)
	}
	rdb := redis.NewClient(opts)
	defer rdb.Close()
	if err := rdb.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("redis at %s: %w (start one with `docker compose up -d redis`)", redisURL, err)
	}
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	runID := hex.EncodeToString(b)
	// One store for both workers; records under "polyglot-" + 4 hex digits
	// of the run.
	prefix := "polyglot-" + runID[:4] + ":"
	store := redisstore.New(rdb, redisstore.WithPrefix(prefix), redisstore.WithTTL(time.Hour))
	defer dropRecords(context.WithoutCancel(ctx), rdb, prefix)
	if err := overRedis(ctx, out, rdb, store, "payments-"+runID); err != nil {
		return fmt.Errorf("redis: %w", err)
	}
	if err := overRabbitMQ(ctx, out, amqpURL, store, "payments-"+runID); err != nil {
		return fmt.Errorf("rabbitmq: %w", err)
	}
	fmt.Fprintln(out, "every payment charged once on both brokers")
	return nil
}

// dropRecords removes the example's idempotency records; a real service
// keeps them for their TTL.
func dropRecords(ctx context.Context, rdb *redis.Client, prefix string) {
	iter := rdb.Scan(ctx, 0, prefix+"*", 1000).Iterator()
	for iter.Next(ctx) {
		rdb.Unlink(ctx, iter.Val())
	}
}

// overRedis: the SDKs' reliable list.
func overRedis(ctx context.Context, out io.Writer, rdb *redis.Client, store *redisstore.Store, queue string) error {
	dlqName := queue + ".dlq"
	defer rdb.Del(context.WithoutCancel(ctx), queue, queue+":processing", queue+":processing:leases",
		dlqName, dlqName+":processing", dlqName+":processing:leases")
	a, err := newPayment(queue, "order-1001", "python", "ok")
	if err != nil {
		return err
	}
	traced, err := newPayment(queue, "order-1002", "go", "ok")
	if err != nil {
		return err
	}
	declined, err := newPayment(queue, "order-1003", "go", "declined")
	if err != nil {
		return err
	}
	// The SDKs' wire, written with go-redis, not with the kit: RPUSH of the
	// envelope's bytes, or of a frame when there are out-of-band headers.
	framed := func(p payment) ([]byte, error) {
		return json.Marshal(struct {
			Frame   int               `json:"__bq_frame"`
			Headers map[string]string `json:"headers"`
			Body    string            `json:"body"`
		}{1, map[string]string{"traceparent": traceparent}, string(p.body)})
	}
	tracedFrame, err := framed(traced)
	if err != nil {
		return err
	}
	declinedFrame, err := framed(declined)
	if err != nil {
		return err
	}
	if err := rdb.RPush(ctx, queue, a.body, tracedFrame, a.body, declinedFrame).Err(); err != nil {
		return err
	}
	fmt.Fprintf(out, "redis: 4 values on list %s (a bare envelope from python, a __bq_frame with a traceparent from go, the first again, a framed payment whose card is declined)\n", queue)

	bill := newBilling(out)
	bill.expect(a, traced, declined)
	sub, err := redislist.NewSubscriber(rdb, redislist.WithBlockTime(100*time.Millisecond))
	if err != nil {
		return err
	}
	pub, err := redislist.NewPublisher(rdb)
	if err != nil {
		return err
	}
	defer pub.Close()
	router, err := newRouter(bill, store, pub)
	if err != nil {
		return err
	}
	router.AddConsumerHandler("charge", queue, sub, bill.charge)
	stop := start(ctx, router)
	defer func() { _ = stop() }()
	err = waitFor(ctx, "the declined payment on "+dlqName, func() (bool, error) {
		n, err := rdb.LLen(ctx, dlqName).Result()
		return n == 1 && bill.charged(a, traced), err
	})
	if err != nil {
		return err
	}
	dead, err := rdb.LIndex(ctx, dlqName, 0).Bytes()
	if err != nil {
		return err
	}
	// The dead letter carries out-of-band headers, so it is stored as a
	// frame, as an SDK would store it; SDK consumers unwrap it.
	var f struct {
		Frame   int               `json:"__bq_frame"`
		Headers map[string]string `json:"headers"`
		Body    string            `json:"body"`
	}
	if json.Unmarshal(dead, &f) == nil && f.Frame == 1 {
		fmt.Fprintf(out, "  %s holds a __bq_frame: traceparent %q, reason header %q\n", dlqName, f.Headers["traceparent"], f.Headers[deadletter.MetadataReason])
		dead = []byte(f.Body)
	}
	if err := describe(out, dlqName, dead); err != nil {
		return err
	}

	bill.fixed.Store(true)
	redriveSub, err := redislist.NewSubscriber(rdb, redislist.WithBlockTime(100*time.Millisecond))
	if err != nil {
		return err
	}
	report, err := redrive.Run(ctx, redriveSub, pub, dlqName, redrive.WithIdleTimeout(500*time.Millisecond))
	if cerr := redriveSub.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "  card issuer back: redrive moved %d from %s to %s\n", report.Moved, dlqName, queue)
	if err := waitFor(ctx, "the redriven payment", func() (bool, error) { return bill.charged(declined), nil }); err != nil {
		return err
	}
	if err := stop(); err != nil {
		return err
	}
	if err := bill.check(a, traced, declined); err != nil {
		return err
	}
	fmt.Fprintf(out, "redis: 3 payments charged once each, %d duplicate skipped, 1 dead-lettered and redriven\n", bill.skipped)
	return nil
}

// peek returns the body of the first message on queue and puts it back
// (nil when the queue is empty or does not exist yet). RabbitMQ has no read
// without taking: the message is taken unacked and the channel closed.
func peek(conn *amqp.Connection, queue string) ([]byte, error) {
	ch, err := conn.Channel()
	if err != nil {
		return nil, err
	}
	defer ch.Close()
	if _, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil); err != nil {
		var ae *amqp.Error
		if errors.As(err, &ae) && ae.Code == amqp.NotFound {
			return nil, nil // not declared yet: no dead letter so far
		}
		return nil, err
	}
	d, ok, err := ch.Get(queue, false)
	if err != nil || !ok {
		return nil, err
	}
	return d.Body, nil
}

// overRabbitMQ: the SDKs' AMQP 0-9-1 binding.
func overRabbitMQ(ctx context.Context, out io.Writer, amqpURL string, store *redisstore.Store, queue string) error {
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		return fmt.Errorf("%w (start it with `docker compose up -d rabbitmq`)", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	dlqName := queue + ".dlq"
	defer func() {
		// A channel of its own: an error closes the channel it happened on.
		if c, err := conn.Channel(); err == nil {
			for _, q := range []string{queue, dlqName} {
				_, _ = c.QueueDelete(q, false, false, false)
			}
			_ = c.Close()
		}
	}()
	a, err := newPayment(queue, "order-2001", "python", "ok")
	if err != nil {
		return err
	}
	php, err := newPayment(queue, "order-2002", "php", "ok")
	if err != nil {
		return err
	}
	declined, err := newPayment(queue, "order-2003", "go", "declined")
	if err != nil {
		return err
	}
	// The SDKs' wire, written with amqp091-go, not with the kit.
	if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		return err
	}
	for _, p := range []payment{a, php, a, declined} {
		headers := amqp.Table{"x-schema-version": p.env.Meta.SchemaVersion, "x-source-lang": p.lang, "x-attempts": p.env.Attempts}
		if p.lang != "php" {
			headers["traceparent"] = traceparent
		}
		err := ch.PublishWithContext(ctx, "", queue, false, false, amqp.Publishing{
			ContentType: "application/json", DeliveryMode: amqp.Persistent, AppId: "babelqueue",
			Type: p.env.Job, CorrelationId: p.env.TraceID, MessageId: p.env.Meta.ID, Headers: headers, Body: p.body,
		})
		if err != nil {
			return err
		}
	}
	fmt.Fprintf(out, "rabbitmq: 4 messages on queue %s (native int x-attempts, message_id = meta.id; the first one twice)\n", queue)

	bill := newBilling(out)
	bill.expect(a, php, declined)
	config := amqpmarshal.NewConfig(amqpURL)
	logger := watermill.NopLogger{}
	sub, err := wamqp.NewSubscriber(config, logger)
	if err != nil {
		return err
	}
	pub, err := amqpmarshal.NewPublisher(config, logger) // declares <queue>.dlq before the first dead letter
	if err != nil {
		return err
	}
	defer pub.Close()
	router, err := newRouter(bill, store, pub)
	if err != nil {
		return err
	}
	router.AddConsumerHandler("charge", queue, sub, bill.charge)
	stop := start(ctx, router)
	defer func() { _ = stop() }()
	var dead []byte
	err = waitFor(ctx, "the declined payment on "+dlqName, func() (bool, error) {
		if !bill.charged(a, php) {
			return false, nil
		}
		body, err := peek(conn, dlqName)
		dead = body
		return body != nil, err
	})
	if err != nil {
		return err
	}
	if err := describe(out, dlqName, dead); err != nil {
		return err
	}

	bill.fixed.Store(true)
	redriveSub, err := wamqp.NewSubscriber(config, logger)
	if err != nil {
		return err
	}
	report, err := redrive.Run(ctx, redriveSub, pub, dlqName, redrive.WithIdleTimeout(time.Second))
	time.Sleep(200 * time.Millisecond) // let the last ack reach RabbitMQ
	if cerr := redriveSub.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "  card issuer back: redrive moved %d from %s to %s\n", report.Moved, dlqName, queue)
	if err := waitFor(ctx, "the redriven payment", func() (bool, error) { return bill.charged(declined), nil }); err != nil {
		return err
	}
	if err := stop(); err != nil {
		return err
	}
	if err := bill.check(a, php, declined); err != nil {
		return err
	}
	fmt.Fprintf(out, "rabbitmq: 3 payments charged once each, %d duplicate skipped, 1 dead-lettered and redriven\n", bill.skipped)
	return nil
}
