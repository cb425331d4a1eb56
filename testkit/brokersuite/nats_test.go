package brokersuite

import (
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestNATSRestartReplaysTheStreamAndTheKitSkipsIt: with the consumer left
// to watermill-nats (AutoProvision, a durable name, DeliverAll), closing the
// subscriber deletes the consumer nats.go created, so a restarted
// subscriber reads the whole stream again. The kit skips every replayed
// message: the handler runs once per message across the restart.
func TestNATSRestartReplaysTheStreamAndTheKitSkipsIt(t *testing.T) {
	url := testenv.NATSURL(t)
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	js, err := nc.JetStream()
	if err != nil {
		t.Fatal(err)
	}
	topic := "bqsuite_" + testenv.RandomHex(6) + "_restart"
	t.Cleanup(func() {
		defer nc.Close()
		if err := js.DeleteStream(topic); err != nil && !errors.Is(err, nats.ErrStreamNotFound) {
			t.Errorf("delete stream %s: %v", topic, err)
		}
	})
	jsConfig := wnats.JetStreamConfig{
		AutoProvision:     true,
		SubscribeOptions:  []nats.SubOpt{nats.DeliverAll(), nats.AckExplicit()},
		DurablePrefix:     group,
		DurableCalculator: func(prefix, topic string) string { return prefix + "_" + topic },
	}
	pub, err := wnats.NewPublisher(wnats.PublisherConfig{URL: url, Marshaler: &wnats.NATSMarshaler{}, JetStream: jsConfig}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	store := memstore.New()
	var charges testenv.Effects
	s := settings{wait: 30 * time.Second}
	worker := func() (*deliveries, func()) {
		sub := testenv.NATSSubscriber(t, url, wnats.SubscriberConfig{
			QueueGroupPrefix: group, CloseTimeout: 5 * time.Second,
			Unmarshaler: &wnats.NATSMarshaler{}, JetStream: jsConfig,
		})
		d := newDeliveries(t)
		r := newRouter(t)
		r.AddMiddleware(d.middleware, idempotency.Middleware(store))
		r.AddConsumerHandler("charge", topic, sub, func(msg *message.Message) error {
			charges.Add(idOf(msg))
			return nil
		})
		return d, testenv.RunRouter(t, r)
	}
	const n = 10
	first, stop := worker()
	ids, _ := testenv.PublishCopies(t, pub, topic, job, n, func(int) int { return 1 })
	s.eventually(t, "the first worker to ack every message", func() bool { return first.acked.Load() >= n }, func() string { return "" })
	stop()
	if _, err := js.ConsumerInfo(topic, group+"_"+topic); !errors.Is(err, nats.ErrConsumerNotFound) {
		t.Fatalf("the consumer watermill-nats created outlived its subscriber (err %v): the replay below is not expected", err)
	}
	second, _ := worker()
	s.eventually(t, "the restarted worker to get the stream again", func() bool { return second.acked.Load() >= n }, func() string { return "" })
	if err := charges.ExactlyOnce(ids); err != nil {
		t.Fatalf("after a restart that replayed %d messages: %v", second.acked.Load(), err)
	}
	t.Logf("restart: the stream's %d messages delivered again, all skipped; %d charges", second.acked.Load(), charges.Total())
}
