package postgresstore_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestAbandonedGroupedClaimDoesNotParkTheRedelivery: under load a claim
// queues behind a statement in flight (here one waiting on another
// transaction's uncommitted row). Its delivery gives up at the store
// timeout (ErrStore: the broker redelivers). The grouped statement that
// carries it still runs afterwards; the claim it takes belongs to a
// delivery that is gone, so it must not stand: the redelivery runs at once
// instead of being parked (ErrInFlight) for the whole claim lease behind
// a claim no one holds (on the ungrouped path the claim would not even have
// waited: its key is free).
func TestAbandonedGroupedClaimDoesNotParkTheRedelivery(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	db.SetMaxOpenConns(8)
	// One claim statement at a time, so that the slow one holds the slot.
	s := newStore(t, db, postgresstore.WithRowClaims(), postgresstore.WithStatementsInFlight(1))
	bg := context.Background()

	// Another transaction inserts a row and keeps it uncommitted: a claim
	// of that key waits for it, holding the claims' statement slot.
	blocker, err := db.BeginTx(bg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer blocker.Rollback() //nolint:errcheck
	if _, err := blocker.ExecContext(bg, `INSERT INTO `+s.Table()+` (key, expires_at, claim) VALUES ($1, NULL, 'other')`,
		postgresstore.RowKey("busy")); err != nil {
		t.Fatal(err)
	}
	slow := make(chan error, 1)
	go func() {
		_, _, err := s.Claim(bg, "busy", time.Minute)
		slow <- err
	}()
	waitForLockWaiter(t, testenv.Postgres(t), s.Table()) // the slow claim holds the slot

	runs := 0
	h := idempotency.Middleware(s, idempotency.WithClaim(time.Minute), idempotency.WithStoreTimeout(300*time.Millisecond))(
		func(*message.Message) ([]*message.Message, error) { runs++; return nil, nil })
	payload := orderMessage(t).Payload
	if _, err := h(message.NewMessage(watermill.NewUUID(), payload)); !errors.Is(err, idempotency.ErrStore) {
		t.Fatalf("first delivery: %v, want ErrStore at the store timeout", err)
	}
	if err := blocker.Rollback(); err != nil { // the slot frees; the queued claim runs now
		t.Fatal(err)
	}
	if err := <-slow; err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)

	// The redelivery.
	if _, err := h(message.NewMessage(watermill.NewUUID(), payload)); err != nil {
		t.Fatalf("redelivery after the first gave up: %v; want it to run, not to wait for the abandoned claim's lease", err)
	}
	if runs != 1 {
		t.Fatalf("handler ran %d times, want 1", runs)
	}
}

// TestLapsedClaimTakeoverCutShortIsReleased: a claim finds its key held by
// a lapsed claim and takes it over (the UPDATE after the INSERT and the
// SELECT), but another transaction holds the row locked, so the UPDATE
// waits, and the caller's deadline passes meanwhile. pgx then drops the
// connection and asks the server to cancel the statement, a request the
// server may never get (here a proxy swallows it; a pooler or the lock
// going at that instant does the same): the server runs the UPDATE once
// the lock goes. The claim must not stay held by the delivery that got the
// error, or its redelivery is parked for the whole lease (an hour here).
// Grouped and WithoutGrouping.
func TestLapsedClaimTakeoverCutShortIsReleased(t *testing.T) {
	t.Parallel()
	for name, opts := range map[string][]postgresstore.Option{
		"grouped":         {postgresstore.WithRowClaims()},
		"WithoutGrouping": {postgresstore.WithRowClaims(), postgresstore.WithoutGrouping()},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			other := testenv.Postgres(t)
			table := newStore(t, other).Table()
			db, proxy := proxiedPostgres(t)
			s, err := postgresstore.New(db, append([]postgresstore.Option{postgresstore.WithTable(table)}, opts...)...)
			if err != nil {
				t.Fatal(err)
			}
			bg := context.Background()
			key := postgresstore.RowKey("lapsed")
			if _, err := other.ExecContext(bg, `INSERT INTO `+table+` (key, expires_at, claim)
				VALUES ($1, (extract(epoch from now()) * 1000)::bigint - 1000, 'crashed')`, key); err != nil {
				t.Fatal(err)
			}
			warmPool(t, db, 3)       // the statements after the cut-off one need no new connection
			proxy.Silent.Store(true) // new connections, a cancel request's among them, get nowhere
			locked := holdLocked(t, other, table, key, 700*time.Millisecond)
			ctx, cancel := context.WithTimeout(stores.WithClaimToken(bg, "gave-up"), 200*time.Millisecond)
			claimed, _, err := s.Claim(ctx, "lapsed", time.Hour)
			cancel()
			if !errors.Is(err, context.DeadlineExceeded) || claimed {
				t.Fatalf("claim behind a locked lapsed row: %v, %v; want its deadline", claimed, err)
			}
			if err := <-locked; err != nil {
				t.Fatal(err)
			}
			proxy.Silent.Store(false)
			// The lock is gone: the takeover ran on the server; it must be
			// undone.
			var holder string
			for range 20 {
				time.Sleep(100 * time.Millisecond)
				if err := other.QueryRowContext(bg, `SELECT coalesce((SELECT claim FROM `+table+` WHERE key = $1), 'none')`,
					key).Scan(&holder); err != nil {
					t.Fatal(err)
				}
				if holder != "gave-up" {
					break
				}
			}
			if holder == "gave-up" {
				t.Fatal("the takeover's claim is held by the delivery that got an error: its redelivery is parked for the lease")
			}
			t.Logf("the row's claim after the lock went: %s", holder)
			// And the redelivery takes the key at once.
			ctx, cancel = context.WithTimeout(stores.WithClaimToken(bg, "redelivery"), 2*time.Second)
			defer cancel()
			if claimed, _, err := s.Claim(ctx, "lapsed", time.Hour); err != nil || !claimed {
				t.Fatalf("the redelivery's claim: %v, %v; want it taken", claimed, err)
			}
		})
	}
}

// warmPool opens n connections of db and leaves them idle in its pool.
func warmPool(t *testing.T, db *sql.DB, n int) {
	t.Helper()
	db.SetMaxIdleConns(n)
	conns := make([]*sql.Conn, n)
	for i := range conns {
		c, err := db.Conn(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		conns[i] = c
	}
	for _, c := range conns {
		_ = c.Close()
	}
}

// proxiedPostgres opens a pgx pool to PostgreSQL through a fault proxy.
func proxiedPostgres(t *testing.T) (*sql.DB, *testenv.FaultProxy) {
	t.Helper()
	dsn, proxy := testenv.PostgresProxyDSN(t)
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db, proxy
}
