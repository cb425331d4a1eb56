package postgresstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/storetest"
	"github.com/babelqueue/watermill-idempotency/testkit/conformance"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// newStore returns a migrated store on a table of its own, dropped when the
// test ends.
func newStore(t testing.TB, db *sql.DB, opts ...postgresstore.Option) *postgresstore.Store {
	t.Helper()
	table := "idem_test_" + testenv.RandomHex(4)
	s, err := postgresstore.New(db, append([]postgresstore.Option{postgresstore.WithTable(table)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	// Before Migrate: one that fails after creating the table (its claims'
	// session refused) leaves nothing behind either.
	t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), `DROP TABLE IF EXISTS `+table) })
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return s
}

func TestContract(t *testing.T) { runContract(t) }

// runContract runs the store contract suite on stores made with opts, on
// tables of their own.
func runContract(t *testing.T, opts ...postgresstore.Option) {
	t.Parallel() // on a table and a pool of its own
	db := testenv.Postgres(t)
	// The 64-way claim races run 16 at a time on connections kept open
	// (database/sql keeps 2 idle by default): opening 64 connections at
	// once, each race, took the server past the claims' deadline on a
	// loaded machine ("failed to connect … timeout"), and every suite
	// running beside this one shares the server's 100 connections.
	db.SetMaxOpenConns(16)
	db.SetMaxIdleConns(16)
	storetest.Run(t,
		func(t *testing.T) stores.Store { return newStore(t, db, opts...) },
		storetest.WithTTLStore(func(t *testing.T, ttl time.Duration) stores.Store {
			return newStore(t, db, append(opts, postgresstore.WithTTL(ttl))...)
		}),
		storetest.WithSecondInstance(func(t *testing.T, s stores.Store) stores.Store {
			// A second worker: its own pool, the same table.
			second, err := postgresstore.New(testenv.Postgres(t), append(opts, postgresstore.WithTable(s.(*postgresstore.Store).Table()))...)
			if err != nil {
				t.Fatal(err)
			}
			return second
		}),
		storetest.WithTxDB(db))
}

func TestConformanceSequences(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	conformance.RunIdempotency(t, "", func(t *testing.T) stores.Store { return newStore(t, db) })
}

func TestIntentChecks(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	conformance.RunIntentChecks(t, "", func(t *testing.T) stores.Store { return newStore(t, db) })
}

// TestMigrateAddsTheFingerprintColumn: a table made by an earlier version
// (no fingerprint column) is brought up to date by Migrate.
func TestMigrateAddsTheFingerprintColumn(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	s := newStore(t, db)
	ctx := context.Background()
	if _, err := db.ExecContext(ctx, `ALTER TABLE `+s.Table()+` DROP COLUMN fingerprint`); err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.Remember(ctx, "k", 42, nil); err != nil {
		t.Fatalf("after Migrate: %v", err)
	}
}

func TestMigrateIsIdempotent(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	s := newStore(t, db)
	ctx := context.Background()
	if err := s.Remember(ctx, "k", 0, nil); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if err := s.Migrate(ctx); err != nil {
			t.Fatalf("Migrate on an existing table: %v", err)
		}
	}
	if seen, _ := stores.Seen(ctx, s, "k"); !seen {
		t.Fatal("Migrate lost a record")
	}
}

func TestSchemaQualifiedTable(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	ctx := context.Background()
	if _, err := db.ExecContext(ctx, `CREATE SCHEMA IF NOT EXISTS idem_schema_test`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), `DROP SCHEMA idem_schema_test CASCADE`) })
	s, err := postgresstore.New(db, postgresstore.WithTable("idem_schema_test.Records"))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.Remember(ctx, "k", 0, nil); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem_schema_test."Records" WHERE key = $1`, postgresstore.RowKey("k")).Scan(&n); err != nil || n != 1 {
		t.Fatalf("row not in the qualified table: n=%d err=%v", n, err)
	}
}

func TestInvalidOptionsAreRejected(t *testing.T) {
	t.Parallel()
	db, _ := sql.Open("pgx", "postgres://127.0.0.1:1/none")
	defer db.Close()
	for _, bad := range []postgresstore.Option{
		postgresstore.WithTable(""), postgresstore.WithTable("drop table x"), postgresstore.WithTable(`a"b`),
		postgresstore.WithTable("a.b.c"), postgresstore.WithTable("1abc"), postgresstore.WithTable("x;--"),
		postgresstore.WithTTL(-time.Second), postgresstore.WithQueryTimeout(-1), postgresstore.WithCleanupBatch(0),
	} {
		if _, err := postgresstore.New(db, bad); !errors.Is(err, postgresstore.ErrInvalidOption) {
			t.Fatalf("New with a bad option: err = %v, want ErrInvalidOption", err)
		}
	}
	if _, err := postgresstore.New(nil); !errors.Is(err, postgresstore.ErrInvalidOption) {
		t.Fatalf("nil db: %v", err)
	}
}

func TestDeleteExpiredIsBatchedAndKeepsLiveRows(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	ctx := context.Background()
	s := newStore(t, db, postgresstore.WithRowClaims(), postgresstore.WithTTL(time.Hour), postgresstore.WithCleanupBatch(4)) // claims in rows, which expire
	expiring := newStoreOnTable(t, db, s.Table(), postgresstore.WithTTL(50*time.Millisecond))
	forever := newStoreOnTable(t, db, s.Table())

	n := 3000
	if testing.Short() {
		n = 300
	}
	for i := range n {
		var err error
		switch i % 3 {
		case 0:
			err = s.Remember(ctx, fmt.Sprintf("live-%d", i), 0, nil)
		case 1:
			err = expiring.Remember(ctx, fmt.Sprintf("expired-%d", i), 0, nil)
		default:
			err = forever.Remember(ctx, fmt.Sprintf("forever-%d", i), 0, nil)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	// A lapsed claim is removed too; a live one stays.
	if ok, _, err := s.Claim(ctx, "lapsed-claim", time.Millisecond); err != nil || !ok {
		t.Fatal(ok, err)
	}
	if ok, _, err := s.Claim(ctx, "live-claim", time.Hour); err != nil || !ok {
		t.Fatal(ok, err)
	}
	time.Sleep(100 * time.Millisecond)
	deleted, err := s.DeleteExpired(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if deleted != int64(n/3+1) {
		t.Fatalf("deleted %d rows, want %d", deleted, n/3+1)
	}
	var left int
	_ = db.QueryRowContext(ctx, `SELECT count(*) FROM `+s.Table()).Scan(&left)
	if left != 2*n/3+1 {
		t.Fatalf("%d rows left, want %d", left, 2*n/3+1)
	}
	if seen, _ := stores.Seen(ctx, s, "live-0"); !seen {
		t.Fatal("a live record was deleted")
	}
	if ok, _, _ := s.Claim(stores.WithClaimToken(ctx, "probe"), "live-claim", time.Hour); ok {
		t.Fatal("a live claim was deleted")
	}
	// Canceled midway: returns what it did, with the context's error.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := s.DeleteExpired(cctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled cleanup: err = %v", err)
	}
}

func newStoreOnTable(t testing.TB, db *sql.DB, table string, opts ...postgresstore.Option) *postgresstore.Store {
	t.Helper()
	s, err := postgresstore.New(db, append([]postgresstore.Option{postgresstore.WithTable(table)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func TestRunCleanupStopsWithItsContext(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	s := newStore(t, db, postgresstore.WithTTL(time.Millisecond))
	ctx, cancel := context.WithCancel(context.Background())
	if err := s.Remember(ctx, "k", 0, nil); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- s.RunCleanup(ctx, 10*time.Millisecond, func(err error) { t.Error(err) }) }()
	deadline := time.Now().Add(5 * time.Second)
	for {
		var n int
		_ = db.QueryRow(`SELECT count(*) FROM ` + s.Table()).Scan(&n)
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("RunCleanup did not remove the expired row")
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("RunCleanup returned %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("RunCleanup did not stop when its context was canceled")
	}
}

// TestServerDownSurfacesErrors points the store at a port where nothing
// listens: every call fails with an error, which the middleware turns into a
// retried delivery.
func TestServerDownSurfacesErrors(t *testing.T) {
	t.Parallel()
	db, err := sql.Open("pgx", "postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=1")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	s, err := postgresstore.New(db)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := stores.Seen(ctx, s, "k"); err == nil {
		t.Fatal("Seen: no error with the server down")
	}
	if _, _, err := s.Claim(ctx, "k", time.Second); err == nil {
		t.Fatal("Claim: no error with the server down")
	}
	runs := 0
	h := idempotency.Middleware(s)(func(*message.Message) ([]*message.Message, error) { runs++; return nil, nil })
	payload := conformance.Fixture(t, "order-created.json")
	if _, err := h(message.NewMessage(watermill.NewUUID(), payload)); !errors.Is(err, idempotency.ErrStore) || runs != 0 {
		t.Fatalf("middleware with the store down: err=%v runs=%d, want ErrStore and no run", err, runs)
	}
}
