// Command transactional places orders with the transactional inbox and
// outbox: the consumption of each order message, the order's row, the
// customer's new balance, the message's idempotency record and the follow-up
// message it produces commit in one PostgreSQL transaction. The follow-up is
// written to an outbox table in that transaction and relayed to its topic
// after the commit, by Watermill's forwarder. A crash at any moment can
// neither lose an order nor apply one twice, nor send a follow-up for an
// order that was not placed. PostgreSQL is the only service: it is the
// message broker too, through watermill-sql.
//
//	docker compose up -d --wait postgres   # or your own PostgreSQL (tested on 15); POSTGRES_DSN overrides
//	go run ./examples/transactional
//
// It publishes orders, some of them two or three times, prints the final
// balances, checks them against the unique orders and checks that each order
// produced exactly one follow-up, and exits 0 when everything matches.
package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency/watermillsql"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
)

func main() {
	dsn := os.Getenv("POSTGRES_DSN")
	if dsn == "" {
		dsn = "postgres://postgres@localhost:5432/test?sslmode=disable"
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := run(ctx, os.Stdout, dsn); err != nil {
		fmt.Fprintln(os.Stderr, "transactional:", err)
		os.Exit(1)
	}
}

// order charges a customer.
type order struct {
	Customer string `json:"customer"`
	Cents    int64  `json:"cents"`
}

func run(ctx context.Context, out io.Writer, dsn string) error {
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxIdleConns(8) // as many as concurrent deliveries: database/sql keeps 2 by default
	if err := db.PingContext(ctx); err != nil {
		return fmt.Errorf("postgres at %s: %w (start it with `docker compose up -d postgres`)", dsn, err)
	}
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	run := hex.EncodeToString(b)
	ordersTopic, followTopic, outboxTopic := "orders_"+run, "orders_placed_"+run, "outbox_"+run
	accounts, orders := "example_accounts_"+run, "example_orders_"+run
	defer db.ExecContext(context.WithoutCancel(ctx), fmt.Sprintf( //nolint:errcheck
		`DROP TABLE IF EXISTS %s, %s, example_idempotency_%s, "watermill_%s", "watermill_offsets_%s", "watermill_%s", "watermill_offsets_%s", "watermill_%s"`,
		accounts, orders, run, ordersTopic, ordersTopic, outboxTopic, outboxTopic, followTopic))

	// 1. The business tables, and the idempotency records beside them.
	if _, err := db.ExecContext(ctx, `CREATE TABLE `+accounts+` (name text PRIMARY KEY, cents bigint NOT NULL);
		INSERT INTO `+accounts+` VALUES ('alice', 10000), ('bob', 10000), ('carol', 10000);
		CREATE TABLE `+orders+` (id text PRIMARY KEY, customer text NOT NULL, cents bigint NOT NULL)`); err != nil {
		return err
	}
	store, err := postgresstore.New(db, postgresstore.WithTable("example_idempotency_"+run))
	if err != nil {
		return err
	}
	defer store.Close() // ends the session its claims are held on (the pgx driver's default)
	if err := store.Migrate(ctx); err != nil {
		return err
	}

	// 2. watermill-sql as the broker: messages are rows, and the subscriber
	//    consumes each one in a transaction it commits on ack.
	logger := watermill.NopLogger{}
	beginner := wsql.BeginnerFromStdSQL(db)
	pub, err := wsql.NewPublisher(beginner, wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, AutoInitializeSchema: true}, logger)
	if err != nil {
		return err
	}
	sub, err := wsql.NewSubscriber(beginner, wsql.SubscriberConfig{
		ConsumerGroup: "shop", PollInterval: 20 * time.Millisecond,
		SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{}, InitializeSchema: true,
	}, logger)
	if err != nil {
		return err
	}

	// 3. The outbox: follow-ups are written in the consuming transaction and
	//    relayed to their topic by Watermill's forwarder after the commit.
	outbox, err := watermillsql.NewOutbox(ctx, db, watermillsql.OutboxConfig{Topic: outboxTopic, PollInterval: 20 * time.Millisecond})
	if err != nil {
		return err
	}
	relay, err := outbox.NewForwarder(pub)
	if err != nil {
		return err
	}

	// 4. The transactional inbox and outbox: the record goes into the
	//    subscriber's own transaction, next to the handler's writes and the
	//    outbox rows.
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		return err
	}
	var placed, skipped atomic.Int64
	router.AddMiddleware(idempotency.Middleware(store,
		idempotency.WithTransaction(db), idempotency.WithSubscriberTx(watermillsql.Tx),
		idempotency.WithOutbox(outbox.Publisher),
		idempotency.WithObserver(idempotency.ObserverFunc(func(_ context.Context, e idempotency.Event) {
			if e.Outcome == idempotency.OutcomeSkip {
				skipped.Add(1)
			}
		}))))

	// 5. The handler writes through the transaction it finds in its context
	//    and returns the follow-up; its id derives from the order's, so a
	//    second relay of it would be recognised downstream.
	router.AddHandler("place-order", ordersTopic, sub, followTopic, pub, func(msg *message.Message) ([]*message.Message, error) {
		tx, ok := postgresstore.TxFromContext(msg.Context())
		if !ok {
			return nil, errors.New("no transaction: is the middleware in transactional mode?")
		}
		e, err := envelope.Parse(msg.Payload)
		if err != nil {
			return nil, err
		}
		var o order
		if err := json.Unmarshal(e.Data, &o); err != nil {
			return nil, err
		}
		if _, err := tx.ExecContext(msg.Context(), `INSERT INTO `+orders+` VALUES ($1, $2, $3)`, e.Meta.ID, o.Customer, o.Cents); err != nil {
			return nil, err
		}
		if _, err := tx.ExecContext(msg.Context(), `UPDATE `+accounts+` SET cents = cents - $1 WHERE name = $2`, o.Cents, o.Customer); err != nil {
			return nil, err
		}
		followUp, err := envelope.NewChild(e, "placed", "urn:babel:orders:placed", map[string]any{"order": e.Meta.ID}, envelope.WithQueue(followTopic))
		if err != nil {
			return nil, err
		}
		payload, err := followUp.Marshal()
		if err != nil {
			return nil, err
		}
		placed.Add(1)
		return []*message.Message{message.NewMessage(watermill.NewUUID(), payload)}, nil
	})
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	routerDone, relayDone := make(chan error, 1), make(chan error, 1)
	go func() { routerDone <- router.Run(runCtx) }()
	go func() { relayDone <- relay.Run(runCtx) }()
	<-router.Running()

	// 6. Publish orders; every third one two or three times.
	list := []order{{"alice", 2500}, {"bob", 1200}, {"carol", 300}, {"alice", 4100}, {"bob", 999}, {"carol", 50}, {"alice", 1}, {"bob", 7000}}
	want := map[string]int64{"alice": 10000, "bob": 10000, "carol": 10000}
	deliveries := 0
	for i, o := range list {
		e, err := envelope.New("urn:babel:orders:created", o, envelope.WithQueue(ordersTopic))
		if err != nil {
			return err
		}
		payload, err := e.Marshal()
		if err != nil {
			return err
		}
		copies := 1
		if i%3 == 0 {
			copies = 2 + i%2
		}
		for range copies {
			if err := pub.Publish(ordersTopic, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
				return err
			}
			deliveries++
		}
		want[o.Customer] -= o.Cents
	}
	fmt.Fprintf(out, "published %d orders as %d messages\n", len(list), deliveries)

	// 7. Wait until the subscriber has committed every order message (it
	//    commits each transaction after the router's ack) and the relay
	//    every outbox row, then compare.
	drained := func(topic, group string) bool {
		var done bool
		err := db.QueryRowContext(ctx, fmt.Sprintf(`SELECT coalesce((SELECT offset_acked FROM "watermill_offsets_%s" WHERE consumer_group = $1), 0)
			>= coalesce((SELECT max("offset") FROM "watermill_%s"), 0)`, topic, topic), group).Scan(&done)
		return err == nil && done
	}
	for !drained(ordersTopic, "shop") || !drained(outboxTopic, "forwarder") {
		select {
		case <-ctx.Done():
			return fmt.Errorf("only %d of %d messages consumed: %w", placed.Load()+skipped.Load(), deliveries, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
	stop()
	if err := errors.Join(<-routerDone, <-relayDone); err != nil {
		return err
	}
	var rows, followUps, distinct int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM `+orders).Scan(&rows); err != nil {
		return err
	}
	if err := db.QueryRowContext(ctx, fmt.Sprintf(`SELECT count(*), count(DISTINCT payload::jsonb->'meta'->>'id') FROM "watermill_%s"`, followTopic)).Scan(&followUps, &distinct); err != nil {
		return err
	}
	fmt.Fprintf(out, "placed %d orders, skipped %d duplicates, relayed %d follow-ups\n\naccount   balance   expected\n", rows, skipped.Load(), followUps)
	mismatch := false
	for _, name := range []string{"alice", "bob", "carol"} {
		var cents int64
		if err := db.QueryRowContext(ctx, `SELECT cents FROM `+accounts+` WHERE name = $1`, name).Scan(&cents); err != nil {
			return err
		}
		fmt.Fprintf(out, "%-8s %8d   %8d\n", name, cents, want[name])
		mismatch = mismatch || cents != want[name]
	}
	if mismatch || rows != len(list) || placed.Load() != int64(len(list)) {
		return fmt.Errorf("balances and orders do not match the %d unique orders", len(list))
	}
	if followUps != len(list) || distinct != len(list) {
		return fmt.Errorf("%d follow-ups (%d distinct) for %d orders", followUps, distinct, len(list))
	}
	fmt.Fprintln(out, "balances match the unique orders: each placed exactly once, its follow-up relayed once")
	return nil
}
