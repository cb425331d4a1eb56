package redislist_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/pubsub/redislist"
	"github.com/babelqueue/watermill-idempotency/testkit/conformance"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

const traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

func newPubSub(t testing.TB, client redis.UniversalClient, opts ...redislist.Option) (*redislist.Publisher, *redislist.Subscriber) {
	t.Helper()
	opts = append([]redislist.Option{redislist.WithBlockTime(100 * time.Millisecond), redislist.WithCloseTimeout(time.Second)}, opts...)
	pub, err := redislist.NewPublisher(client, opts...)
	if err != nil {
		t.Fatal(err)
	}
	sub, err := redislist.NewSubscriber(client, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Close(); _ = pub.Close() })
	return pub, sub
}

func receive(t testing.TB, msgs <-chan *message.Message) *message.Message {
	t.Helper()
	select {
	case m, ok := <-msgs:
		if !ok {
			t.Fatal("messages channel closed")
		}
		return m
	case <-time.After(10 * time.Second):
		t.Fatal("no message within 10 s")
	}
	return nil
}

func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func lrange(t testing.TB, client redis.UniversalClient, key string) []string {
	t.Helper()
	v, err := client.LRange(context.Background(), key, 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func newEnvelope(t testing.TB, queue string) []byte {
	t.Helper()
	e, err := envelope.New("urn:babel:orders:created", map[string]any{"order": 42, "big": json.Number("123456789012345678901")}, envelope.WithQueue(queue))
	if err != nil {
		t.Fatal(err)
	}
	b, err := e.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestPayloadIdentity runs the conformance block redis.payload_identity:
// the fixture envelope is stored as the list element byte for byte and
// comes back unchanged, with meta.id as the message UUID.
func TestPayloadIdentity(t *testing.T) {
	t.Parallel()
	var manifest struct {
		Redis struct {
			PayloadIdentity struct {
				EnvelopeFile string `json:"envelope_file"`
			} `json:"payload_identity"`
		} `json:"redis"`
	}
	raw, err := os.ReadFile(filepath.Join(conformance.Dir(), "manifest.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &manifest); err != nil {
		t.Fatal(err)
	}
	file := manifest.Redis.PayloadIdentity.EnvelopeFile
	if file == "" {
		t.Fatal("manifest has no redis.payload_identity.envelope_file")
	}
	fixture := conformance.Fixture(t, filepath.Base(file))
	id, err := envelope.ReadIdentity(fixture)
	if err != nil {
		t.Fatal(err)
	}

	client := testenv.Redis(t)
	queue := keyPrefix(t, client) + "orders"
	pub, sub := newPubSub(t, client)
	msg := message.NewMessage("not-the-id", fixture)
	// The projections restate the body: they do not turn the value into a frame.
	msg.Metadata.Set(envelope.MetadataMessageID, id.ID)
	msg.Metadata.Set(envelope.MetadataJob, "urn:x")
	if err := pub.Publish(queue, msg); err != nil {
		t.Fatal(err)
	}
	if got := lrange(t, client, queue); len(got) != 1 || got[0] != string(fixture) {
		t.Fatalf("stored element is not the fixture byte for byte:\n got %q\nwant %q", got, fixture)
	}
	msgs, err := sub.Subscribe(context.Background(), queue)
	if err != nil {
		t.Fatal(err)
	}
	got := receive(t, msgs)
	if !bytes.Equal(got.Payload, fixture) {
		t.Fatalf("reserved payload differs:\n got %q\nwant %q", got.Payload, fixture)
	}
	if got.UUID != id.ID {
		t.Fatalf("UUID %q, want meta.id %q", got.UUID, id.ID)
	}
	if p := lrange(t, client, queue+":processing"); len(p) != 1 || p[0] != string(fixture) {
		t.Fatalf("processing list holds %q, want the fixture", p)
	}
	got.Ack()
	eventually(t, "ack to empty the processing list", func() bool {
		return len(lrange(t, client, queue+":processing")) == 0 && client.ZCard(context.Background(), queue+":processing:leases").Val() == 0
	})
}

// TestFrames: out-of-band headers travel in the SDKs' frame, both ways.
func TestFrames(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	queue := keyPrefix(t, client) + "orders"
	pub, sub := newPubSub(t, client)
	body := newEnvelope(t, queue)

	msg := message.NewMessage("x", body)
	msg.Metadata.Set("traceparent", traceparent)
	msg.Metadata.Set("blank", "  ")
	if err := pub.Publish(queue, msg); err != nil {
		t.Fatal(err)
	}
	stored := lrange(t, client, queue)
	var f struct {
		Frame   int               `json:"__bq_frame"`
		Headers map[string]string `json:"headers"`
		Body    string            `json:"body"`
	}
	if err := json.Unmarshal([]byte(stored[0]), &f); err != nil {
		t.Fatal(err)
	}
	if f.Frame != 1 || f.Body != string(body) || len(f.Headers) != 1 || f.Headers["traceparent"] != traceparent {
		t.Fatalf("frame = %+v, want traceparent only and the body byte for byte", f)
	}

	// What the SDKs write, read back: frames and values that only look like one.
	sdkFrame, _ := json.Marshal(map[string]any{"__bq_frame": 1, "headers": map[string]any{"traceparent": traceparent, "n": 3, "": "x"}, "body": string(body)})
	notFrames := []string{
		`{"__bq_frame":0,"body":"x"}`,
		`{"__bq_frame":1,"body":{"a":1}}`,
		`{"__bq_frame":false,"headers":{},"body":"x"}`,
	}
	if err := client.RPush(context.Background(), queue, sdkFrame, notFrames[0], notFrames[1], notFrames[2]).Err(); err != nil {
		t.Fatal(err)
	}
	msgs, err := sub.Subscribe(context.Background(), queue)
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range []struct {
		payload string
		trace   string
	}{{string(body), traceparent}, {string(body), traceparent}, {notFrames[0], ""}, {notFrames[1], ""}, {notFrames[2], ""}} {
		m := receive(t, msgs)
		if string(m.Payload) != want.payload || m.Metadata.Get("traceparent") != want.trace {
			t.Fatalf("message %d: payload %q traceparent %q, want %q %q", i, m.Payload, m.Metadata.Get("traceparent"), want.payload, want.trace)
		}
		if i == 0 && len(m.Metadata) != 1 {
			t.Fatalf("message %d: metadata %v, want traceparent only", i, m.Metadata)
		}
		// The SDK's frame has headers that are not metadata: the value it
		// was read from rides along, so that a put-back writes it unchanged.
		if i == 1 && (len(m.Metadata) != 2 || m.Metadata.Get(redislist.MetadataStoredValue) != string(sdkFrame)) {
			t.Fatalf("message %d: metadata %v, want traceparent and the stored value", i, m.Metadata)
		}
		m.Ack()
	}
}

// TestNackRepublishesWithAttemptsPlusOne: a nack puts the envelope back
// with attempts one higher and nothing else changed, keeps the frame's
// headers, and removes the reserved copy in the same script.
func TestNackRepublishesWithAttemptsPlusOne(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	queue := keyPrefix(t, client) + "orders"
	pub, sub := newPubSub(t, client)
	body := newEnvelope(t, queue)
	msg := message.NewMessage("x", body)
	msg.Metadata.Set("traceparent", traceparent)
	if err := pub.Publish(queue, msg); err != nil {
		t.Fatal(err)
	}
	msgs, err := sub.Subscribe(context.Background(), queue)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := envelope.Parse(body)
	for attempt := 1; attempt <= 3; attempt++ {
		m := receive(t, msgs)
		got, err := envelope.Parse(m.Payload)
		if err != nil {
			t.Fatal(err)
		}
		want.Attempts = attempt - 1
		wantBytes, _ := want.Marshal()
		gotBytes, _ := got.Marshal()
		if !bytes.Equal(gotBytes, wantBytes) || m.Metadata.Get("traceparent") != traceparent {
			t.Fatalf("delivery %d:\n got %s %v\nwant %s", attempt, gotBytes, m.Metadata, wantBytes)
		}
		if !bytes.Contains(m.Payload, []byte(`"big":123456789012345678901`)) {
			t.Fatalf("data changed: %s", m.Payload)
		}
		m.Nack()
	}
	m := receive(t, msgs)
	m.Ack()
	eventually(t, "queue, processing and leases empty", func() bool {
		n, _ := client.Exists(context.Background(), queue, queue+":processing", queue+":processing:leases").Result()
		return n == 0
	})
}

// TestLapsedReservationIsDeliveredAgain: a consumer that stops without an
// ack (a worker that died) leaves its value reserved; after the visibility
// timeout another consumer gets it. A value an SDK worker reserved (in the
// processing list without a lease) is never touched.
func TestLapsedReservationIsDeliveredAgain(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	queue := keyPrefix(t, client) + "orders"
	ctx := context.Background()
	sdkReserved := newEnvelope(t, queue)
	if err := client.RPush(ctx, queue+":processing", sdkReserved).Err(); err != nil {
		t.Fatal(err)
	}
	pub, dying := newPubSub(t, client, redislist.WithVisibilityTimeout(time.Second), redislist.WithCloseTimeout(10*time.Millisecond))
	body := newEnvelope(t, queue)
	if err := pub.Publish(queue, message.NewMessage("x", body)); err != nil {
		t.Fatal(err)
	}
	msgs, err := dying.Subscribe(ctx, queue)
	if err != nil {
		t.Fatal(err)
	}
	first := receive(t, msgs)
	if err := dying.Close(); err != nil { // no ack: the worker is gone
		t.Fatal(err)
	}
	if p := lrange(t, client, queue+":processing"); len(p) != 2 {
		t.Fatalf("processing holds %d values, want the SDK's and ours", len(p))
	}

	_, sub := newPubSub(t, client, redislist.WithVisibilityTimeout(time.Second))
	start := time.Now()
	msgs, err = sub.Subscribe(ctx, queue)
	if err != nil {
		t.Fatal(err)
	}
	again := receive(t, msgs)
	if again.UUID != first.UUID || !bytes.Equal(again.Payload, body) {
		t.Fatalf("redelivered %s %s, want %s unchanged", again.UUID, again.Payload, first.UUID)
	}
	if waited := time.Since(start); waited > 5*time.Second {
		t.Fatalf("redelivered after %v, want about the 1 s visibility timeout", waited)
	}
	again.Ack()
	eventually(t, "only the SDK's value left in processing", func() bool {
		p := lrange(t, client, queue+":processing")
		return len(p) == 1 && p[0] == string(sdkReserved)
	})
	time.Sleep(1500 * time.Millisecond) // more reclaim rounds: still untouched
	if p := lrange(t, client, queue+":processing"); len(p) != 1 || p[0] != string(sdkReserved) || len(lrange(t, client, queue)) != 0 {
		t.Fatalf("the SDK worker's reservation was disturbed: processing %q", p)
	}
}

// TestLeaseExtendedWhileHandlerRuns: a handler slower than the visibility
// timeout keeps its message: no second delivery.
func TestLeaseExtendedWhileHandlerRuns(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	queue := keyPrefix(t, client) + "orders"
	pub, sub := newPubSub(t, client, redislist.WithVisibilityTimeout(600*time.Millisecond))
	_, other := newPubSub(t, client, redislist.WithVisibilityTimeout(600*time.Millisecond))
	if err := pub.Publish(queue, message.NewMessage("x", newEnvelope(t, queue))); err != nil {
		t.Fatal(err)
	}
	msgs, _ := sub.Subscribe(context.Background(), queue)
	otherMsgs, _ := other.Subscribe(context.Background(), queue)
	var m *message.Message
	select {
	case m = <-msgs:
		msgs = otherMsgs
	case m = <-otherMsgs:
	case <-time.After(10 * time.Second):
		t.Fatal("no message within 10 s")
	}
	select {
	case dup := <-msgs:
		t.Fatalf("delivered twice while the handler ran: %s", dup.UUID)
	case <-time.After(2 * time.Second):
	}
	m.Ack()
}

// TestCloseWaitsForInFlightAndLeaksNothing: Close returns after the
// message in flight is acked, hands back a message no one received, and
// leaves no goroutine behind. It runs alone (no t.Parallel): goleak sees
// every goroutine in the process.
func TestCloseWaitsForInFlightAndLeaksNothing(t *testing.T) {
	client := testenv.Redis(t)
	queue := keyPrefix(t, client) + "orders"
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	pub, err := redislist.NewPublisher(client)
	if err != nil {
		t.Fatal(err)
	}
	sub, err := redislist.NewSubscriber(client, redislist.WithBlockTime(100*time.Millisecond), redislist.WithCloseTimeout(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	a, b := newEnvelope(t, queue), newEnvelope(t, queue)
	if err := pub.Publish(queue, message.NewMessage("a", a), message.NewMessage("b", b)); err != nil {
		t.Fatal(err)
	}
	msgs1, _ := sub.Subscribe(context.Background(), queue)
	msgs2, _ := sub.Subscribe(context.Background(), queue)
	var inFlight *message.Message
	select {
	case inFlight = <-msgs1:
	case inFlight = <-msgs2:
	case <-time.After(10 * time.Second):
		t.Fatal("no message")
	}
	closed := make(chan struct{})
	go func() { _ = sub.Close(); close(closed) }()
	select {
	case <-closed:
		t.Fatal("Close returned before the message in flight was acked")
	case <-time.After(300 * time.Millisecond):
	}
	inFlight.Ack()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not return after the ack")
	}
	for range msgs1 {
		t.Fatal("a message came after Close")
	}
	for range msgs2 {
		t.Fatal("a message came after Close")
	}
	// The other message was reserved by the second consumer, never
	// received, and is back at the head of the queue.
	left := lrange(t, client, queue)
	if len(left) != 1 || len(lrange(t, client, queue+":processing")) != 0 {
		t.Fatalf("queue %q processing %q, want the unreceived message back", left, lrange(t, client, queue+":processing"))
	}
	if _, err := sub.Subscribe(context.Background(), queue); !errors.Is(err, redislist.ErrClosed) {
		t.Fatalf("Subscribe after Close: %v, want ErrClosed", err)
	}
	_ = pub.Close()
	if err := pub.Publish(queue, message.NewMessage("c", a)); !errors.Is(err, redislist.ErrClosed) {
		t.Fatalf("Publish after Close: %v, want ErrClosed", err)
	}
}

// TestPublishHonoursContextDeadline: Publish returns by the message
// context's deadline.
func TestPublishHonoursContextDeadline(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	queue := keyPrefix(t, client) + "orders"
	pub, _ := newPubSub(t, client)
	ctx, cancel := context.WithTimeout(context.Background(), -time.Second)
	defer cancel()
	msg := message.NewMessage("x", newEnvelope(t, queue))
	msg.SetContext(ctx)
	if err := pub.Publish(queue, msg); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Publish with an expired context: %v, want DeadlineExceeded", err)
	}
}

// TestRedisCluster: a queue named with a hash tag works on Redis Cluster;
// one without is refused with ErrNoHashTag.
func TestRedisCluster(t *testing.T) {
	t.Parallel()
	client := testenv.RedisCluster(t)
	tag := "{bqtest-" + testenv.RandomHex(6) + "}"
	t.Cleanup(func() {
		client.Del(context.Background(), tag, tag+":processing", tag+":processing:leases")
	})
	pub, sub := newPubSub(t, client)
	if _, err := sub.Subscribe(context.Background(), "orders-"+testenv.RandomHex(4)); !errors.Is(err, redislist.ErrNoHashTag) {
		t.Fatalf("Subscribe without a hash tag: %v, want ErrNoHashTag", err)
	}
	body := newEnvelope(t, tag)
	if err := pub.Publish(tag, message.NewMessage("x", body)); err != nil {
		t.Fatal(err)
	}
	msgs, err := sub.Subscribe(context.Background(), tag)
	if err != nil {
		t.Fatal(err)
	}
	m := receive(t, msgs)
	m.Nack()
	m = receive(t, msgs)
	if e, _ := envelope.Parse(m.Payload); e.Attempts != 1 {
		t.Fatalf("attempts %d after a nack on the cluster, want 1", e.Attempts)
	}
	m.Ack()
	eventually(t, "cluster keys empty", func() bool {
		n, _ := client.Exists(context.Background(), tag+":processing").Result()
		m, _ := client.Exists(context.Background(), tag).Result()
		return n+m == 0
	})
}
