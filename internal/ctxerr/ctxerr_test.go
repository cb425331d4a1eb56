package ctxerr_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/internal/ctxerr"
)

// deadlinePassed is a context whose deadline has passed but which does
// not report done yet: the moment between a network deadline set from it
// firing and its own timer doing so.
type deadlinePassed struct{ context.Context }

func (deadlinePassed) Deadline() (time.Time, bool) { return time.Now().Add(-time.Millisecond), true }

// TestMatch: an error of a statement or a dial cut short by its
// context matches the context's error, even in the moment before the
// context reports done; any other error is left as it is.
func TestMatch(t *testing.T) {
	cause := errors.New("dial tcp 127.0.0.1:5432: i/o timeout")
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, c := range []struct {
		name string
		ctx  context.Context
		err  error
		want error // nil: err as it is
	}{
		{"no error", cancelled, nil, nil},
		{"context live", context.Background(), cause, nil},
		{"context cancelled", cancelled, cause, context.Canceled},
		{"deadline passed, context not yet done", deadlinePassed{context.Background()}, cause, context.DeadlineExceeded},
		{"already the context's", cancelled, fmt.Errorf("query: %w", context.Canceled), nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := ctxerr.Match(c.ctx, c.err)
			switch {
			case c.err == nil:
				if got != nil {
					t.Fatalf("Match(nil) = %v; want nil", got)
				}
			case c.want == nil:
				if got != c.err {
					t.Fatalf("Match(%v) = %v; want the error as it is", c.err, got)
				}
			case !errors.Is(got, c.want) || !errors.Is(got, c.err):
				t.Fatalf("Match(%v) = %v; want it to match %v and the driver's error", c.err, got, c.want)
			}
		})
	}
}
