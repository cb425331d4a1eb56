package idempotency_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// The case on a router: three publishes of one plain message (same
// UUID, same bq-message-id) reach two handlers on the topic; each runs once.
func TestKeySourceRouterPlainMessagesOncePerHandler(t *testing.T) {
	t.Parallel()
	for _, src := range []struct {
		name string
		key  idempotency.KeySource
	}{
		{"uuid", idempotency.KeyFromUUID()},
		{"metadata", idempotency.KeyFromMetadata(envelope.MetadataMessageID)},
	} {
		t.Run(src.name, func(t *testing.T) {
			ps := newPubSub()
			var a acks
			var charge, email testenv.Effects
			r := newRouter(t)
			r.AddMiddleware(a.middleware, idempotency.Middleware(memstore.New(),
				idempotency.WithKeySource(src.key), idempotency.WithClaim(10*time.Second)))
			r.AddConsumerHandler("charge", "orders", ps, func(msg *message.Message) error {
				charge.Add(msg.UUID)
				return nil
			})
			r.AddConsumerHandler("email", "orders", ps, func(msg *message.Message) error {
				email.Add(msg.UUID)
				return nil
			})
			testenv.RunRouter(t, r)
			for range 3 {
				msg := message.NewMessage("order-1042", []byte(`{"order_id":1042}`))
				msg.Metadata.Set(envelope.MetadataMessageID, "order-1042")
				if err := ps.Publish("orders", msg); err != nil {
					t.Fatal(err)
				}
			}
			eventually(t, "6 deliveries acked", func() bool { return a.acked.Load() == 6 })
			a.wg.Wait()
			if charge.Total() != 1 || email.Total() != 1 {
				t.Fatalf("charge ran %d times, email %d; want each once", charge.Total(), email.Total())
			}
		})
	}
}

// PlaceOrder is a command of a components/cqrs application that does not
// use BabelQueue envelopes: cqrs.JSONMarshaler, a new Watermill UUID on
// every Send.
type PlaceOrder struct {
	OrderID string `json:"order_id"`
	Amount  int    `json:"amount"`
}

// cqrsOnce wires a command bus and a command processor on pub and sub, with
// the kit keyed on an Idempotency-Key metadata field the bus sets from the
// command, sends one command twice and another once, and checks that each
// was handled once once every delivery was acked.
func cqrsOnce(t *testing.T, pub message.Publisher, sub func() (message.Subscriber, error), topic string, store stores.Store, drained func() bool) {
	t.Helper()
	logger := watermill.NopLogger{}
	var a acks
	var fx testenv.Effects
	r := newRouter(t)
	r.AddMiddleware(a.middleware, idempotency.Middleware(store,
		idempotency.WithKeySource(idempotency.KeyFromMetadata("Idempotency-Key")), idempotency.WithClaim(10*time.Second)))

	marshaler := cqrs.JSONMarshaler{}
	processor, err := cqrs.NewCommandProcessorWithConfig(r, cqrs.CommandProcessorConfig{
		GenerateSubscribeTopic: func(cqrs.CommandProcessorGenerateSubscribeTopicParams) (string, error) { return topic, nil },
		SubscriberConstructor:  func(cqrs.CommandProcessorSubscriberConstructorParams) (message.Subscriber, error) { return sub() },
		Marshaler:              marshaler,
		Logger:                 logger,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := processor.AddHandlers(cqrs.NewCommandHandler("PlaceOrder", func(_ context.Context, cmd *PlaceOrder) error {
		fx.Add(cmd.OrderID)
		return nil
	})); err != nil {
		t.Fatal(err)
	}
	bus, err := cqrs.NewCommandBusWithConfig(pub, cqrs.CommandBusConfig{
		GeneratePublishTopic: func(cqrs.CommandBusGeneratePublishTopicParams) (string, error) { return topic, nil },
		OnSend: func(p cqrs.CommandBusOnSendParams) error {
			if cmd, ok := p.Command.(*PlaceOrder); ok {
				p.Message.Metadata.Set("Idempotency-Key", "place-order-"+cmd.OrderID)
			}
			return nil
		},
		Marshaler: marshaler,
		Logger:    logger,
	})
	if err != nil {
		t.Fatal(err)
	}
	testenv.RunRouter(t, r)

	ctx := context.Background()
	for _, cmd := range []*PlaceOrder{{"o-1", 10}, {"o-1", 10}, {"o-2", 20}} {
		if err := bus.Send(ctx, cmd); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "3 deliveries acked", func() bool { return a.acked.Load() >= 3 && (drained == nil || drained()) })
	a.wg.Wait()
	if err := fx.ExactlyOnce([]string{"o-1", "o-2"}); err != nil {
		t.Fatalf("commands: %v", err)
	}
}

func TestKeySourceCQRSCommandSentTwiceHandledOnceOnGoChannel(t *testing.T) {
	t.Parallel()
	ps := newPubSub()
	cqrsOnce(t, ps, func() (message.Subscriber, error) { return ps, nil }, "commands", memstore.New(), nil)
}

func TestKeySourceCQRSCommandSentTwiceHandledOnceOnRedisStreams(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	prefix := "t" + testenv.RandomHex(4) + ":"
	topic, group := "bq-test-commands-"+testenv.RandomHex(4), "g-"+testenv.RandomHex(4)
	t.Cleanup(func() {
		ctx := context.Background()
		client.Del(ctx, topic)
		_ = testenv.DropKeys(ctx, client, prefix+"*")
	})
	logger := watermill.NopLogger{}
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: client}, logger)
	if err != nil {
		t.Fatal(err)
	}
	sub := func() (message.Subscriber, error) {
		return redisstream.NewSubscriber(redisstream.SubscriberConfig{
			Client: client, ConsumerGroup: group, OldestId: "0",
			NackResendSleep: 20 * time.Millisecond, BlockTime: 100 * time.Millisecond,
			DisableIndefiniteInitialBlock: true,
		}, logger)
	}
	store := redisstore.New(client, redisstore.WithPrefix(prefix), redisstore.WithTTL(10*time.Minute))
	cqrsOnce(t, pub, sub, topic, store, func() bool {
		return testenv.StreamDrained(context.Background(), client, topic, group, 3)
	})
}
