package sdkstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	_ "github.com/go-sql-driver/mysql" // the "mysql" database/sql driver, for MariaDB
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/sdkstore"
	"github.com/babelqueue/watermill-idempotency/stores/storetest"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// redisPrefix returns a key prefix unique to the test whose keys are
// dropped when it ends.
func redisPrefix(t *testing.T, client redis.UniversalClient) string {
	t.Helper()
	run := "sdkt" + testenv.RandomHex(4)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		// Twice: a call a parallel subtest gave up on may still land a
		// moment after the subtests ended.
		for pass := range 2 {
			if err := dropKeys(ctx, client, run+"*"); err != nil {
				t.Errorf("drop %s*: %v", run, err)
			}
			if pass == 0 {
				time.Sleep(500 * time.Millisecond)
			}
		}
	})
	return run
}

// dropKeys unlinks the keys matching pattern; on a Redis Cluster one by one
// on each master, since its keys live in many slots.
func dropKeys(ctx context.Context, client redis.UniversalClient, pattern string) error {
	cluster, ok := client.(*redis.ClusterClient)
	if !ok {
		return testenv.DropKeys(ctx, client, pattern)
	}
	return cluster.ForEachMaster(ctx, func(ctx context.Context, node *redis.Client) error {
		iter := node.Scan(ctx, 0, pattern, 1000).Iterator()
		for iter.Next(ctx) {
			if err := node.Unlink(ctx, iter.Val()).Err(); err != nil {
				return err
			}
		}
		return iter.Err()
	})
}

// sqlTable returns a table name unique to the test, dropped (with its
// claim table) when it ends.
func sqlTable(t *testing.T, db *sql.DB, base string) string {
	t.Helper()
	name := base + "_" + testenv.RandomHex(4)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		for _, n := range []string{name, name + "_claims"} {
			if _, err := db.ExecContext(ctx, "DROP TABLE IF EXISTS "+n); err != nil {
				t.Errorf("drop %s: %v", n, err)
			}
		}
	})
	return name
}

// ok fails the test on a constructor's error: ok(t)(sdkstore.NewX(…)).
func ok(t *testing.T) func(stores.Store, error) stores.Store {
	return func(s stores.Store, err error) stores.Store {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
}

// migrate runs the store's Migrate.
func migrate(t *testing.T, s stores.Store) {
	t.Helper()
	m := s.(interface{ Migrate(context.Context) error })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := m.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestPHPRedisContract(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	p := redisPrefix(t, client) + ":idem:"
	newStore := func(t *testing.T) stores.Store {
		return ok(t)(sdkstore.NewPHPRedis(client, sdkstore.WithPrefix(p), sdkstore.WithScopedKeys()))
	}
	storetest.Run(t, newStore, storetest.WithTTLStore(func(t *testing.T, ttl time.Duration) stores.Store {
		return ok(t)(sdkstore.NewPHPRedis(client, sdkstore.WithPrefix(p), sdkstore.WithScopedKeys(), sdkstore.WithTTL(ttl)))
	}), secondInstance(newStore))
}

func TestGoRedisContract(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	p := redisPrefix(t, client) + ":idemp:"
	newStore := func(t *testing.T) stores.Store {
		return ok(t)(sdkstore.NewGoRedis(client, sdkstore.WithPrefix(p), sdkstore.WithScopedKeys()))
	}
	storetest.Run(t, newStore, storetest.WithTTLStore(func(t *testing.T, ttl time.Duration) stores.Store {
		return ok(t)(sdkstore.NewGoRedis(client, sdkstore.WithPrefix(p), sdkstore.WithScopedKeys(), sdkstore.WithTTL(ttl)))
	}), secondInstance(newStore))
}

// TestRedisContractOnCluster: both Redis layouts on a 3-master Redis
// Cluster (a Go SDK record and the kit's claim on it live in different
// slots).
func TestRedisContractOnCluster(t *testing.T) {
	t.Parallel()
	client := testenv.RedisCluster(t)
	p := redisPrefix(t, client)
	t.Run("PHPRedis", func(t *testing.T) {
		t.Parallel() // its own prefix
		newStore := func(t *testing.T) stores.Store {
			return ok(t)(sdkstore.NewPHPRedis(client, sdkstore.WithPrefix(p+":idem:"), sdkstore.WithScopedKeys()))
		}
		storetest.Run(t, newStore, secondInstance(newStore))
	})
	t.Run("GoRedis", func(t *testing.T) {
		t.Parallel() // its own prefix
		newStore := func(t *testing.T) stores.Store {
			return ok(t)(sdkstore.NewGoRedis(client, sdkstore.WithPrefix(p+":idemp:"), sdkstore.WithScopedKeys()))
		}
		storetest.Run(t, newStore, secondInstance(newStore))
	})
}

func TestPHPPDOContract(t *testing.T) {
	t.Parallel()
	for _, db := range databases(t) {
		t.Run(db.dialect.String(), func(t *testing.T) {
			t.Parallel() // a table of its own
			table := sqlTable(t, db.db, "bq_idempotency")
			migrate(t, ok(t)(sdkstore.NewPHPPDO(db.db, db.dialect, sdkstore.WithTable(table))))
			newStore := func(t *testing.T) stores.Store {
				return ok(t)(sdkstore.NewPHPPDO(db.db, db.dialect, sdkstore.WithTable(table), sdkstore.WithScopedKeys()))
			}
			storetest.Run(t, newStore, secondInstance(newStore),
				storetest.WithShortLease(time.Second)) // the layout keeps expiries in whole seconds
		})
	}
}

func TestGoPostgresContract(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	db.SetMaxOpenConns(16) // a shared server
	table := sqlTable(t, db, "babelqueue_idempotency")
	migrate(t, ok(t)(sdkstore.NewGoPostgres(db, sdkstore.WithTable(table))))
	newStore := func(t *testing.T) stores.Store {
		return ok(t)(sdkstore.NewGoPostgres(db, sdkstore.WithTable(table), sdkstore.WithScopedKeys()))
	}
	storetest.Run(t, newStore, storetest.WithTTLStore(func(t *testing.T, ttl time.Duration) stores.Store {
		return ok(t)(sdkstore.NewGoPostgres(db, sdkstore.WithTable(table), sdkstore.WithScopedKeys(), sdkstore.WithTTL(ttl)))
	}), secondInstance(newStore))
}

// secondInstance gives the suite a second worker's store on the same keys
// or table: another instance built as the first was, so a holder of its
// own.
func secondInstance(newStore func(t *testing.T) stores.Store) storetest.Option {
	return storetest.WithSecondInstance(func(t *testing.T, _ stores.Store) stores.Store { return newStore(t) })
}

type database struct {
	dialect sdkstore.Dialect
	db      *sql.DB
}

// databases returns the PostgreSQL and MariaDB databases the PHP PdoStore
// layout is tested on.
func databases(t *testing.T) []database {
	pg, maria := testenv.Postgres(t), testenv.MariaDB(t)
	// The servers are shared with other test runs: keep to a few
	// connections (racing claims still race, queued on the pool).
	pg.SetMaxOpenConns(16)
	maria.SetMaxOpenConns(16)
	return []database{{sdkstore.PostgreSQL, pg}, {sdkstore.MariaDB, maria}}
}

// allStores returns one store of each layout on fresh keys and tables.
func allStores(t *testing.T, opts ...sdkstore.Option) map[string]stores.Store {
	client := testenv.Redis(t)
	p := redisPrefix(t, client)
	pg, maria := testenv.Postgres(t), testenv.MariaDB(t)
	pg.SetMaxOpenConns(16)
	maria.SetMaxOpenConns(16)
	phpPG := ok(t)(sdkstore.NewPHPPDO(pg, sdkstore.PostgreSQL, append(opts, sdkstore.WithTable(sqlTable(t, pg, "bq_idempotency")))...))
	phpMaria := ok(t)(sdkstore.NewPHPPDO(maria, sdkstore.MariaDB, append(opts, sdkstore.WithTable(sqlTable(t, maria, "bq_idempotency")))...))
	goPG := ok(t)(sdkstore.NewGoPostgres(pg, append(opts, sdkstore.WithTable(sqlTable(t, pg, "babelqueue_idempotency")))...))
	migrate(t, phpPG)
	migrate(t, phpMaria)
	migrate(t, goPG)
	return map[string]stores.Store{
		"PHPRedis":     ok(t)(sdkstore.NewPHPRedis(client, append(opts, sdkstore.WithPrefix(p+":idem:"))...)),
		"GoRedis":      ok(t)(sdkstore.NewGoRedis(client, append(opts, sdkstore.WithPrefix(p+":idemp:"))...)),
		"PHPPDO/PG":    phpPG,
		"PHPPDO/Maria": phpMaria,
		"GoPostgres":   goPG,
	}
}

// TestScopedKeysAreRefused: a key scoped by handler (the middleware's
// default) would hold a record no SDK consumer reads; every method refuses
// it, and writes nothing.
func TestScopedKeysAreRefused(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for name, s := range allStores(t) {
		t.Run(name, func(t *testing.T) {
			id := "scoped-" + testenv.RandomHex(8)
			key := idempotency.Key("orders-handler", id)
			_, err := stores.Seen(ctx, s, key)
			if !errors.Is(err, sdkstore.ErrScopedKey) {
				t.Errorf("Seen: %v, want ErrScopedKey", err)
			}
			if idempotency.IsPermanent(err) {
				t.Error("ErrScopedKey is permanent: a wiring mistake would dead-letter every message")
			}
			if err := s.Remember(ctx, key, 0, nil); !errors.Is(err, sdkstore.ErrScopedKey) {
				t.Errorf("Remember: %v, want ErrScopedKey", err)
			}
			if err := s.Forget(ctx, key); !errors.Is(err, sdkstore.ErrScopedKey) {
				t.Errorf("Forget: %v, want ErrScopedKey", err)
			}
			c := s
			if _, _, err := c.Claim(ctx, key, time.Minute); !errors.Is(err, sdkstore.ErrScopedKey) {
				t.Errorf("Claim: %v, want ErrScopedKey", err)
			}
			if err := c.Release(ctx, key); !errors.Is(err, sdkstore.ErrScopedKey) {
				t.Errorf("Release: %v, want ErrScopedKey", err)
			}
			if seen, err := stores.Seen(ctx, s, id); err != nil || seen {
				t.Errorf("Seen(%q) = %v, %v: a refused key left a record", id, seen, err)
			}
		})
	}
}

func TestInvalidOptions(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	pg := testenv.Postgres(t)
	for name, err := range map[string]error{
		"PHPPDO with a TTL":               second(sdkstore.NewPHPPDO(pg, sdkstore.PostgreSQL, sdkstore.WithTTL(time.Hour))),
		"PHPPDO with a bad table":         second(sdkstore.NewPHPPDO(pg, sdkstore.PostgreSQL, sdkstore.WithTable("x; DROP TABLE y"))),
		"PHPPDO with no dialect":          second(sdkstore.NewPHPPDO(pg, 0)),
		"PHPPDO with a prefix":            second(sdkstore.NewPHPPDO(pg, sdkstore.PostgreSQL, sdkstore.WithPrefix("x:"))),
		"GoRedis, claims under records":   second(sdkstore.NewGoRedis(client, sdkstore.WithClaimPrefix("bq:idemp:claims:"))),
		"GoRedis with a table":            second(sdkstore.NewGoRedis(client, sdkstore.WithTable("t"))),
		"PHPRedis with a claim prefix":    second(sdkstore.NewPHPRedis(client, sdkstore.WithClaimPrefix("c:"))),
		"PHPRedis with a negative TTL":    second(sdkstore.NewPHPRedis(client, sdkstore.WithTTL(-time.Second))),
		"PHPRedis with a spaced prefix":   second(sdkstore.NewPHPRedis(client, sdkstore.WithPrefix("bq idem:"))),
		"GoPostgres, claims in the table": second(sdkstore.NewGoPostgres(pg, sdkstore.WithClaimTable(sdkstore.DefaultGoTable))),
		"GoPostgres with no database":     second(sdkstore.NewGoPostgres(nil)),
		"GoRedis with no client":          second(sdkstore.NewGoRedis(nil)),
	} {
		if !errors.Is(err, sdkstore.ErrInvalidOption) {
			t.Errorf("%s: %v, want ErrInvalidOption", name, err)
		}
	}
}

func second[T any](_ T, err error) error { return err }

// TestMariaDBCollation: an SDK table whose message_id compares ids without
// regard to case or trailing spaces would merge distinct meta.ids; Migrate
// refuses it and names the fix.
func TestMariaDBCollation(t *testing.T) {
	t.Parallel()
	db := testenv.MariaDB(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	table := sqlTable(t, db, "bq_idempotency")
	if _, err := db.ExecContext(ctx, `CREATE TABLE `+table+` (message_id VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci NOT NULL PRIMARY KEY, state VARCHAR(16) NOT NULL, expires_at BIGINT NULL)`); err != nil {
		t.Fatal(err)
	}
	s := ok(t)(sdkstore.NewPHPPDO(db, sdkstore.MariaDB, sdkstore.WithTable(table))).(*sdkstore.PHPPDOStore)
	err := s.Migrate(ctx)
	if !errors.Is(err, sdkstore.ErrKeyCollation) || !strings.Contains(err.Error(), "ALTER TABLE") {
		t.Fatalf("Migrate on a case-insensitive table: %v, want ErrKeyCollation naming the ALTER TABLE", err)
	}
	if _, err := db.ExecContext(ctx, `ALTER TABLE `+table+` MODIFY message_id VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL`); err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx); err != nil {
		t.Fatalf("Migrate after the fix: %v", err)
	}
}

// TestDefaultScopeIsRefusedUnderRouter: wired with the middleware's default
// scope (the handler name), a delivery fails with ErrScopedKey before the
// handler runs, instead of writing a record no SDK consumer reads; with
// WithScope("") the same message runs and its record is the one the Go SDK
// reads.
func TestDefaultScopeIsRefusedUnderRouter(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	p := redisPrefix(t, client) + ":idemp:"
	store := ok(t)(sdkstore.NewGoRedis(client, sdkstore.WithPrefix(p)))
	for _, tc := range []struct {
		name string
		opts []idempotency.Option
		want error
	}{
		{"default scope", nil, sdkstore.ErrScopedKey},
		{"WithScope(\"\")", []idempotency.Option{idempotency.WithScope("")}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
			t.Cleanup(func() { _ = pubsub.Close() })
			r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			var runs atomic.Int32
			results := make(chan error, 1)
			guarded := idempotency.Middleware(store, tc.opts...)(func(*message.Message) ([]*message.Message, error) {
				runs.Add(1)
				return nil, nil
			})
			r.AddConsumerHandler("orders-handler", "orders", pubsub, func(msg *message.Message) error {
				_, err := guarded(msg)
				select {
				case results <- err:
				default:
				}
				return nil // ack: one delivery is enough to see the outcome
			})
			testenv.RunRouter(t, r)
			e, err := envelope.New("urn:babel:orders:created", map[string]any{"n": 1})
			if err != nil {
				t.Fatal(err)
			}
			payload, _ := e.Marshal()
			if err := pubsub.Publish("orders", message.NewMessage(watermill.NewUUID(), payload)); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-results:
				if tc.want == nil && err != nil || tc.want != nil && !errors.Is(err, tc.want) {
					t.Fatalf("delivery: %v, want %v", err, tc.want)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("no delivery")
			}
			n, err := client.Exists(context.Background(), p+e.Meta.ID).Result()
			if err != nil {
				t.Fatal(err)
			}
			if wantRuns := map[bool]int32{true: 0, false: 1}[tc.want != nil]; runs.Load() != wantRuns || n != int64(wantRuns) {
				t.Fatalf("handler ran %d times, Go SDK record present: %v; want %d run(s)", runs.Load(), n == 1, wantRuns)
			}
		})
	}
}

// TestDeleteExpired: lapsed claims go (and on the Go SDK layout, expired
// records); remembered messages, live records and live claims stay.
func TestDeleteExpired(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	type expirer interface {
		stores.Store
		DeleteExpired(context.Context, int) (int64, error)
	}
	type tc struct {
		name        string
		s           stores.Store
		lease, wait time.Duration
		want        int64 // rows deleted: 3 lapsed claims, plus 3 expired records on the Go SDK layout
	}
	var cases []tc
	for _, db := range databases(t) {
		if testing.Short() {
			break // -short: the Go SDK layout only; the PHP layout's whole-second leases wait 2 s a case
		}
		table := sqlTable(t, db.db, "bq_idempotency")
		s := ok(t)(sdkstore.NewPHPPDO(db.db, db.dialect, sdkstore.WithTable(table)))
		migrate(t, s)
		cases = append(cases, tc{"PHPPDO/" + db.dialect.String(), s, time.Second, 2100 * time.Millisecond, 3})
	}
	pg := testenv.Postgres(t)
	goPG := ok(t)(sdkstore.NewGoPostgres(pg, sdkstore.WithTable(sqlTable(t, pg, "babelqueue_idempotency")), sdkstore.WithTTL(200*time.Millisecond)))
	migrate(t, goPG)
	cases = append(cases, tc{"GoPostgres", goPG, 200 * time.Millisecond, 300 * time.Millisecond, 6})
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := c.s.(expirer)
			run := testenv.RandomHex(4)
			for i := range 3 {
				if ok, _, err := s.Claim(ctx, fmt.Sprintf("%s-lapsed-%d", run, i), c.lease); err != nil || !ok {
					t.Fatalf("Claim: %v, %v", ok, err)
				}
				if err := s.Remember(ctx, fmt.Sprintf("%s-done-%d", run, i), 0, nil); err != nil {
					t.Fatal(err)
				}
			}
			time.Sleep(c.wait)
			if ok, _, err := s.Claim(ctx, run+"-live", time.Minute); err != nil || !ok {
				t.Fatalf("Claim: %v, %v", ok, err)
			}
			var deleted int64
			for {
				n, err := s.DeleteExpired(ctx, 2)
				if err != nil {
					t.Fatal(err)
				}
				deleted += n
				if n < 2 {
					break
				}
			}
			if deleted != c.want {
				t.Fatalf("deleted %d rows, want %d", deleted, c.want)
			}
			// Probed by another holder: the store's own claim counts as
			// taken by it.
			if ok, _, err := s.Claim(stores.WithClaimToken(ctx, "probe"), run+"-live", time.Minute); err != nil || ok {
				t.Fatalf("a live claim was deleted: Claim = %v, %v", ok, err)
			}
			if c.want == 3 { // the PHP layout keeps remembered messages
				if seen, err := stores.Seen(ctx, s, run+"-done-0"); err != nil || !seen {
					t.Fatalf("a remembered message was deleted: Seen = %v, %v", seen, err)
				}
			}
		})
	}
}
