package idempotency_test

import (
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
// sits innermost so that every retry consults it.
func Example_router() {
	logger := watermill.NopLogger{}
	pubSub := gochannel.NewGoChannel(gochannel.Config{}, logger)
	router, _ := message.NewRouter(message.RouterConfig{}, logger)

	poison, _ := middleware.PoisonQueueWithFilter(pubSub, "payments.dlq", idempotency.IsPermanent)
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
	router.AddConsumerHandler("charge", "payments", pubSub, func(msg *message.Message) error {
		return nil // charge the card
	})
	_ = router // router.Run(ctx) starts consuming
}
