package amqpmarshal_test

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/babelqueue/watermill-idempotency/marshal/amqpmarshal"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// A Go consumer beside PHP and Python services on RabbitMQ: it reads the
// "payments" queue the SDKs publish to, runs each payment once, carries the
// traceparent to what it produces, and dead-letters to "payments.dlq" as the
// SDKs do. (Not run: it needs a RabbitMQ server.)
func Example() {
	logger := watermill.NopLogger{}
	config := amqpmarshal.NewConfig("amqp://guest:guest@localhost:5672/")
	sub, err := wamqp.NewSubscriber(config, logger)
	if err != nil {
		panic(err)
	}
	pub, err := amqpmarshal.NewPublisher(config, logger) // declares payments.dlq before the first dead letter
	if err != nil {
		panic(err)
	}
	dlq, err := deadletter.Middleware(pub)
	if err != nil {
		panic(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		panic(err)
	}
	router.AddMiddleware(
		dlq,
		middleware.Retry{MaxRetries: 3, InitialInterval: 100 * time.Millisecond,
			ShouldRetry: func(p middleware.RetryParams) bool { return !idempotency.IsPermanent(p.Err) }}.Middleware,
		deadletter.CountAttempts,
		idempotency.Middleware(memstore.New()),
	)
	router.AddHandler("charge", "payments", sub, "receipts", pub, func(msg *message.Message) ([]*message.Message, error) {
		// charge the card, then tell the receipts service (the receipt inherits
		// a derived meta.id and the payment's traceparent)
		receipt, err := idempotency.NewChildMessage(msg, "receipt", "urn:babel:receipts:requested", map[string]string{"payment": msg.UUID})
		if err != nil {
			return nil, err
		}
		return []*message.Message{receipt}, nil
	})
	_ = router.Run(context.Background())
}
