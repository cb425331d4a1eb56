package idempotency_test

import (
	"context"
	"errors"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
)

// The transactional mode for handlers that use pgx natively: the payment's
// INSERT and the message's record commit together, in the pgx transaction
// the middleware begins (its BEGIN carrying the record, so the kit adds no
// round trip to the handler's own transaction).
func ExampleWithPgxTransaction() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://app@db/payments")
	if err != nil {
		panic(err)
	}
	// The store keeps its own statements on database/sql; a *sql.DB over
	// the same pool serves it.
	store, err := postgresstore.New(stdlib.OpenDBFromPool(pool))
	if err != nil {
		panic(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	router.AddMiddleware(idempotency.Middleware(store, idempotency.WithPgxTransaction(pool)))
	subscriber := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{}) // your broker's subscriber
	router.AddConsumerHandler("charge", "payments", subscriber, func(msg *message.Message) error {
		tx, ok := idempotency.PgxTxFromContext(msg.Context())
		if !ok {
			return errors.New("not in the transactional mode")
		}
		_, err := tx.Exec(msg.Context(), `INSERT INTO payments (message_uuid, amount_cents) VALUES ($1, $2)`, msg.UUID, 1299)
		return err // the middleware commits, or rolls back on an error
	})
	_ = router.Run(ctx)
}
