package redrive_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/redrive"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// world is an order service on Redis Streams: a consumer with the full
// middleware stack (dead letters, retry, idempotency), a payment gateway that
// can be down, and a confirmation mailer (an external effect).
type world struct {
	t        *testing.T
	client   *redis.Client
	topic    string
	dlq      string
	store    *redisstore.Store
	pub      message.Publisher
	down     atomic.Bool // the payment gateway
	mu       sync.Mutex
	charges  map[string]int // the idempotent core, per meta.id
	emails   map[string]int // the external effect, per meta.id
	replayed map[string]int // core runs seen as replays
}

func newWorld(t *testing.T) *world {
	t.Helper()
	client := testenv.Redis(t)
	run := testenv.RandomHex(4)
	w := &world{t: t, client: client, topic: "bq-test-orders-" + run, charges: map[string]int{}, emails: map[string]int{}, replayed: map[string]int{}}
	w.dlq = w.topic + ".dlq"
	w.store = redisstore.New(client, redisstore.WithPrefix("t"+run+":"), redisstore.WithTTL(10*time.Minute))
	t.Cleanup(func() { client.Del(context.Background(), w.topic, w.dlq) })
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: redis.NewClient(client.Options())}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	w.pub = pub
	return w
}

// subscriber returns a subscriber with a client of its own: closing a
// redisstream subscriber closes its client.
func (w *world) subscriber(group string) message.Subscriber {
	sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
		Client: redis.NewClient(w.client.Options()), ConsumerGroup: group, Consumer: "c", OldestId: "0",
		NackResendSleep: 20 * time.Millisecond, BlockTime: 50 * time.Millisecond, DisableIndefiniteInitialBlock: true,
		// What a previous run left pending comes first; nothing is taken
		// back mid-run (see package redrive).
		MaxIdleTime: time.Millisecond, ClaimInterval: time.Hour,
	}, watermill.NopLogger{})
	if err != nil {
		w.t.Fatal(err)
	}
	return sub
}

// startConsumer runs the order service until the test ends.
func (w *world) startConsumer() {
	t := w.t
	dlq, err := deadletter.Middleware(w.pub)
	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(dlq,
		middleware.Retry{MaxRetries: 2, InitialInterval: time.Millisecond,
			ShouldRetry: func(p middleware.RetryParams) bool { return !idempotency.IsPermanent(p.Err) }}.Middleware,
		deadletter.CountAttempts,
		idempotency.Middleware(w.store))
	r.AddConsumerHandler("charge", w.topic, w.subscriber("orders-service"), func(msg *message.Message) error {
		id, _ := envelope.ReadIdentity(msg.Payload)
		if w.down.Load() {
			return errors.New("payment gateway unavailable")
		}
		w.mu.Lock()
		w.charges[id.ID]++
		if idempotency.IsReplay(msg.Context()) {
			w.replayed[id.ID]++
		}
		w.mu.Unlock()
		return idempotency.BypassExternalEffects(msg.Context(), func(context.Context) error {
			w.mu.Lock()
			w.emails[id.ID]++
			w.mu.Unlock()
			return nil
		})
	})
	testenv.RunRouter(t, r)
}

func (w *world) publishOrders(n int) []string {
	ids := make([]string, n)
	for i := range n {
		e, err := envelope.New("urn:babel:orders:created", map[string]any{"order": i}, envelope.WithQueue(w.topic))
		if err != nil {
			w.t.Fatal(err)
		}
		payload, _ := e.Marshal()
		if err := w.pub.Publish(w.topic, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
			w.t.Fatal(err)
		}
		ids[i] = e.Meta.ID
	}
	return ids
}

// waitFor polls cond for up to 20s.
func (w *world) waitFor(what string, cond func() bool) {
	w.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			w.t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// dlqBacklog is what the redrive group has not consumed yet: the messages
// on the dead-letter topic.
func (w *world) dlqBacklog() int64 {
	n, err := w.client.XLen(context.Background(), w.dlq).Result()
	if err != nil {
		w.t.Fatal(err)
	}
	groups, _ := w.client.XInfoGroups(context.Background(), w.dlq).Result()
	for _, g := range groups {
		if g.Name == "redrive" {
			return g.Lag + g.Pending
		}
	}
	return n
}

func (w *world) count(m map[string]int, id string) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return m[id]
}

func (w *world) redrive(ctx context.Context, opts ...redrive.Option) (redrive.Report, error) {
	sub := w.subscriber("redrive")
	defer func() {
		time.Sleep(100 * time.Millisecond) // let the last ack reach Redis
		sub.Close()
	}()
	return redrive.Run(ctx, sub, w.pub, w.dlq, append([]redrive.Option{redrive.WithIdleTimeout(time.Second)}, opts...)...)
}

func TestDeadLetterThenRedriveOnRedisStreams(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	w.startConsumer()

	// 1. The gateway is down: every order fails its retries and lands on
	//    the dead-letter topic with a dead_letter block.
	w.down.Store(true)
	ids := w.publishOrders(12)
	w.waitFor("12 dead letters", func() bool { return w.dlqBacklog() == 12 })
	entries, err := w.client.XRange(context.Background(), w.dlq, "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range entries {
		var e envelope.Envelope
		e, err = envelope.Parse([]byte(x.Values["payload"].(string)))
		if err != nil {
			t.Fatalf("dead letter does not parse: %v", err)
		}
		dl := e.DeadLetter
		if dl == nil || dl.Reason != "failed" || dl.OriginalQueue != w.topic || dl.Attempts != 3 || *dl.Error != "payment gateway unavailable" {
			t.Fatalf("dead_letter block %+v", dl)
		}
	}

	// 2. A dry run moves nothing and leaves every message on the DLQ.
	report, err := redrive.Preview(context.Background(), redrive.RedisStreamBrowser(w.client, "redrive"), w.dlq)
	if err != nil || report.Moved != 12 || !report.DryRun || w.dlqBacklog() != 12 {
		t.Fatalf("dry run: %+v err=%v backlog=%d", report, err, w.dlqBacklog())
	}
	for _, e := range report.Entries {
		if e.To != w.topic || !e.Moved || e.Reason != "failed" {
			t.Fatalf("dry-run entry %+v", e)
		}
	}

	// 3. The gateway is fixed. A selection moves only what it selects.
	w.down.Store(false)
	report, err = w.redrive(context.Background(), redrive.WithIDs(ids[0], ids[1]))
	if err != nil || report.Moved != 2 {
		t.Fatalf("selection: %+v err=%v", report, err)
	}
	w.waitFor("the two selected orders", func() bool { return w.count(w.charges, ids[0]) == 1 && w.count(w.charges, ids[1]) == 1 })
	if w.dlqBacklog() != 10 {
		t.Fatalf("backlog %d after moving 2 of 12", w.dlqBacklog())
	}

	// 4. An undecodable body on the DLQ stays there.
	if err := w.pub.Publish(w.dlq, message.NewMessage(watermill.NewUUID(), []byte("garbage"))); err != nil {
		t.Fatal(err)
	}

	// 5. A rate-limited run interrupted midway loses nothing.
	ctx, cancel := context.WithTimeout(context.Background(), 700*time.Millisecond)
	report, err = w.redrive(ctx, redrive.WithRate(5))
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) || report.Moved == 0 || report.Moved >= 10 {
		t.Fatalf("interrupted run: moved %d, err=%v", report.Moved, err)
	}
	interrupted := report.Moved

	// 6. The rest, all at once.
	report, err = w.redrive(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if interrupted+report.Moved < 10 {
		t.Fatalf("moved %d + %d of 10: messages lost", interrupted, report.Moved)
	}
	w.waitFor("every order charged", func() bool {
		for _, id := range ids {
			if w.count(w.charges, id) == 0 {
				return false
			}
		}
		return true
	})
	time.Sleep(200 * time.Millisecond) // let any duplicate arrive
	for _, id := range ids {
		if w.count(w.charges, id) != 1 || w.count(w.emails, id) != 1 {
			t.Fatalf("order %s: %d charges, %d emails; want 1 each", id, w.count(w.charges, id), w.count(w.emails, id))
		}
	}
	if backlog := w.dlqBacklog(); backlog != 1 {
		t.Fatalf("DLQ backlog %d, want only the undecodable message", backlog)
	}
	var undecodable int
	for _, e := range report.Entries {
		if e.Moved == false && len(e.Note) > 11 && e.Note[:11] == "undecodable" {
			undecodable++
		}
	}
	if undecodable != 1 {
		t.Fatalf("report: %+v", report.Entries)
	}
}

// TestReplayBypassOnRedisStreams: already-processed orders, forgotten and
// replayed with the bypass marker, run the idempotent core once more and
// never the external effect.
func TestReplayBypassOnRedisStreams(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	w.startConsumer()
	ids := w.publishOrders(5)
	w.waitFor("5 orders", func() bool { return w.count(w.charges, ids[4]) == 1 && w.count(w.charges, ids[0]) == 1 })

	// The operator puts the processed messages on a replay topic (here:
	// the DLQ, with their original queue) and forgets their records.
	entries, err := w.client.XRange(context.Background(), w.topic, "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, x := range entries {
		e, err := envelope.Parse([]byte(x.Values["payload"].(string)))
		if err != nil {
			t.Fatal(err)
		}
		e.DeadLetter = &envelope.DeadLetter{Reason: envelope.ReasonFailed, OriginalQueue: w.topic, FailedAt: time.Now().UnixMilli(), Lang: "go"}
		payload, _ := e.Marshal()
		if err := w.pub.Publish(w.dlq, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
			t.Fatal(err)
		}
		if err := w.store.Forget(ctx, idempotency.Key("charge", e.Meta.ID)); err != nil {
			t.Fatal(err)
		}
	}
	report, err := w.redrive(ctx, redrive.WithReplayBypass())
	if err != nil || report.Moved != 5 {
		t.Fatalf("replay: %+v err=%v", report, err)
	}
	w.waitFor("the replays", func() bool {
		for _, id := range ids {
			if w.count(w.charges, id) != 2 {
				return false
			}
		}
		return true
	})
	for _, id := range ids {
		if w.count(w.replayed, id) != 1 || w.count(w.emails, id) != 1 {
			t.Fatalf("order %s: %d replays seen, %d emails; want 1 replay and the email only once", id, w.count(w.replayed, id), w.count(w.emails, id))
		}
	}
}
