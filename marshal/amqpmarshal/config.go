package amqpmarshal

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
)

// ErrDeclareQueue is matched by a publication that failed because its
// destination queue could not be declared (for example, it exists with other
// arguments, or belongs to another connection exclusively). Nothing was
// published.
var ErrDeclareQueue = errors.New("amqpmarshal: cannot declare the destination queue")

// NewConfig returns the watermill-amqp configuration of the BabelQueue SDKs'
// topology: a durable queue named after the topic, the default exchange,
// routing key = queue name, persistent delivery, the binding's [Marshaler],
// publisher confirms, and one unacknowledged message per consumer (raise
// Consume.Qos.PrefetchCount for throughput). A subscriber declares its queue
// before consuming; publish with [NewPublisher], which declares the
// destination queue too.
//
// A queue the SDKs declared with arguments (a quorum queue, a TTL) must be
// declared with the same arguments here: set Queue.Arguments, or RabbitMQ
// refuses the declaration.
func NewConfig(amqpURI string) wamqp.Config {
	c := wamqp.NewDurableQueueConfig(amqpURI)
	c.Marshaler = Marshaler{}
	c.Publish.ConfirmDelivery = true
	return c
}

// Publisher publishes with watermill-amqp's connection and [Config] so that
// no message is ever reported published while RabbitMQ dropped it. It
// declares a topic's queue before its first publication to it, publishes
// every message with the mandatory flag and waits for its publisher
// confirm. RabbitMQ returns a mandatory message that no queue receives
// (basic.return) before confirming it; Publish then declares the queue
// again (it was deleted since it was declared), publishes the message once
// more and, returned again, fails with [ErrUnroutable]. So Publish returns
// nil only once the broker holds every message on a queue, and an error
// otherwise: behind the dead-letter middleware, the original is then
// nacked for redelivery, never acked. Use it for dead letters above all:
// the dead-letter queue usually does not exist until the first dead
// letter, and an operator may delete it at any time.
//
// watermill-amqp's own publisher cannot do this: it publishes mandatory
// only when asked to and then ignores what RabbitMQ returns, taking the
// confirm that follows for a delivery. This one opens a channel per
// Publish call (as watermill-amqp does by default), in confirm mode,
// listening for returns. config.Publish.GenerateRoutingKey and
// config.Exchange name the destination, config.Marshaler writes the
// messages and config.Queue says how queues are declared; the mandatory
// flag and publisher confirms are always on, whatever config.Publish says
// (Publish.Transactional, which excludes confirms, is refused).
//
// The declaration makes a publication routable on the default exchange,
// the SDKs' topology; with an exchange of your own, bind the queues
// yourself (a message the exchange routes to no queue fails with
// ErrUnroutable).
type Publisher struct {
	conn   *wamqp.ConnectionWrapper
	config wamqp.Config
	logger watermill.LoggerAdapter

	closeMu sync.RWMutex // held for reading by each Publish
	closed  bool

	mu       sync.Mutex
	declared map[string]bool
}

var _ message.Publisher = (*Publisher)(nil)

// Errors of [Publisher.Publish] that callers branch on.
var (
	// ErrUnroutable is matched by a publication RabbitMQ returned as
	// unroutable (no queue received it) although the topic's queue was
	// declared again. The message was not published.
	ErrUnroutable = errors.New("amqpmarshal: no queue received the message")
	// ErrClosed is returned by Publish after Close.
	ErrClosed = errors.New("amqpmarshal: publisher closed")
)

// NewPublisher connects to config.Connection and returns a Publisher that
// owns the connection (watermill-amqp's, which reconnects after a broker
// restart). config.Queue says how queues are declared.
func NewPublisher(config wamqp.Config, logger watermill.LoggerAdapter) (*Publisher, error) {
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	if config.Queue.GenerateName == nil {
		return nil, errors.New("amqpmarshal: missing Config.Queue.GenerateName")
	}
	if config.Publish.Transactional {
		return nil, errors.New("amqpmarshal: Config.Publish.Transactional is not supported: the publisher waits for publisher confirms, which a transactional channel cannot give")
	}
	if err := config.ValidatePublisher(); err != nil {
		return nil, fmt.Errorf("amqpmarshal: %w", err)
	}
	conn, err := wamqp.NewConnection(config.Connection, logger)
	if err != nil {
		return nil, fmt.Errorf("amqpmarshal: connect: %w", err)
	}
	return &Publisher{conn: conn, config: config, logger: logger, declared: map[string]bool{}}, nil
}

// Publish declares topic's queue (once per publisher, and again when
// RabbitMQ returns a message as unroutable) and publishes the messages to
// it, one after the other, each mandatory and confirmed, and each bounded
// by its context. An error means a message, and those after it, may not
// have been published: [ErrDeclareQueue] when the queue could not be
// declared, [ErrUnroutable] when no queue received a message.
func (p *Publisher) Publish(topic string, messages ...*message.Message) error {
	p.closeMu.RLock()
	defer p.closeMu.RUnlock()
	if p.closed {
		return ErrClosed
	}
	if len(messages) == 0 {
		return nil
	}
	if err := p.declare(topic, false); err != nil {
		return err
	}
	ch, returns, err := p.channel()
	if err != nil {
		return err
	}
	defer func() { _ = ch.Close() }()
	exchange := p.config.Exchange.GenerateName(topic)
	key := p.config.Publish.GenerateRoutingKey(topic)
	for _, msg := range messages {
		returned, err := p.publish(ch, returns, exchange, key, msg)
		if err != nil {
			return err
		}
		if returned == nil {
			continue
		}
		// The queue is gone (deleted after it was declared): declare it
		// again and publish once more.
		p.logger.Info("message returned as unroutable; declaring the queue again", watermill.LogFields{
			"topic": topic, "message_uuid": msg.UUID, "reply": returned.ReplyText,
		})
		if err := p.declare(topic, true); err != nil {
			return err
		}
		if returned, err = p.publish(ch, returns, exchange, key, msg); err != nil {
			return err
		}
		if returned != nil {
			return fmt.Errorf("%w: message %s to exchange %q, routing key %q: %d %s", ErrUnroutable, msg.UUID, exchange, key, returned.ReplyCode, returned.ReplyText)
		}
	}
	return nil
}

// channel opens a channel in confirm mode that reports returned messages.
func (p *Publisher) channel() (*amqp.Channel, <-chan amqp.Return, error) {
	conn := p.conn.Connection()
	if conn == nil || conn.IsClosed() {
		return nil, nil, errors.New("amqpmarshal: not connected to RabbitMQ")
	}
	ch, err := conn.Channel()
	if err != nil {
		return nil, nil, fmt.Errorf("amqpmarshal: open channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		_ = ch.Close()
		return nil, nil, fmt.Errorf("amqpmarshal: confirm mode: %w", err)
	}
	// One return at most is outstanding: each publication is confirmed
	// and its return read before the next.
	return ch, ch.NotifyReturn(make(chan amqp.Return, 1)), nil
}

// publish publishes msg mandatory and waits for its confirm. RabbitMQ sends
// the return of an unroutable message before its confirm, on the same
// channel, and the client hands it over before the confirm: once confirmed,
// a message that was returned has its return waiting. returned is that
// return, or nil.
func (p *Publisher) publish(ch *amqp.Channel, returns <-chan amqp.Return, exchange, key string, msg *message.Message) (returned *amqp.Return, err error) {
	publishing, err := p.config.Marshaler.Marshal(msg)
	if err != nil {
		return nil, fmt.Errorf("amqpmarshal: marshal %s: %w", msg.UUID, err)
	}
	ctx := msg.Context()
	confirm, err := ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, true, false, publishing)
	if err != nil {
		return nil, fmt.Errorf("amqpmarshal: publish %s: %w", msg.UUID, err)
	}
	acked, err := confirm.WaitContext(ctx)
	if err != nil {
		return nil, fmt.Errorf("amqpmarshal: publish %s: waiting for its confirm: %w", msg.UUID, err)
	}
	if !acked {
		return nil, fmt.Errorf("amqpmarshal: publish %s: not confirmed by RabbitMQ (nacked, or the channel closed)", msg.UUID)
	}
	select {
	case r, ok := <-returns:
		if ok {
			return &r, nil
		}
		return nil, fmt.Errorf("amqpmarshal: publish %s: the channel closed", msg.UUID)
	default:
		return nil, nil
	}
}

// declare declares topic's queue, and the exchange when there is one, once
// (again when again is set).
func (p *Publisher) declare(topic string, again bool) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.declared[topic] && !again {
		return nil
	}
	queue := p.config.Queue.GenerateName(topic)
	conn := p.conn.Connection()
	if conn == nil || conn.IsClosed() {
		return fmt.Errorf("%w %q: not connected to RabbitMQ", ErrDeclareQueue, queue)
	}
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("%w %q: open channel: %w", ErrDeclareQueue, queue, err)
	}
	defer func() { _ = ch.Close() }()
	q := p.config.Queue
	if _, err := ch.QueueDeclare(queue, q.Durable, q.AutoDelete, q.Exclusive, false, q.Arguments); err != nil {
		return fmt.Errorf("%w %q: %w", ErrDeclareQueue, queue, err)
	}
	if exchange := p.config.Exchange.GenerateName(topic); exchange != "" && p.config.TopologyBuilder != nil {
		if err := p.config.TopologyBuilder.ExchangeDeclare(ch, exchange, p.config); err != nil {
			return fmt.Errorf("amqpmarshal: declare exchange %q: %w", exchange, err)
		}
	}
	p.declared[topic] = true
	return nil
}

// Close waits for the publications in progress, then closes the connection.
func (p *Publisher) Close() error {
	p.closeMu.Lock()
	defer p.closeMu.Unlock()
	if p.closed {
		return nil
	}
	p.closed = true
	return p.conn.Close()
}

// CheckTopic declares topic's queue (once per publisher), so that a
// message published to topic is kept: the dead-letter middleware calls it
// (deadletter.TopicChecker) before the first message of the topic a
// dead-letter queue serves is handled. An error matches [ErrDeclareQueue]
// (the queue exists with other arguments, say) or [ErrClosed].
func (p *Publisher) CheckTopic(_ context.Context, topic string) error {
	p.closeMu.RLock()
	defer p.closeMu.RUnlock()
	if p.closed {
		return ErrClosed
	}
	return p.declare(topic, false)
}
