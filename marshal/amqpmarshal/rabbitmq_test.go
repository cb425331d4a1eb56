package amqpmarshal_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/marshal/amqpmarshal"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

const traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

// rabbit is one test's RabbitMQ: a connection, and a queue name unique to
// the test whose queue and dead-letter queue are deleted when it ends.
type rabbit struct {
	url, queue string
	ch         *amqp.Channel
}

func newRabbit(t *testing.T) rabbit {
	t.Helper()
	url := testenv.AMQPURL(t)
	conn := testenv.AMQP(t)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	r := rabbit{url: url, queue: "bq-test-" + testenv.RandomHex(6), ch: ch}
	t.Cleanup(func() {
		for _, q := range []string{r.queue, r.queue + ".dlq"} {
			if _, err := ch.QueueDelete(q, false, false, false); err != nil {
				t.Errorf("delete queue %s: %v", q, err)
			}
		}
	})
	return r
}

// publishSDK publishes body as the BabelQueue Go SDK does: durable queue,
// default exchange, persistent, contract properties, and native Go int
// x-attempts / x-schema-version headers.
func (r rabbit) publishSDK(t *testing.T, e envelope.Envelope) {
	t.Helper()
	body, err := e.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.ch.QueueDeclare(r.queue, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	err = r.ch.PublishWithContext(context.Background(), "", r.queue, false, false, amqp.Publishing{
		ContentType: "application/json", ContentEncoding: "utf-8", DeliveryMode: amqp.Persistent, AppId: "babelqueue",
		Body: body, Type: e.Job, CorrelationId: e.TraceID, MessageId: e.Meta.ID,
		Headers: amqp.Table{"traceparent": traceparent, "x-attempts": e.Attempts, "x-schema-version": e.Meta.SchemaVersion, "x-source-lang": e.Meta.Lang},
	})
	if err != nil {
		t.Fatal(err)
	}
}

// depth returns the ready messages of queue (-1 when it does not exist).
func (r rabbit) depth(t *testing.T, queue string) int {
	t.Helper()
	conn := testenv.AMQP(t) // a failed passive declare closes its channel
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		var ae *amqp.Error
		if errors.As(err, &ae) && ae.Code == amqp.NotFound {
			return -1
		}
		t.Fatal(err)
	}
	_ = ch.Close()
	return q.Messages
}

func sdkEnvelope(t *testing.T, queue string, i int) envelope.Envelope {
	t.Helper()
	e, err := envelope.New("urn:babel:payments:charge", map[string]any{"order": i}, envelope.WithQueue(queue))
	if err != nil {
		t.Fatal(err)
	}
	e.Meta.Lang = "python"
	return e
}

// acks counts how the router ended the deliveries it handed out.
type acks struct{ acked, nacked atomic.Int64 }

func (a *acks) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		go func() {
			select {
			case <-msg.Acked():
				a.acked.Add(1)
			case <-msg.Nacked():
				a.nacked.Add(1)
			case <-time.After(30 * time.Second):
			}
		}()
		return h(msg)
	}
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func newRouter(t *testing.T) *message.Router {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func subscriber(t *testing.T, config wamqp.Config) *wamqp.Subscriber {
	t.Helper()
	sub, err := wamqp.NewSubscriber(config, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Close() })
	return sub
}

func publisher(t *testing.T, config wamqp.Config) *amqpmarshal.Publisher {
	t.Helper()
	pub, err := amqpmarshal.NewPublisher(config, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

// TestSDKMessagesOnRabbitMQ runs the kit's router on messages published
// exactly as the SDKs publish them: every message is handled once although
// each is published twice, duplicates are acked, a failed delivery is
// redelivered by RabbitMQ and then succeeds, and the handler sees the
// identity properties and the traceparent.
func TestSDKMessagesOnRabbitMQ(t *testing.T) {
	t.Parallel()
	rb := newRabbit(t)
	const n = 20
	var ids []string
	for i := range n {
		e := sdkEnvelope(t, rb.queue, i)
		ids = append(ids, e.Meta.ID)
		rb.publishSDK(t, e)
		rb.publishSDK(t, e) // a duplicate publish
	}
	failOnce := ids[3]
	var effects testenv.Effects
	var failed atomic.Bool
	var mu sync.Mutex
	var bad []string
	var a acks
	router := newRouter(t)
	router.AddMiddleware(a.middleware, idempotency.Middleware(memstore.New()))
	router.AddConsumerHandler("charge", rb.queue, subscriber(t, amqpmarshal.NewConfig(rb.url)), func(msg *message.Message) error {
		e, err := envelope.Parse(msg.Payload)
		if err != nil {
			return err
		}
		if msg.UUID != e.Meta.ID || msg.Metadata.Get(envelope.MetadataJob) != e.Job ||
			msg.Metadata.Get(envelope.MetadataTraceID) != e.TraceID || msg.Metadata.Get("traceparent") != traceparent ||
			msg.Metadata.Get(amqpmarshal.HeaderAttempts) != "0" {
			mu.Lock()
			bad = append(bad, msg.UUID)
			mu.Unlock()
		}
		if e.Meta.ID == failOnce && failed.CompareAndSwap(false, true) {
			return errors.New("payment gateway timeout")
		}
		effects.Add(e.Meta.ID)
		return nil
	})
	stop := testenv.RunRouter(t, router)
	eventually(t, "every delivery to be acked", func() bool { return a.acked.Load() == 2*n })
	stop()
	for _, id := range ids {
		if c := effects.Count(id); c != 1 {
			t.Errorf("%s charged %d times, want 1", id, c)
		}
	}
	if a.nacked.Load() != 1 || !failed.Load() {
		t.Errorf("nacked %d, want the 1 failed delivery", a.nacked.Load())
	}
	if len(bad) > 0 {
		t.Errorf("messages without their identity or traceparent: %v", bad)
	}
	if d := rb.depth(t, rb.queue); d != 0 {
		t.Errorf("%d messages left on the queue", d)
	}
}

// countingMarshaler counts the deliveries the subscriber read.
type countingMarshaler struct {
	wamqp.Marshaler
	reads *atomic.Int64
}

func (c countingMarshaler) Unmarshal(d amqp.Delivery) (*message.Message, error) {
	c.reads.Add(1)
	return c.Marshaler.Unmarshal(d)
}

// deadLetterRouter runs handler behind the kit's dead-letter middleware,
// publishing with pub, and counts the subscriber's reads.
func deadLetterRouter(t *testing.T, rb rabbit, pub message.Publisher, reads *atomic.Int64, a *acks, handler message.NoPublishHandlerFunc) func() {
	t.Helper()
	dlq, err := deadletter.Middleware(pub)
	if err != nil {
		t.Fatal(err)
	}
	config := amqpmarshal.NewConfig(rb.url)
	config.Marshaler = countingMarshaler{config.Marshaler, reads}
	router := newRouter(t)
	router.AddMiddleware(a.middleware, dlq, deadletter.CountAttempts, idempotency.Middleware(memstore.New()))
	router.AddConsumerHandler("charge", rb.queue, subscriber(t, config), handler)
	return testenv.RunRouter(t, router)
}

// TestUnreadableMessageIsReadOnce: a delivery no handler can use (not an
// envelope, headers of every AMQP type) is read once and dead-lettered
// verbatim, not requeued in a loop (watermill-amqp's stock marshaler rejects
// it, and the subscriber requeues it at once, for ever).
func TestUnreadableMessageIsReadOnce(t *testing.T) {
	t.Parallel()
	rb := newRabbit(t)
	if _, err := rb.ch.QueueDeclare(rb.queue, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	err := rb.ch.PublishWithContext(context.Background(), "", rb.queue, false, false, amqp.Publishing{
		DeliveryMode: amqp.Persistent, Body: []byte("<xml>not an envelope</xml>"),
		Headers: amqp.Table{"x-attempts": int64(0), "x-nested": amqp.Table{"a": int32(1)}, "x-dec": amqp.Decimal{Scale: 1, Value: 5}, "traceparent": traceparent},
	})
	if err != nil {
		t.Fatal(err)
	}
	var reads atomic.Int64
	var a acks
	stop := deadLetterRouter(t, rb, publisher(t, amqpmarshal.NewConfig(rb.url)), &reads, &a, func(msg *message.Message) error {
		_, err := envelope.Parse(msg.Payload)
		return err
	})
	eventually(t, "the dead letter", func() bool { return rb.depth(t, rb.queue+".dlq") == 1 })
	time.Sleep(300 * time.Millisecond) // room for a redelivery loop to show
	stop()
	if r := reads.Load(); r != 1 {
		t.Fatalf("the delivery was read %d times, want 1", r)
	}
	if a.acked.Load() != 1 || rb.depth(t, rb.queue) != 0 {
		t.Fatalf("acked %d, %d left on the queue", a.acked.Load(), rb.depth(t, rb.queue))
	}
	d, ok, err := rb.ch.Get(rb.queue+".dlq", true)
	if err != nil || !ok {
		t.Fatalf("get dead letter: %v %v", ok, err)
	}
	if string(d.Body) != "<xml>not an envelope</xml>" || d.Headers[deadletter.MetadataVerbatim] != "1" || d.Headers["traceparent"] != traceparent {
		t.Fatalf("dead letter %s %v", d.Body, d.Headers)
	}
}

// TestDeadLettersWithoutDLQ: the dead-letter queue was never declared.
// Every failed message ends on it, as an SDK reads a dead letter, with the
// traceparent and an x-attempts header that agrees with the body.
func TestDeadLettersWithoutDLQ(t *testing.T) {
	t.Parallel()
	rb := newRabbit(t)
	const n = 3
	ids := map[string]bool{}
	for i := range n {
		e := sdkEnvelope(t, rb.queue, i)
		ids[e.Meta.ID] = true
		rb.publishSDK(t, e)
	}
	if d := rb.depth(t, rb.queue+".dlq"); d != -1 {
		t.Fatalf("the dead-letter queue exists already (%d)", d)
	}
	var reads atomic.Int64
	var a acks
	stop := deadLetterRouter(t, rb, publisher(t, amqpmarshal.NewConfig(rb.url)), &reads, &a, func(*message.Message) error {
		return errors.New("card declined")
	})
	eventually(t, "every delivery to be acked", func() bool { return a.acked.Load() == n })
	stop()
	if got := rb.depth(t, rb.queue+".dlq"); got != n {
		t.Fatalf("%d of %d dead letters on %s.dlq: the others are lost", got, n, rb.queue)
	}
	for range n {
		d, ok, err := rb.ch.Get(rb.queue+".dlq", true)
		if err != nil || !ok {
			t.Fatalf("get dead letter: %v %v", ok, err)
		}
		e, err := envelope.Parse(d.Body)
		if err != nil || e.DeadLetter == nil || !ids[e.Meta.ID] {
			t.Fatalf("dead letter %s: %v", d.Body, err)
		}
		if d.MessageId != e.Meta.ID || d.Type != e.Job || d.CorrelationId != e.TraceID || d.Headers["traceparent"] != traceparent ||
			d.Headers[amqpmarshal.HeaderAttempts] != int32(e.Attempts) || e.Attempts != 1 {
			t.Fatalf("dead letter properties %+v headers %v attempts %d", d, d.Headers, e.Attempts)
		}
	}
}

// TestRefusedDeadLetterFailsTheDelivery: while the dead-letter queue
// cannot be declared (another connection holds it exclusively), no
// delivery is acked and none is lost; once it can, every dead letter lands.
func TestRefusedDeadLetterFailsTheDelivery(t *testing.T) {
	t.Parallel()
	rb := newRabbit(t)
	const n = 3
	for i := range n {
		rb.publishSDK(t, sdkEnvelope(t, rb.queue, i))
	}
	holder, err := amqp.Dial(rb.url)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	hch, err := holder.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := hch.QueueDeclare(rb.queue+".dlq", false, true, true, false, nil); err != nil {
		t.Fatal(err)
	}
	var reads atomic.Int64
	var a acks
	config := amqpmarshal.NewConfig(rb.url)
	stop := deadLetterRouter(t, rb, publisher(t, config), &reads, &a, func(*message.Message) error {
		return errors.New("card declined")
	})
	eventually(t, "refused dead letters", func() bool { return a.nacked.Load() >= n })
	if a.acked.Load() != 0 {
		t.Fatalf("%d deliveries acked although their dead letter was refused", a.acked.Load())
	}
	_ = holder.Close() // the exclusive queue goes with its connection
	eventually(t, "every delivery to be acked", func() bool { return a.acked.Load() == n })
	stop()
	if got, left := rb.depth(t, rb.queue+".dlq"), rb.depth(t, rb.queue); got != n || left != 0 {
		t.Fatalf("%d dead letters, %d left on the queue, want %d and 0", got, left, n)
	}
}

// TestPublisherRefusesUndeclarableQueue: a publication to a queue that
// cannot be declared returns ErrDeclareQueue.
func TestPublisherRefusesUndeclarableQueue(t *testing.T) {
	t.Parallel()
	rb := newRabbit(t)
	if _, err := rb.ch.QueueDeclare(rb.queue, false, false, false, false, nil); err != nil { // not durable
		t.Fatal(err)
	}
	err := publisher(t, amqpmarshal.NewConfig(rb.url)).Publish(rb.queue, message.NewMessage("x", []byte("{}")))
	if !errors.Is(err, amqpmarshal.ErrDeclareQueue) || !strings.Contains(err.Error(), rb.queue) {
		t.Fatalf("err = %v, want ErrDeclareQueue", err)
	}
}

// TestDeadLetterQueueDeletedAfterFirstUse: the dead-letter queue is deleted
// after the publisher declared it and its first dead letter landed. The
// publisher publishes mandatory: RabbitMQ returns the next dead letter as
// unroutable, the publisher declares the queue again and publishes it once
// more, so every dead letter lands and every original is acked. (Declared
// once per process and published without mandatory, the next 3 were
// confirmed, dropped and their originals acked: 3 of 3 lost.)
func TestDeadLetterQueueDeletedAfterFirstUse(t *testing.T) {
	t.Parallel()
	rb := newRabbit(t)
	rb.publishSDK(t, sdkEnvelope(t, rb.queue, 0))
	var reads atomic.Int64
	var a acks
	stop := deadLetterRouter(t, rb, publisher(t, amqpmarshal.NewConfig(rb.url)), &reads, &a, func(*message.Message) error {
		return errors.New("card declined")
	})
	eventually(t, "the first dead letter", func() bool { return a.acked.Load() == 1 && rb.depth(t, rb.queue+".dlq") == 1 })
	if _, err := rb.ch.QueueDelete(rb.queue+".dlq", false, false, false); err != nil {
		t.Fatal(err)
	}
	const n = 3
	for i := 1; i <= n; i++ {
		rb.publishSDK(t, sdkEnvelope(t, rb.queue, i))
	}
	eventually(t, "every delivery to be acked", func() bool { return a.acked.Load() == 1+n })
	stop()
	if got := rb.depth(t, rb.queue+".dlq"); got != n {
		t.Fatalf("%d of %d dead letters on %s.dlq after it was deleted: the others are lost", max(got, 0), n, rb.queue)
	}
	if a.nacked.Load() != 0 || rb.depth(t, rb.queue) != 0 {
		t.Fatalf("nacked %d, %d left on the queue", a.nacked.Load(), rb.depth(t, rb.queue))
	}
}

// TestUnroutablePublicationFails: a message no queue receives (published to
// an exchange no queue is bound to) is returned by RabbitMQ: Publish fails
// with ErrUnroutable after declaring the topic's queue once more and
// trying again, never reporting success for a message that was dropped.
// Behind the dead-letter middleware, the original is nacked, never acked.
func TestUnroutablePublicationFails(t *testing.T) {
	t.Parallel()
	rb := newRabbit(t)
	exchange := rb.queue + "-x"
	t.Cleanup(func() {
		if err := rb.ch.ExchangeDelete(exchange, false, false); err != nil {
			t.Errorf("delete exchange %s: %v", exchange, err)
		}
	})
	config := amqpmarshal.NewConfig(rb.url)
	config.Exchange.GenerateName = func(string) string { return exchange }
	config.Exchange.Type = "direct"
	pub := publisher(t, config)
	err := pub.Publish(rb.queue+".dlq", message.NewMessage("x", []byte("{}")))
	if !errors.Is(err, amqpmarshal.ErrUnroutable) || !strings.Contains(err.Error(), exchange) {
		t.Fatalf("err = %v, want ErrUnroutable naming %s", err, exchange)
	}

	rb.publishSDK(t, sdkEnvelope(t, rb.queue, 0))
	var reads atomic.Int64
	var a acks
	stop := deadLetterRouter(t, rb, pub, &reads, &a, func(*message.Message) error {
		return errors.New("card declined")
	})
	eventually(t, "the failed dead letter to nack the original", func() bool { return a.nacked.Load() >= 2 })
	stop()
	if a.acked.Load() != 0 {
		t.Fatalf("%d deliveries acked although their dead letter was returned", a.acked.Load())
	}
	if d := rb.depth(t, rb.queue+".dlq"); d != 0 {
		t.Fatalf("%d messages on the unbound queue", d)
	}
	if d := rb.depth(t, rb.queue); d != 1 {
		t.Fatalf("%d messages on %s, want the original back", d, rb.queue)
	}
}

// TestCheckTopicDeclaresTheDeadLetterQueue: the publisher is the
// dead-letter middleware's topic checker: CheckTopic declares the queue
// (it exists before any dead letter), and a queue that cannot be declared
// fails the check with ErrDeclareQueue naming it.
func TestCheckTopicDeclaresTheDeadLetterQueue(t *testing.T) {
	t.Parallel()
	rb := newRabbit(t)
	var checker deadletter.TopicChecker = publisher(t, amqpmarshal.NewConfig(rb.url))
	if err := checker.CheckTopic(context.Background(), rb.queue+".dlq"); err != nil {
		t.Fatal(err)
	}
	if depth := rb.depth(t, rb.queue+".dlq"); depth != 0 {
		t.Fatalf("depth of %s.dlq after the check: %d, want an empty queue", rb.queue, depth)
	}
	if _, err := rb.ch.QueueDeclare(rb.queue, false, false, false, false, nil); err != nil { // not durable
		t.Fatal(err)
	}
	if err := checker.CheckTopic(context.Background(), rb.queue); !errors.Is(err, amqpmarshal.ErrDeclareQueue) || !strings.Contains(err.Error(), rb.queue) {
		t.Fatalf("err = %v, want ErrDeclareQueue naming %s", err, rb.queue)
	}
}
