package redislist_test

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/pubsub/redislist"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestBinaryPayloadIsNeverAltered: a payload that is not UTF-8 (protobuf,
// the CQRS protobuf marshaler, compressed bodies) that must travel in a
// frame (it has metadata, or no meta.id, so its UUID goes in a header) is
// framed with the payload base64-encoded under body_b64 (a frame's "body"
// is a JSON string, where invalid bytes would become U+FFFD), and arrives
// byte for byte with its metadata and UUID.
func TestBinaryPayloadIsNeverAltered(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	queue := keyPrefix(t, client) + "bin"
	pub, sub := newPubSub(t, client)
	payload := []byte{0x0a, 0x03, 0xff, 0xfe, 0x80, 'o', 'k', 0x00}
	msg := message.NewMessage("a-uuid", payload)
	msg.Metadata.Set("name", "orders.PlaceOrder")
	if err := pub.Publish(queue, msg); err != nil {
		t.Fatal(err)
	}
	if v := client.LIndex(context.Background(), queue, 0).Val(); !strings.Contains(v, `"`+redislist.FrameBodyBase64Key+`":`) {
		t.Fatalf("stored %q, want a frame with %s", v, redislist.FrameBodyBase64Key)
	}
	msgs, err := sub.Subscribe(context.Background(), queue)
	if err != nil {
		t.Fatal(err)
	}
	got := receive(t, msgs)
	got.Ack()
	if !bytes.Equal(got.Payload, payload) || got.UUID != "a-uuid" || got.Metadata.Get("name") != "orders.PlaceOrder" {
		t.Fatalf("payload % x (uuid %s, metadata %v) arrived as % x (uuid %s, metadata %v)", payload, msg.UUID, msg.Metadata, got.Payload, got.UUID, got.Metadata)
	}
}
