package reliability

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestRedisStoreRestartMidRun restarts the store's Redis (SIGKILL, then a
// new process on the same append-only file) while two consumers work.
func TestRedisStoreRestartMidRun(t *testing.T) {
	if testing.Short() {
		t.Skip("restarts a server")
	}
	srv := testenv.StartRedisServer(t)
	client := redis.NewClient(&redis.Options{Addr: srv.Addr(), MaxRetries: -1, DialTimeout: 500 * time.Millisecond})
	t.Cleanup(func() { _ = client.Close() })
	store := redisstore.New(client, redisstore.WithTTL(10*time.Minute))
	runThroughOutage(t, store, func() {
		srv.Kill()
		time.Sleep(time.Second)
		srv.Start()
	})
}

// TestPostgresStoreRestartMidRun crashes and restarts the store's
// PostgreSQL (immediate stop) while two consumers work.
func TestPostgresStoreRestartMidRun(t *testing.T) {
	if testing.Short() {
		t.Skip("restarts a server")
	}
	srv := startPostgresServer(t)
	db := srv.open(t)
	store, err := postgresstore.New(db, postgresstore.WithTTL(10*time.Minute), postgresstore.WithQueryTimeout(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	runThroughOutage(t, store, func() { srv.restart(time.Second) })
}

// runThroughOutage publishes messages with duplicates to Redis Streams,
// consumes them with two workers guarded by store under WithClaim, calls
// outage once a third of them ran, and checks that every message then ran
// exactly once: deliveries that met the outage failed (and came back) rather
// than being acked or run.
func runThroughOutage(t *testing.T, inner stores.Store, outage func()) {
	store := &countingStore{inner: inner}
	broker := testenv.Redis(t)
	ctx := context.Background()
	n := envInt("OUTAGE_MESSAGES", 1500)
	topic, group := randomName("bq-outage-"), "workers"
	defer broker.Del(ctx, topic)
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: redis.NewClient(broker.Options())}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	ids, entries := publishWithDuplicates(t, pub, topic, n)

	var fx testenv.Effects
	var ran, storeErrors, rememberFailed atomic.Int64
	mw := idempotency.Middleware(store, idempotency.WithClaim(30*time.Second),
		// Ride out a restart: remembering after a successful run retries for
		// about 6 seconds before giving up (the documented narrow window).
		idempotency.WithRememberRetry(8, 50*time.Millisecond),
		idempotency.WithObserver(idempotency.ObserverFunc(func(_ context.Context, e idempotency.Event) {
			switch e.Outcome {
			case idempotency.OutcomeStoreError:
				storeErrors.Add(1)
			case idempotency.OutcomeRememberFailed:
				rememberFailed.Add(1)
			}
		})))
	for _, name := range []string{"c1", "c2"} {
		stop := startConsumer(t, broker.Options(), topic, group, name, mw, func(msg *message.Message) error {
			id, _ := envelope.ReadIdentity(msg.Payload)
			fx.Add(id.ID)
			ran.Add(1)
			time.Sleep(time.Millisecond) // the effect
			return nil
		})
		t.Cleanup(stop)
	}
	deadline := time.Now().Add(3 * time.Minute)
	for ran.Load() < int64(n/3) {
		if time.Now().After(deadline) {
			t.Fatal("consumers made no progress")
		}
		time.Sleep(10 * time.Millisecond)
	}
	outage()
	for !testenv.StreamDrained(ctx, broker, topic, group, entries) {
		if time.Now().After(deadline) {
			t.Fatalf("not drained after the outage (%d runs, %d store errors)", ran.Load(), storeErrors.Load())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := fx.ExactlyOnce(ids); err != nil {
		t.Fatalf("%v (%d store errors, %d remembers given up)", err, storeErrors.Load(), rememberFailed.Load())
	}
	if store.failed.Load() == 0 {
		t.Fatal("no store call met the outage: the test did not test it")
	}
	if rememberFailed.Load() != 0 {
		t.Fatalf("%d records were given up during the outage", rememberFailed.Load())
	}
	t.Logf("%d messages as %d entries; %d store calls failed during the outage (%d deliveries failed their check and came back, "+
		"the rest were records retried); every message ran once", n, entries, store.failed.Load(), storeErrors.Load())
}

// countingStore counts the calls that failed; it delegates every method of
// the store contract.
type countingStore struct {
	inner  stores.Store
	failed atomic.Int64
}

func (c *countingStore) count(err error) error {
	if err != nil {
		c.failed.Add(1)
	}
	return err
}

func (c *countingStore) Lookup(ctx context.Context, k string) (stores.Record, error) {
	r, err := c.inner.Lookup(ctx, k)
	return r, c.count(err)
}
func (c *countingStore) Remember(ctx context.Context, k string, fp uint64, value []byte) error {
	return c.count(c.inner.Remember(ctx, k, fp, value))
}
func (c *countingStore) Forget(ctx context.Context, k string) error {
	return c.count(c.inner.Forget(ctx, k))
}
func (c *countingStore) Claim(ctx context.Context, k string, lease time.Duration) (bool, stores.Record, error) {
	ok, found, err := c.inner.Claim(ctx, k, lease)
	return ok, found, c.count(err)
}
func (c *countingStore) Extend(ctx context.Context, k string, lease time.Duration) (bool, error) {
	held, err := c.inner.Extend(ctx, k, lease)
	return held, c.count(err)
}
func (c *countingStore) Release(ctx context.Context, k string) error {
	return c.count(c.inner.Release(ctx, k))
}
func (c *countingStore) Capabilities() stores.Capabilities { return c.inner.Capabilities() }
func (c *countingStore) Fail(ctx context.Context, k string, fp uint64, f stores.Failure) error {
	return c.count(c.inner.Fail(ctx, k, fp, f))
}
func (c *countingStore) Reopen(ctx context.Context, k, marker string) (bool, error) {
	ok, err := c.inner.Reopen(ctx, k, marker)
	return ok, c.count(err)
}
