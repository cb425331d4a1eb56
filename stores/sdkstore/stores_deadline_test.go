package sdkstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/sdkstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// dlCalls are the calls of the deadline tests on s: every call of the
// store's contract, each by the key's own holder (so that none meets
// another holder's claim).
func dlCalls(s stores.Store) []func(ctx context.Context, key string) error {
	holder := func(ctx context.Context, key string) context.Context {
		return stores.WithClaimToken(ctx, "h-"+key)
	}
	calls := []func(ctx context.Context, key string) error{
		func(ctx context.Context, key string) error { return s.Remember(holder(ctx, key), key, 1, nil) },
		func(ctx context.Context, key string) error {
			_, _, err := s.Claim(holder(ctx, key), key, time.Minute)
			return err
		},
		func(ctx context.Context, key string) error { _, err := s.Lookup(ctx, key); return err },
		func(ctx context.Context, key string) error {
			_, err := s.Extend(holder(ctx, key), key, time.Minute)
			return err
		},
		func(ctx context.Context, key string) error { return s.Release(holder(ctx, key), key) },
		func(ctx context.Context, key string) error { return s.Forget(ctx, key) },
	}
	if s.Capabilities().Failures {
		calls = append(calls,
			func(ctx context.Context, key string) error {
				err := s.Fail(holder(ctx, key), key, 1, stores.Failure{Attempts: 1, FirstFailure: time.Now()})
				if errors.Is(err, stores.ErrClaimTaken) {
					return nil // an answer: the key is remembered
				}
				return err
			},
			func(ctx context.Context, key string) error { _, err := s.Reopen(ctx, key, "m"); return err },
		)
	}
	return calls
}

// dlRedisStores returns the two Redis layouts' stores on client, with
// keys under a prefix of the test's.
func dlRedisStores(t *testing.T, client redis.UniversalClient, direct redis.UniversalClient) map[string]stores.Store {
	t.Helper()
	p := redisPrefix(t, direct)
	return map[string]stores.Store{
		"PHPRedis": ok(t)(sdkstore.NewPHPRedis(client, sdkstore.WithPrefix(p+":php:"))),
		"GoRedis":  ok(t)(sdkstore.NewGoRedis(client, sdkstore.WithPrefix(p+":go:"), sdkstore.WithClaimPrefix(p+":claim:"))),
	}
}

// dlRedisClient returns a client of the real Redis through a fault proxy,
// with read and write timeouts of 2 s and ContextTimeoutEnabled as
// contextTimeout, and the proxy.
func dlRedisClient(t *testing.T, contextTimeout bool) (client, direct *redis.Client, proxy *testenv.FaultProxy) {
	t.Helper()
	direct = testenv.Redis(t)
	proxy = testenv.NewFaultProxy(t, direct.Options().Addr)
	o := direct.Options()
	o.Addr, o.ReadTimeout, o.WriteTimeout, o.ContextTimeoutEnabled = proxy.Addr(), 2*time.Second, 2*time.Second, contextTimeout
	client = redis.NewClient(o)
	t.Cleanup(func() { _ = client.Close() })
	return client, direct, proxy
}

// dlSQLStores returns the SQL layouts' stores on pools through a fault
// proxy, migrated: the PHP PdoStore's table on PostgreSQL (pgx) and on
// MariaDB, and the Go SDK's table on PostgreSQL (pgx), with the proxies.
func dlSQLStores(t *testing.T) (map[string]stores.Store, []*testenv.FaultProxy) {
	t.Helper()
	pgDirect := testenv.Postgres(t)
	pgDSN, pgProxy := testenv.PostgresProxyDSN(t)
	pg, err := sql.Open("pgx", pgDSN)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pg.Close() })

	mariaDirect := testenv.MariaDB(t)
	cfg, err := mysql.ParseDSN(testenv.Getenv("MARIADB_DSN", testenv.DefaultMariaDBDSN))
	if err != nil {
		t.Fatal(err)
	}
	mariaProxy := testenv.NewFaultProxy(t, cfg.Addr)
	cfg.Addr = mariaProxy.Addr()
	maria, err := sql.Open("mysql", cfg.FormatDSN())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = maria.Close() })

	out := map[string]stores.Store{
		"PHPPDO/PostgreSQL": ok(t)(sdkstore.NewPHPPDO(pg, sdkstore.PostgreSQL, sdkstore.WithTable(sqlTable(t, pgDirect, "sdk_dl_pdo")))),
		"PHPPDO/MariaDB":    ok(t)(sdkstore.NewPHPPDO(maria, sdkstore.MariaDB, sdkstore.WithTable(sqlTable(t, mariaDirect, "sdk_dl_pdo")))),
		"GoPostgres/pgx":    ok(t)(sdkstore.NewGoPostgres(pg, sdkstore.WithTable(sqlTable(t, pgDirect, "sdk_dl_go")))),
	}
	for _, s := range out {
		migrate(t, s)
	}
	return out, []*testenv.FaultProxy{pgProxy, mariaProxy}
}

// TestStoresDeadlineErrorsMatchTheContext: through proxies whose replies
// come 3ms late, callers with deadlines of 1 to 20ms of the Redis layouts
// (on clients with and without ContextTimeoutEnabled) and of the SQL
// layouts on PostgreSQL (pgx) and MariaDB get their answer or an error
// that matches their context's, never a bare network timeout or the
// driver's own.
func TestStoresDeadlineErrorsMatchTheContext(t *testing.T) {
	if testing.Short() {
		t.Skip("a load of a few seconds")
	}
	t.Parallel()
	for _, contextTimeout := range []bool{false, true} {
		client, direct, proxy := dlRedisClient(t, contextTimeout)
		proxy.Delay.Store(int64(3 * time.Millisecond))
		for name, s := range dlRedisStores(t, client, direct) {
			t.Run(fmt.Sprintf("%s/ContextTimeoutEnabled=%v", name, contextTimeout), func(t *testing.T) {
				testenv.RequireContextErrors(t, 8, 60, dlCalls(s)...)
			})
		}
	}
	sqlStores, proxies := dlSQLStores(t)
	for _, p := range proxies {
		p.Delay.Store(int64(3 * time.Millisecond))
	}
	for name, s := range sqlStores {
		t.Run(name, func(t *testing.T) {
			testenv.RequireContextErrors(t, 8, 60, dlCalls(s)...)
		})
	}
}

// TestStoresReturnByTheirDeadline: against servers that accept
// connections and never answer, every call of the Redis layouts returns
// at its context's deadline with its error, whether or not the client
// honours contexts' deadlines (without ContextTimeoutEnabled, go-redis
// waits out its own read timeout, ten times the deadline here), and so
// does every call of the SQL layouts on PostgreSQL (pgx) and MariaDB.
// Then the servers answer again and the same stores serve.
func TestStoresReturnByTheirDeadline(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out many deadlines")
	}
	t.Parallel()
	type target struct {
		s       stores.Store
		proxies []*testenv.FaultProxy
	}
	targets := map[string]target{}
	for _, contextTimeout := range []bool{false, true} {
		client, direct, proxy := dlRedisClient(t, contextTimeout)
		for name, s := range dlRedisStores(t, client, direct) {
			targets[fmt.Sprintf("%s/ContextTimeoutEnabled=%v", name, contextTimeout)] = target{s, []*testenv.FaultProxy{proxy}}
		}
	}
	sqlStores, proxies := dlSQLStores(t)
	for name, s := range sqlStores {
		targets[name] = target{s, proxies}
	}
	for name, tg := range targets {
		t.Run(name, func(t *testing.T) {
			stall := func(stalled bool) {
				for _, p := range tg.proxies {
					p.Silent.Store(stalled)
					if stalled {
						p.Delay.Store(int64(time.Hour))
					} else {
						p.Delay.Store(0)
					}
				}
			}
			if err := tg.s.Remember(context.Background(), "warm-up", 0, nil); err != nil { // a pooled connection
				t.Fatal(err)
			}
			stall(true)
			defer stall(false)
			calls := dlCalls(tg.s)
			if strings.HasPrefix(name, "PHPPDO") {
				// Its Extend and Release of a claim this store did not take
				// send nothing (it knows its claims by the expiry they
				// wrote), and answer at once.
				calls = append(calls[:3:3], calls[5:]...)
			}
			const callers, deadline = 8, 200 * time.Millisecond
			testenv.RequireDeadlines(t, callers, len(calls), deadline, func(ctx context.Context, c, r int) error {
				err := calls[(c+r)%len(calls)](ctx, fmt.Sprintf("k-%d-%d", c, r))
				if err != nil && !errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("a call under a %v deadline: %v; want its context's error", deadline, err)
				}
				return err
			})

			// The servers answer again: the same store serves.
			stall(false)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			key := "after-" + strings.ReplaceAll(name, "/", "-")
			if err := tg.s.Remember(ctx, key, 1, nil); err != nil {
				t.Fatalf("Remember after the server came back: %v", err)
			}
		})
	}
}
