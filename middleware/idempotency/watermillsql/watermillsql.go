// Package watermillsql connects the idempotency middleware's transactional
// mode to watermill-sql.
//
// Tx lets the middleware reuse the transaction watermill-sql's subscriber
// consumes a message in, so that consuming the message, the handler's writes
// and the message's record commit in one transaction:
//
//	router.AddMiddleware(idempotency.Middleware(store,
//		idempotency.WithTransaction(db), idempotency.WithSubscriberTx(watermillsql.Tx)))
//
// Outbox is a transactional outbox: the messages a handler produces are
// written in that same transaction (idempotency.WithOutbox(outbox.Publisher))
// and relayed to the broker after the commit by Watermill's
// components/forwarder (Outbox.NewForwarder), whatever the broker.
//
// It is a package of its own so that only users of watermill-sql build it.
package watermillsql

import (
	"context"
	"database/sql"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
)

// Tx returns the transaction watermill-sql's subscriber consumes the message
// in. The subscriber commits it when the router acks the message and rolls it
// back on a nack. It reports false when there is none, or when the subscriber
// was built on a pgx beginner rather than database/sql (use
// wsql.BeginnerFromStdSQL).
func Tx(ctx context.Context) (*sql.Tx, bool) {
	tx, ok := wsql.TxFromContext(ctx)
	if !ok {
		return nil, false
	}
	std, ok := tx.(*wsql.StdSQLTx)
	if !ok || std.Tx == nil {
		return nil, false
	}
	return std.Tx, true
}
