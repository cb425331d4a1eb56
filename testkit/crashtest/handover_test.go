package crashtest

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// handoverWithin is the promise: a message whose consumer was SIGKILLed
// mid-handler runs on another consumer within it, with the default lease
// and a broker that hands the message on within about a second.
const handoverWithin = 10 * time.Second

// TestKilledHoldersMessageRunsElsewhereRedis and ...Postgres: a consumer
// holding a message's claim (its handler never ends) is SIGKILLed; the
// other consumer, which has been parking its redeliveries meanwhile, runs
// the message within handoverWithin of the kill. The claim, no longer
// renewed, lapses within the default lease.
func TestKilledHoldersMessageRunsElsewhereRedis(t *testing.T) { handoverAfterKill(t, handoverRedis) }

func TestKilledHoldersMessageRunsElsewherePostgres(t *testing.T) {
	handoverAfterKill(t, handoverPostgres)
}

func handoverAfterKill(t *testing.T, mode string) {
	if testing.Short() {
		t.Skip("kills a consumer process and waits for the handover")
	}
	t.Parallel()
	s, runs := handoverSetup(t, mode, "handover")

	var doomedLogs, survivorLogs bytes.Buffer
	doomed := s.consumer("doomed", &doomedLogs)
	if err := doomed.Start(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the doomed consumer to start the handler", time.Minute, func() bool { return runs("doomed") == 1 })
	survivor := s.consumer("survivor", &survivorLogs)
	if err := survivor.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = survivor.Process.Signal(syscall.SIGTERM)
		_ = survivor.Wait()
	}()
	// The survivor gets the idle entry, finds the claim renewed, parks it:
	// for two leases nothing runs there.
	time.Sleep(2 * idempotency.DefaultLease)
	if runs("survivor") != 0 {
		t.Fatalf("the survivor ran the message while its holder was alive and renewing its claim:\n%s", tail(survivorLogs.Bytes()))
	}
	killed := time.Now()
	_ = doomed.Process.Signal(syscall.SIGKILL)
	_ = doomed.Wait()
	waitFor(t, "the survivor to run the message", time.Minute, func() bool { return runs("survivor") == 1 })
	took := time.Since(killed)
	t.Logf("%s: the message ran on the survivor %v after its holder was SIGKILLed (default lease %v)", mode, took.Round(10*time.Millisecond), idempotency.DefaultLease)
	if took > handoverWithin {
		t.Fatalf("the message ran elsewhere %v after its holder died, want within %v; survivor:\n%s", took, handoverWithin, tail(survivorLogs.Bytes()))
	}
}

// TestPausedHolderFindsItsClaimLost: the holder of a message's claim is
// paused (SIGSTOP) for longer than the lease; the other consumer runs the
// message meanwhile. Resumed (SIGCONT), the paused holder's next renewal
// asks the store, which no longer holds its claim: its handler's context
// ends with ErrClaimLost. The message ran once on the survivor.
func TestPausedHolderFindsItsClaimLost(t *testing.T) { pausedHolder(t, handoverRedis, "paused") }

// TestPausedTxClaimHolderFindsItsClaimLost is the same with postgresstore
// WithTransactionClaims: the paused holder's claim transaction ends on the
// server (idle_in_transaction_session_timeout), the other consumer runs
// the message, the resumed holder's handler context ends with its claim
// lost, and the table holds one record.
func TestPausedTxClaimHolderFindsItsClaimLost(t *testing.T) {
	pausedHolder(t, handoverTxClaims, "pausedtx")
}

// TestPausedSessionClaimHolderFindsItsClaimLost is the same with
// postgresstore WithSessionClaims: the paused holder's session ends on the
// server (idle_session_timeout, the lease), its advisory lock with it, the
// other consumer runs the message, the resumed holder's handler context
// ends with its claim lost, and the table holds one record.
func TestPausedSessionClaimHolderFindsItsClaimLost(t *testing.T) {
	pausedHolder(t, handoverSession, "pausedsess")
}

func pausedHolder(t *testing.T, mode, name string) {
	if testing.Short() {
		t.Skip("pauses a consumer process past its lease")
	}
	t.Parallel()
	s, runs := handoverSetup(t, mode, name)
	var doomedLogs, survivorLogs bytes.Buffer
	doomed := s.consumer("doomed", &doomedLogs)
	if err := doomed.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = doomed.Process.Signal(syscall.SIGCONT)
		_ = doomed.Process.Signal(syscall.SIGTERM)
		_ = doomed.Wait()
	}()
	waitFor(t, "the holder to start the handler", time.Minute, func() bool { return runs("doomed") == 1 })
	survivor := s.consumer("survivor", &survivorLogs)
	if err := survivor.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = survivor.Process.Signal(syscall.SIGTERM)
		_ = survivor.Wait()
	}()
	if err := doomed.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the survivor to run the message while the holder is paused", 2*time.Minute, func() bool { return runs("survivor") == 1 })
	if err := doomed.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the resumed holder's handler to see its claim lost", time.Minute, func() bool { return runs("doomed, claim lost") == 1 })
	if n := runs("survivor") + runs("doomed"); n != 2 {
		t.Fatalf("%d runs, want the holder's (cancelled) and the survivor's\ndoomed:\n%s\nsurvivor:\n%s", n, doomedLogs.String(), survivorLogs.String())
	}
	if mode != handoverTxClaims && mode != handoverSession {
		return
	}
	var records int
	db := testenv.Postgres(t)
	if err := db.QueryRowContext(context.Background(), `SELECT count(*) FROM `+s.store).Scan(&records); err != nil || records != 1 {
		t.Fatalf("%d records (%v), want 1", records, err)
	}
}

// handoverSetup makes the ledger of runs and the store table of a handover
// test in mode (dropped when it ends), publishes one message on the
// setup's topic, and returns the setup and how many runs a consumer noted.
func handoverSetup(t *testing.T, mode, name string) (setup, func(consumer string) int) {
	t.Helper()
	db := testenv.Postgres(t)
	rdb := testenv.Redis(t)
	ctx := context.Background()
	suffix := testenv.RandomHex(4)
	s := setup{mode: mode, topic: "bq_" + name + "_" + suffix, group: "handover", ledger: name + "_runs_" + suffix, store: name + "_idem_" + suffix}
	s.createTables(t, db, `consumer text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp()`)
	t.Cleanup(func() {
		rdb.Del(context.Background(), s.topic)
		_ = testenv.DropKeys(context.Background(), rdb, s.store[len(s.store)-8:]+":*")
	})
	e, err := envelope.New("urn:babel:ledger:credit", map[string]any{"amount": 1})
	if err != nil {
		t.Fatal(err)
	}
	payload, _ := e.Marshal()
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: rdb}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(s.topic, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
		t.Fatal(err)
	}
	return s, func(consumer string) (n int) {
		_ = db.QueryRowContext(ctx, `SELECT count(*) FROM `+s.ledger+` WHERE consumer = $1`, consumer).Scan(&n)
		return n
	}
}

// waitFor polls cond until it holds, failing t after within.
func waitFor(t *testing.T, what string, within time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", within, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// handover is the consumer of the handover tests: the kit with the default
// lease on the mode's store; the handler notes its run and, on the doomed
// consumer, never ends.
func handover(ctx context.Context, db *sql.DB, pgStore *postgresstore.Store) error {
	consumer, ledger := os.Getenv("CRASHTEST_CONSUMER"), os.Getenv("CRASHTEST_LEDGER")
	redisOpts, err := redis.ParseURL(testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL))
	if err != nil {
		return err
	}
	rdb := redis.NewClient(redisOpts)
	defer rdb.Close()
	var store stores.Store = pgStore
	if os.Getenv("CRASHTEST_MODE") == handoverRedis {
		name := os.Getenv("CRASHTEST_STORE")
		store = redisstore.New(rdb, redisstore.WithPrefix(name[len(name)-8:]+":"))
	}
	if os.Getenv("CRASHTEST_MODE") == handoverTxClaims {
		txStore, err := postgresstore.New(db, postgresstore.WithTable(os.Getenv("CRASHTEST_STORE")), postgresstore.WithTransactionClaims())
		if err != nil {
			return err
		}
		store = txStore
	}
	if os.Getenv("CRASHTEST_MODE") == handoverSession {
		sessStore, err := postgresstore.New(db, postgresstore.WithTable(os.Getenv("CRASHTEST_STORE")), postgresstore.WithSessionClaims())
		if err != nil {
			return err
		}
		defer func() { _ = sessStore.ReleaseAll(context.Background()) }()
		store = sessStore
	}
	sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
		Client: redis.NewClient(redisOpts), ConsumerGroup: os.Getenv("CRASHTEST_GROUP"), Consumer: consumer, OldestId: "0",
		BlockTime: 100 * time.Millisecond, DisableIndefiniteInitialBlock: true,
		ClaimInterval: 100 * time.Millisecond, MaxIdleTime: time.Second,
	}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	router.AddMiddleware(idempotency.Middleware(store))
	router.AddConsumerHandler("handover", os.Getenv("CRASHTEST_TOPIC"), sub, func(msg *message.Message) error {
		if _, err := db.ExecContext(msg.Context(), `INSERT INTO `+ledger+` (consumer) VALUES ($1)`, consumer); err != nil {
			return err
		}
		if consumer == "doomed" {
			<-msg.Context().Done() // runs until the process is killed, or its claim lost
			if errors.Is(context.Cause(msg.Context()), idempotency.ErrClaimLost) {
				_, _ = db.ExecContext(context.Background(), `INSERT INTO `+ledger+` (consumer) VALUES ('doomed, claim lost')`)
			}
		}
		return nil
	})
	return router.Run(ctx)
}
