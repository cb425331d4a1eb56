package watermillsql_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency/watermillsql"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestSubscriberTransactionIsReused consumes from watermill-sql's
// PostgreSQL subscriber: the handler's writes, the record and the consumption
// of the message share the subscriber's transaction (no second one is
// opened), and duplicates take effect once.
func TestSubscriberTransactionIsReused(t *testing.T) {
	t.Parallel()
	db := testenv.PostgresForSubscriber(t)
	ctx := context.Background()
	suffix := testenv.RandomHex(4)
	topic, ledger := "bq_test_orders_"+suffix, "ledger_"+suffix
	store, err := postgresstore.New(db, postgresstore.WithTable("idem_wmsql_"+suffix))
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE `+ledger+` (account text PRIMARY KEY, balance bigint NOT NULL); INSERT INTO `+ledger+` VALUES ('alice', 0)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = db.ExecContext(context.Background(), fmt.Sprintf(`DROP TABLE IF EXISTS %s, idem_wmsql_%s, "watermill_%s", "watermill_offsets_%s"`, ledger, suffix, topic, topic))
	})

	logger := watermill.NopLogger{}
	beginner := wsql.BeginnerFromStdSQL(db)
	sub, err := wsql.NewSubscriber(beginner, wsql.SubscriberConfig{
		ConsumerGroup: "ledger", PollInterval: 20 * time.Millisecond, ResendInterval: 20 * time.Millisecond,
		SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{}, InitializeSchema: true,
	}, logger)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := wsql.NewPublisher(beginner, wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, AutoInitializeSchema: true}, logger)
	if err != nil {
		t.Fatal(err)
	}

	var acked, ownTx, runs atomic.Int64
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(
		func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				out, err := h(msg)
				if err == nil {
					acked.Add(1)
				}
				return out, err
			}
		},
		idempotency.Middleware(store, idempotency.WithTransaction(db), idempotency.WithSubscriberTx(watermillsql.Tx)),
	)
	router.AddConsumerHandler("credit", topic, sub, func(msg *message.Message) error {
		runs.Add(1)
		tx, ok := postgresstore.TxFromContext(msg.Context())
		subTx, subOK := watermillsql.Tx(msg.Context())
		if !ok || !subOK {
			return errors.New("no transaction in the handler's context")
		}
		if tx != subTx {
			ownTx.Add(1)
		}
		_, err := tx.ExecContext(msg.Context(), `UPDATE `+ledger+` SET balance = balance + 1 WHERE account = 'alice'`)
		return err
	})
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- router.Run(runCtx) }()
	t.Cleanup(func() { cancel(); <-done })
	<-router.Running()

	const orders = 50
	entries := 0
	for i := range orders {
		e, _ := envelope.New("urn:babel:orders:created", map[string]any{"n": i})
		payload, _ := e.Marshal()
		for range 1 + i%2 {
			if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
				t.Fatal(err)
			}
			entries++
		}
	}
	// Done when the group's committed offset covers every message: the
	// subscriber commits each transaction after the router's ack, so a
	// handler having returned is not enough.
	deadline := time.Now().Add(60 * time.Second)
	for !testenv.SQLTopicDrained(ctx, db, topic, "ledger") {
		if time.Now().After(deadline) {
			t.Fatalf("not drained: %d of %d deliveries handled", acked.Load(), entries)
		}
		time.Sleep(20 * time.Millisecond)
	}
	var balance int64
	if err := db.QueryRowContext(ctx, `SELECT balance FROM `+ledger+` WHERE account = 'alice'`).Scan(&balance); err != nil {
		t.Fatal(err)
	}
	if balance != orders || runs.Load() != orders {
		t.Fatalf("balance=%d runs=%d for %d orders published as %d entries", balance, runs.Load(), orders, entries)
	}
	if ownTx.Load() != 0 {
		t.Fatalf("%d deliveries ran in a transaction other than the subscriber's", ownTx.Load())
	}
	var sqlTx *sql.Tx
	if _, ok := watermillsql.Tx(context.Background()); ok || sqlTx != nil {
		t.Fatal("Tx found a transaction in an empty context")
	}
}
