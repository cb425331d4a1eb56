package idempotency_test

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// The middleware skips a redelivery of a message it already handled.
func Example() {
	store := memstore.New(memstore.WithTTL(72 * time.Hour))
	charge := idempotency.Middleware(store)(func(msg *message.Message) ([]*message.Message, error) {
		fmt.Println("charging card")
		return nil, nil
	})

	order, _ := envelope.New("urn:babel:payments:requested", map[string]any{"amount_cents": 1299})
	payload, _ := order.Marshal()

	// The broker delivers the same message twice.
	for range 2 {
		if _, err := charge(message.NewMessage(watermill.NewUUID(), payload)); err != nil {
			fmt.Println("error:", err)
		}
	}
	// Output:
	// charging card
}

// The recommended router set-up: permanent rejections go straight to a
// dead-letter topic, everything else is retried, and the idempotency guard
// sits innermost so that every retry consults it. Of three deliveries, the
// redelivery is skipped and the message with an unknown schema_version is
// dead-lettered: without the poison queue the router would retry it for
// ever.
func Example_router() {
	logger := watermill.NopLogger{}
	pubSub := gochannel.NewGoChannel(gochannel.Config{}, logger)
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		panic(err)
	}

	poison, err := middleware.PoisonQueueWithFilter(pubSub, "payments.dlq", idempotency.IsPermanent)
	if err != nil {
		panic(err)
	}
	router.AddMiddleware(
		middleware.Recoverer,
		poison,
		middleware.Retry{
			MaxRetries:      3,
			InitialInterval: 100 * time.Millisecond,
			ShouldRetry:     func(p middleware.RetryParams) bool { return !idempotency.IsPermanent(p.Err) },
		}.Middleware,
		idempotency.Middleware(memstore.New(), idempotency.WithClaim(30*time.Second)),
	)
	charged := make(chan struct{}, 2)
	router.AddConsumerHandler("charge", "payments", pubSub, func(msg *message.Message) error {
		id, _ := envelope.ReadIdentity(msg.Payload)
		fmt.Println("charging", id.ID)
		charged <- struct{}{}
		return nil
	})

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dlq, err := pubSub.Subscribe(ctx, "payments.dlq")
	if err != nil {
		panic(err)
	}
	stopped := make(chan struct{})
	go func() { _ = router.Run(ctx); close(stopped) }()
	<-router.Running()

	order, _ := envelope.New("urn:babel:payments:requested", map[string]any{"amount_cents": 1299},
		envelope.WithID("payment-1042"))
	payload, _ := order.Marshal()
	future := []byte(`{"job":"urn:babel:payments:requested","data":{},"meta":{"id":"payment-1043","schema_version":2}}`)
	for _, body := range [][]byte{payload, payload, future} { // the first one twice
		if err := pubSub.Publish("payments", message.NewMessage(watermill.NewUUID(), body)); err != nil {
			panic(err)
		}
	}

	<-charged // deliveries run concurrently: wait for the charge, then the dead letter
	rejected := <-dlq
	rejected.Ack()
	cancel()
	<-stopped
	id, _ := envelope.ReadIdentity(rejected.Payload)
	fmt.Println("dead-lettered", id.ID+":", rejected.Metadata.Get(middleware.ReasonForPoisonedKey))
	// Output:
	// charging payment-1042
	// dead-lettered payment-1043: idempotency: unsupported envelope schema version (permanent rejection): meta.schema_version 2, this consumer reads 1
}
