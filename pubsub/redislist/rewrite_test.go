package redislist_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/pubsub/redislist"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// pythonString spells s as a JSON string the way Python's json.dumps does
// by default (ensure_ascii): every character beyond ASCII as a \u escape.
func pythonString(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r < 0x20 || r > 0x7e:
			if r > 0xffff {
				r -= 0x10000
				fmt.Fprintf(&b, `\u%04x\u%04x`, 0xd800+(r>>10), 0xdc00+(r&0x3ff))
				continue
			}
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte('"')
	return b.String()
}

// sdkFrame is a frame as an SDK in another language writes it: Python's
// separators and escapes, headers in its own order, a header that is not a
// string (which the kit does not make metadata of) and a body with
// characters beyond ASCII.
func sdkFrame(queue string, attempts int) (value, body string) {
	body = fmt.Sprintf(`{"job": "urn:babel:orders:created", "trace_id": "t-%[1]s", "data": {"note": "café <b>&</b> 🚚", "big": 123456789012345678901}, `+
		`"meta": {"id": "id-%[1]s", "queue": %[2]q, "lang": "python", "schema_version": 1, "created_at": 1700000000000}, "attempts": %[3]d}`,
		testenv.RandomHex(4), queue, attempts)
	value = `{"__bq_frame": 1, "headers": {"traceparent": "` + traceparent + `", "x-retries": 3, "sampled": true}, "body": ` + pythonString(body) + `}`
	return value, body
}

// TestNackKeepsAnSDKFrameByteForByte: a nack of a frame an SDK wrote puts
// back the very bytes it stored, but for the body's "attempts", one
// higher: its header that is not a string, its separators, its escapes and
// its member order stay. (The kit used to re-encode the frame from the
// string headers alone: sorted, compact, the other headers dropped.)
func TestNackKeepsAnSDKFrameByteForByte(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	queue := keyPrefix(t, client) + "orders"
	value, _ := sdkFrame(queue, 0)
	if err := client.RPush(context.Background(), queue, value).Err(); err != nil {
		t.Fatal(err)
	}
	_, sub := newPubSub(t, client)
	msgs, err := sub.Subscribe(context.Background(), queue)
	if err != nil {
		t.Fatal(err)
	}
	for attempt := range 3 {
		m := receive(t, msgs)
		if m.Metadata.Get("traceparent") != traceparent || !bytes.Contains(m.Payload, fmt.Appendf(nil, `"attempts": %d}`, attempt)) {
			t.Fatalf("delivery %d: payload %s metadata %v", attempt, m.Payload, m.Metadata)
		}
		m.Nack()
		want := strings.Replace(value, `\"attempts\": 0}`, fmt.Sprintf(`\"attempts\": %d}`, attempt+1), 1)
		// The subscription reserves the value again at once: it is on the
		// queue or reserved, byte for byte.
		var got []string
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			if got = append(lrange(t, client, queue), lrange(t, client, queue+":processing")...); len(got) == 1 && got[0] == want {
				break
			}
		}
		if len(got) != 1 || got[0] != want {
			t.Fatalf("nack %d put back\n%q\nwant\n%s", attempt+1, got, want)
		}
	}
	m := receive(t, msgs)
	m.Ack()
	eventually(t, "the queue drained", func() bool { return drained(client, queue) })
}

// TestPutBackKeepsTheStoredValue: a message read from a list and published
// back unchanged, as a redrive run puts back a dead letter it does not move
// (a new message with the UUID, payload and metadata of the one it read),
// is stored as the very value it was read from: an SDK's frame keeps its
// headers that are not strings and its spelling, and a bare value without
// meta.id stays bare (the kit used to wrap it in a frame with an invented
// bq-watermill-uuid header). A message that was changed is written afresh.
func TestPutBackKeepsTheStoredValue(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	queue := keyPrefix(t, client) + "orders.dlq"
	frame, _ := sdkFrame(queue, 3)
	values := []string{
		frame,
		`not an envelope: no meta.id`,
		`{"__bq_frame":1,"headers":{},"body":"{\"attempts\":1}"}`,
		`{"__bq_frame":1,"headers":{"traceparent":"` + traceparent + `"},"body":"{\"attempts\":1}","sdk":"extra member"}`,
		string(newEnvelope(t, queue)),
	}
	for _, v := range values {
		if err := client.RPush(context.Background(), queue, v).Err(); err != nil {
			t.Fatal(err)
		}
	}
	// Put back on a list of its own, which no subscription takes from.
	back := queue + ":back"
	pub, sub := newPubSub(t, client)
	msgs, err := sub.Subscribe(context.Background(), queue)
	if err != nil {
		t.Fatal(err)
	}
	var read []*message.Message
	for range values {
		m := receive(t, msgs)
		if err := pub.Publish(back, copyOf(m)); err != nil {
			t.Fatal(err)
		}
		m.Ack()
		read = append(read, m)
	}
	if got := lrange(t, client, back); strings.Join(got, "\n") != strings.Join(values, "\n") {
		for i := range got {
			if got[i] != values[i] {
				t.Errorf("value %d put back as\n%s\nwant\n%s", i, got[i], values[i])
			}
		}
		t.FailNow()
	}

	// Changed (a header added), a message is written afresh, and what it
	// was read from does not travel.
	changed := copyOf(read[0])
	changed.Metadata.Set("bq-dead-letter-put-back", "run-1")
	if err := pub.Publish(back, changed); err != nil {
		t.Fatal(err)
	}
	got := lrange(t, client, back)[len(values)]
	want := `{"__bq_frame":1,"headers":{"bq-dead-letter-put-back":"run-1","traceparent":"` + traceparent + `"},"body":`
	if !strings.HasPrefix(got, want) || strings.Contains(got, "x-retries") || strings.Contains(got, redislist.MetadataStoredValue) {
		t.Fatalf("changed message stored as\n%s\nwant a frame of its metadata, starting\n%s", got, want)
	}
}

// TestStoredValueIsATransportHeader: the copy of the value read describes
// one hop: a child, a dead letter or a redriven copy does not inherit it.
func TestStoredValueIsATransportHeader(t *testing.T) {
	t.Parallel()
	if !envelope.TransportHeader(redislist.MetadataStoredValue) {
		t.Fatalf("envelope.TransportHeader(%q) = false", redislist.MetadataStoredValue)
	}
}

// copyOf is what a redrive run puts back: a new message with the UUID,
// payload and metadata of m.
func copyOf(m *message.Message) *message.Message {
	c := message.NewMessage(m.UUID, m.Payload)
	for k, v := range m.Metadata {
		c.Metadata.Set(k, v)
	}
	return c
}

// TestBinaryBodyIsDeadLettered: a body that is not UTF-8 whose handler
// fails reaches the dead-letter list, framed with its metadata and its
// body in base64 under body_b64, and leaves the main queue: one handler
// run. It used to be refused (ErrNotUTF8), so the dead-letter middleware
// failed and the original was nacked for ever (48 handler runs in 5 s).
// Read back from the dead-letter list it is the same bytes.
func TestBinaryBodyIsDeadLettered(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	queue := keyPrefix(t, client) + "orders"
	body := []byte{0x0a, 0x03, 0xff, 0xfe, 0x80, 'o', 'k', 0x00, '"', '\\'}
	if err := client.RPush(context.Background(), queue, body).Err(); err != nil {
		t.Fatal(err)
	}
	pub, _ := newPubSub(t, client)
	dlq, err := deadletter.Middleware(pub)
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	startWorker(t, client, queue, []message.HandlerMiddleware{dlq}, func(*message.Message) error {
		runs.Add(1)
		return errors.New("cannot decode a protobuf body")
	})
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if client.LLen(context.Background(), queue+".dlq").Val() == 1 && drained(client, queue) {
			break
		}
	}
	time.Sleep(300 * time.Millisecond) // room for a redelivery loop to show
	if n, dead := runs.Load(), client.LLen(context.Background(), queue+".dlq").Val(); n != 1 || dead != 1 {
		t.Fatalf("the handler ran %d times and %d dead letter(s) landed, want 1 and 1", n, dead)
	}
	if !drained(client, queue) {
		t.Fatalf("the original is still on %s: %v", queue, lrange(t, client, queue))
	}
	stored := lrange(t, client, queue+".dlq")[0]
	if !strings.Contains(stored, `"__bq_frame":1`) || !strings.Contains(stored, `"body_b64":`) || strings.Contains(stored, `"body":`) ||
		strings.Contains(stored, redislist.MetadataStoredValue) {
		t.Fatalf("dead letter stored as %s, want a frame with body_b64", stored)
	}
	_, sub := newPubSub(t, client)
	msgs, err := sub.Subscribe(context.Background(), queue+".dlq")
	if err != nil {
		t.Fatal(err)
	}
	m := receive(t, msgs)
	m.Ack()
	if !bytes.Equal(m.Payload, body) || m.Metadata.Get(deadletter.MetadataVerbatim) != "1" || m.Metadata.Get(deadletter.MetadataOriginalTopic) != queue {
		t.Fatalf("dead letter read back as % x %v", m.Payload, m.Metadata)
	}
	eventually(t, "the dead letter acked", func() bool { return drained(client, queue+".dlq") })
}
