package watermillsql_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency/watermillsql"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestMain leaves out Example_outbox, which needs PostgreSQL, when
// PostgreSQL is not there (unless CI is set). The example's outbox relay
// runs watermill-sql's subscriber: it runs on the subscriber tests' own
// server (testenv.PostgresSubscriberDSN), given to it as POSTGRES_DSN.
func TestMain(m *testing.M) {
	dsn, fallback := testenv.LookupPostgresSubscriberDSN()
	if fallback != nil {
		fmt.Fprintf(os.Stderr, "note: Example_outbox: %v\n", fallback)
	}
	if err := os.Setenv("POSTGRES_DSN", dsn); err != nil {
		panic(err)
	}
	os.Exit(testenv.RunWithServerExamples(m, "PostgreSQL", func(ctx context.Context) error {
		db, err := sql.Open("pgx", dsn)
		if err != nil {
			return err
		}
		defer db.Close()
		return db.PingContext(ctx)
	}, "Example_outbox"))
}

// The transactional inbox and outbox: the message's record and the receipt
// the handler produces commit in one transaction, and the relay publishes
// the receipt to the broker after the commit. Delivered twice, the payment
// writes one outbox row and one receipt reaches the broker. It needs the
// PostgreSQL at POSTGRES_DSN (default
// postgres://postgres@localhost:5432/test?sslmode=disable).
func Example_outbox() {
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
	records, outboxTopic := "example_idempotency_"+suffix, "example_outbox_"+suffix
	defer func() {
		_, _ = db.ExecContext(ctx, fmt.Sprintf(`DROP TABLE IF EXISTS %s, "watermill_%s", "watermill_offsets_%s"`,
			records, outboxTopic, outboxTopic))
	}()
	store, err := postgresstore.New(db, postgresstore.WithTable(records))
	if err != nil {
		panic(err)
	}
	if err := store.Migrate(ctx); err != nil {
		panic(err)
	}
	outbox, err := watermillsql.NewOutbox(ctx, db, watermillsql.OutboxConfig{Topic: outboxTopic, PollInterval: 20 * time.Millisecond})
	if err != nil {
		panic(err)
	}

	charge := idempotency.Middleware(store,
		idempotency.WithTransaction(db), idempotency.WithOutbox(outbox.Publisher),
	)(func(msg *message.Message) ([]*message.Message, error) {
		// The charge would be written with postgresstore.TxFromContext here.
		receipt, err := idempotency.NewChildMessage(msg, "receipt", "urn:babel:receipts:requested",
			map[string]any{"payment": "payment-1042"})
		if err != nil {
			return nil, err
		}
		pub, _ := idempotency.OutboxFromContext(msg.Context()) // bound to the delivery's transaction
		return nil, pub.Publish("receipts", receipt)
	})
	payment, _ := envelope.New("urn:babel:payments:requested", map[string]any{"amount_cents": 1299},
		envelope.WithID("payment-1042"))
	payload, _ := payment.Marshal()
	for range 2 { // the broker delivers it twice
		if _, err := charge(message.NewMessage(watermill.NewUUID(), payload)); err != nil {
			panic(err)
		}
	}
	var rows int
	if err := db.QueryRowContext(ctx, fmt.Sprintf(`SELECT count(*) FROM "watermill_%s"`, outboxTopic)).Scan(&rows); err != nil {
		panic(err)
	}
	fmt.Println("outbox rows:", rows)

	// The relay: from the outbox to the broker (GoChannel here).
	broker := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer broker.Close()
	receipts, err := broker.Subscribe(ctx, "receipts")
	if err != nil {
		panic(err)
	}
	relay, err := outbox.NewForwarder(broker)
	if err != nil {
		panic(err)
	}
	relayed := make(chan error, 1)
	go func() { relayed <- relay.Run(ctx) }()
	receipt := <-receipts
	receipt.Ack()
	if err := relay.Close(); err != nil {
		panic(err)
	}
	<-relayed
	id, _ := envelope.ReadIdentity(receipt.Payload)
	fmt.Println("relayed receipt:", id.ID == envelope.DeriveID("payment-1042", "receipt"))
	// Output:
	// outbox rows: 1
	// relayed receipt: true
}
