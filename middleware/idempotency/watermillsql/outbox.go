package watermillsql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
)

// OutboxConfig configures an Outbox. The zero value is usable on PostgreSQL
// except for Topic, which names the outbox.
type OutboxConfig struct {
	// Topic is the watermill-sql topic the outbox rows are written to: with
	// the default schema, the table "watermill_<Topic>". Required; one
	// outbox may serve any number of handlers and destination topics.
	Topic string

	// SchemaAdapter and OffsetsAdapter are watermill-sql's (defaults:
	// wsql.DefaultPostgreSQLSchema and wsql.DefaultPostgreSQLOffsetsAdapter,
	// which read rows in commit order).
	SchemaAdapter  wsql.SchemaAdapter
	OffsetsAdapter wsql.OffsetsAdapter

	// ConsumerGroup is the relay's consumer group (default "forwarder").
	// Relays of one outbox in the same group share the work; a row is
	// relayed once per group.
	ConsumerGroup string

	// PollInterval is how often the relay looks for new rows when it found
	// none (default watermill-sql's, one second).
	PollInterval time.Duration

	// Logger is used by the publisher and the relay (default none).
	Logger watermill.LoggerAdapter
}

// Outbox is a transactional outbox on watermill-sql: messages written with
// a Publisher bound to a transaction become rows of the outbox table that
// commit or roll back with that transaction, and a relay (NewForwarder,
// Watermill's components/forwarder) publishes the committed rows to the
// broker afterwards, outside any transaction of the handler's.
//
// With the idempotency middleware's transactional mode, the record of the
// consumed message, the handler's writes and the messages it produced commit
// in one transaction, and the delivery is acked only after that commit:
//
//	outbox, err := watermillsql.NewOutbox(ctx, db, watermillsql.OutboxConfig{Topic: "orders_outbox"})
//	router.AddMiddleware(idempotency.Middleware(store,
//		idempotency.WithTransaction(db), idempotency.WithOutbox(outbox.Publisher)))
//	relay, err := outbox.NewForwarder(brokerPublisher)
//	go relay.Run(ctx) // beside the router; relay.Close() stops it
//
// The relay publishes each row at least once: a row whose publication
// succeeded is published again if the relay dies before it marked the row
// consumed. Give produced messages identities derived from the consumed
// message (envelope.NewChild) so that their consumers skip the second copy.
type Outbox struct {
	db  *sql.DB
	cfg OutboxConfig
}

// ErrNoTopic is returned by NewOutbox without OutboxConfig.Topic.
var ErrNoTopic = errors.New("watermillsql: outbox topic is empty")

// NewOutbox returns the outbox in db and creates its tables when they do
// not exist (a transaction cannot create them: watermill-sql forbids it, as
// CREATE TABLE may commit implicitly on some databases).
func NewOutbox(ctx context.Context, db *sql.DB, cfg OutboxConfig) (*Outbox, error) {
	if db == nil {
		return nil, errors.New("watermillsql: nil database")
	}
	if cfg.Topic == "" {
		return nil, ErrNoTopic
	}
	if cfg.SchemaAdapter == nil {
		cfg.SchemaAdapter = wsql.DefaultPostgreSQLSchema{}
	}
	if cfg.OffsetsAdapter == nil {
		cfg.OffsetsAdapter = wsql.DefaultPostgreSQLOffsetsAdapter{}
	}
	if cfg.ConsumerGroup == "" {
		cfg.ConsumerGroup = "forwarder"
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	o := &Outbox{db: db, cfg: cfg}
	sub, err := o.subscriber()
	if err != nil {
		return nil, err
	}
	defer sub.Close()
	initialized := make(chan error, 1)
	go func() { initialized <- sub.SubscribeInitialize(cfg.Topic) }()
	select {
	case err := <-initialized:
		if err != nil {
			return nil, fmt.Errorf("watermillsql: create the tables of outbox %q: %w", cfg.Topic, err)
		}
	case <-ctx.Done():
		return nil, fmt.Errorf("watermillsql: create the tables of outbox %q: %w", cfg.Topic, ctx.Err())
	}
	return o, nil
}

// Topic returns the outbox's watermill-sql topic.
func (o *Outbox) Topic() string { return o.cfg.Topic }

// Publisher returns a publisher that writes messages to the outbox in tx:
// Publish(topic, msgs...) stores each message with its destination topic in
// a row that commits or rolls back with tx. Pass the method to
// idempotency.WithOutbox.
func (o *Outbox) Publisher(tx *sql.Tx) (message.Publisher, error) {
	pub, err := wsql.NewPublisher(wsql.TxFromStdSQL(tx), wsql.PublisherConfig{SchemaAdapter: o.cfg.SchemaAdapter}, o.cfg.Logger)
	if err != nil {
		return nil, fmt.Errorf("watermillsql: outbox publisher: %w", err)
	}
	return forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: o.cfg.Topic}), nil
}

// NewForwarder returns the relay: Watermill's forwarder reading the outbox's
// committed rows and publishing each message to its destination topic with
// out. A row is consumed only after out published it; a failed publication
// is retried (out's errors go back to the outbox subscriber, which resends).
// Run it with Run(ctx) beside the router and stop it with Close.
func (o *Outbox) NewForwarder(out message.Publisher, middlewares ...message.HandlerMiddleware) (*forwarder.Forwarder, error) {
	sub, err := o.subscriber()
	if err != nil {
		return nil, err
	}
	f, err := forwarder.NewForwarder(sub, out, o.cfg.Logger, forwarder.Config{
		ForwarderTopic: o.cfg.Topic,
		Middlewares:    middlewares,
	})
	if err != nil {
		_ = sub.Close()
		return nil, fmt.Errorf("watermillsql: outbox relay: %w", err)
	}
	return f, nil
}

func (o *Outbox) subscriber() (*wsql.Subscriber, error) {
	sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(o.db), wsql.SubscriberConfig{
		ConsumerGroup:  o.cfg.ConsumerGroup,
		PollInterval:   o.cfg.PollInterval,
		ResendInterval: 100 * time.Millisecond,
		SchemaAdapter:  o.cfg.SchemaAdapter,
		OffsetsAdapter: o.cfg.OffsetsAdapter,
	}, o.cfg.Logger)
	if err != nil {
		return nil, fmt.Errorf("watermillsql: outbox subscriber: %w", err)
	}
	return sub, nil
}
