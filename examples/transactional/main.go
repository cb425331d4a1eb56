// Command transactional keeps account balances with the transactional inbox:
// the consumption of each transfer message, the balance update and the
// message's idempotency record commit in one PostgreSQL transaction, so a
// crash at any moment can neither lose a transfer nor apply one twice.
// PostgreSQL is the only service: it is the message broker too, through
// watermill-sql.
//
//	docker compose up -d postgres   # or any PostgreSQL 14+; POSTGRES_DSN overrides
//	go run ./examples/transactional
//
// It publishes transfers, some of them two or three times, prints the final
// balances and checks them against the unique transfers, and exits 0 when
// they match.
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

// transfer moves cents from one account to another.
type transfer struct {
	From  string `json:"from"`
	To    string `json:"to"`
	Cents int64  `json:"cents"`
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
	topic, accounts := "transfers_"+run, "example_accounts_"+run
	defer db.ExecContext(context.WithoutCancel(ctx), fmt.Sprintf( //nolint:errcheck
		`DROP TABLE IF EXISTS %s, example_idempotency_%s, "watermill_%s", "watermill_offsets_%s"`, accounts, run, topic, topic))

	// 1. The business table, and the idempotency records beside it.
	if _, err := db.ExecContext(ctx, `CREATE TABLE `+accounts+` (name text PRIMARY KEY, cents bigint NOT NULL);
		INSERT INTO `+accounts+` VALUES ('alice', 10000), ('bob', 10000), ('carol', 10000)`); err != nil {
		return err
	}
	store, err := postgresstore.New(db, postgresstore.WithTable("example_idempotency_"+run))
	if err != nil {
		return err
	}
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
		ConsumerGroup: "ledger", PollInterval: 20 * time.Millisecond,
		SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{}, InitializeSchema: true,
	}, logger)
	if err != nil {
		return err
	}

	// 3. The transactional inbox: the record goes into the subscriber's own
	//    transaction, next to the handler's writes.
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		return err
	}
	var applied, skipped atomic.Int64
	router.AddMiddleware(idempotency.Middleware(store,
		idempotency.WithTransaction(db), idempotency.WithSubscriberTx(watermillsql.Tx),
		idempotency.WithObserver(idempotency.ObserverFunc(func(_ context.Context, e idempotency.Event) {
			if e.Outcome == idempotency.OutcomeSkip {
				skipped.Add(1)
			}
		}))))

	// 4. The handler writes through the transaction it finds in its context.
	router.AddConsumerHandler("apply-transfer", topic, sub, func(msg *message.Message) error {
		tx, ok := postgresstore.TxFromContext(msg.Context())
		if !ok {
			return errors.New("no transaction: is the middleware in transactional mode?")
		}
		e, err := envelope.Parse(msg.Payload)
		if err != nil {
			return err
		}
		var t transfer
		if err := json.Unmarshal(e.Data, &t); err != nil {
			return err
		}
		for name, delta := range map[string]int64{t.From: -t.Cents, t.To: t.Cents} {
			if _, err := tx.ExecContext(msg.Context(), `UPDATE `+accounts+` SET cents = cents + $1 WHERE name = $2`, delta, name); err != nil {
				return err
			}
		}
		applied.Add(1)
		return nil
	})
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(runCtx) }()
	<-router.Running()

	// 5. Publish transfers; every third one two or three times.
	transfers := []transfer{
		{"alice", "bob", 2500}, {"bob", "carol", 1200}, {"carol", "alice", 300}, {"alice", "carol", 4100},
		{"bob", "alice", 999}, {"carol", "bob", 50}, {"alice", "bob", 1}, {"bob", "carol", 7000},
	}
	want := map[string]int64{"alice": 10000, "bob": 10000, "carol": 10000}
	deliveries := 0
	for i, t := range transfers {
		e, err := envelope.New("urn:babel:ledger:transfer", t, envelope.WithQueue(topic))
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
			if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
				return err
			}
			deliveries++
		}
		want[t.From] -= t.Cents
		want[t.To] += t.Cents
	}
	fmt.Fprintf(out, "published %d transfers as %d messages\n", len(transfers), deliveries)

	// 6. Wait until the subscriber has committed every message (it commits
	//    each transaction after the router's ack), then compare.
	for {
		var drained bool
		err := db.QueryRowContext(ctx, fmt.Sprintf(`SELECT coalesce((SELECT offset_acked FROM "watermill_offsets_%s" WHERE consumer_group = 'ledger'), 0)
			>= (SELECT max("offset") FROM "watermill_%s")`, topic, topic)).Scan(&drained)
		if err == nil && drained {
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("only %d of %d messages consumed: %w", applied.Load()+skipped.Load(), deliveries, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
	stop()
	if err := <-routerDone; err != nil {
		return err
	}
	fmt.Fprintf(out, "applied %d transfers, skipped %d duplicates\n\naccount   balance   expected\n", applied.Load(), skipped.Load())
	mismatch := false
	for _, name := range []string{"alice", "bob", "carol"} {
		var cents int64
		if err := db.QueryRowContext(ctx, `SELECT cents FROM `+accounts+` WHERE name = $1`, name).Scan(&cents); err != nil {
			return err
		}
		fmt.Fprintf(out, "%-8s %8d   %8d\n", name, cents, want[name])
		mismatch = mismatch || cents != want[name]
	}
	if mismatch || applied.Load() != int64(len(transfers)) {
		return fmt.Errorf("balances do not match the %d unique transfers", len(transfers))
	}
	fmt.Fprintln(out, "balances match the unique transfers: each applied exactly once")
	return nil
}
