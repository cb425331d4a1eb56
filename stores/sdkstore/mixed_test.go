package sdkstore_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/sdkstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// layout is one SDK store layout: the kit's store on it and an SDK
// consumer on the same keys or table.
type layout struct {
	name string
	kit  stores.Store
	sdk  sdkConsumer
	// sdkSeesClaims: the SDK reads the kit's in-flight claims (the PHP
	// layouts). The Go SDK reads any live record as done, so the kit keeps
	// its claims where the Go SDK never looks.
	sdkSeesClaims bool
}

const sdkTTL = time.Hour

func layouts(t *testing.T) []layout {
	t.Helper()
	client := testenv.Redis(t)
	p := redisPrefix(t, client)
	pg, maria := testenv.Postgres(t), testenv.MariaDB(t)
	// The servers are shared: keep to a few connections each.
	pg.SetMaxOpenConns(16)
	maria.SetMaxOpenConns(16)
	phpPGTable, phpMariaTable, goPGTable := sqlTable(t, pg, "bq_idempotency"), sqlTable(t, maria, "bq_idempotency"), sqlTable(t, pg, "babelqueue_idempotency")
	phpPG := ok(t)(sdkstore.NewPHPPDO(pg, sdkstore.PostgreSQL, sdkstore.WithTable(phpPGTable)))
	phpMaria := ok(t)(sdkstore.NewPHPPDO(maria, sdkstore.MariaDB, sdkstore.WithTable(phpMariaTable)))
	goPG := ok(t)(sdkstore.NewGoPostgres(pg, sdkstore.WithTable(goPGTable), sdkstore.WithTTL(sdkTTL)))
	for _, s := range []stores.Store{phpPG, phpMaria, goPG} {
		migrate(t, s)
	}
	return []layout{
		{"PHPRedisStore", ok(t)(sdkstore.NewPHPRedis(client, sdkstore.WithPrefix(p+":idem:"))), phpRedisSDK{client, p + ":idem:", sdkTTL}, true},
		{"PHPPdoStore/PostgreSQL", phpPG, phpPDOSDK{pg, false, phpPGTable, sdkTTL}, true},
		{"PHPPdoStore/MariaDB", phpMaria, phpPDOSDK{maria, true, phpMariaTable, sdkTTL}, true},
		{"GoSDKRedis", ok(t)(sdkstore.NewGoRedis(client, sdkstore.WithPrefix(p+":idemp:"), sdkstore.WithTTL(sdkTTL))), goRedisSDK{client, p + ":idemp:", sdkTTL}, false},
		{"GoSDKPostgres", goPG, goPostgresSDK{pg, goPGTable, sdkTTL}, false},
	}
}

// fleet is the kit (the real middleware, keyed on meta.id alone, with
// claims) and an SDK consumer sharing one store, counting effects.
type fleet struct {
	t       *testing.T
	kit     message.HandlerFunc
	sdk     sdkConsumer
	effects testenv.Effects
	byKit   atomic.Int64
	bySDK   atomic.Int64

	mu       sync.Mutex
	failOnce map[string]bool // ids whose next run fails, once
}

func newFleet(t *testing.T, l layout) *fleet {
	f := &fleet{t: t, sdk: l.sdk, failOnce: map[string]bool{}}
	f.kit = idempotency.Middleware(l.kit, idempotency.WithScope(""), idempotency.WithClaim(30*time.Second))(
		func(msg *message.Message) ([]*message.Message, error) {
			id, err := envelope.ReadIdentity(msg.Payload)
			if err != nil {
				return nil, err
			}
			if err := f.run(id.ID); err != nil {
				return nil, err
			}
			f.byKit.Add(1)
			return nil, nil
		})
	return f
}

var errInjected = errors.New("injected handler failure")

// run is the effect, shared by both sides: it fails once for ids marked so.
func (f *fleet) run(id string) error {
	f.mu.Lock()
	fail := f.failOnce[id]
	delete(f.failOnce, id)
	f.mu.Unlock()
	if fail {
		return errInjected
	}
	f.effects.Add(id)
	return nil
}

// retryable: the broker would redeliver (a store that did not answer in
// time, as a loaded machine's may, included).
func retryable(err error) bool {
	return errors.Is(err, idempotency.ErrInFlight) || errors.Is(err, idempotency.ErrStore) || errors.Is(err, errParked) || errors.Is(err, errInjected)
}

// deliverKit delivers payload to the kit until it is handled or skipped.
func (f *fleet) deliverKit(ctx context.Context, payload []byte) {
	for {
		msg := message.NewMessage(watermill.NewUUID(), payload)
		msg.SetContext(ctx)
		_, err := f.kit(msg)
		if err == nil {
			return
		}
		if !retryable(err) || ctx.Err() != nil {
			f.t.Errorf("kit delivery: %v", err)
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// deliverSDK delivers id to the SDK consumer until it is handled or skipped.
func (f *fleet) deliverSDK(ctx context.Context, id string) {
	for {
		ran, err := f.sdk.handle(ctx, id, func() error { return f.run(id) })
		if err == nil {
			if ran {
				f.bySDK.Add(1)
			}
			return
		}
		if !retryable(err) || ctx.Err() != nil {
			f.t.Errorf("SDK delivery: %v", err)
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func envelopes(t *testing.T, n int) (ids []string, payloads [][]byte) {
	t.Helper()
	for i := range n {
		e, err := envelope.New("urn:babel:orders:created", map[string]any{"i": i}, envelope.WithQueue("orders"))
		if err != nil {
			t.Fatal(err)
		}
		p, err := e.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		ids, payloads = append(ids, e.Meta.ID), append(payloads, p)
	}
	return ids, payloads
}

// deliverInTurn makes one in five of n messages fail on its first run and
// delivers each twice, one delivery after the other, in the orders given
// (message i in orders[i%len(orders)]), "kit" or "sdk" for each. It returns
// the messages' ids.
func (f *fleet) deliverInTurn(ctx context.Context, n int, orders ...[2]string) []string {
	ids, payloads := envelopes(f.t, n)
	for i, id := range ids {
		if i%5 == 0 {
			f.failOnce[id] = true
		}
		for _, side := range orders[i%len(orders)] {
			if side == "kit" {
				f.deliverKit(ctx, payloads[i])
			} else {
				f.deliverSDK(ctx, id)
			}
		}
	}
	return ids
}

// deliverAtOnce makes one in five of n messages fail on its first run and
// delivers each twice at the same instant, once to the kit and once to the
// SDK consumer. It returns the messages' ids.
func (f *fleet) deliverAtOnce(ctx context.Context, n int) []string {
	ids, payloads := envelopes(f.t, n)
	for i, id := range ids {
		if i%5 == 0 {
			f.failOnce[id] = true
		}
	}
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i, id := range ids {
		wg.Go(func() { <-start; f.deliverKit(ctx, payloads[i]) })
		wg.Go(func() { <-start; f.deliverSDK(ctx, id) })
	}
	close(start)
	wg.Wait()
	return ids
}

// ranTwice fails the test if a message never ran and returns how many ran
// more than once.
func (f *fleet) ranTwice(ids []string) int {
	twice := 0
	for _, id := range ids {
		switch n := f.effects.Count(id); {
		case n == 0:
			f.t.Fatalf("message %s never ran", id)
		case n > 1:
			twice++
		}
	}
	return twice
}

// fleetMessages is how many messages the fleet tests that deliver them
// one by one send: 100, or 40 under -short (each is a few round trips on
// every layout, MariaDB's included).
func fleetMessages() int {
	if testing.Short() {
		return 40
	}
	return 100
}

// TestMixedFleetOneEffect: every message is delivered twice, one delivery
// after the other, across a kit consumer and an SDK consumer in every
// order (kit then SDK, SDK then kit, and each side twice), and one in five
// fails on its first run: each takes effect exactly once, on every layout.
func TestMixedFleetOneEffect(t *testing.T) {
	t.Parallel()
	for _, l := range layouts(t) {
		t.Run(l.name, func(t *testing.T) {
			t.Parallel() // keys and tables of its own
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			f := newFleet(t, l)
			ids := f.deliverInTurn(ctx, fleetMessages(), [2]string{"kit", "sdk"}, [2]string{"sdk", "kit"}, [2]string{"kit", "kit"}, [2]string{"sdk", "sdk"})
			if err := f.effects.ExactlyOnce(ids); err != nil {
				t.Fatal(err)
			}
			t.Logf("%d messages delivered twice: %d effects by the kit, %d by the SDK", len(ids), f.byKit.Load(), f.bySDK.Load())
		})
	}
}

// TestMixedFleetConcurrentClaims: both copies of every message arrive at
// once, one at a kit consumer and one at an SDK consumer. On the PHP
// layouts, whose claims both sides read, each takes effect exactly once.
// The Go SDK cannot see an in-flight claim (it reads any record as done),
// so there two deliveries at the very same moment can both run: the test
// checks that none is lost and reports how many ran twice.
func TestMixedFleetConcurrentClaims(t *testing.T) {
	t.Parallel()
	for _, l := range layouts(t) {
		t.Run(l.name, func(t *testing.T) {
			t.Parallel() // keys and tables of its own
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			f := newFleet(t, l)
			ids := f.deliverAtOnce(ctx, fleetMessages())
			if l.sdkSeesClaims {
				if err := f.effects.ExactlyOnce(ids); err != nil {
					t.Fatal(err)
				}
			} else {
				twice := f.ranTwice(ids)
				t.Logf("deliveries at the same instant on a kit and a Go SDK consumer: %d of %d ran twice (the Go SDK cannot see in-flight claims)", twice, len(ids))
			}
			t.Logf("%d effects by the kit, %d by the SDK", f.byKit.Load(), f.bySDK.Load())
		})
	}
}

// TestMixedFleetOnRedisStreams: a kit worker (router, Redis Streams
// subscriber, middleware wired with WithScope("") and WithClaim) and an SDK
// consumer are two members of one consumer group. 100 messages are
// published twice; each takes effect exactly once, and both sides did some
// of the work. On the PHP layouts both copies are published back to back
// (they are handled at the same time); on the Go SDK layouts the second
// copies follow once the first ones are acked.
func TestMixedFleetOnRedisStreams(t *testing.T) {
	t.Parallel()
	for _, l := range layouts(t) {
		t.Run(l.name, func(t *testing.T) {
			t.Parallel() // keys and tables of its own
			client := testenv.Redis(t)
			topic, group := "sdkt-orders-"+testenv.RandomHex(4), "fleet"
			t.Cleanup(func() { client.Del(context.Background(), topic) })
			// The group exists before either member reads, so both share
			// the stream from its first entry.
			if err := client.XGroupCreateMkStream(context.Background(), topic, group, "0").Err(); err != nil {
				t.Fatal(err)
			}
			f := newFleet(t, l)

			sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
				Client: client, ConsumerGroup: group, Consumer: "kit-1", OldestId: "0",
				NackResendSleep: 20 * time.Millisecond, BlockTime: 100 * time.Millisecond,
				DisableIndefiniteInitialBlock: true,
			}, watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			r.AddConsumerHandler("orders", topic, sub, func(msg *message.Message) error {
				_, err := f.kit(msg)
				return err
			})
			testenv.RunRouter(t, r)
			stopSDK := runSDKMember(t, client, f, topic, group, "sdk-1")
			defer stopSDK()

			pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: client}, watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			var ids []string
			entries := 0
			if l.sdkSeesClaims {
				ids, entries = testenv.PublishCopies(t, pub, topic, "urn:babel:orders:created", 100, func(int) int { return 2 })
			} else {
				var payloads [][]byte
				ids, payloads = envelopes(t, 100)
				for range 2 {
					for _, p := range payloads {
						if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), p)); err != nil {
							t.Fatal(err)
						}
						entries++
					}
					waitDrained(t, client, topic, group, entries, f)
				}
			}
			waitDrained(t, client, topic, group, entries, f)
			if err := f.effects.ExactlyOnce(ids); err != nil {
				t.Fatal(err)
			}
			if f.byKit.Load() == 0 || f.bySDK.Load() == 0 {
				t.Fatalf("one side did all the work: %d effects by the kit, %d by the SDK", f.byKit.Load(), f.bySDK.Load())
			}
			t.Logf("%d entries for 100 messages: %d effects by the kit, %d by the SDK", entries, f.byKit.Load(), f.bySDK.Load())
		})
	}
}

func waitDrained(t *testing.T, client *redis.Client, topic, group string, entries int, f *fleet) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !testenv.StreamDrained(context.Background(), client, topic, group, entries) {
		if time.Now().After(deadline) {
			t.Fatalf("not drained: %d entries, %d effects", entries, f.effects.Total())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// runSDKMember consumes topic as a member of group the way an SDK consumer
// does: one entry at a time, its meta.id through the SDK store, acked once
// handled or skipped. It runs until stop is called.
func runSDKMember(t *testing.T, client *redis.Client, f *fleet, topic, group, consumer string) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			streams, err := client.XReadGroup(ctx, &redis.XReadGroupArgs{
				Group: group, Consumer: consumer, Streams: []string{topic, ">"}, Count: 1, Block: 100 * time.Millisecond,
			}).Result()
			if err != nil {
				if !errors.Is(err, redis.Nil) && ctx.Err() == nil && !isNoGroup(err) {
					t.Errorf("XREADGROUP: %v", err)
					return
				}
				time.Sleep(10 * time.Millisecond)
				continue
			}
			for _, s := range streams {
				for _, m := range s.Messages {
					payload, _ := m.Values["payload"].(string)
					id, err := envelope.ReadIdentity([]byte(payload))
					if err != nil {
						t.Errorf("entry %s: %v", m.ID, err)
						continue
					}
					f.deliverSDK(ctx, id.ID)
					if err := client.XAck(context.Background(), topic, group, m.ID).Err(); err != nil {
						t.Errorf("XACK: %v", err)
					}
				}
			}
		}
	}()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return stop
}

// isNoGroup: the kit's subscriber creates the group; the SDK member may
// read before it does.
func isNoGroup(err error) bool { return err != nil && strings.HasPrefix(err.Error(), "NOGROUP") }

// TestMixedFleetPHPIdempotentWrap: the PHP consumer wraps its handler with
// Idempotent::wrap, which takes no claim, instead of ClaimingDispatch::wrap.
// Copies one after the other still take effect once (each side reads the
// other's records); copies at the same instant can both run, since the PHP
// side never looks for a claim: the test checks none is lost and reports
// how many ran twice.
func TestMixedFleetPHPIdempotentWrap(t *testing.T) {
	t.Parallel()
	for _, l := range layouts(t) {
		switch sdk := l.sdk.(type) {
		case phpRedisSDK:
			l.sdk = phpIdempotentWrap{sdk.seen, sdk.remember}
		case phpPDOSDK:
			l.sdk = phpIdempotentWrap{sdk.seen, sdk.remember}
		default:
			continue
		}
		t.Run(l.name, func(t *testing.T) {
			t.Parallel() // keys and tables of its own
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			f := newFleet(t, l)
			ids := f.deliverInTurn(ctx, fleetMessages(), [2]string{"kit", "sdk"}, [2]string{"sdk", "kit"})
			if err := f.effects.ExactlyOnce(ids); err != nil {
				t.Fatalf("copies one after the other: %v", err)
			}
			f = newFleet(t, l)
			ids = f.deliverAtOnce(ctx, fleetMessages())
			twice := f.ranTwice(ids)
			t.Logf("copies at the same instant on a kit consumer and a PHP consumer on Idempotent::wrap: %d of %d ran twice (it takes no claim)", twice, len(ids))
		})
	}
}
