package testenv_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestSubscriberServerIgnoresTransactionsOnPostgresDSN: a transaction left
// open on POSTGRES_DSN's server (as another program's consumer leaves one)
// does not stall watermill-sql's subscriber on PostgresSubscriberDSN's: a
// message published after it began is read. On one server the subscriber
// would read nothing until that transaction ended.
func TestSubscriberServerIgnoresTransactionsOnPostgresDSN(t *testing.T) {
	t.Parallel()
	dsn := testenv.PostgresSubscriberDSN(t)
	if sameServer(t, dsn, testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN)) {
		t.Skip("the watermill-sql subscriber tests share POSTGRES_DSN's server here (no server of their own)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// Another program's transaction, with a transaction id, left open
	// until the test ends.
	shared, err := testenv.Postgres(t).Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := shared.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(); _ = shared.Close() }()
	var xid int64
	if err := tx.QueryRowContext(ctx, `SELECT txid_current()`).Scan(&xid); err != nil {
		t.Fatal(err)
	}

	db := testenv.PostgresForSubscriber(t)
	topic := "bq_test_private_" + testenv.RandomHex(4)
	t.Cleanup(func() {
		_, _ = db.ExecContext(context.Background(), fmt.Sprintf(`DROP TABLE IF EXISTS "watermill_%[1]s", "watermill_offsets_%[1]s"`, topic))
	})
	beginner := wsql.BeginnerFromStdSQL(db)
	logger := watermill.NopLogger{}
	pub, err := wsql.NewPublisher(beginner, wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, AutoInitializeSchema: true}, logger)
	if err != nil {
		t.Fatal(err)
	}
	sub, err := wsql.NewSubscriber(beginner, wsql.SubscriberConfig{
		ConsumerGroup: "private", PollInterval: 20 * time.Millisecond, InitializeSchema: true,
		SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{},
	}, logger)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	if err := sub.SubscribeInitialize(topic); err != nil {
		t.Fatal(err)
	}
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	sent := message.NewMessage(watermill.NewUUID(), []byte(`{"after":"the open transaction"}`))
	if err := pub.Publish(topic, sent); err != nil {
		t.Fatal(err)
	}
	select {
	case msg := <-msgs:
		msg.Ack()
		if msg.UUID != sent.UUID {
			t.Fatalf("read message %s, want %s", msg.UUID, sent.UUID)
		}
	case <-ctx.Done():
		t.Fatalf("the subscriber read nothing in 30 s while transaction %d stayed open on POSTGRES_DSN's server", xid)
	}
}

// sameServer reports whether two DSNs name one PostgreSQL server (host and
// port), whatever their databases.
func sameServer(t *testing.T, a, b string) bool {
	t.Helper()
	ca, err := pgx.ParseConfig(a)
	if err != nil {
		t.Fatal(err)
	}
	cb, err := pgx.ParseConfig(b)
	if err != nil {
		t.Fatal(err)
	}
	return ca.Port == cb.Port && canonicalHost(ca.Host) == canonicalHost(cb.Host)
}

func canonicalHost(h string) string {
	if h == "localhost" || h == "::1" {
		return "127.0.0.1"
	}
	return h
}
