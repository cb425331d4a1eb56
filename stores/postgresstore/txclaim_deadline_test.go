package postgresstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"hash/fnv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// The deadline tests of the paths TestEffectsDeadlineErrorsMatchTheContext
// and TestCarrierAttackRandomDeadlines leave out: transaction claims
// (WithTransactionClaims), claims of rows sent one by one
// (WithoutGrouping), and the records written in a transaction of the
// caller's (RememberTx, BeginTx, BeginPgx).

// dlHolder names the holder of key's claims in the deadline tests: every
// call on a key is its holder's, so that none meets another's claim.
func dlHolder(ctx context.Context, key string) context.Context {
	return stores.WithClaimToken(ctx, "h-"+key)
}

// dlPick draws one of n for key, the same every time.
func dlPick(key string, n int) int {
	h := fnv.New32a()
	_, _ = h.Write([]byte(key))
	return int(h.Sum32() % uint32(n))
}

// dlCalls are the calls of the deadline tests on s, whose pool is db:
// a claim that, taken, is extended and settled (remembered, failed or
// released) under the same deadline, a Lookup, a Remember, a RememberTx
// in a transaction of the caller's, a BeginTx, and (conns not nil, the
// pgx driver) a BeginPgx on one of conns. Errors of calls that are not
// the store's (the caller's own BEGIN) are not counted.
func dlCalls(t *testing.T, s *postgresstore.Store, db *sql.DB, conns chan *pgx.Conn, dsn string) []func(ctx context.Context, key string) error {
	calls := []func(ctx context.Context, key string) error{
		func(ctx context.Context, key string) error {
			ctx = dlHolder(ctx, key)
			claimed, _, err := s.Claim(ctx, key, time.Minute)
			if err != nil || !claimed {
				return err
			}
			defer func() { _ = s.Release(dlHolder(context.Background(), key), key) }()
			if _, err := s.Extend(ctx, key, time.Minute); err != nil {
				return err
			}
			switch dlPick(key, 3) {
			case 0:
				return s.Remember(ctx, key, 1, []byte("v"))
			case 1:
				return s.Fail(ctx, key, 1, stores.Failure{Attempts: 1, FirstFailure: time.Now()})
			default:
				return s.Release(ctx, key)
			}
		},
		func(ctx context.Context, key string) error { _, err := s.Lookup(ctx, key); return err },
		func(ctx context.Context, key string) error {
			return s.Remember(dlHolder(ctx, key), key, 1, []byte("v"))
		},
		func(ctx context.Context, key string) error {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				return nil // the caller's own BEGIN
			}
			defer func() { _ = tx.Rollback() }()
			_, _, err = s.RememberTx(dlHolder(ctx, key), tx, key, 1, []byte("v"))
			return err
		},
		func(ctx context.Context, key string) error {
			tx, _, _, err := s.BeginTx(dlHolder(ctx, key), db, nil, key, 1, []byte("v"))
			if err == nil {
				_ = tx.Rollback()
			}
			return err
		},
	}
	if conns == nil {
		return calls
	}
	return append(calls, func(ctx context.Context, key string) error {
		conn := <-conns
		defer func() {
			if conn.IsClosed() { // cut by its deadline: a fresh one for the next caller
				c, err := pgx.Connect(context.Background(), dsn)
				if err != nil {
					t.Error(err)
				}
				conn = c
			}
			conns <- conn
		}()
		tx, _, _, err := s.BeginPgx(dlHolder(ctx, key), conn, pgx.TxOptions{}, key, 1, []byte("v"))
		if err == nil {
			_ = tx.Rollback(context.Background())
		}
		return err
	})
}

// dlPgxConns opens n pgx connections to dsn, closed when the test ends.
func dlPgxConns(t *testing.T, dsn string, n int) chan *pgx.Conn {
	t.Helper()
	conns := make(chan *pgx.Conn, n)
	for range n {
		c, err := pgx.Connect(context.Background(), dsn)
		if err != nil {
			t.Fatal(err)
		}
		conns <- c
	}
	t.Cleanup(func() {
		for range n {
			c := <-conns
			if c != nil {
				_ = c.Close(context.Background())
			}
		}
	})
	return conns
}

// TestClaimModesDeadlineErrorsMatchTheContext: on a pool whose replies
// come 3ms late, through both drivers, callers with deadlines of 1 to
// 20ms of a store with transaction claims, and of one with claims of rows
// sent one by one, get their answer or an error that matches their
// context's, never the driver's own (lib/pq's "canceling statement due to
// user request", a network timeout), in claims, their extensions and
// settlements, Lookups, Remembers, and records written in a transaction of
// the caller's.
func TestClaimModesDeadlineErrorsMatchTheContext(t *testing.T) {
	if testing.Short() {
		t.Skip("a load of a few seconds")
	}
	for _, c := range []struct {
		name   string
		driver string
		opts   []postgresstore.Option
	}{
		{"transaction claims/pgx", "pgx", []postgresstore.Option{postgresstore.WithTransactionClaims()}},
		{"transaction claims/lib-pq", "postgres", []postgresstore.Option{postgresstore.WithTransactionClaims()}},
		{"rows claims ungrouped/pgx", "pgx", []postgresstore.Option{postgresstore.WithRowClaims(), postgresstore.WithoutGrouping()}},
		{"rows claims ungrouped/lib-pq", "postgres", []postgresstore.Option{postgresstore.WithoutGrouping()}},
	} {
		t.Run(c.name, func(t *testing.T) {
			direct := h2DriverPool(t, c.driver)
			dsn, proxy := testenv.PostgresProxyDSN(t)
			proxy.Delay.Store(int64(3 * time.Millisecond))
			db, err := sql.Open(c.driver, dsn)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = db.Close() })
			db.SetMaxOpenConns(24) // a claim per worker, and statements beside them
			s, err := postgresstore.New(db, append([]postgresstore.Option{postgresstore.WithTable("idem_dl_" + testenv.RandomHex(4))}, c.opts...)...)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _, _ = direct.Exec(`DROP TABLE IF EXISTS ` + s.Table()) })
			t.Cleanup(func() { _ = s.Close() })
			if err := s.Migrate(context.Background()); err != nil {
				t.Fatal(err)
			}
			var conns chan *pgx.Conn
			if c.driver == "pgx" {
				conns = dlPgxConns(t, dsn, 8)
			}
			testenv.RequireContextErrors(t, 8, 40, dlCalls(t, s, db, conns, dsn)...)
			if err := s.ReleaseAll(context.Background()); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// errClaimEnded stands for an Extend that reported the claim not held:
// a transaction claim's Extend cut short by its deadline ends the claim
// (its transaction cannot be trusted any more) and says so.
var errClaimEnded = errors.New("the claim is not held any more")

// TestTransactionClaimsReturnByTheirDeadline: claims taken while the
// server answered, then the server stops answering (the claims'
// connections stall, new ones get no reply): every settlement of a claim
// (Remember, Fail, Release, Extend), and a Claim, a Lookup and a Remember
// of keys not claimed, return by their context's deadline with its error,
// not after the store's query timeout (5s). Then the server answers again
// and the same store serves. On pgx only: lib/pq cancels a statement by
// asking the server, and waits for its answer with no deadline of its
// own, so that no call of it returns while the server says nothing.
func TestTransactionClaimsReturnByTheirDeadline(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out many deadlines")
	}
	for _, driver := range []string{"pgx"} {
		t.Run(driver, func(t *testing.T) {
			direct := h2DriverPool(t, driver)
			dsn, proxy := testenv.PostgresProxyDSN(t)
			db, err := sql.Open(driver, dsn)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = db.Close() })
			const callers, rounds, deadline = 8, 2, 300 * time.Millisecond
			db.SetMaxOpenConns(2*callers*rounds + 4)
			s, err := postgresstore.New(db, postgresstore.WithTable("idem_dl_"+testenv.RandomHex(4)), postgresstore.WithTransactionClaims())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _, _ = direct.Exec(`DROP TABLE IF EXISTS ` + s.Table()) })
			t.Cleanup(func() { // before the table goes: no claim's transaction left on it
				proxy.Silent.Store(false)
				proxy.Delay.Store(0)
				_ = s.ReleaseAll(context.Background())
				_ = db.Close()
			})
			if err := s.Migrate(context.Background()); err != nil {
				t.Fatal(err)
			}
			key := func(c, r int) string { return fmt.Sprintf("held-%d-%d", c, r) }
			for c := range callers {
				for r := range rounds {
					if claimed, _, err := s.Claim(dlHolder(context.Background(), key(c, r)), key(c, r), time.Minute); err != nil || !claimed {
						t.Fatalf("claim %s = %v, %v", key(c, r), claimed, err)
					}
				}
			}
			proxy.Silent.Store(true)
			proxy.Delay.Store(int64(time.Hour))

			calls := []func(ctx context.Context, key string) error{
				func(ctx context.Context, key string) error { return s.Remember(ctx, key, 1, []byte("v")) },
				func(ctx context.Context, key string) error {
					return s.Fail(ctx, key, 1, stores.Failure{Attempts: 1, FirstFailure: time.Now()})
				},
				func(ctx context.Context, key string) error { return s.Release(ctx, key) },
				func(ctx context.Context, key string) error {
					held, err := s.Extend(ctx, key, time.Minute)
					if err == nil && !held {
						return errClaimEnded
					}
					return err
				},
				func(ctx context.Context, key string) error {
					_, _, err := s.Claim(ctx, "free-"+key, time.Minute)
					return err
				},
				func(ctx context.Context, key string) error { _, err := s.Lookup(ctx, "free-"+key); return err },
				func(ctx context.Context, key string) error { return s.Remember(ctx, "free-"+key, 1, nil) },
			}
			testenv.RequireDeadlines(t, callers, rounds, deadline, func(ctx context.Context, c, r int) error {
				i := (c*rounds + r) % len(calls)
				start := time.Now()
				err := calls[i](dlHolder(ctx, key(c, r)), key(c, r))
				if took := time.Since(start); took > deadline+time.Second || err == nil {
					t.Logf("call %d under a %v deadline returned %v after %v", i, deadline, err, took.Round(time.Millisecond))
				}
				if err != nil && !errors.Is(err, errClaimEnded) && !errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("a call under a %v deadline: %v; want its context's error", deadline, err)
				}
				return err
			})

			// The server answers again: the same store serves.
			proxy.Silent.Store(false)
			proxy.Delay.Store(0)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			if claimed, _, err := s.Claim(dlHolder(ctx, "after"), "after", time.Minute); err != nil || !claimed {
				t.Fatalf("Claim after the server came back = %v, %v", claimed, err)
			}
			if err := s.Remember(dlHolder(ctx, "after"), "after", 1, nil); err != nil {
				t.Fatalf("Remember after the server came back: %v", err)
			}
			if err := s.ReleaseAll(ctx); err != nil {
				t.Fatal(err)
			}
		})
	}
}
