// Command quickstart is the README's quick start, whole: a payments
// consumer on Redis Streams with the production wiring (the idempotency
// middleware with a retry budget, then the dead-letter topic), and a
// producer that sends envelopes keyed on a business id.
//
//	docker compose up -d --wait redis   # or any Redis 6.2+; REDIS_URL overrides
//	go run ./examples/quickstart
//
// The producer sends three payments, one of them twice, and a body that is
// not an envelope. Every payment is charged once; the unreadable body fails
// in the handler, runs four times in all (counted in the store, so a
// redelivery does not start over) and then lands on the dead-letter topic
// (payments.dlq here: "<topic>.dlq"), acked, instead of coming back for
// ever. The example removes its stream and records when it ends.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
)

func main() {
	url := os.Getenv("REDIS_URL")
	if url == "" {
		url = "redis://localhost:6379/0"
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := run(ctx, os.Stdout, url); err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
}

// wire is the production wiring the README shows first: the idempotency
// middleware with a retry budget per message innermost, and the
// dead-letter topic outermost, for what failed for good.
func wire(router *message.Router, publisher message.Publisher, store stores.Store) error {
	dlq, err := deadletter.Middleware(publisher) // failed for good: to "<topic>.dlq", then acked
	if err != nil {
		return err
	}
	router.AddMiddleware(
		dlq, // outermost: sees final failures only; a store outage or a parked copy goes back to the broker
		idempotency.Middleware(store, // claims keep concurrent copies apart; duplicates are skipped
			// A failing message (a panic included) runs 4 times in all, retried
			// in place with backoff and jitter, counted in the store whatever the
			// broker does; dead-lettered once, and a redelivery of it is acked.
			idempotency.WithRetries(idempotency.Retries{Max: 3})),
	)
	return nil
}

// payment is the data of an urn:babel:payments:requested envelope.
type payment struct {
	OrderID     string `json:"order_id"`
	AmountCents int64  `json:"amount_cents"`
	Currency    string `json:"currency"`
}

// send publishes one payment as an envelope whose meta.id is the payment's
// business key: sent twice, it is one payment.
func send(publisher message.Publisher, topic string, p payment) error {
	e, err := envelope.New("urn:babel:payments:requested", p,
		envelope.WithID("payment-"+p.OrderID), envelope.WithQueue(topic))
	if err != nil {
		return err
	}
	payload, err := e.Marshal()
	if err != nil {
		return err
	}
	return publisher.Publish(topic, message.NewMessage(e.Meta.ID, payload))
}

func run(ctx context.Context, out io.Writer, redisURL string) error {
	opts, err := redis.ParseURL(redisURL)
	if err != nil {
		return fmt.Errorf("REDIS_URL: %w", err)
	}
	redisClient := redis.NewClient(opts)
	defer redisClient.Close()
	if err := redisClient.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("redis at %s: %w (start one with `docker compose up -d --wait redis`)", opts.Addr, err)
	}
	// Names of this run's own, removed at the end.
	run := randomHex(4)
	topic, prefix := "bq-quickstart-payments-"+run, "bq-quickstart-"+run+":"
	defer cleanup(context.WithoutCancel(ctx), redisClient, topic, prefix)

	// 1. The store: one for the whole fleet, records kept 7 days. It has
	// redisClient to itself: watermill-redisstream closes the client it is
	// given when its subscriber or publisher closes, and a store on that
	// client could not record a delivery that ends during the shutdown (a
	// redelivery would run it again).
	store := redisstore.New(redisClient, redisstore.WithPrefix(prefix), redisstore.WithTTL(7*24*time.Hour))

	// 2. The broker: Redis Streams, one consumer group; a client each.
	logger := watermill.NopLogger{}
	publisher, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: redis.NewClient(opts)}, logger)
	if err != nil {
		return err
	}
	defer publisher.Close()
	subscriber, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
		Client: redis.NewClient(opts), ConsumerGroup: "payments", OldestId: "0",
		// A crashed consumer's pending messages go to another one after 5 s
		// idle (the default is a minute); the kit parks a copy whose first
		// run is still under way.
		ClaimInterval: time.Second, MaxIdleTime: 5 * time.Second,
	}, logger)
	if err != nil {
		return err
	}

	// 3. The router, wired for production, and the handler.
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	if err := wire(router, publisher, store); err != nil {
		return err
	}
	var mu sync.Mutex
	charged := map[string]int{}
	unreadable := 0
	router.AddConsumerHandler("charge", topic, subscriber, func(msg *message.Message) error {
		e, err := envelope.Parse(msg.Payload)
		if err != nil {
			mu.Lock()
			unreadable++
			mu.Unlock()
			return fmt.Errorf("unreadable payment: %w", err)
		}
		var p payment
		if err := json.Unmarshal(e.Data, &p); err != nil {
			return fmt.Errorf("unreadable payment %s: %w", e.Meta.ID, err)
		}
		mu.Lock()
		charged[p.OrderID]++
		mu.Unlock()
		fmt.Fprintf(out, "charged order %s: %d %s\n", p.OrderID, p.AmountCents, p.Currency)
		return nil
	})
	dlq, err := subscriber.Subscribe(ctx, topic+".dlq")
	if err != nil {
		return err
	}
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(ctx) }()
	<-router.Running()

	// 4. The producer: three payments, one sent twice, and a body that is
	// not an envelope.
	for _, p := range []payment{
		{"1042", 1299, "EUR"}, {"1043", 4500, "EUR"}, {"1042", 1299, "EUR"}, {"1044", 800, "USD"},
	} {
		if err := send(publisher, topic, p); err != nil {
			return err
		}
	}
	if err := publisher.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("not an envelope"))); err != nil {
		return err
	}

	// 5. The unreadable body reaches the dead-letter topic after four runs.
	select {
	case letter := <-dlq:
		letter.Ack()
		mu.Lock()
		runs := unreadable
		mu.Unlock()
		fmt.Fprintf(out, "dead-lettered after %d runs: %s\n", runs, letter.Metadata.Get(deadletter.MetadataError))
	case <-ctx.Done():
		return fmt.Errorf("no dead letter: %w", ctx.Err())
	}
	for ctx.Err() == nil {
		mu.Lock()
		done := len(charged) == 3
		mu.Unlock()
		if done {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := router.Close(); err != nil {
		return err
	}
	if err := <-routerDone; err != nil {
		return err
	}
	mu.Lock()
	defer mu.Unlock()
	for order, n := range charged {
		if n != 1 {
			return fmt.Errorf("order %s charged %d times", order, n)
		}
	}
	fmt.Fprintf(out, "%d orders, each charged once\n", len(charged))
	return nil
}

func cleanup(ctx context.Context, client *redis.Client, topic, prefix string) {
	client.Del(ctx, topic, topic+".dlq")
	var cursor uint64
	for {
		keys, next, err := client.Scan(ctx, cursor, prefix+"*", 1000).Result()
		if err != nil {
			return
		}
		if len(keys) > 0 {
			client.Del(ctx, keys...)
		}
		if cursor = next; cursor == 0 {
			return
		}
	}
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
