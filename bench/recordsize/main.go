// Command recordsize measures how many bytes one remembered id costs in Redis
// and in PostgreSQL, for this kit's record layout and, side by side, for the
// straightforward layout it replaces. Figures go to docs/benchmarks.md.
//
//	go run ./bench/recordsize -n 1000000
//
// Redis: the growth of INFO memory's used_memory over n records with a TTL,
// written with the exact command redisstore issues (checked against a real
// Remember first). PostgreSQL: pg_total_relation_size (heap, indexes, TOAST,
// free-space and visibility maps) of a table of n rows after VACUUM, keys in
// random order as real ids arrive. Everything it writes is removed at the end.
package main

import (
	"context"
	"database/sql"
	"flag"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"strconv"
	"time"

	"github.com/google/uuid"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func main() {
	n := flag.Int("n", 1_000_000, "records to write per layout")
	redisURL := flag.String("redis", testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL), "Redis URL")
	dsn := flag.String("postgres", testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN), "PostgreSQL DSN")
	flag.Parse()
	ctx := context.Background()
	if err := run(ctx, *n, *redisURL, *dsn); err != nil {
		fmt.Fprintln(os.Stderr, "recordsize:", err)
		os.Exit(1)
	}
}

const (
	handler = "charge" // the scope: a Watermill handler name
	ttl     = 7 * 24 * time.Hour
	records = 604_800_000 // the sizing case: 1,000 new ids/s kept 7 days
)

func run(ctx context.Context, n int, redisURL, dsn string) error {
	fmt.Printf("records per layout: %d (scoped keys: handler %q + UUIDv4 meta.id, TTL %v)\n\n", n, handler, ttl)
	fmt.Println("| store | layout | bytes per id | at 604.8 M ids |")
	fmt.Println("|---|---|---:|---:|")
	if err := measureRedis(ctx, n, redisURL); err != nil {
		return err
	}
	return measurePostgres(ctx, n, dsn)
}

func measureRedis(ctx context.Context, n int, url string) error {
	opts, err := redis.ParseURL(url)
	if err != nil {
		return err
	}
	client := redis.NewClient(opts)
	defer client.Close()
	store := redisstore.New(client, redisstore.WithTTL(ttl))

	// The command written below is the one RememberFingerprint issues
	// (the middleware keeps a content fingerprint with every record): check.
	probe := idempotency.Key(handler, uuid.NewString())
	if err := store.Remember(ctx, probe, 0xfeedface, nil); err != nil {
		return err
	}
	if v, _ := client.Get(ctx, store.RedisKey(probe)).Result(); v != strconv.FormatUint(store.Capabilities().KeptFingerprint(0xfeedface), 10) {
		return fmt.Errorf("redisstore wrote %q, not the kept fingerprint", v)
	}
	_ = store.Forget(ctx, probe)

	layouts := []struct {
		name  string
		key   func(id string) string
		value func() string
	}{
		{"kit: `bq:` + 11-byte digest, value the kept fingerprint (2–9999)",
			func(id string) string { return store.RedisKey(idempotency.Key(handler, id)) },
			func() string { return strconv.FormatUint(store.Capabilities().KeptFingerprint(mrand.Uint64()|1), 10) }},
		{"straightforward: `idempotency:charge:<uuid>`, value 1",
			func(id string) string { return "idempotency:" + handler + ":" + id }, func() string { return "1" }},
	}
	for _, l := range layouts {
		keys := make([]string, n)
		values := make([]string, n)
		for i := range keys {
			keys[i], values[i] = l.key(uuid.NewString()), l.value()
		}
		i := 0
		perID, err := testenv.RedisBytesPerKey(ctx, client, keys,
			func(p redis.Pipeliner, k string) { p.Set(ctx, k, values[i], ttl); i++ },
			func(p redis.Pipeliner, k string) { p.Unlink(ctx, k) })
		if err != nil {
			return err
		}
		fmt.Printf("| Redis | %s | %.1f | %s |\n", l.name, perID, gib(perID*records))
	}
	return nil
}

func measurePostgres(ctx context.Context, n int, dsn string) error {
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	suffix := testenv.RandomHex(4)
	kitTable := "recordsize_kit_" + suffix
	plainTable := "recordsize_plain_" + suffix
	defer db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+kitTable+", "+plainTable) //nolint:errcheck

	store, err := postgresstore.New(db, postgresstore.WithTable(kitTable), postgresstore.WithTTL(ttl))
	if err != nil {
		return err
	}
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	// Rows as the middleware's RememberFingerprint writes them (a uuid key,
	// an expiry, a fingerprint, no claim), keys in random order; checked
	// against a real one.
	if err := store.Remember(ctx, "probe", 0xfeedface, nil); err != nil {
		return err
	}
	if _, err := db.ExecContext(ctx, "DELETE FROM "+kitTable); err != nil {
		return err
	}
	if _, err := db.ExecContext(ctx, `INSERT INTO `+kitTable+` (key, expires_at, fingerprint)
		SELECT gen_random_uuid(), (extract(epoch from now()) * 1000)::bigint + $1, (random() * 9e18)::bigint FROM generate_series(1, $2)`,
		ttl.Milliseconds(), n); err != nil {
		return err
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE `+plainTable+` (
		key text PRIMARY KEY, created_at timestamptz NOT NULL DEFAULT now(), expires_at timestamptz NOT NULL)`); err != nil {
		return err
	}
	if _, err := db.ExecContext(ctx, `CREATE INDEX ON `+plainTable+` (expires_at)`); err != nil {
		return err
	}
	if _, err := db.ExecContext(ctx, `INSERT INTO `+plainTable+` (key, expires_at)
		SELECT '`+handler+`:' || gen_random_uuid()::text, now() + interval '7 days' FROM generate_series(1, $1)`, n); err != nil {
		return err
	}
	for _, l := range []struct{ name, table string }{
		{"kit: uuid key (digest), bigint expiry, bigint fingerprint, claim NULL; primary key only", kitTable},
		{"straightforward: text key `charge:<uuid>`, two timestamptz, expiry index", plainTable},
	} {
		if _, err := db.ExecContext(ctx, "VACUUM ANALYZE "+l.table); err != nil {
			return err
		}
		var size int64
		if err := db.QueryRowContext(ctx, `SELECT pg_total_relation_size($1::regclass)`, l.table).Scan(&size); err != nil {
			return err
		}
		perID := float64(size) / float64(n)
		fmt.Printf("| PostgreSQL | %s | %.1f | %s |\n", l.name, perID, gib(perID*records))
	}
	return nil
}

func gib(bytes float64) string { return fmt.Sprintf("%.1f GiB", bytes/(1<<30)) }
