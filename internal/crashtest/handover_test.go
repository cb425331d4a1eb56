package crashtest

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/internal/testenv"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
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
	db := testenv.Postgres(t)
	rdb := testenv.Redis(t)
	ctx := context.Background()
	suffix := testenv.RandomHex(4)
	s := setup{mode: mode, topic: "bq_handover_" + suffix, group: "handover", ledger: "handover_runs_" + suffix, store: "handover_idem_" + suffix}
	if _, err := db.ExecContext(ctx, `CREATE TABLE `+s.ledger+` (consumer text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`); err != nil {
		t.Fatal(err)
	}
	store, err := postgresstore.New(db, postgresstore.WithTable(s.store))
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = db.ExecContext(context.Background(), fmt.Sprintf(`DROP TABLE IF EXISTS %s, %s`, s.ledger, s.store))
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
	runs := func(consumer string) (n int, last time.Time) {
		_ = db.QueryRowContext(ctx, `SELECT count(*), coalesce(max(at), 'epoch') FROM `+s.ledger+` WHERE consumer = $1`, consumer).Scan(&n, &last)
		return n, last
	}
	waitFor := func(what string, within time.Duration, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(within)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("timed out after %v waiting for %s", within, what)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}

	var doomedLogs, survivorLogs bytes.Buffer
	doomed := s.consumer("doomed", &doomedLogs)
	if err := doomed.Start(); err != nil {
		t.Fatal(err)
	}
	waitFor("the doomed consumer to start the handler", time.Minute, func() bool { n, _ := runs("doomed"); return n == 1 })
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
	if n, _ := runs("survivor"); n != 0 {
		t.Fatalf("the survivor ran the message while its holder was alive and renewing its claim:\n%s", tail(survivorLogs.Bytes()))
	}
	killed := time.Now()
	_ = doomed.Process.Signal(syscall.SIGKILL)
	_ = doomed.Wait()
	waitFor("the survivor to run the message", time.Minute, func() bool { n, _ := runs("survivor"); return n == 1 })
	took := time.Since(killed)
	t.Logf("%s: the message ran on the survivor %v after its holder was SIGKILLed (default lease %v)", mode, took.Round(10*time.Millisecond), idempotency.DefaultLease)
	if took > handoverWithin {
		t.Fatalf("the message ran elsewhere %v after its holder died, want within %v; survivor:\n%s", took, handoverWithin, tail(survivorLogs.Bytes()))
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
			<-msg.Context().Done() // runs until the process is killed
		}
		return nil
	})
	return router.Run(ctx)
}
