package postgresstore_test

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// overlapWatch records the runs of each message id, and every moment two
// ran at once.
type overlapWatch struct {
	mu       sync.Mutex
	running  map[string]int
	runs     map[string]int
	overlaps []string
}

// run marks a run of id as started, and returns its end.
func (o *overlapWatch) run(id string, worker int) func() {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.running == nil {
		o.running, o.runs = map[string]int{}, map[string]int{}
	}
	o.running[id]++
	o.runs[id]++
	if o.running[id] > 1 {
		o.overlaps = append(o.overlaps, fmt.Sprintf("%s (a run on worker %d began while another ran)", id, worker))
	}
	return func() {
		o.mu.Lock()
		defer o.mu.Unlock()
		o.running[id]--
	}
}

// runMixedFleet has two workers consume one Redis stream through the
// middleware, worker 0 with a Store of session claims, worker 1 with a
// Store made with optsB and the middleware's options mwB, on one table;
// the broker hands a message idle for half a second to the other worker,
// so each message, whose handler runs 1.5s, is redelivered while it runs.
// No message may run twice at once, and each must be recorded.
func runMixedFleet(t *testing.T, optsB []postgresstore.Option, mwB func(db1 *sql.DB) []idempotency.Option, onceEach bool) {
	t.Helper()
	rdb := testenv.Redis(t)
	db0, db1 := testenv.Postgres(t), testenv.Postgres(t)
	a := newStore(t, db0)
	b, err := postgresstore.New(db1, append([]postgresstore.Option{postgresstore.WithTable(a.Table())}, optsB...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	if !a.SessionClaims() {
		t.Fatal("worker 0 has no session claims")
	}
	topic := "bq_mixed_" + testenv.RandomHex(4)
	t.Cleanup(func() { rdb.Del(context.Background(), topic) })
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: rdb}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	watch := &overlapWatch{}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	var runsAt [2]atomic.Int32
	var obs [2]*outcomes
	for i, s := range []*postgresstore.Store{a, b} {
		sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
			Client: rdb, ConsumerGroup: "g", Consumer: fmt.Sprintf("w%d", i), OldestId: "0",
			BlockTime: 100 * time.Millisecond, DisableIndefiniteInitialBlock: true,
			ClaimInterval: 100 * time.Millisecond, MaxIdleTime: 500 * time.Millisecond,
		}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		opts := []idempotency.Option{idempotency.WithClaim(sessionRouterLease), idempotency.WithParkWait(0)}
		if i == 1 {
			opts = mwB(db1)
		}
		obs[i] = &outcomes{}
		router.AddMiddleware(idempotency.Middleware(s, append(opts, idempotency.WithObserver(obs[i]))...))
		router.AddConsumerHandler("h", topic, sub, func(msg *message.Message) error {
			id := msg.Metadata.Get("id")
			runsAt[i].Add(1)
			defer watch.run(id, i)()
			select {
			case <-time.After(1500 * time.Millisecond):
				return nil
			case <-msg.Context().Done():
				return context.Cause(msg.Context())
			}
		})
		wg.Go(func() { _ = router.Run(ctx) })
		select {
		case <-router.Running():
		case <-time.After(10 * time.Second):
			t.Fatal("the router did not start")
		}
	}
	// One message at a time, so that a worker is free to take the other's
	// running message from the broker.
	const n = 6
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("mixed-%d-%s", i, testenv.RandomHex(4))
		msg := envelopeMessage(t, ids[i])
		msg.Metadata.Set("id", ids[i]) // for the watch
		if err := pub.Publish(topic, msg); err != nil {
			t.Fatal(err)
		}
		waitCond(t, "the message recorded", 30*time.Second, func() bool {
			var records int
			if err := db0.QueryRowContext(context.Background(), `SELECT count(*) FROM `+a.Table()+` WHERE claim IS NULL`).Scan(&records); err != nil {
				t.Fatal(err)
			}
			return records > i
		})
	}
	// Let the redeliveries in flight settle: no run may still be going.
	waitCond(t, "no run in flight", 30*time.Second, func() bool {
		watch.mu.Lock()
		defer watch.mu.Unlock()
		for _, r := range watch.running {
			if r > 0 {
				return false
			}
		}
		return true
	})
	watch.mu.Lock()
	defer watch.mu.Unlock()
	t.Logf("runs on worker 0 (session claims): %d, on worker 1: %d; outcomes %v / %v", runsAt[0].Load(), runsAt[1].Load(), obs[0].counts(), obs[1].counts())
	if obs[0].of(idempotency.OutcomePark)+obs[1].of(idempotency.OutcomePark) == 0 {
		t.Error("no redelivery met a running message (no park): the test proved nothing")
	}
	if len(watch.overlaps) > 0 {
		t.Fatalf("messages ran twice at once: %v", watch.overlaps)
	}
	if onceEach {
		for _, id := range ids {
			if watch.runs[id] != 1 {
				t.Errorf("message %s ran %d times; want once", id, watch.runs[id])
			}
		}
	}
	if runsAt[0].Load() == 0 || runsAt[1].Load() == 0 {
		t.Log("one worker ran nothing: the kinds never met on a message")
	}
}

// envelopeMessage is a message of an envelope whose meta.id is id.
func envelopeMessage(t *testing.T, id string) *message.Message {
	t.Helper()
	e, err := envelope.New("urn:babel:test:mixed", map[string]any{"n": 1})
	if err != nil {
		t.Fatal(err)
	}
	e.Meta.ID = id
	payload, err := e.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	return message.NewMessage(watermill.NewUUID(), payload)
}

// A worker with session claims beside one with claims of rows, on one
// table: no message runs twice at once, and each runs once.
func TestHostileMixedFleetSessionAndRowClaims(t *testing.T) {
	if testing.Short() {
		t.Skip("seconds of slow handlers")
	}
	t.Parallel()
	runMixedFleet(t, []postgresstore.Option{postgresstore.WithRowClaims()}, func(*sql.DB) []idempotency.Option {
		return []idempotency.Option{idempotency.WithClaim(sessionRouterLease), idempotency.WithParkWait(0)}
	}, true)
}

// A worker with session claims beside one recording in the handler's
// transaction (WithTransaction), on one table: no message runs twice at
// once.
func TestHostileMixedFleetSessionAndTransaction(t *testing.T) {
	if testing.Short() {
		t.Skip("seconds of slow handlers")
	}
	t.Parallel()
	runMixedFleet(t, nil, func(db *sql.DB) []idempotency.Option {
		return []idempotency.Option{idempotency.WithTransaction(db)}
	}, false)
}
