package deadletter_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// A handler that keeps failing: Retry runs it three times, then the
// message goes to orders.dlq as an envelope with a dead_letter block that
// any BabelQueue SDK can read, and the original is acked.
func Example() {
	logger := watermill.NopLogger{}
	pubSub := gochannel.NewGoChannel(gochannel.Config{}, logger)
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		panic(err)
	}
	dlq, err := deadletter.Middleware(pubSub)
	if err != nil {
		panic(err)
	}
	router.AddMiddleware(
		dlq, // outside Retry: sees only final errors
		middleware.Retry{
			MaxRetries:  2,
			ShouldRetry: func(p middleware.RetryParams) bool { return !idempotency.IsPermanent(p.Err) },
		}.Middleware,
		deadletter.CountAttempts, // inside Retry: counts the runs
		idempotency.Middleware(memstore.New()),
	)
	router.AddConsumerHandler("charge", "orders", pubSub, func(*message.Message) error {
		return errors.New("payment gateway said no")
	})

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dead, err := pubSub.Subscribe(ctx, "orders.dlq")
	if err != nil {
		panic(err)
	}
	stopped := make(chan struct{})
	go func() { _ = router.Run(ctx); close(stopped) }()
	<-router.Running()

	e, _ := envelope.New("urn:babel:payments:charge", map[string]any{"order_id": 1042},
		envelope.WithID("charge-1042"), envelope.WithQueue("orders"))
	payload, _ := e.Marshal()
	if err := pubSub.Publish("orders", message.NewMessage(watermill.NewUUID(), payload)); err != nil {
		panic(err)
	}

	msg := <-dead
	msg.Ack()
	cancel()
	<-stopped
	d, _ := envelope.Parse(msg.Payload)
	fmt.Println("id:", d.Meta.ID)
	fmt.Println("reason:", d.DeadLetter.Reason)
	fmt.Println("error:", *d.DeadLetter.Error)
	fmt.Println("original queue:", d.DeadLetter.OriginalQueue)
	fmt.Println("attempts:", d.DeadLetter.Attempts)
	// Output:
	// id: charge-1042
	// reason: failed
	// error: payment gateway said no
	// original queue: orders
	// attempts: 3
}
