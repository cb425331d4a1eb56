package redislist

import (
	"strconv"
	"testing"
)

// TestBumpAttemptsSaturates: a nack of a message whose "attempts" is the
// largest integer must not wrap it to a negative count (an SDK's
// max-attempts check would then never dead-letter it again); it stays at
// the largest integer.
func TestBumpAttemptsSaturates(t *testing.T) {
	in := `{"job":"x","attempts":` + strconv.FormatInt(1<<63-1, 10) + `}`
	got, _ := bumpAttempts([]byte(in))
	if string(got) != in {
		t.Fatalf("bumpAttempts(%s) = %s, want the count kept at its maximum", in, got)
	}
}
