package natsjetstream_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"

	"github.com/babelqueue/watermill-idempotency/brokers/natsjetstream"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

const group = "bq_natsjs"

func jsConfig() wnats.JetStreamConfig {
	return wnats.JetStreamConfig{
		AutoProvision:     true,
		SubscribeOptions:  []nats.SubOpt{nats.DeliverAll(), nats.AckExplicit()},
		DurablePrefix:     group,
		DurableCalculator: func(prefix, topic string) string { return prefix + "_" + topic },
	}
}

func subscriberConfig() wnats.SubscriberConfig {
	return wnats.SubscriberConfig{
		QueueGroupPrefix: group, SubscribersCount: 1, CloseTimeout: 5 * time.Second,
		AckWaitTimeout: 30 * time.Second, Unmarshaler: &wnats.NATSMarshaler{}, JetStream: jsConfig(),
	}
}

// subscriptionConfig is subscriberConfig as WithDurableConsumers takes it.
func subscriptionConfig() wnats.SubscriberSubscriptionConfig {
	c := subscriberConfig()
	return c.GetSubscriberSubscriptionConfig()
}

// subscriber is a watermill-nats subscriber of subscriberConfig, closed
// when t ends.
func subscriber(t *testing.T, url string) *wnats.Subscriber {
	t.Helper()
	return testenv.NATSSubscriber(t, url, subscriberConfig())
}

func publisher(t *testing.T, url string) *wnats.Publisher {
	t.Helper()
	pub, err := wnats.NewPublisher(wnats.PublisherConfig{URL: url, Marshaler: &wnats.NATSMarshaler{}, JetStream: jsConfig()}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

func TestCheckStreamName(t *testing.T) {
	t.Parallel()
	for name, ok := range map[string]bool{
		"payments": true, "payments_dlq": true, "pay-ments:1": true, natsjetstream.DeadLetterTopic("orders"): true,
		"payments.dlq": false, "": false, "a b": false, "a\tb": false, "a*": false, "a>": false, "a/b": false, `a\b`: false,
		"a\x00b": false, strings.Repeat("x", natsjetstream.MaxStreamName+1): false,
	} {
		if err := natsjetstream.CheckStreamName(name); (err == nil) != ok || (err != nil && !errors.Is(err, natsjetstream.ErrInvalidStreamName)) {
			t.Errorf("CheckStreamName(%q) = %v, want ok %v", name, err, ok)
		}
	}
}

// TestQuickStartDeadLetterTopicIsRefusedBeforeAnyRun: the README's wiring on
// JetStream (AutoProvision, the default "<topic>.dlq") dead-lettered
// nothing: the dead letter could not be published, its message came back
// and ran again for ever (the issue counted 125 runs of a poison message
// in 40 s). With Streams as the dead-letter middleware's topic checker and
// CheckOnSubscribe, Router.Run fails before any message runs, naming the
// topic, the rule and the fix; with DeadLetterTopic's names the same
// wiring dead-letters the poison message once, to "<topic>_dlq", created
// by the check.
func TestQuickStartDeadLetterTopicIsRefusedBeforeAnyRun(t *testing.T) {
	t.Parallel()
	topic := "bqnatsjs_" + testenv.RandomHex(6)
	url, js := testenv.JetStream(t, topic, natsjetstream.DeadLetterTopic(topic))
	pub := publisher(t, url)
	if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("not an envelope"))); err != nil {
		t.Fatal(err)
	}
	streams := natsjetstream.NewStreams(js, jsConfig(), nil)
	var runs atomic.Int32
	router := func(opts ...deadletter.Option) *message.Router {
		dlq, err := deadletter.Middleware(pub, opts...)
		if err != nil {
			t.Fatal(err)
		}
		r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		r.AddMiddleware(dlq, idempotency.Middleware(memstore.New()))
		r.AddSubscriberDecorators(deadletter.CheckOnSubscribe(pub, opts...))
		r.AddConsumerHandler("charge", topic, subscriber(t, url), func(*message.Message) error {
			runs.Add(1)
			return errors.New("cannot decode")
		})
		return r
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := router(deadletter.WithTopicCheck(streams)).Run(ctx)
	if !errors.Is(err, deadletter.ErrTopicUnusable) || !errors.Is(err, natsjetstream.ErrInvalidStreamName) ||
		!strings.Contains(err.Error(), topic+".dlq") || !strings.Contains(err.Error(), "natsjetstream.DeadLetterTopic") {
		t.Fatalf("Router.Run = %v\nwant ErrTopicUnusable and ErrInvalidStreamName naming %s.dlq and the fix", err, topic)
	}
	if runs.Load() != 0 {
		t.Fatalf("the handler ran %d times before the check failed the router", runs.Load())
	}

	stop := testenv.RunRouter(t, router(deadletter.WithTopic(natsjetstream.DeadLetterTopic), deadletter.WithTopicCheck(streams)))
	testenv.Eventually(t, "the poison message on "+natsjetstream.DeadLetterTopic(topic), func() bool {
		info, err := js.StreamInfo(natsjetstream.DeadLetterTopic(topic))
		return err == nil && info.State.Msgs == 1
	})
	stop()
	if runs.Load() != 1 {
		t.Fatalf("%d runs of a message the handler cannot read, want 1", runs.Load())
	}
}

// TestStreamsWithoutAutoProvision: without AutoProvision a topic is
// usable when a stream captures its subject, whatever its name, and
// fails with ErrNoStream naming the subject otherwise.
func TestStreamsWithoutAutoProvision(t *testing.T) {
	t.Parallel()
	stream := "bqnatsjs_" + testenv.RandomHex(6)
	_, js := testenv.JetStream(t, stream)
	config := jsConfig()
	config.AutoProvision = false
	streams := natsjetstream.NewStreams(js, config, nil)
	dlq := stream + ".dlq" // a subject, not a stream name: fine here
	err := streams.CheckTopic(context.Background(), dlq)
	if !errors.Is(err, natsjetstream.ErrNoStream) || !strings.Contains(err.Error(), dlq) {
		t.Fatalf("CheckTopic(%s) = %v, want ErrNoStream naming the subject", dlq, err)
	}
	testenv.AddStream(t, js, &nats.StreamConfig{Name: stream, Subjects: []string{stream, stream + ".>"}})
	if err := streams.CheckTopic(context.Background(), dlq); err != nil {
		t.Fatalf("a stream captures %s: %v", dlq, err)
	}
}

// TestDurableConsumerOutlivesItsSubscriber: a watermill-nats subscriber
// that created its durable consumer deletes it on Close, and the next one
// reads the stream from its start (the restart: 27 dead letters
// for 14 messages). WithDurableConsumers creates the consumer first: it
// outlives the subscriber, and the restarted one gets only what came
// after.
func TestDurableConsumerOutlivesItsSubscriber(t *testing.T) {
	t.Parallel()
	topic := "bqnatsjs_" + testenv.RandomHex(6)
	url, js := testenv.JetStream(t, topic)
	pub := publisher(t, url)
	durableName := jsConfig().CalculateDurableName(topic)
	const n = 5
	for i := range n {
		msg := message.NewMessage(watermill.NewUUID(), []byte{byte('a' + i)})
		if err := pub.Publish(topic, msg); err != nil {
			t.Fatal(err)
		}
	}
	consume := func(sub message.Subscriber, want int) []string {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		msgs, err := sub.Subscribe(ctx, topic)
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		timeout := time.After(30 * time.Second)
		for len(got) < want {
			select {
			case m := <-msgs:
				got = append(got, string(m.Payload))
				m.Ack()
			case <-timeout:
				t.Fatalf("%d of %d messages: %v", len(got), want, got)
			}
		}
		return got
	}
	first := subscriber(t, url)
	consume(natsjetstream.WithDurableConsumers(first, js, subscriptionConfig(), natsjetstream.Consumer{MaxAckPending: 1}), n)
	testenv.Eventually(t, "the acks of the first subscriber", func() bool {
		info, err := js.ConsumerInfo(topic, durableName)
		return err == nil && info.NumAckPending == 0 && info.NumPending == 0
	})
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	info, err := js.ConsumerInfo(topic, durableName)
	if err != nil {
		t.Fatalf("the durable consumer after its subscriber closed: %v", err)
	}
	if info.Config.AckWait != 30*time.Second || info.Config.MaxAckPending != 1 || info.Config.DeliverGroup != group {
		t.Errorf("consumer config %+v: want AckWait 30s (the subscriber's), MaxAckPending 1, deliver group %s", info.Config, group)
	}
	if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("after"))); err != nil {
		t.Fatal(err)
	}
	second := natsjetstream.WithDurableConsumers(subscriber(t, url), js, subscriptionConfig(), natsjetstream.Consumer{MaxAckPending: 1})
	if got := consume(second, 1); got[0] != "after" {
		t.Fatalf("the restarted subscriber's first message is %q: the stream was read again from its start", got[0])
	}
}

// TestDurableNeedsAName: WithDurableConsumers refuses a configuration
// without a durable name, as a consumer could not outlive it.
func TestDurableNeedsAName(t *testing.T) {
	t.Parallel()
	url, js := testenv.JetStream(t)
	config := subscriptionConfig()
	config.JetStream.DurablePrefix, config.JetStream.DurableCalculator = "", nil
	_, err := natsjetstream.WithDurableConsumers(subscriber(t, url), js, config, natsjetstream.Consumer{}).Subscribe(context.Background(), "bqnatsjs_unnamed")
	if !errors.Is(err, natsjetstream.ErrNoDurable) {
		t.Fatalf("err = %v, want ErrNoDurable", err)
	}
}
