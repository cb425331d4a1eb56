package watermillsql_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/internal/testenv"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency/watermillsql"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
)

type dlqSink struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (d *dlqSink) Publish(_ string, msgs ...*message.Message) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.msgs = append(d.msgs, msgs...)
	return nil
}

func (*dlqSink) Close() error { return nil }

// TestSwallowedStatementErrorDoesNotWedgeTheSubscriber: under
// WithSubscriberTx a handler runs a statement that fails and ignores the
// error (a common "duplicate key means done" idiom). In PostgreSQL that
// aborts the subscriber's transaction: the attempt cannot commit. The
// attempt must be rolled back to its savepoint and fail as the handler's
// own failure, so Retry and the dead-letter middleware deal with it and the
// messages behind it are consumed. It must not be reported as a transient
// store failure on a transaction left aborted, which watermill-sql then
// resends in that same dead transaction for ever.
func TestSwallowedStatementErrorDoesNotWedgeTheSubscriber(t *testing.T) {
	db := testenv.Postgres(t)
	ctx := context.Background()
	suffix := testenv.RandomHex(4)
	topic, ledger := "bq_test_swallow_"+suffix, "ledger_sw_"+suffix
	store, err := postgresstore.New(db, postgresstore.WithTable("idem_sw_"+suffix))
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE `+ledger+` (n int PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = db.ExecContext(context.Background(), fmt.Sprintf(`DROP TABLE IF EXISTS %s, idem_sw_%s, "watermill_%s", "watermill_offsets_%s"`, ledger, suffix, topic, topic))
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
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	dlq := &dlqSink{}
	dl, err := deadletter.Middleware(dlq)
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	router.AddMiddleware(
		dl,
		middleware.Retry{MaxRetries: 2, InitialInterval: 5 * time.Millisecond,
			ShouldRetry: func(p middleware.RetryParams) bool { return !idempotency.IsPermanent(p.Err) }}.Middleware,
		deadletter.CountAttempts,
		idempotency.Middleware(store, idempotency.WithTransaction(db), idempotency.WithSubscriberTx(watermillsql.Tx)),
	)
	router.AddConsumerHandler("apply", topic, sub, func(msg *message.Message) error {
		runs.Add(1)
		tx, _ := postgresstore.TxFromContext(msg.Context())
		e, err := envelope.Parse(msg.Payload)
		if err != nil {
			return err
		}
		var data struct{ N int }
		if err := json.Unmarshal(e.Data, &data); err != nil {
			return err
		}
		n := data.N
		if n == 0 {
			_, _ = tx.ExecContext(msg.Context(), `SELECT 1/0`) // fails; the handler ignores it
			return nil
		}
		_, err = tx.ExecContext(msg.Context(), `INSERT INTO `+ledger+` VALUES ($1)`, n)
		return err
	})
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- router.Run(runCtx) }()
	t.Cleanup(func() { cancel(); <-done })
	<-router.Running()

	const orders = 4
	for i := range orders {
		e, _ := envelope.New("urn:babel:orders:created", map[string]any{"n": i})
		payload, _ := e.Marshal()
		if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(20 * time.Second)
	for !testenv.SQLTopicDrained(ctx, db, topic, "ledger") {
		if time.Now().After(deadline) {
			var applied int
			_ = db.QueryRowContext(ctx, `SELECT count(*) FROM `+ledger).Scan(&applied)
			t.Fatalf("subscriber wedged: after 20 s, %d handler runs, %d of %d later messages applied, %d dead letters",
				runs.Load(), applied, orders-1, len(dlq.msgs))
		}
		time.Sleep(20 * time.Millisecond)
	}
	var applied int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM `+ledger).Scan(&applied); err != nil {
		t.Fatal(err)
	}
	dlq.mu.Lock()
	dead := len(dlq.msgs)
	dlq.mu.Unlock()
	if applied != orders-1 || dead != 1 {
		t.Fatalf("%d of %d later messages applied, %d dead letters; want all applied and the failing one dead-lettered", applied, orders-1, dead)
	}
}
