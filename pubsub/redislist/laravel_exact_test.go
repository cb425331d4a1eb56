package redislist_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/pubsub/redislist"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// laravelJobText is a job as PHP's json_encode writes one: escaped
// slashes and unicode, an integer beyond float64's 53 bits, an empty
// array, a decimal with a trailing zero.
const laravelJobText = `{"uuid":"6f1c2a8e-4b0e-4c55-9a43-0d5c2f3b9a10","displayName":"App\\Jobs\\Charge","job":"Illuminate\\Queue\\CallQueuedHandler@call","maxTries":null,"maxExceptions":null,"failOnTimeout":false,"backoff":null,"timeout":null,"retryUntil":null,"data":{"commandName":"App\\Jobs\\Charge","command":"O:15:\"App\\Jobs\\Charge\":1:{s:8:\"order_id\";i:1;}","order_id":1790000000000000001,"lines":[],"amount":1.10,"note":"caf\u00e9 \/ x"},"id":"Qz8cWm2KfT0x","attempts":0}`

// TestLaravelLapsedReservationKeepsTheJobExact: the reserved member is the
// job byte for byte, with "attempts" one higher and the reservation token
// as its first member; when the worker dies and the reservation lapses,
// the job delivered again is the one pushed, every byte of its data as it
// was. It used to be re-encoded by the pop script's JSON library, which
// rounds integers to 14 digits and writes [] as {}.
func TestLaravelLapsedReservationKeepsTheJobExact(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	name, php := laravelQueue(t, client)
	cleanupLaravel(t, client, php.queue)
	ctx := context.Background()
	php.push(t, []byte(laravelJobText))

	_, dying := newPubSub(t, client, laravelOpts(redislist.WithVisibilityTimeout(time.Second), redislist.WithCloseTimeout(10*time.Millisecond))...)
	msgs, err := dying.Subscribe(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	first := receive(t, msgs)
	if string(first.Payload) != laravelJobText {
		t.Fatalf("delivered\n%s\nwant the job as pushed\n%s", first.Payload, laravelJobText)
	}
	reserved := client.ZRange(ctx, php.queue+":reserved", 0, -1).Val()
	bumped := strings.Replace(laravelJobText, `"attempts":0`, `"attempts":1`, 1)
	if len(reserved) != 1 || !strings.HasPrefix(reserved[0], `{"`+redislist.LaravelReservationKey+`":"`) ||
		len(reserved[0]) != len(bumped)+len(redislist.LaravelReservationKey)+22 || reserved[0][len(redislist.LaravelReservationKey)+23:] != bumped[1:] {
		t.Fatalf("reserved set %q,\nwant one member: the token first, then the job byte for byte with attempts 1:\n%s", reserved, bumped)
	}
	_ = dying.Close() // no ack: the worker died

	_, sub := newPubSub(t, client, laravelOpts(redislist.WithVisibilityTimeout(time.Second))...)
	msgs, err = sub.Subscribe(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	again := receive(t, msgs)
	if string(again.Payload) != bumped {
		t.Fatalf("delivered after the reservation lapsed\n%s\nwant the job pushed with attempts 1, every other byte as it was\n%s", again.Payload, bumped)
	}
	again.Ack()
	eventually(t, "the queue drained", func() bool { r, res, d := laravelCopies(t, php); return r+res+d == 0 })
}

// TestLaravelJobTheLuaLibraryCannotEncodeIsNotLost: a job that is valid
// JSON but holds a number beyond float64 (1e400) is reserved and delivered
// like any other. The pop script used to take it off the ready list and
// then fail to re-encode it, so that it was on no list or set at all.
func TestLaravelJobTheLuaLibraryCannotEncodeIsNotLost(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	name, php := laravelQueue(t, client)
	cleanupLaravel(t, client, php.queue)
	ctx := context.Background()
	for _, job := range []string{
		`{"uuid":"a","attempts":0,"data":{"amount":1e400}}`,
		`{"uuid":"b","attempts":0,"data":{"amount":-1e400,"tiny":1e-400}}`,
	} {
		php.push(t, []byte(job))
	}
	_, sub := newPubSub(t, client, laravelOpts()...)
	msgs, err := sub.Subscribe(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`{"uuid":"a","attempts":0,"data":{"amount":1e400}}`, `{"uuid":"b","attempts":0,"data":{"amount":-1e400,"tiny":1e-400}}`} {
		select {
		case m := <-msgs:
			if string(m.Payload) != want {
				t.Fatalf("delivered %s, want %s", m.Payload, want)
			}
			m.Ack()
		case <-time.After(10 * time.Second):
			ready, reserved, delayed := laravelCopies(t, php)
			t.Fatalf("%s not delivered within 10 s; the queue holds %d ready, %d reserved, %d delayed", want, ready, reserved, delayed)
		}
	}
	eventually(t, "the queue drained", func() bool { r, res, d := laravelCopies(t, php); return r+res+d == 0 })
}
