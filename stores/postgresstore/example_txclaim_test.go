package postgresstore_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
)

// Claims held in transactions: the claim is an open transaction holding the
// message's record uncommitted while the handler runs, and its commit is the
// record. A worker that dies mid-handler frees its messages at once (its
// connection closes); there is no lease to wait out. Each message in flight
// holds one connection of the pool. It needs the PostgreSQL at POSTGRES_DSN
// (default postgres://postgres@localhost:5432/test?sslmode=disable).
func Example_transactionClaims() {
	ctx := context.Background()
	dsn := os.Getenv("POSTGRES_DSN")
	if dsn == "" {
		dsn = "postgres://postgres@localhost:5432/test?sslmode=disable"
	}
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		panic(err)
	}
	defer db.Close()
	const concurrency = 8 // the router's concurrent deliveries
	db.SetMaxOpenConns(2 * concurrency)
	db.SetMaxIdleConns(2 * concurrency)

	records := "example_tx_claims_" + strings.ToLower(watermill.NewShortUUID())
	defer func() { _, _ = db.ExecContext(ctx, "DROP TABLE IF EXISTS "+records) }()
	store, err := postgresstore.New(db, postgresstore.WithTable(records), postgresstore.WithTransactionClaims())
	if err != nil {
		panic(err)
	}
	if err := store.Migrate(ctx); err != nil {
		panic(err)
	}
	// When the worker stops (after its router): roll back the claims it
	// still holds, so that their messages run elsewhere at once.
	defer func() { _ = store.ReleaseAll(ctx) }()

	notify := idempotency.Middleware(store)(func(msg *message.Message) ([]*message.Message, error) {
		fmt.Println("e-mail sent") // an effect outside the database
		return nil, nil
	})
	order, _ := envelope.New("urn:babel:orders:shipped", map[string]any{"order": 1042}, envelope.WithID("order-1042-shipped"))
	payload, _ := order.Marshal()
	for range 2 { // the broker delivers it twice
		if _, err := notify(message.NewMessage(watermill.NewUUID(), payload)); err != nil {
			panic(err)
		}
	}
	// Output:
	// e-mail sent
}
