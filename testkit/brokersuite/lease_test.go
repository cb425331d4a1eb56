package brokersuite

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// The claim outlives its lease for as long as its handler runs: a broker
// that redelivers a message while its handler still runs (JetStream's
// AckWait, Redis Streams' claim of idle entries, both shorter than the
// handler here) hands the copy to the other worker, which finds the claim
// alive and parks it. Each message runs once. Before claims were renewed,
// the lease lapsed under the running handler and the copy ran too.
const (
	// Two seconds: renewals come every lease/3, and a loaded machine (the
	// suite beside another, on two cores) delayed one past a lease of one
	// second; the claim was then lost, as promised, and the copy ran.
	leaseUnderTest   = 2 * time.Second
	slowHandler      = 3 * leaseUnderTest
	brokerRedelivery = time.Second
	slowMessages     = 2
	slowWorkerCount  = 2 * slowMessages // idle workers to take the redelivered copies at once
)

// slowWorkers runs slowWorkerCount routers on subscribers from newSub, each with the
// kit on one shared redisstore (lease leaseUnderTest) and a handler that
// takes slowHandler, publishes slowMessages on topic and waits until
// drained says the broker has nothing pending. Every message must have run
// once.
func slowWorkers(t *testing.T, pub message.Publisher, topic string, newSub func() message.Subscriber, drained func() bool) {
	store := redisstore.New(testenv.Redis(t), redisstore.WithPrefix("bql"+testenv.RandomHex(4)+":"))
	var charges testenv.Effects
	var deliveries atomic.Int64 // every copy the broker hands a router, parked ones included
	for range slowWorkerCount {
		r := newRouter(t)
		r.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				deliveries.Add(1)
				return h(msg)
			}
		})
		r.AddMiddleware(idempotency.Middleware(store, idempotency.WithClaim(leaseUnderTest)))
		r.AddConsumerHandler("charge", topic, newSub(), func(msg *message.Message) error {
			charges.Add(idOf(msg))
			select {
			case <-time.After(slowHandler):
				return nil
			case <-msg.Context().Done():
				cause := context.Cause(msg.Context())
				if errors.Is(cause, idempotency.ErrClaimLost) {
					t.Logf("message %s: %v (a renewal came too late)", idOf(msg), cause)
				}
				return cause
			}
		})
		testenv.RunRouter(t, r)
	}
	ids, _ := testenv.PublishCopies(t, pub, topic, job, slowMessages, func(int) int { return 1 })
	s := settings{wait: 60 * time.Second}
	s.eventually(t, "every message to run and the broker to have nothing pending", func() bool {
		return charges.Total() >= slowMessages && drained()
	}, func() string { return "" })
	if err := charges.ExactlyOnce(ids); err != nil {
		t.Fatalf("handlers of %v under a lease of %v, redelivered after %v: %v", slowHandler, leaseUnderTest, brokerRedelivery, err)
	}
	// The routers stop when the test ends: first let the copies the client
	// still buffers (a redelivery the broker sent before the ack) come in,
	// so that none arrives while its subscriber closes (watermill-nats
	// v2.1.3 closes its output channel while a message callback may still
	// select on it, which the race detector reports).
	quiet, last, since := 2*brokerRedelivery, deliveries.Load(), time.Now()
	s.eventually(t, "no copy delivered for twice the redelivery time", func() bool {
		if n := deliveries.Load(); n != last {
			last, since = n, time.Now()
		}
		return time.Since(since) >= quiet
	}, func() string { return fmt.Sprintf("%d copies delivered so far", last) })
}

func TestSlowHandlerUnderJetStreamRedeliveryRunsOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("handlers of seconds")
	}
	t.Parallel()
	url := testenv.NATSURL(t)
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	js, err := nc.JetStream()
	if err != nil {
		t.Fatal(err)
	}
	topic := "bqsuite_" + testenv.RandomHex(6) + "_slow"
	t.Cleanup(func() {
		defer nc.Close()
		if err := js.DeleteStream(topic); err != nil && !errors.Is(err, nats.ErrStreamNotFound) {
			t.Errorf("delete stream %s: %v", topic, err)
		}
	})
	jsConfig := wnats.JetStreamConfig{
		AutoProvision:     true,
		SubscribeOptions:  []nats.SubOpt{nats.DeliverAll(), nats.AckExplicit(), nats.AckWait(brokerRedelivery)},
		DurablePrefix:     group,
		DurableCalculator: func(prefix, topic string) string { return prefix + "_" + topic },
	}
	pub, err := wnats.NewPublisher(wnats.PublisherConfig{URL: url, Marshaler: &wnats.NATSMarshaler{}, JetStream: jsConfig}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	newSub := func() message.Subscriber {
		return testenv.NATSSubscriber(t, url, wnats.SubscriberConfig{
			QueueGroupPrefix: group, CloseTimeout: 5 * time.Second, AckWaitTimeout: time.Minute,
			Unmarshaler: &wnats.NATSMarshaler{}, JetStream: jsConfig,
		})
	}
	slowWorkers(t, pub, topic, newSub, func() bool {
		info, err := js.ConsumerInfo(topic, group+"_"+topic)
		return err == nil && info.NumAckPending == 0 && info.NumPending == 0
	})
}

func TestSlowHandlerUnderRedisStreamsRedeliveryRunsOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("handlers of seconds")
	}
	t.Parallel()
	admin := testenv.Redis(t)
	opts := admin.Options()
	topic := "bqsuite-" + testenv.RandomHex(6) + "-slow"
	t.Cleanup(func() {
		if err := admin.Del(context.Background(), topic).Err(); err != nil {
			t.Errorf("delete the stream: %v", err)
		}
	})
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: redis.NewClient(opts)}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	newSub := func() message.Subscriber {
		sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
			Client: redis.NewClient(opts), ConsumerGroup: group, Consumer: "c-" + testenv.RandomHex(4), OldestId: "0",
			BlockTime: 100 * time.Millisecond, DisableIndefiniteInitialBlock: true,
			MaxIdleTime: brokerRedelivery, ClaimInterval: 200 * time.Millisecond,
			// Closed, the subscriber's reader would sleep half a second
			// after its client's "closed" error, past goleak's wait at the
			// end of the package: it stops at once instead.
			ShouldStopOnReadErrors: func(err error) bool { return errors.Is(err, redis.ErrClosed) },
		}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = sub.Close() })
		return sub
	}
	slowWorkers(t, pub, topic, newSub, func() bool {
		groups, err := admin.XInfoGroups(context.Background(), topic).Result()
		if err != nil || len(groups) == 0 {
			return false
		}
		return groups[0].Pending == 0 && groups[0].Lag == 0
	})
}
