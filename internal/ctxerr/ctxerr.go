// Package ctxerr makes the error of a call that its context cut short
// match the context's error, whatever the driver or client reported, so
// that a caller who ran out of time is told so, and is not taken for a
// store that failed.
package ctxerr

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Match makes err, the error of a statement, a Redis command or a
// connection run under ctx, match ctx's error once ctx is done or past
// its deadline, whatever the driver or client reported: lib/pq reports
// the server's "canceling statement due to user request" for a statement
// its context cancelled, and a dial or a read cut short by the deadline
// reports a network timeout, which a moment before ctx's own timer fires
// finds ctx not yet done. nil stays nil.
func Match(ctx context.Context, err error) error {
	if err == nil {
		return nil
	}
	cerr := ctx.Err()
	if dl, ok := ctx.Deadline(); cerr == nil && ok && !time.Now().Before(dl) {
		cerr = context.DeadlineExceeded
	}
	if cerr == nil || errors.Is(err, cerr) {
		return err
	}
	return fmt.Errorf("%w (%w)", cerr, err)
}
