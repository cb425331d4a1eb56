package postgresstore_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" driver: session claims need it

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
)

// Session claims, the default on the pgx driver: each claim is an advisory
// lock on one connection the Store keeps for its claims, so a claim writes
// no row and a worker that dies frees its claims at once (the message then
// runs again when the broker hands it out). The record is the only row
// written per message. WithSessionClaims insists on them (New fails with
// ErrNotPgx on another driver, where claims are rows otherwise). It needs
// the PostgreSQL at POSTGRES_DSN (default
// postgres://postgres@localhost:5432/test?sslmode=disable), not behind a
// pooler in transaction mode (Migrate fails with ErrSessionPooled; use
// WithRowClaims there).
func Example_sessionClaims() {
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

	records := "example_session_claims_" + strings.ToLower(watermill.NewShortUUID())
	defer func() { _, _ = db.ExecContext(ctx, "DROP TABLE IF EXISTS "+records) }()
	store, err := postgresstore.New(db, postgresstore.WithTable(records), postgresstore.WithSessionClaims())
	if err != nil {
		panic(err)
	}
	if err := store.Migrate(ctx); err != nil {
		panic(err)
	}
	// When the worker stops (after its router): end the session, so that
	// the messages it still holds run elsewhere at once.
	defer store.Close()

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
	var rows int
	_ = db.QueryRowContext(ctx, "SELECT count(*) FROM "+records).Scan(&rows)
	fmt.Println("rows:", rows)
	// Output:
	// e-mail sent
	// rows: 1
}
