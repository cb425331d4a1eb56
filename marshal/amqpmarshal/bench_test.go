package amqpmarshal_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/marshal/amqpmarshal"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// BenchmarkRouter measures the AMQP path end to end: b.N messages published
// as the SDKs publish them are consumed by a Watermill router through the
// marshaler, with a handler that does nothing ("bare") and with the kit in
// front of it (dead letters, attempt counting, the idempotency guard: on
// Redis for "kit", in memory for "kit-memstore", which isolates the
// middleware from the store's round trips; "kit-4-consumers" is "kit" with
// four subscriptions on the queue). Publishing is not timed. Run both in one invocation, several
// times, and compare with benchstat:
//
//	for i in 1 2 3 4 5 6; do go test -run '^$' -bench BenchmarkRouter -benchtime 3000x ./marshal/amqpmarshal/; done | tee amqp.txt
//	benchstat amqp.txt
func BenchmarkRouter(b *testing.B) {
	url := testenv.AMQPURL(b)
	client := testenv.Redis(b)
	for _, side := range []string{"bare", "kit-memstore", "kit", "kit-4-consumers"} {
		b.Run(side, func(b *testing.B) {
			conn := testenv.AMQP(b)
			ch, err := conn.Channel()
			if err != nil {
				b.Fatal(err)
			}
			queue := "bq-bench-" + testenv.RandomHex(6)
			prefix := "bq-bench-" + testenv.RandomHex(6) + ":"
			b.Cleanup(func() {
				_, _ = ch.QueueDelete(queue, false, false, false)
				_, _ = ch.QueueDelete(queue+".dlq", false, false, false)
				_ = testenv.DropKeys(context.Background(), client, prefix+"*")
			})
			if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			for i := range b.N {
				e, _ := envelope.New("urn:babel:orders:created", map[string]any{"order": i, "sku": "A-1042", "qty": 3}, envelope.WithQueue(queue))
				body, _ := e.Marshal()
				err := ch.PublishWithContext(context.Background(), "", queue, false, false, amqp.Publishing{
					ContentType: "application/json", DeliveryMode: amqp.Persistent, AppId: "babelqueue",
					Type: e.Job, CorrelationId: e.TraceID, MessageId: e.Meta.ID, Body: body,
					Headers: amqp.Table{"x-attempts": 0, "x-schema-version": 1, "x-source-lang": "python"},
				})
				if err != nil {
					b.Fatal(err)
				}
			}
			config := amqpmarshal.NewConfig(url)
			config.Consume.Qos.PrefetchCount = 64
			sub, err := wamqp.NewSubscriber(config, watermill.NopLogger{})
			if err != nil {
				b.Fatal(err)
			}
			defer sub.Close()
			router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
			if err != nil {
				b.Fatal(err)
			}
			if side != "bare" {
				pub, err := amqpmarshal.NewPublisher(config, watermill.NopLogger{})
				if err != nil {
					b.Fatal(err)
				}
				defer pub.Close()
				dlq, err := deadletter.Middleware(pub)
				if err != nil {
					b.Fatal(err)
				}
				var store stores.Store = memstore.New()
				if side != "kit-memstore" {
					store = redisstore.New(client, redisstore.WithPrefix(prefix), redisstore.WithTTL(time.Hour))
				}
				router.AddMiddleware(dlq, deadletter.CountAttempts, idempotency.Middleware(store))
			}
			var handled atomic.Int64
			done := make(chan struct{})
			consumers := 1
			if side == "kit-4-consumers" {
				consumers = 4 // four subscriptions on the queue, as four workers would be
			}
			for c := range consumers {
				router.AddConsumerHandler(fmt.Sprintf("bench-%d", c), queue, sub, func(*message.Message) error {
					if handled.Add(1) == int64(b.N) {
						close(done)
					}
					return nil
				})
			}
			b.ResetTimer()
			b.StartTimer()
			stop := testenv.RunRouter(b, router)
			select {
			case <-done:
			case <-time.After(5 * time.Minute):
				b.Fatalf("handled %d of %d", handled.Load(), b.N)
			}
			b.StopTimer()
			stop()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msg/s")
		})
	}
}
