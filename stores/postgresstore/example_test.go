package postgresstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestMain leaves out Example, which needs PostgreSQL, when PostgreSQL is
// not there (unless CI is set).
func TestMain(m *testing.M) {
	os.Exit(testenv.RunWithServerExamples(m, "PostgreSQL", func(ctx context.Context) error {
		db, err := sql.Open("pgx", testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN))
		if err != nil {
			return err
		}
		defer db.Close()
		return db.PingContext(ctx)
	}, "Example", "Example_transactionClaims", "ExampleWithPartitions"))
}

// The consumer inbox: the handler's write and the message's record commit
// in one transaction, so a payment delivered twice is booked once, even if
// the worker dies between the two. It needs the PostgreSQL at POSTGRES_DSN
// (default postgres://postgres@localhost:5432/test?sslmode=disable).
func Example() {
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

	// Tables of this run's own, dropped at the end.
	suffix := strings.ToLower(watermill.NewShortUUID())
	records, ledger := "example_idempotency_"+suffix, "example_ledger_"+suffix
	defer func() { _, _ = db.ExecContext(ctx, "DROP TABLE IF EXISTS "+records+", "+ledger) }()
	store, err := postgresstore.New(db, postgresstore.WithTable(records))
	if err != nil {
		panic(err)
	}
	defer store.Close() // ends the session the claims are held on
	if err := store.Migrate(ctx); err != nil {
		panic(err)
	}
	if _, err := db.ExecContext(ctx, "CREATE TABLE "+ledger+" (payment text, amount_cents int)"); err != nil {
		panic(err)
	}

	book := idempotency.Middleware(store, idempotency.WithTransaction(db))(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := postgresstore.TxFromContext(msg.Context()) // the transaction the record commits in
		_, err := tx.ExecContext(msg.Context(), "INSERT INTO "+ledger+" VALUES ('payment-1042', 1299)")
		return nil, err
	})
	payment, _ := envelope.New("urn:babel:payments:requested", map[string]any{"amount_cents": 1299},
		envelope.WithID("payment-1042"))
	payload, _ := payment.Marshal()
	for range 2 { // the broker delivers it twice
		if _, err := book(message.NewMessage(watermill.NewUUID(), payload)); err != nil {
			panic(err)
		}
	}

	var rows int
	if err := db.QueryRowContext(ctx, "SELECT count(*) FROM "+ledger).Scan(&rows); err != nil {
		panic(err)
	}
	fmt.Println("ledger rows:", rows)
	// Output:
	// ledger rows: 1
}

// The key column holds the first 128 bits of SHA-256 of the store key (the
// handler name and meta.id) as a uuid: find a record with psql by it.
// RowKey does no I/O.
func ExampleRowKey() {
	fmt.Println(postgresstore.RowKey(idempotency.Key("charge", "payment-1042")))
	// Output:
	// 36c87ab4-776a-5d0f-4cc6-0e4e794dfaea
}

// New checks its options without touching the database: a table name must
// be a plain identifier, optionally qualified by a schema.
func ExampleNew() {
	db, err := sql.Open("pgx", "postgres://localhost/test") // not contacted
	if err != nil {
		panic(err)
	}
	defer db.Close()

	_, err = postgresstore.New(db, postgresstore.WithTable("billing.idempotency"))
	fmt.Println(err)
	_, err = postgresstore.New(db, postgresstore.WithTable("idempotency; DROP TABLE orders"))
	fmt.Println(errors.Is(err, postgresstore.ErrInvalidOption))
	// Output:
	// <nil>
	// true
}
