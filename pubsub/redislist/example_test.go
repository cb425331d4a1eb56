package redislist_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/pubsub/redislist"
)

// A Go service and a Python or PHP service share one BabelQueue queue on
// Redis: what the SDKs push is consumed here, and what is published here
// is what they read. A W3C traceparent travels in the SDKs' frame.
// (It needs Redis at REDIS_URL, or localhost:6379.)
func Example() {
	url := os.Getenv("REDIS_URL")
	if url == "" {
		url = "redis://localhost:6379/0"
	}
	opts, _ := redis.ParseURL(url)
	client := redis.NewClient(opts)
	defer client.Close()
	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	queue := "orders-example-" + hex.EncodeToString(suffix)
	defer client.Del(context.Background(), queue, queue+":processing", queue+":processing:leases")

	pub, _ := redislist.NewPublisher(client)
	sub, _ := redislist.NewSubscriber(client, redislist.WithVisibilityTimeout(time.Minute))
	defer sub.Close()

	order, _ := envelope.New("urn:babel:orders:created", map[string]any{"order_id": 42}, envelope.WithQueue(queue))
	payload, _ := order.Marshal()
	msg := message.NewMessage(order.Meta.ID, payload)
	msg.Metadata.Set("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	if err := pub.Publish(queue, msg); err != nil {
		fmt.Println("publish:", err)
		return
	}
	stored, _ := client.LIndex(context.Background(), queue, 0).Result()
	fmt.Println("stored as a frame:", stored[:len(`{"__bq_frame":1`)])

	msgs, _ := sub.Subscribe(context.Background(), queue)
	got := <-msgs
	e, _ := envelope.Parse(got.Payload)
	fmt.Println(e.Job, got.UUID == order.Meta.ID, got.Metadata.Get("traceparent")[:2])
	got.Ack()
	// Output:
	// stored as a frame: {"__bq_frame":1
	// urn:babel:orders:created true 00
}
