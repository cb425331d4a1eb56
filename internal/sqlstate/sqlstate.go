// Package sqlstate reads a database error whatever the database/sql
// driver: its SQLSTATE (pgx's *pgconn.PgError and lib/pq's *pq.Error both
// report it through a SQLState method), and whether its context ended it.
package sqlstate

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Of returns the SQLSTATE of the first error in err's chain that has one,
// and whether there was one.
func Of(err error) (string, bool) {
	var state interface{ SQLState() string }
	if !errors.As(err, &state) {
		return "", false
	}
	return state.SQLState(), true
}

// Is reports whether err carries the SQLSTATE code.
func Is(err error, code string) bool {
	got, ok := Of(err)
	return ok && got == code
}

// Codes PostgreSQL reports that the kit's packages act on.
const (
	SerializationFailure = "40001"
	DeadlockDetected     = "40P01"
	UndefinedTable       = "42P01"
)

// WithContext makes err, the error of a statement, a Redis command or a
// connection run under ctx, match ctx's error once ctx is done or past
// its deadline, whatever the driver or client reported: lib/pq reports
// the server's "canceling statement due to user request" for a statement
// its context cancelled, and a dial or a read cut short by the deadline
// reports a network timeout, which a moment before ctx's own timer fires
// finds ctx not yet done. nil stays nil.
func WithContext(ctx context.Context, err error) error {
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
