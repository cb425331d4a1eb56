package main

import (
	"bytes"
	"strings"
	"testing"

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

