package watermillsql_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency/watermillsql"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
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

func (d *dlqSink) len() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.msgs)
}

// ledgerRun is what consumeLedger saw: handler runs by message number,
// the numbers applied (in the ledger), the dead letters.
type ledgerRun struct {
	runs    map[int]int
	applied map[int]int
	dead    int
}

func (r ledgerRun) totalRuns() int {
	n := 0
	for _, runs := range r.runs {
		n += runs
	}
	return n
}

// ledgerDDL is the ledger's table; extra DDL of a case may follow.
const ledgerDDL = `CREATE TABLE %[1]s (n int PRIMARY KEY)`

// consumeLedger publishes messages 0 to orders-1 on watermill-sql and
// consumes them with the README's transactional wiring on watermill-sql
// (the dead-letter middleware, Retry, CountAttempts and the idempotency
// middleware with WithSubscriberTx). The handler runs first(ctx, db, tx,
// ledger, n, run) and, when it returns no error, inserts n into the ledger.
// It waits up to 20 s for the topic to be consumed, then reports.
func consumeLedger(t *testing.T, orders int, extraDDL string,
	first func(ctx context.Context, db *sql.DB, tx *sql.Tx, ledger string, n, run int) error,
) ledgerRun {
	t.Helper()
	db := testenv.PostgresForSubscriber(t)
	ctx := context.Background()
	suffix := testenv.RandomHex(4)
	topic, ledger := "bq_test_ledger_"+suffix, "ledger_sw_"+suffix
	store, err := postgresstore.New(db, postgresstore.WithTable("idem_sw_"+suffix))
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = db.ExecContext(context.Background(), fmt.Sprintf(`DROP TABLE IF EXISTS %[1]s, %[1]s_child, %[1]s_parent, %[1]s_hot, idem_sw_%[2]s, "watermill_%[3]s", "watermill_offsets_%[3]s"`,
			ledger, suffix, topic))
	})
	if _, err := db.ExecContext(ctx, fmt.Sprintf(ledgerDDL+"; "+extraDDL, ledger)); err != nil {
		t.Fatal(err)
	}

	logger := watermill.NopLogger{}
	beginner := wsql.BeginnerFromStdSQL(db)
	sub, err := wsql.NewSubscriber(beginner, wsql.SubscriberConfig{
		ConsumerGroup: "ledger", PollInterval: 20 * time.Millisecond, ResendInterval: 20 * time.Millisecond,
		RetryInterval: 20 * time.Millisecond,
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
	var mu sync.Mutex
	runs := map[int]int{}
	router.AddMiddleware(
		dl,
		middleware.Retry{MaxRetries: 2, InitialInterval: 5 * time.Millisecond,
			ShouldRetry: func(p middleware.RetryParams) bool { return !idempotency.IsPermanent(p.Err) }}.Middleware,
		deadletter.CountAttempts,
		idempotency.Middleware(store, idempotency.WithTransaction(db), idempotency.WithSubscriberTx(watermillsql.Tx)),
	)
	router.AddConsumerHandler("apply", topic, sub, func(msg *message.Message) error {
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
		mu.Lock()
		runs[n]++
		run := runs[n]
		mu.Unlock()
		if err := first(msg.Context(), db, tx, ledger, n, run); err != nil {
			return err
		}
		_, err = tx.ExecContext(msg.Context(), `INSERT INTO `+ledger+` VALUES ($1)`, n)
		return err
	})
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- router.Run(runCtx) }()
	t.Cleanup(func() { cancel(); <-done })
	<-router.Running()

	for i := range orders {
		e, _ := envelope.New("urn:babel:orders:created", map[string]any{"n": i})
		payload, _ := e.Marshal()
		if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(20 * time.Second)
	for !testenv.SQLTopicDrained(ctx, db, topic, "ledger") && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond) // a late run would show now
	r := ledgerRun{applied: map[int]int{}, dead: dlq.len()}
	rows, err := db.QueryContext(ctx, `SELECT n, count(*) FROM `+ledger+` GROUP BY n`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var n, c int
		if err := rows.Scan(&n, &c); err != nil {
			t.Fatal(err)
		}
		r.applied[n] = c
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	r.runs = runs
	mu.Unlock()
	if !testenv.SQLTopicDrained(ctx, db, topic, "ledger") {
		t.Errorf("subscriber wedged: after 20 s, %d handler runs (%v by message), applied %v, %d dead letters",
			r.totalRuns(), r.runs, r.applied, r.dead)
	}
	return r
}

// wantOneDeadLetter asserts the outcome of a message 0 that fails for good:
// dead-lettered once, every later message applied once.
func wantOneDeadLetter(t *testing.T, r ledgerRun, orders int) {
	t.Helper()
	later := 0
	for n := 1; n < orders; n++ {
		if r.applied[n] == 1 {
			later++
		}
	}
	if later != orders-1 || r.applied[0] != 0 || r.dead != 1 {
		t.Fatalf("%d of %d later messages applied once, message 0 applied %d times, %d dead letters (%d handler runs); want all later ones applied and message 0 dead-lettered",
			later, orders-1, r.applied[0], r.dead, r.totalRuns())
	}
}

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
	t.Parallel()
	const orders = 4
	r := consumeLedger(t, orders, "", func(ctx context.Context, _ *sql.DB, tx *sql.Tx, _ string, n, _ int) error {
		if n == 0 {
			_, _ = tx.ExecContext(ctx, `SELECT 1/0`) // fails; the handler ignores it
		}
		return nil
	})
	wantOneDeadLetter(t, r, orders)
}

// TestDeferredViolationDoesNotWedgeTheSubscriber: under WithSubscriberTx a
// handler's write violates a DEFERRABLE INITIALLY DEFERRED foreign key.
// Nothing fails until a COMMIT checks it, and watermill-sql commits a whole
// batch after the router acked it: the batch would roll back and be read
// again, the handler run again, for ever, the messages behind it never
// consumed. The attempt must check its deferred constraints in its own
// savepoint and fail there, as the handler's own failure: retried, then
// dead-lettered, and the messages behind it consumed.
func TestDeferredViolationDoesNotWedgeTheSubscriber(t *testing.T) {
	t.Parallel()
	const orders = 4
	r := consumeLedger(t, orders, `CREATE TABLE %[1]s_parent (id int PRIMARY KEY);
		CREATE TABLE %[1]s_child (parent int REFERENCES %[1]s_parent DEFERRABLE INITIALLY DEFERRED)`,
		func(ctx context.Context, _ *sql.DB, tx *sql.Tx, ledger string, n, _ int) error {
			if n != 0 {
				return nil
			}
			_, err := tx.ExecContext(ctx, `INSERT INTO `+ledger+`_child VALUES (42)`) // no parent 42: only a check of deferred constraints sees it
			return err
		})
	wantOneDeadLetter(t, r, orders)
	if runs := r.runs[0]; runs != 3 {
		t.Fatalf("message 0 ran %d times; want 3 (Retry's), then the dead letter", runs)
	}
}

// TestSerializationFailureIsReadAgainInAFreshTransaction: watermill-sql
// consumes in a REPEATABLE READ transaction. Message 0's first run updates
// a row that another transaction updated and committed since the
// snapshot: a serialization failure (40001). Run again in the same
// snapshot (Retry, or watermill-sql resending a nacked message in the same
// transaction) it can only fail again. It must be transient, never
// dead-lettered, and the consuming transaction rolled back so that the
// message is read again in a fresh one, where it runs once more and
// applies: two runs for message 0, one for every other, each applied once.
func TestSerializationFailureIsReadAgainInAFreshTransaction(t *testing.T) {
	t.Parallel()
	const orders = 4
	r := consumeLedger(t, orders, `CREATE TABLE %[1]s_hot (v int NOT NULL); INSERT INTO %[1]s_hot VALUES (0)`,
		func(ctx context.Context, db *sql.DB, tx *sql.Tx, ledger string, n, run int) error {
			if n == 0 && run == 1 {
				// Another transaction updates the row after the snapshot.
				if _, err := db.ExecContext(ctx, `UPDATE `+ledger+`_hot SET v = v + 1`); err != nil {
					return err
				}
			}
			_, err := tx.ExecContext(ctx, `UPDATE `+ledger+`_hot SET v = v + 1`)
			return err
		})
	for n := range orders {
		if r.applied[n] != 1 {
			t.Errorf("message %d applied %d times, want once", n, r.applied[n])
		}
	}
	if r.dead != 0 || r.runs[0] != 2 || r.totalRuns() != orders+1 {
		t.Fatalf("%d dead letters, message 0 ran %d times, %d runs in all (%v); want no dead letter, 2 runs for message 0 (the conflicting one and one in a fresh transaction), %d in all",
			r.dead, r.runs[0], r.totalRuns(), r.runs, orders+1)
	}
}
