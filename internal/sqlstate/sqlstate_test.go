package sqlstate_test

import (
	"context"
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
