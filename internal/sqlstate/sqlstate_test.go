package sqlstate_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	_ "github.com/lib/pq" // registers "postgres"

	"github.com/babelqueue/watermill-idempotency/internal/sqlstate"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestOfBothDrivers: the SQLSTATE of a real error, wrapped, through pgx and
// through lib/pq; none for an error without one.
func TestOfBothDrivers(t *testing.T) {
	for _, driver := range []string{"pgx", "postgres"} {
		db := testenv.PostgresWithDriver(t, driver)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := db.ExecContext(ctx, `SELECT * FROM no_such_table_sqlstate_test`)
		cancel()
		wrapped := fmt.Errorf("context: %w", err)
		if code, ok := sqlstate.Of(wrapped); !ok || code != sqlstate.UndefinedTable || !sqlstate.Is(wrapped, sqlstate.UndefinedTable) {
			t.Errorf("%s: Of(%v) = %q, %v; want %s", driver, err, code, ok, sqlstate.UndefinedTable)
		}
	}
	if code, ok := sqlstate.Of(fmt.Errorf("plain")); ok || code != "" || sqlstate.Is(nil, sqlstate.UndefinedTable) {
		t.Errorf("an error without a SQLSTATE: %q, %v", code, ok)
	}
}

// deadlinePassed is a context whose deadline has passed but which does
// not report done yet: the moment between a network deadline set from it
// firing and its own timer doing so.
type deadlinePassed struct{ context.Context }

func (deadlinePassed) Deadline() (time.Time, bool) { return time.Now().Add(-time.Millisecond), true }

// TestWithContext: an error of a statement or a dial cut short by its
// context matches the context's error, even in the moment before the
// context reports done; any other error is left as it is.
func TestWithContext(t *testing.T) {
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
			got := sqlstate.WithContext(c.ctx, c.err)
			switch {
			case c.err == nil:
				if got != nil {
					t.Fatalf("WithContext(nil) = %v; want nil", got)
				}
			case c.want == nil:
				if got != c.err {
					t.Fatalf("WithContext(%v) = %v; want the error as it is", c.err, got)
				}
			case !errors.Is(got, c.want) || !errors.Is(got, c.err):
				t.Fatalf("WithContext(%v) = %v; want it to match %v and the driver's error", c.err, got, c.want)
			}
		})
	}
}
