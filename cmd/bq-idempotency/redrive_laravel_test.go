package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/pubsub/redislist"
)

// TestRedriveLaravelKeepsADeadLetterItPutsBack: a dead letter on a Laravel
// dead-letter queue that a run does not select is put back, and the
// subscriber may take the put-back again before the original is acked: the
// two reservations are byte-identical. Run after run the dead letter stays
// on the queue, unchanged, and nothing is left reserved. The two used to
// be one member of the reserved set, and the ack of the original took the
// put-back's reservation with it: the dead letter was gone (0 ready, 0
// reserved).
func TestRedriveLaravelKeepsADeadLetterItPutsBack(t *testing.T) {
	t.Parallel()
	d := newListDeadLetters(t, redislist.LayoutLaravel, "")
	dead := d.deadLetter(0)
	d.push(dead)
	for run := range 5 {
		r := d.redrive("--reason", "poison")
		if r.code != 0 || !strings.Contains(r.stdout, "1 read, 0 moved, 1 kept") {
			t.Fatalf("run %d: exit %d\n%s%s", run, r.code, r.stdout, r.stderr)
		}
		if got, n := d.waiting(), d.reserved(); len(got) != 1 || !bytes.Equal(got[0], dead) || n != 0 {
			t.Fatalf("after run %d: %d waiting, %d reserved; want the dead letter, unchanged, and nothing reserved", run, len(got), n)
		}
	}
}

// TestRedriveLaravelMovesABodyThatIsNotAJob: a dead letter whose body is
// not a Laravel job (binary, dead-lettered verbatim) sits on a Laravel
// dead-letter queue wrapped in a Laravel job that carries it and its
// dead-letter metadata. A run that does not move it puts it back, body and
// metadata unchanged; --move-verbatim moves it to the queue it came from,
// where the kit reads it back byte for byte. Publish used to refuse such a
// dead letter (ErrNotLaravelJob), so it never reached the queue.
func TestRedriveLaravelMovesABodyThatIsNotAJob(t *testing.T) {
	t.Parallel()
	d := newListDeadLetters(t, redislist.LayoutLaravel, "")
	body := []byte{0x0a, 0x03, 0xff, 0xfe, 0x80, 'o', 'k', 0x00}
	pub, err := redislist.NewPublisher(d.client, redislist.WithLayout(redislist.LayoutLaravel))
	if err != nil {
		t.Fatal(err)
	}
	dead := message.NewMessage("uuid-1", body)
	dead.Metadata.Set(deadletter.MetadataReason, envelope.ReasonFailed)
	dead.Metadata.Set(deadletter.MetadataOriginalTopic, d.queue)
	dead.Metadata.Set(deadletter.MetadataVerbatim, "1")
	if err := pub.Publish(d.dlq, dead); err != nil {
		t.Fatalf("dead-letter a body that is not a Laravel job: %v", err)
	}
	if r := d.redrive(); r.code != 0 || !strings.Contains(r.stdout, "1 read, 0 moved, 1 kept") || strings.Contains(r.stdout, "skipped") {
		t.Fatalf("run without --move-verbatim: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if got := d.waiting(); len(got) != 1 || !bytes.Equal(got[0], body) {
		t.Fatalf("put back as %q, want the body byte for byte", got)
	}
	if r := d.redrive("--move-verbatim"); r.code != 0 || !strings.Contains(r.stdout, "1 read, 1 moved") {
		t.Fatalf("run with --move-verbatim: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if n := d.reserved(); n != 0 || len(d.waiting()) != 0 {
		t.Fatalf("%d reserved, %d waiting on the dead-letter queue after the move", n, len(d.waiting()))
	}
	sub, err := redislist.NewSubscriber(d.client, redislist.WithLayout(redislist.LayoutLaravel), redislist.WithBlockTime(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	msgs, err := sub.Subscribe(ctx, d.queue)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-msgs:
		m.Ack()
		if !bytes.Equal(m.Payload, body) || m.UUID != "uuid-1" || m.Metadata.Get(deadletter.MetadataReason) != "" {
			t.Fatalf("moved message read as %s % x %v, want % x without the dead-letter metadata", m.UUID, m.Payload, m.Metadata, body)
		}
	case <-ctx.Done():
		t.Fatalf("nothing on %s after the move", d.queue)
	}
}
