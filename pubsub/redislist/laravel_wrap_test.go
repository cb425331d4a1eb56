package redislist_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// notJobs are bodies a Laravel worker cannot take as they are: binary, text
// that is not JSON, and JSON that is no Laravel job.
var notJobs = [][]byte{
	{0x0a, 0x03, 0xff, 0xfe, 0x80, 'o', 'k', 0x00},
	[]byte("plain text, not JSON"),
	[]byte(`{"no":"attempts"}`),
}

// TestLaravelDeadLetterOfABodyThatIsNotAJob: bodies that are not Laravel
// jobs, pushed raw on a Laravel queue by another producer, fail for good in
// a kit handler. Each lands on the dead-letter queue, wrapped in a Laravel
// job that carries it and the dead-letter metadata, and leaves the main
// queue; Laravel's own pop takes the wrapper without a script error, and
// the kit's subscriber reads the body back byte for byte with its
// metadata. Publish used to refuse such a body (ErrNotLaravelJob): the
// original was nacked and delivered again for ever, the dead-letter queue
// empty.
func TestLaravelDeadLetterOfABodyThatIsNotAJob(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	name, php := laravelQueue(t, client)
	cleanupLaravel(t, client, php.queue)
	dlqName := name + ".dlq"
	dlq := phpWorker{client: client, queue: "queues:" + dlqName}
	cleanupLaravel(t, client, dlq.queue)
	for _, body := range notJobs {
		php.push(t, body)
	}

	pub, sub := newPubSub(t, client, laravelOpts()...)
	mw, err := deadletter.Middleware(pub)
	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(mw)
	var runs atomic.Int64
	r.AddConsumerHandler("parse", name, sub, func(*message.Message) error {
		runs.Add(1)
		return errors.New("cannot parse the body")
	})
	stop := testenv.RunRouter(t, r)
	ctx := context.Background()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ready, reserved, delayed := laravelCopies(t, php)
		n := client.LLen(ctx, dlq.queue).Val()
		if ready+reserved+delayed == 0 && n == int64(len(notJobs)) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %d runs: %d on the dead-letter queue, %d ready, %d reserved, %d delayed on the main queue; want the %d bodies dead-lettered and gone from the main queue",
				runs.Load(), n, ready, reserved, delayed, len(notJobs))
		}
		time.Sleep(20 * time.Millisecond)
	}
	stop()
	if got := runs.Load(); got != int64(len(notJobs)) {
		t.Errorf("%d handler runs for %d bodies, want one each", got, len(notJobs))
	}

	// Laravel's pop takes each wrapper: a JSON object with an integer
	// "attempts".
	scratch := phpWorker{client: client, queue: "queues:" + name + ".scratch"}
	cleanupLaravel(t, client, scratch.queue)
	for _, v := range lrange(t, client, dlq.queue) {
		scratch.push(t, []byte(v))
		popped := scratch.work(t, func(job []byte) {
			var decoded map[string]any
			if err := json.Unmarshal(job, &decoded); err != nil {
				t.Errorf("wrapper %s is not JSON: %v", job, err)
			}
			if a, ok := decoded["attempts"].(float64); !ok || a != 0 {
				t.Errorf("wrapper %s: attempts %v, want 0", job, decoded["attempts"])
			}
		})
		if !popped {
			t.Fatalf("Laravel's pop did not take the wrapper %s", v)
		}
	}

	// The kit reads each body back byte for byte, with the dead-letter
	// metadata.
	_, reader := newPubSub(t, client, laravelOpts()...)
	msgs, err := reader.Subscribe(ctx, dlqName)
	if err != nil {
		t.Fatal(err)
	}
	var got [][]byte
	for range notJobs {
		m := receive(t, msgs)
		got = append(got, m.Payload)
		if m.Metadata.Get(deadletter.MetadataOriginalTopic) != name || m.Metadata.Get(deadletter.MetadataReason) != envelope.ReasonFailed || m.Metadata.Get(deadletter.MetadataVerbatim) != "1" {
			t.Errorf("dead letter %q read with metadata %v, want the dead-letter reason and original topic", m.Payload, m.Metadata)
		}
		m.Ack()
	}
	for _, body := range notJobs {
		if !slices.ContainsFunc(got, func(b []byte) bool { return bytes.Equal(b, body) }) {
			t.Errorf("body % x not read back byte for byte; read %q", body, got)
		}
	}
	eventually(t, "the dead-letter queue drained", func() bool {
		n, _ := client.Exists(ctx, dlq.queue, dlq.queue+":reserved", dlq.queue+":delayed").Result()
		return n == 0
	})
}

// TestLaravelBodyThatIsNotAJobTravelsWrapped: Publish writes a body that is
// not a Laravel job as a wrapper Laravel's pop takes; the kit's subscriber
// delivers the body byte for byte with its UUID and metadata. A Nack sends
// it round again, still a wrapper; Close gives back one no handler took.
func TestLaravelBodyThatIsNotAJobTravelsWrapped(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	name, php := laravelQueue(t, client)
	cleanupLaravel(t, client, php.queue)
	ctx := context.Background()
	pub, sub := newPubSub(t, client, laravelOpts()...)
	msgs, err := sub.Subscribe(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	for i, body := range notJobs {
		uuid := "uuid-" + strconv.Itoa(i)
		msg := message.NewMessage(uuid, body)
		msg.Metadata.Set("name", "orders.PlaceOrder")
		if err := pub.Publish(name, msg); err != nil {
			t.Fatalf("publish % x: %v", body, err)
		}
		m := receive(t, msgs)
		if !bytes.Equal(m.Payload, body) || m.UUID != uuid || m.Metadata.Get("name") != "orders.PlaceOrder" {
			t.Fatalf("delivered %s % x %v, want % x with its UUID and metadata", m.UUID, m.Payload, m.Metadata, body)
		}
		// Reserved as a Laravel job (the previous ack may still be on its way).
		var found bool
		for _, member := range client.ZRange(ctx, php.queue+":reserved", 0, -1).Val() {
			var job struct {
				UUID     string `json:"uuid"`
				Attempts *int64 `json:"attempts"`
			}
			if json.Unmarshal([]byte(member), &job) == nil && job.UUID == uuid {
				found = job.Attempts != nil && *job.Attempts == 1
			}
		}
		if !found {
			t.Fatalf("%s not reserved as a Laravel job with attempts 1: %q", uuid, client.ZRange(ctx, php.queue+":reserved", 0, -1).Val())
		}
		m.Nack()
		again := receive(t, msgs)
		if !bytes.Equal(again.Payload, body) || again.UUID != uuid || again.Metadata.Get("name") != "orders.PlaceOrder" {
			t.Fatalf("after a nack: %s % x %v, want % x", again.UUID, again.Payload, again.Metadata, body)
		}
		again.Ack()
	}
	eventually(t, "the queue drained", func() bool { r, res, d := laravelCopies(t, php); return r+res+d == 0 })
}

// TestLaravelRawValueIsReservedWrapped: a value another producer pushed
// that is not a Laravel job is reserved wrapped (base64-encoded by the pop
// script, with attempts and the reservation token), so that a reservation
// that lapses or a release brings back a job Laravel's pop takes, and two
// identical values in flight stay apart. The handler gets the value byte
// for byte, on its first delivery and after a nack. It used to be reserved
// as it was: back on the ready list, it failed Laravel's pop.
func TestLaravelRawValueIsReservedWrapped(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	name, php := laravelQueue(t, client)
	cleanupLaravel(t, client, php.queue)
	scratch := phpWorker{client: client, queue: php.queue + "-scratch"}
	cleanupLaravel(t, client, scratch.queue)
	ctx := context.Background()
	all := make([]byte, 256)
	for i := range all {
		all[i] = byte(i)
	}
	_, sub := newPubSub(t, client, laravelOpts()...)
	msgs, err := sub.Subscribe(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	for _, value := range [][]byte{{}, []byte("a"), []byte("ab"), []byte("abc"), []byte("abcd"), all, []byte(`[1,2]`), []byte(`"attempts"`)} {
		php.push(t, value)
		m := receive(t, msgs)
		if !bytes.Equal(m.Payload, value) {
			t.Fatalf("delivered % x, want % x", m.Payload, value)
		}
		var member string
		for _, v := range client.ZRange(ctx, php.queue+":reserved", 0, -1).Val() {
			var job struct {
				Body     string `json:"body_b64"`
				Attempts int    `json:"attempts"`
				Token    string `json:"__bq_reservation"`
			}
			if json.Unmarshal([]byte(v), &job) == nil && job.Attempts == 1 && job.Token != "" {
				if body, err := base64.StdEncoding.DecodeString(job.Body); err == nil && bytes.Equal(body, value) {
					member = v
				}
			}
		}
		if member == "" {
			t.Fatalf("% x reserved as %q, want a Laravel job carrying it base64-encoded", value, client.ZRange(ctx, php.queue+":reserved", 0, -1).Val())
		}
		scratch.push(t, []byte(member))
		if !scratch.work(t, func([]byte) {}) {
			t.Fatalf("Laravel's pop did not take the reserved member %s", member)
		}
		m.Nack()
		again := receive(t, msgs)
		if !bytes.Equal(again.Payload, value) {
			t.Fatalf("after a nack: % x, want % x", again.Payload, value)
		}
		again.Ack()
	}
	eventually(t, "the queue drained", func() bool { r, res, d := laravelCopies(t, php); return r+res+d == 0 })
}
