package redislist_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/pubsub/redislist"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestLapsedTwiceKeepsTheJobExact: a job of odd but valid JSON
// (spaces around members, an escaped member name, a nested "attempts" in
// data and in a string, a member that only mentions the reservation key,
// a duplicate key, an integer beyond float64, an empty array) popped by a
// worker that dies, lapsed and migrated back, twice: each delivery is the
// job pushed byte for byte with only the top-level "attempts" counted.
func TestLapsedTwiceKeepsTheJobExact(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("waits for two reservations to lapse")
	}
	client := testenv.Redis(t)
	name, php := laravelQueue(t, client)
	cleanupLaravel(t, client, php.queue)
	ctx := context.Background()
	job := ` { "uuid" : "u-1" ,"d\u0061ta":{"attempts":7,"s":"\"attempts\":1, \"` + redislist.LaravelReservationKey + `\":\"x\"","id":1790000000000000001,"lines":[]}, "x":1,"x":2,` + "\n\t" + `"attempts" : 4 } `
	php.push(t, []byte(job))
	for run, attempts := range []string{"4", "5", "6"} {
		want := strings.Replace(job, `"attempts" : 4`, `"attempts" : `+attempts, 1)
		opts := laravelOpts(redislist.WithVisibilityTimeout(time.Second), redislist.WithCloseTimeout(10*time.Millisecond))
		_, sub := newPubSub(t, client, opts...)
		msgs, err := sub.Subscribe(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		got := receive(t, msgs)
		if string(got.Payload) != want {
			t.Fatalf("delivery %d:\n%q\nwant\n%q", run+1, got.Payload, want)
		}
		if run == 2 {
			got.Ack()
		}
		_ = sub.Close() // dies without an ack (but the last)
	}
	eventually(t, "the queue drained", func() bool { r, res, d := laravelCopies(t, php); return r+res+d == 0 })
}
