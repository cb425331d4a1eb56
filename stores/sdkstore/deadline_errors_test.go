package sdkstore_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	_ "github.com/lib/pq" // registers "postgres"

	"github.com/babelqueue/watermill-idempotency/stores/sdkstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestGoPostgresDeadlineErrorsMatchTheContext: on a lib/pq pool whose
// replies come 3ms late, callers with deadlines of 1 to 20ms get their
// answer or an error that matches their context's, never lib/pq's own
// "canceling statement due to user request" for a statement their
// context ended.
func TestGoPostgresDeadlineErrorsMatchTheContext(t *testing.T) {
	if testing.Short() {
		t.Skip("a load of a few seconds")
	}
	t.Parallel()
	direct := testenv.Postgres(t)
	dsn, p := testenv.PostgresProxyDSN(t)
	p.Delay.Store(int64(3 * time.Millisecond))
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	table := "sdk_deadline_" + testenv.RandomHex(4)
	s, err := sdkstore.NewGoPostgres(db, sdkstore.WithTable(table))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = direct.Exec(`DROP TABLE IF EXISTS ` + table + `, ` + table + `_claims`) })
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	testenv.RequireContextErrors(t, 8, 60,
		func(ctx context.Context, key string) error { return s.Remember(ctx, key, 1, nil) },
		func(ctx context.Context, key string) error {
			_, _, err := s.Claim(ctx, key, time.Minute)
			return err
		},
		func(ctx context.Context, key string) error { _, err := s.Lookup(ctx, key); return err },
		func(ctx context.Context, key string) error { _, err := s.Extend(ctx, key, time.Minute); return err },
		func(ctx context.Context, key string) error { return s.Forget(ctx, key) },
	)
}
