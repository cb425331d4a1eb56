// Package crashtest proves the transactional inbox under process death: a
// consumer process applies a ledger of 5,000 messages (a fifth of them
// published twice) and is killed with SIGKILL at random moments, at least 10
// times, and restarted until its topic is drained. With the transactional
// mode the ledger must then equal the sum over unique messages exactly.
//
// The test binary is also the consumer: the parent runs it again with
// CRASHTEST_ROLE=consumer (TestConsumerProcess).
package crashtest

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency/watermillsql"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// The consumer modes.
const (
	streamsTx    = "streams-tx"    // Redis Streams, transactional store
	sqlTx        = "sql-tx"        // watermill-sql subscriber, its own transaction reused
	streamsPlain = "streams-plain" // Redis Streams, plain PostgreSQL store (the window shown)
	streamsClaim = "streams-claim" // Redis Streams, Redis store with WithClaim
	// Redis Streams, the default lease, a handler that never ends on the
	// consumer named "doomed" (handover_test.go), on each store.
	handoverRedis    = "handover-redis"
	handoverPostgres = "handover-postgres"
	handoverTxClaims = "handover-txclaims" // postgresstore WithTransactionClaims (attack_txclaims_test.go)
	handoverSession  = "handover-session"  // postgresstore WithSessionClaims
)

const minKills = 10

func TestCrashRedisStreamsTransactional(t *testing.T) { crash(t, streamsTx, true, false) }
func TestCrashWatermillSQLTransactional(t *testing.T) { crash(t, sqlTx, true, false) }

// TestWorkerDeathWithClaims: a worker is SIGKILLed again and again while it
// holds claims; a second worker in the group runs throughout. The dead
// worker's claims lapse after their lease, the other worker takes its
// pending messages, and nothing is lost. (With the plain Redis store, a kill
// between an effect and its record can still repeat that effect: reported,
// not asserted.)
func TestWorkerDeathWithClaims(t *testing.T) { crash(t, streamsClaim, false, true) }

// TestWorkerDeathTransactional: the same with the transactional store, which
// also repeats no effect.
func TestWorkerDeathTransactional(t *testing.T) { crash(t, streamsTx, true, true) }

// TestCrashRedisStreamsPlainStore is the demonstration of the window that
// the transactional mode closes: the effect commits, the process dies before
// the record is written, and the redelivery applies the effect again. It
// reports what happened and asserts only that nothing was lost.
func TestCrashRedisStreamsPlainStore(t *testing.T) { crash(t, streamsPlain, false, false) }

type setup struct {
	mode, topic, group, ledger, store string
	messages                          int
	// dsn is the consumers' POSTGRES_DSN, when not the test's own.
	dsn string
}

// createTables creates the setup's ledger, with ledgerColumns, and the
// table of its idempotency store (postgresstore, migrated), and drops both
// when t ends.
func (s setup) createTables(t *testing.T, db *sql.DB, ledgerColumns string) {
	t.Helper()
	ctx := context.Background()
	if _, err := db.ExecContext(ctx, `CREATE TABLE `+s.ledger+` (`+ledgerColumns+`)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = db.ExecContext(context.Background(), fmt.Sprintf(`DROP TABLE IF EXISTS %s, %s`, s.ledger, s.store))
	})
	store, err := postgresstore.New(db, postgresstore.WithTable(s.store))
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
}

func (s setup) env(consumer string) []string {
	env := os.Environ()
	if s.dsn != "" {
		env = append(env, "POSTGRES_DSN="+s.dsn) // the last value of a name wins
	}
	return append(env, "CRASHTEST_ROLE=consumer", "CRASHTEST_MODE="+s.mode, "CRASHTEST_TOPIC="+s.topic,
		"CRASHTEST_GROUP="+s.group, "CRASHTEST_LEDGER="+s.ledger, "CRASHTEST_STORE="+s.store, "CRASHTEST_CONSUMER="+consumer)
}

func (s setup) consumer(name string, logs *bytes.Buffer) *exec.Cmd {
	cmd := exec.Command(os.Args[0], "-test.run=^TestConsumerProcess$", "-test.count=1", "-test.v")
	cmd.Env = s.env(name)
	cmd.Stdout, cmd.Stderr = logs, logs
	return cmd
}

// crash runs the scenario for mode; exact asserts that no effect repeated;
// stableWorker adds a second consumer that is never killed.
func crash(t *testing.T, mode string, exact, stableWorker bool) {
	if testing.Short() {
		t.Skip("kills and restarts consumer processes for about half a minute")
	}
	t.Parallel()
	ctx := context.Background()
	suffix := testenv.RandomHex(4)
	s := setup{mode: mode, topic: "bq_crash_" + suffix, group: "ledger", ledger: "crash_ledger_" + suffix, store: "crash_idem_" + suffix, messages: 5000}
	var db *sql.DB
	var rdb *redis.Client
	if mode == sqlTx {
		// watermill-sql's subscriber: on the server of its own, for the
		// consumers too.
		s.dsn = testenv.PostgresSubscriberDSN(t)
		db = testenv.PostgresForSubscriber(t)
	} else {
		db = testenv.Postgres(t)
		rdb = testenv.Redis(t)
	}
	if mode == streamsClaim {
		s.messages = 1000 // each effect takes 5ms, so that kills land while claims are held
	}
	s.createTables(t, db, `message_id text NOT NULL, amount bigint NOT NULL`)
	t.Cleanup(func() {
		_, _ = db.ExecContext(context.Background(), fmt.Sprintf(`DROP TABLE IF EXISTS "watermill_%s", "watermill_offsets_%s"`, s.topic, s.topic))
		if rdb != nil {
			rdb.Del(context.Background(), s.topic)
			// The workers' redisstore records (streamsClaim): the prefix is
			// the store name's last 8 characters.
			_ = testenv.DropKeys(context.Background(), rdb, s.store[len(s.store)-8:]+":*")
		}
	})

	entries, want := publish(t, s, db, rdb)
	drained := func() bool {
		if mode == sqlTx {
			return testenv.SQLTopicDrained(ctx, db, s.topic, s.group)
		}
		return testenv.StreamDrained(ctx, rdb, s.topic, s.group, entries)
	}

	// Kill the consumer at random moments, then let one finish the work.
	var logs, stableLogs bytes.Buffer
	kills := 0
	if stableWorker {
		stable := s.consumer("stable", &stableLogs)
		if err := stable.Start(); err != nil {
			t.Fatal(err)
		}
		defer func() {
			_ = stable.Process.Signal(syscall.SIGTERM)
			_ = stable.Wait()
		}()
	}
	deadline := time.Now().Add(4 * time.Minute)
	for kills < minKills || !drained() {
		if time.Now().After(deadline) {
			t.Fatalf("not drained after %d kills; consumer output:\n%s", kills, tail(logs.Bytes()))
		}
		cmd := s.consumer("consumer", &logs)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		if kills < minKills {
			time.Sleep(time.Duration(150+mrand.IntN(350)) * time.Millisecond)
			_ = cmd.Process.Signal(syscall.SIGKILL)
			_ = cmd.Wait()
			kills++
			continue
		}
		for !drained() && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
		}
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	}

	var sum, rows, distinct int64
	if err := db.QueryRowContext(ctx, `SELECT coalesce(sum(amount), 0), count(*), count(DISTINCT message_id) FROM `+s.ledger).Scan(&sum, &rows, &distinct); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s (stable worker: %v): %d messages as %d entries, %d SIGKILLs; ledger: %d entries for %d messages, total %d (exact total %d, %d applied twice)",
		mode, stableWorker, s.messages, entries, kills, rows, distinct, sum, want, rows-distinct)
	if distinct != int64(s.messages) {
		t.Fatalf("%d of %d messages reached the ledger: messages were lost", distinct, s.messages)
	}
	if exact && (sum != want || rows != int64(s.messages)) {
		t.Fatalf("ledger total %d over %d entries, want exactly %d over %d", sum, rows, want, s.messages)
	}
}

// publish sends every message once and a fifth of them twice; it returns
// the number of entries and the exact ledger total.
func publish(t *testing.T, s setup, db *sql.DB, rdb *redis.Client) (entries int, total int64) {
	t.Helper()
	logger := watermill.NopLogger{}
	var pub message.Publisher
	var err error
	if s.mode == sqlTx {
		pub, err = wsql.NewPublisher(wsql.BeginnerFromStdSQL(db), wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, AutoInitializeSchema: true}, logger)
	} else {
		pub, err = redisstream.NewPublisher(redisstream.PublisherConfig{Client: rdb}, logger)
	}
	if err != nil {
		t.Fatal(err)
	}
	var batch []*message.Message
	flush := func() {
		if len(batch) == 0 {
			return
		}
		if err := pub.Publish(s.topic, batch...); err != nil {
			t.Fatal(err)
		}
		batch = batch[:0]
	}
	for i := range s.messages {
		amount := int64(i + 1)
		total += amount
		e, err := envelope.New("urn:babel:ledger:credit", map[string]any{"amount": amount})
		if err != nil {
			t.Fatal(err)
		}
		payload, _ := e.Marshal()
		copies := 1
		if i%5 == 0 {
			copies = 2
		}
		for range copies {
			batch = append(batch, message.NewMessage(watermill.NewUUID(), payload))
			entries++
		}
		if len(batch) >= 200 {
			flush()
		}
	}
	flush()
	return entries, total
}

func tail(b []byte) string {
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

// TestConsumerProcess is the consumer the crash tests kill; it only runs as
// their child (CRASHTEST_ROLE consumer, or kafka-consumer for the Kafka
// test).
func TestConsumerProcess(t *testing.T) {
	run := map[string]func(context.Context) error{"consumer": consume, "kafka-consumer": consumeKafka}[os.Getenv("CRASHTEST_ROLE")]
	if run == nil {
		t.Skip("the crash tests' consumer process")
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	if err := run(ctx); err != nil {
		t.Fatal(err)
	}
}

func consume(ctx context.Context) error {
	mode, topic, group, ledger := os.Getenv("CRASHTEST_MODE"), os.Getenv("CRASHTEST_TOPIC"), os.Getenv("CRASHTEST_GROUP"), os.Getenv("CRASHTEST_LEDGER")
	db, store, err := openStore()
	if err != nil {
		return err
	}
	defer db.Close()
	logger := watermill.NopLogger{}

	var sub message.Subscriber
	var guard message.HandlerMiddleware
	opts := []idempotency.Option{idempotency.WithTransaction(db)}
	switch mode {
	case sqlTx:
		sub, err = wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db), wsql.SubscriberConfig{
			ConsumerGroup: group, PollInterval: 10 * time.Millisecond, ResendInterval: 10 * time.Millisecond,
			SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{}, InitializeSchema: true,
		}, logger)
		opts = append(opts, idempotency.WithSubscriberTx(watermillsql.Tx))
	case handoverRedis, handoverPostgres, handoverTxClaims, handoverSession:
		return handover(ctx, db, store)
	case chaosTx, chaosRedis, chaosPostgres, chaosTxClaims, chaosSession:
		return chaosConsume(ctx, db, store)
	case streamsTx, streamsPlain, streamsClaim:
		if mode != streamsTx {
			opts = nil
		}
		redisOpts, perr := redis.ParseURL(testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL))
		if perr != nil {
			return perr
		}
		rdb := redis.NewClient(redisOpts)
		defer rdb.Close()
		if mode == streamsClaim {
			// The store is Redis; the claim's lease is short so that a dead
			// worker's claims lapse quickly.
			rstore := redisstore.New(rdb, redisstore.WithPrefix(os.Getenv("CRASHTEST_STORE")[len(os.Getenv("CRASHTEST_STORE"))-8:]+":"),
				redisstore.WithTTL(time.Hour))
			guard = idempotency.Middleware(rstore, idempotency.WithClaim(time.Second))
		}
		sub, err = redisstream.NewSubscriber(redisstream.SubscriberConfig{
			Client: redis.NewClient(redisOpts), ConsumerGroup: group, Consumer: os.Getenv("CRASHTEST_CONSUMER"), OldestId: "0",
			BlockTime: 100 * time.Millisecond, DisableIndefiniteInitialBlock: true,
			ClaimInterval: 100 * time.Millisecond, MaxIdleTime: 500 * time.Millisecond,
		}, logger)
	default:
		return fmt.Errorf("unknown mode %q", mode)
	}
	if err != nil {
		return err
	}

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		return err
	}
	if guard == nil {
		guard = idempotency.Middleware(store, opts...)
	}
	router.AddMiddleware(guard)
	router.AddConsumerHandler("ledger", topic, sub, func(msg *message.Message) error {
		id, amount, err := credit(msg)
		if err != nil {
			return err
		}
		exec := func(q string, args ...any) error { _, err := db.ExecContext(msg.Context(), q, args...); return err }
		if tx, ok := postgresstore.TxFromContext(msg.Context()); ok {
			exec = func(q string, args ...any) error { _, err := tx.ExecContext(msg.Context(), q, args...); return err }
		} else if mode == streamsTx || mode == sqlTx {
			return fmt.Errorf("no transaction in a transactional mode")
		}
		if mode == streamsClaim {
			time.Sleep(5 * time.Millisecond) // a slow effect: kills land while claims are held
		}
		return exec(`INSERT INTO `+ledger+` (message_id, amount) VALUES ($1, $2)`, id, strconv.FormatInt(amount, 10))
	})
	return router.Run(ctx)
}

// openStore opens the consumer's database and the idempotency store the
// parent created (CRASHTEST_STORE).
func openStore() (*sql.DB, *postgresstore.Store, error) {
	db, err := sql.Open("pgx", withApplicationName(testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN), os.Getenv("CRASHTEST_APPNAME")))
	if err != nil {
		return nil, nil, err
	}
	store, err := postgresstore.New(db, postgresstore.WithTable(os.Getenv("CRASHTEST_STORE")))
	if err != nil {
		_ = db.Close()
		return nil, nil, err
	}
	return db, store, nil
}

// credit reads the ledger credit a message carries: its meta.id and amount.
func credit(msg *message.Message) (id string, amount int64, err error) {
	e, err := envelope.Parse(msg.Payload)
	if err != nil {
		return "", 0, err
	}
	var data struct{ Amount int64 }
	if err := json.Unmarshal(e.Data, &data); err != nil {
		return "", 0, err
	}
	return e.Meta.ID, data.Amount, nil
}
