package redislist_test

import (
	"bytes"
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/internal/testenv"
	"github.com/babelqueue/watermill-idempotency/pubsub/redislist"
)

// TestBinaryPayloadIsNeverAltered: a payload that is not UTF-8 (protobuf,
// the CQRS protobuf marshaler, compressed bodies) that must travel in a
// frame (it has metadata, or no meta.id, so its UUID goes in a header)
// either arrives byte for byte or is refused at Publish with
// ErrNotUTF8; it is never delivered altered (a frame's body is a JSON
// string, where invalid bytes would become U+FFFD).
func TestBinaryPayloadIsNeverAltered(t *testing.T) {
	client := testenv.Redis(t)
	queue := keyPrefix(t, client) + "bin"
	pub, sub := newPubSub(t, client)
	payload := []byte{0x0a, 0x03, 0xff, 0xfe, 0x80, 'o', 'k', 0x00}
	msg := message.NewMessage("a-uuid", payload)
	msg.Metadata.Set("name", "orders.PlaceOrder")
	err := pub.Publish(queue, msg)
	if errors.Is(err, redislist.ErrNotUTF8) {
		if n := client.LLen(context.Background(), queue).Val(); n != 0 {
			t.Fatalf("refused, yet %d value(s) on the queue", n)
		}
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := sub.Subscribe(context.Background(), queue)
	if err != nil {
		t.Fatal(err)
	}
	got := receive(t, msgs)
	got.Ack()
	if !bytes.Equal(got.Payload, payload) {
		t.Fatalf("payload % x arrived as % x", payload, got.Payload)
	}
}
