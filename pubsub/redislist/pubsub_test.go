package redislist_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/pubsub/redislist"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// keyPrefix returns a prefix unique to the test whose keys are dropped
// when the test ends.
func keyPrefix(t testing.TB, client redis.UniversalClient) string {
	t.Helper()
	prefix := "bqtest:" + testenv.RandomHex(6) + ":"
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := testenv.DropKeys(ctx, client, prefix+"*"); err != nil {
			t.Errorf("drop %s*: %v", prefix, err)
		}
	})
	return prefix
}

// TestPubSub runs Watermill's own pub/sub suite against the reliable-list
// layout. Declared: persistent, in order for a single subscriber (one
// message in flight per subscription, FIFO until a nack puts a message at
// the tail), no consumer groups (a list is one queue of competing
// consumers), no exactly-once delivery.
func TestPubSub(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	prefix := keyPrefix(t, client)
	construct := func(t *testing.T) (message.Publisher, message.Subscriber) {
		opts := []redislist.Option{
			redislist.WithKeyPrefix(prefix),
			redislist.WithBlockTime(100 * time.Millisecond),
			redislist.WithVisibilityTimeout(30 * time.Second),
			redislist.WithCloseTimeout(time.Second),
		}
		pub, err := redislist.NewPublisher(client, opts...)
		if err != nil {
			t.Fatal(err)
		}
		sub, err := redislist.NewSubscriber(client, opts...)
		if err != nil {
			t.Fatal(err)
		}
		return pub, sub
	}
	tests.TestPubSub(t, tests.Features{
		ConsumerGroups:                      false,
		ExactlyOnceDelivery:                 false,
		GuaranteedOrder:                     true,
		GuaranteedOrderWithSingleSubscriber: true,
		Persistent:                          true,
	}, construct, func(t *testing.T, _ string) (message.Publisher, message.Subscriber) { return construct(t) })
}
