package redisdeadline_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/internal/redisdeadline"
)

var errLeft = errors.New("left")

// TestWatchReturnsByTheDeadline: a call slower than its context's deadline
// returns leave's error at the deadline, and its answer goes to late.
func TestWatchReturnsByTheDeadline(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	release := make(chan struct{})
	lateAnswer := make(chan int, 1)
	start := time.Now()
	v, err := redisdeadline.Watch(ctx, false,
		func() (int, error) { <-release; return 7, nil },
		func(v int, err error) { lateAnswer <- v },
		func() error { return errLeft })
	took := time.Since(start)
	close(release)
	if v != 0 || !errors.Is(err, errLeft) {
		t.Fatalf("Watch = %d, %v; want 0 and leave's error", v, err)
	}
	if took > 5*time.Second {
		t.Fatalf("returned after %v, for a 50ms deadline", took)
	}
	select {
	case got := <-lateAnswer:
		if got != 7 {
			t.Fatalf("late got %d, want 7", got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("late was never handed the answer")
	}
}

// TestWatchKeepsAnAnswerInTime: an answer before the deadline is the
// caller's, and late is not called.
func TestWatchKeepsAnAnswerInTime(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	wantErr := errors.New("the call's")
	v, err := redisdeadline.Watch(ctx, false,
		func() (int, error) { return 3, wantErr },
		func(int, error) { t.Error("late called for an answer in time") },
		func() error { return errLeft })
	if v != 3 || err != wantErr {
		t.Fatalf("Watch = %d, %v; want 3, %v", v, err, wantErr)
	}
}

// TestWatchRunsInlineWithoutADeadline: with no deadline, or on a client
// that honours deadlines, the call runs on the caller's goroutine and its
// answer is the caller's, even from a context already done (a watched
// call would leave at once, its answer still 20ms away).
func TestWatchRunsInlineWithoutADeadline(t *testing.T) {
	t.Parallel()
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	expired, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	for _, c := range []struct {
		name   string
		ctx    context.Context
		inline bool
	}{
		{"no deadline", cancelled, false},
		{"client honours deadlines", expired, true},
	} {
		v, err := redisdeadline.Watch(c.ctx, c.inline,
			func() (int, error) { time.Sleep(20 * time.Millisecond); return 1, nil },
			nil, func() error { return errLeft })
		if v != 1 || err != nil {
			t.Errorf("%s: Watch = %d, %v; want the call's answer, 1 and no error", c.name, v, err)
		}
	}
	// The same call on a client that does not honour deadlines leaves.
	if _, err := redisdeadline.Watch(expired, false,
		func() (int, error) { time.Sleep(20 * time.Millisecond); return 1, nil },
		nil, func() error { return errLeft }); !errors.Is(err, errLeft) {
		t.Errorf("watched, past its deadline: %v; want leave's error", err)
	}
}
