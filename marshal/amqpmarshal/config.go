package amqpmarshal

import (
	"errors"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
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

// Publisher is a watermill-amqp publisher that declares a topic's queue
// before its first publication to it, so that a message published to the
// default exchange is never dropped as unroutable; with the publisher
// confirms of [NewConfig], Publish returns only once the broker holds the
// message on a durable queue. Use it for dead letters above all: the
// dead-letter queue usually does not exist until the first dead letter.
//
// The declaration makes a publication routable on the default exchange,
// the SDKs' topology; with an exchange of your own, bind the queues
// yourself. A queue deleted while the publisher runs is not declared again:
// declare it, or restart the publisher.
type Publisher struct {
	pub    *wamqp.Publisher
	conn   *wamqp.ConnectionWrapper
	config wamqp.Config

	mu       sync.Mutex
	declared map[string]bool
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher connects to config.Connection and returns a Publisher that
// owns the connection. config.Queue says how queues are declared.
func NewPublisher(config wamqp.Config, logger watermill.LoggerAdapter) (*Publisher, error) {
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	if config.Queue.GenerateName == nil {
		return nil, errors.New("amqpmarshal: missing Config.Queue.GenerateName")
	}
	conn, err := wamqp.NewConnection(config.Connection, logger)
	if err != nil {
		return nil, fmt.Errorf("amqpmarshal: connect: %w", err)
	}
	pub, err := wamqp.NewPublisherWithConnection(config, logger, conn)
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("amqpmarshal: publisher: %w", err)
	}
	return &Publisher{pub: pub, conn: conn, config: config, declared: map[string]bool{}}, nil
}

// Publish declares topic's queue (once per publisher) and publishes the
// messages to it. An error means a message may not have been published.
func (p *Publisher) Publish(topic string, messages ...*message.Message) error {
	if err := p.declare(topic); err != nil {
		return err
	}
	return p.pub.Publish(topic, messages...)
}

func (p *Publisher) declare(topic string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.declared[topic] {
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
	p.declared[topic] = true
	return nil
}

// Close closes the publisher and its connection.
func (p *Publisher) Close() error {
	return errors.Join(p.pub.Close(), p.conn.Close())
}
