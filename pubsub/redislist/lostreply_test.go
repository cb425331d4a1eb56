package redislist_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/pubsub/redislist"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestLostBlockingReplyLosesNoMessage: a consumer waits on an empty queue
// (the blocking move), a message arrives, and the reply that carries it to
// the consumer is lost with its connection. The server already moved the
// value to the processing list; the message must still be delivered (by
// this consumer or after the visibility timeout), never left reserved for
// ever with no one to deliver it again.
func TestLostBlockingReplyLosesNoMessage(t *testing.T) {
	t.Parallel()
	direct := testenv.Redis(t)
	proxy := testenv.NewFaultProxy(t, direct.Options().Addr)
	opts := *direct.Options()
	opts.Addr = proxy.Addr()
	viaProxy := redis.NewClient(&opts)
	t.Cleanup(func() { _ = viaProxy.Close() })
	testenv.TrackKeys(t, viaProxy, direct)

	queue := keyPrefix(t, direct) + "orders"
	ctx := context.Background()
	const visibility = 2 * time.Second
	_, sub := newPubSub(t, viaProxy, redislist.WithVisibilityTimeout(visibility), redislist.WithBlockTime(time.Second))
	pub, err := redislist.NewPublisher(direct)
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := sub.Subscribe(ctx, queue)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond) // the consumer is waiting in the blocking move
	proxy.DropReply.Store(true)
	body := newEnvelope(t, queue)
	if err := pub.Publish(queue, message.NewMessage("x", body)); err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-msgs:
		m.Ack()
	case <-time.After(5 * visibility):
		t.Fatalf("message never delivered within 5x the visibility timeout (replies dropped: %d): queue %q, processing %q, leases %v",
			proxy.Dropped.Load(), lrange(t, direct, queue), lrange(t, direct, queue+":processing"),
			direct.ZRange(ctx, queue+":processing:leases", 0, -1).Val())
	}
}
