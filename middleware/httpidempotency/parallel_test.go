package httpidempotency_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestMain runs the tests with testenv.SetParallelism (they wait on
// servers more than on the CPU), then drops every orders table a test
// created that still exists: once, in CI, one outlived its test's
// cleanup; the test is printed, so that the next such run says which.
func TestMain(m *testing.M) {
	code := testenv.Main(m)
	if err := ordersTables.dropLeft(); err != nil {
		fmt.Fprintf(os.Stderr, "httpidempotency tests: %v\n", err)
		code = 1
	}
	os.Exit(code)
}

// createdTables notes the tables the tests create, by the test that did.
type createdTables struct {
	mu     sync.Mutex
	tables map[string]string // table -> test name
}

// ordersTables are the orders tables of the tests' APIs.
var ordersTables = &createdTables{tables: map[string]string{}}

func (c *createdTables) add(t testing.TB, table string) {
	c.mu.Lock()
	c.tables[table] = t.Name()
	c.mu.Unlock()
}

// dropLeft drops the noted tables that still exist, saying which.
func (c *createdTables) dropLeft() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.tables) == 0 {
		return nil
	}
	db, err := sql.Open("pgx", testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN))
	if err != nil {
		return err
	}
	defer db.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for table, test := range c.tables {
		var exists bool
		if err := db.QueryRowContext(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&exists); err != nil {
			return fmt.Errorf("look for %s: %w", table, err)
		}
		if !exists {
			continue
		}
		fmt.Fprintf(os.Stderr, "httpidempotency tests: table %s of %s outlived its test; dropped now\n", table, test)
		if _, err := db.ExecContext(ctx, `DROP TABLE IF EXISTS `+table); err != nil {
			return fmt.Errorf("drop %s: %w", table, err)
		}
	}
	return nil
}
