package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestMain leaves out Example, which needs Redis, when Redis is not there
// (unless CI is set).
func TestMain(m *testing.M) {
	os.Exit(testenv.RunWithServerExamples(m, "Redis", func(ctx context.Context) error {
		opts, err := redis.ParseURL(testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL))
		if err != nil {
			return err
		}
		client := redis.NewClient(opts)
		defer client.Close()
		return client.Ping(ctx).Err()
	}, "Example"))
}

// A fleet shares one Redis: the second delivery of a message is skipped,
// and the record expires with the TTL. It needs the Redis at REDIS_URL
// (default redis://localhost:6379/0).
func Example() {
	url := os.Getenv("REDIS_URL")
	if url == "" {
		url = "redis://localhost:6379/0"
	}
	opts, err := redis.ParseURL(url)
	if err != nil {
		panic(err)
	}
	client := redis.NewClient(opts)
	defer client.Close()
	store := redisstore.New(client, redisstore.WithTTL(7*24*time.Hour))

	charge := idempotency.Middleware(store)(func(*message.Message) ([]*message.Message, error) {
		fmt.Println("charging card")
		return nil, nil
	})
	id := "payment-" + watermill.NewUUID() // one id per run of the example
	payment, _ := envelope.New("urn:babel:payments:requested", map[string]any{"amount_cents": 1299}, envelope.WithID(id))
	payload, _ := payment.Marshal()
	for range 2 { // the broker delivers it twice
		if _, err := charge(message.NewMessage(watermill.NewUUID(), payload)); err != nil {
			panic(err)
		}
	}

	ctx := context.Background()
	ttl, err := client.PTTL(ctx, store.RedisKey(id)).Result() // called directly, the key is meta.id
	if err != nil {
		panic(err)
	}
	fmt.Println("kept for about 7 days:", ttl > 7*24*time.Hour-time.Minute)
	if err := store.Forget(ctx, id); err != nil { // leave nothing behind
		panic(err)
	}
	// Output:
	// charging card
	// kept for about 7 days: true
}

// A record's Redis key is the prefix and an 11-byte digest of the store key
// (the handler name and meta.id), whatever their length: find it with
// redis-cli. RedisKey does no I/O.
func ExampleStore_RedisKey() {
	client := redis.NewClient(&redis.Options{Addr: "localhost:6379"}) // not contacted
	defer client.Close()
	store := redisstore.New(client)

	key := store.RedisKey(idempotency.Key("charge", "payment-1042"))
	fmt.Printf("%d bytes: %q + %x\n", len(key), key[:len(redisstore.DefaultPrefix)], key[len(redisstore.DefaultPrefix):])
	// Output:
	// 14 bytes: "bq:" + 36c87ab4776a5d0f4cc60e
}

// Check a prefix from configuration before New, which panics on a bad one:
// braces would make a Redis Cluster hash tag and put every record in one
// slot.
func ExampleValidatePrefix() {
	fmt.Println(redisstore.ValidatePrefix("payments:"))
	err := redisstore.ValidatePrefix("{payments}:")
	fmt.Println(errors.Is(err, redisstore.ErrInvalidOption))
	// Output:
	// <nil>
	// true
}
