package watermillsql_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency/watermillsql"
)

// relay starts the outbox relay towards follow and returns the outbox and
// the publisher the router is given for its publish topic. Under the outbox
// the router must never publish: the follow-ups leave through the relay.
func (c *matrixCase) relay(t *testing.T, follow message.Publisher) (*watermillsql.Outbox, message.Publisher) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	outbox, err := watermillsql.NewOutbox(ctx, c.side, watermillsql.OutboxConfig{Topic: c.outboxTopic(), PollInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	fwd, err := outbox.NewForwarder(follow)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- fwd.Run(context.Background()) }()
	t.Cleanup(func() {
		if err := fwd.Close(); err != nil {
			t.Error(err)
		}
		<-done
	})
	var routerPub message.Publisher = refusing{t}
	if c.f == smallPool {
		// A publisher on the handler's own one-connection pool, as a
		// deployment publishing to watermill-sql would have.
		routerPub, err = wsql.NewPublisher(wsql.BeginnerFromStdSQL(c.db), wsql.PublisherConfig{
			SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, AutoInitializeSchema: true}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
	}
	return outbox, routerPub
}

func (c *matrixCase) outboxOptions(outbox *watermillsql.Outbox) []idempotency.Option {
	return []idempotency.Option{idempotency.WithOutbox(outbox.Publisher)}
}

// refusing fails the test if the router publishes at all.
type refusing struct{ t *testing.T }

func (r refusing) Publish(topic string, _ ...*message.Message) error {
	r.t.Errorf("the router published to %s: produced messages must leave through the outbox", topic)
	return errors.New("the router must not publish")
}

func (refusing) Close() error { return nil }
