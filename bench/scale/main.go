// Command scale measures how the stores behave as records pile up: bytes per
// remembered id, and the p50/p99 latency of a first-seen delivery and of a
// duplicate through the middleware, at 0, 1M, 5M and 10M records in Redis
// and in PostgreSQL; and the time the PostgreSQL expired-row cleanup takes
// per million rows. Figures go to docs/benchmarks.md; -json writes them for
// bench/chart.
//
//	go run ./bench/scale -json docs/data/scale.json
//
// With -week it runs only a simulated week of the PostgreSQL layouts: the
// plain table, whose cleanup deletes expired rows, against the partitioned
// one (postgresstore.WithPartitions), whose cleanup drops partitions, each
// loaded with a week of history (10M records by default) and run for a
// few days live (see week.go):
//
//	go run ./bench/scale -week
//
// Redis records go to logical database -redis-db (15 by default), which
// must be empty and is emptied at the end. PostgreSQL records go to tables
// of the run's own, dropped at the end.
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"flag"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// Point is one store at one record count.
type Point struct {
	Store       string  `json:"store"`
	Records     int     `json:"records"`
	BytesPerID  float64 `json:"bytes_per_id,omitempty"`
	FirstP50us  float64 `json:"first_seen_p50_us"`
	FirstP99us  float64 `json:"first_seen_p99_us"`
	DupP50us    float64 `json:"duplicate_p50_us"`
	DupP99us    float64 `json:"duplicate_p99_us"`
	CleanupSecs float64 `json:"cleanup_seconds_per_million,omitempty"`
}

const handler = "" // direct calls: keys are meta.id

func main() {
	milestones := flag.String("records", "0,1000000,5000000,10000000", "record counts to measure at")
	samples := flag.Int("samples", 2000, "deliveries timed per path and record count")
	redisURL := flag.String("redis", testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL), "Redis URL")
	redisDB := flag.Int("redis-db", 15, "Redis logical database to fill (must be empty; emptied at the end)")
	dsn := flag.String("postgres", testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN), "PostgreSQL DSN")
	cleanupRows := flag.Int("cleanup-rows", 1_000_000, "expired rows for the cleanup measurement")
	jsonOut := flag.String("json", "", "also write the results as JSON to this file")
	weekRun := flag.Bool("week", false, "run only the simulated week of the PostgreSQL layouts (plain table against partitions)")
	var wc weekConfig
	flag.DurationVar(&wc.day, "week-day", 75*time.Second, "length of a simulated day (the partition period; the drop margin is 1 min)")
	flag.IntVar(&wc.perDay, "week-per-day", 1_250_000, "records written a simulated day")
	flag.IntVar(&wc.retention, "week-retention", 7, "days a record is kept")
	flag.IntVar(&wc.live, "week-live", 2, "days run live after the history is loaded")
	flag.IntVar(&wc.claimers, "week-claimers", 4, "concurrent first-seen Claims timed during each cleanup")
	flag.Parse()
	if *weekRun {
		if err := week(context.Background(), *dsn, wc); err != nil {
			fmt.Fprintln(os.Stderr, "scale:", err)
			os.Exit(1)
		}
		return
	}
	var counts []int
	for _, s := range strings.Split(*milestones, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil {
			fmt.Fprintln(os.Stderr, "scale: -records:", err)
			os.Exit(2)
		}
		counts = append(counts, n)
	}
	slices.Sort(counts)
	if err := run(context.Background(), counts, *samples, *redisURL, *redisDB, *dsn, *cleanupRows, *jsonOut); err != nil {
		fmt.Fprintln(os.Stderr, "scale:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, counts []int, samples int, redisURL string, redisDB int, dsn string, cleanupRows int, jsonOut string) error {
	var points []Point
	fmt.Println("| store | records | bytes per id | first-seen p50 | p99 | duplicate p50 | p99 |")
	fmt.Println("|---|---:|---:|---:|---:|---:|---:|")
	redisPoints, err := scaleRedis(ctx, counts, samples, redisURL, redisDB)
	if err != nil {
		return fmt.Errorf("redis: %w", err)
	}
	pgPoints, err := scalePostgres(ctx, counts, samples, dsn)
	if err != nil {
		return fmt.Errorf("postgres: %w", err)
	}
	points = append(append(points, redisPoints...), pgPoints...)
	secs, err := cleanupPerMillion(ctx, dsn, cleanupRows)
	if err != nil {
		return fmt.Errorf("cleanup: %w", err)
	}
	points = append(points, Point{Store: "postgres cleanup", Records: cleanupRows, CleanupSecs: secs})
	fmt.Printf("\nPostgreSQL DeleteExpired: %.2f s per million expired rows (%d expired among %d rows, batches of 1024 blocks)\n",
		secs, cleanupRows, 2*cleanupRows)
	if jsonOut != "" {
		b, _ := json.MarshalIndent(points, "", "  ")
		return os.WriteFile(jsonOut, append(b, '\n'), 0o644)
	}
	return nil
}

func printPoint(p Point) {
	bytes := "-"
	if p.BytesPerID > 0 {
		bytes = fmt.Sprintf("%.1f", p.BytesPerID)
	}
	fmt.Printf("| %s | %d | %s | %.0f µs | %.0f µs | %.0f µs | %.0f µs |\n",
		p.Store, p.Records, bytes, p.FirstP50us, p.FirstP99us, p.DupP50us, p.DupP99us)
}

// latencies times samples first-seen deliveries of fresh envelopes, then
// samples duplicates of them.
func latencies(store stores.Store, samples int) (first, dup []time.Duration, err error) {
	h := idempotency.Middleware(store, idempotency.WithReplayHorizon(0))(func(*message.Message) ([]*message.Message, error) {
		return nil, nil
	})
	payloads := make([][]byte, samples)
	for i := range payloads {
		e, err := envelope.New("urn:babel:orders:created", map[string]any{"order_id": i, "amount_cents": 1299})
		if err != nil {
			return nil, nil, err
		}
		payloads[i], _ = e.Marshal()
	}
	deliver := func(p []byte) (time.Duration, error) {
		msg := message.NewMessage("scale", p)
		start := time.Now()
		_, err := h(msg)
		return time.Since(start), err
	}
	for _, p := range payloads {
		d, err := deliver(p)
		if err != nil {
			return nil, nil, err
		}
		first = append(first, d)
	}
	for _, p := range payloads {
		d, err := deliver(p)
		if err != nil {
			return nil, nil, err
		}
		dup = append(dup, d)
	}
	return first, dup, nil
}

func percentile(d []time.Duration, p float64) float64 {
	s := slices.Clone(d)
	slices.Sort(s)
	return float64(s[int(p*float64(len(s)-1))]) / float64(time.Microsecond)
}

func point(name string, records int, first, dup []time.Duration) Point {
	return Point{Store: name, Records: records, FirstP50us: percentile(first, 0.5), FirstP99us: percentile(first, 0.99),
		DupP50us: percentile(dup, 0.5), DupP99us: percentile(dup, 0.99)}
}

func scaleRedis(ctx context.Context, counts []int, samples int, url string, db int) ([]Point, error) {
	opts, err := redis.ParseURL(url)
	if err != nil {
		return nil, err
	}
	opts.DB = db
	client := redis.NewClient(opts)
	defer client.Close()
	if n, err := client.DBSize(ctx).Result(); err != nil || n != 0 {
		return nil, fmt.Errorf("database %d is not empty (%d keys, %v); pick another with -redis-db", db, n, err)
	}
	defer client.FlushDBAsync(context.Background())
	store := redisstore.New(client, redisstore.WithTTL(7*24*time.Hour))
	base, err := testenv.RedisUsedMemory(ctx, client)
	if err != nil {
		return nil, err
	}
	var points []Point
	loaded := 0
	for _, target := range counts {
		// Records as the middleware writes them: a digest key, the kept
		// fingerprint as value, a TTL.
		pipe := client.Pipeline()
		for ; loaded < target; loaded++ {
			pipe.Set(ctx, store.RedisKey(idempotency.Key(handler, uuid.NewString())),
				strconv.FormatUint(store.Capabilities().KeptFingerprint(mrand.Uint64()|1), 10), 7*24*time.Hour)
			if pipe.Len() >= 10_000 {
				if _, err := pipe.Exec(ctx); err != nil {
					return nil, err
				}
			}
		}
		if _, err := pipe.Exec(ctx); err != nil {
			return nil, err
		}
		var bytes float64
		if loaded > 0 {
			used, err := testenv.RedisUsedMemory(ctx, client)
			if err != nil {
				return nil, err
			}
			bytes = float64(used-base) / float64(loaded)
		}
		first, dup, err := latencies(store, samples)
		if err != nil {
			return nil, err
		}
		p := point("redis", target, first, dup)
		p.BytesPerID = bytes
		printPoint(p)
		points = append(points, p)
	}
	return points, nil
}

func scalePostgres(ctx context.Context, counts []int, samples int, dsn string) ([]Point, error) {
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return nil, err
	}
	defer db.Close()
	table := "scale_idem_" + testenv.RandomHex(3)
	store, err := postgresstore.New(db, postgresstore.WithTable(table), postgresstore.WithTTL(7*24*time.Hour))
	if err != nil {
		return nil, err
	}
	if err := store.Migrate(ctx); err != nil {
		return nil, err
	}
	defer db.ExecContext(context.Background(), "DROP TABLE "+table) //nolint:errcheck
	var points []Point
	loaded := 0
	for _, target := range counts {
		for loaded < target {
			batch := min(1_000_000, target-loaded)
			if _, err := db.ExecContext(ctx, `INSERT INTO `+table+` (key, expires_at, fingerprint)
				SELECT gen_random_uuid(), (extract(epoch from now()) * 1000)::bigint + $1, (random() * 9e18)::bigint
				FROM generate_series(1, $2)`, (7 * 24 * time.Hour).Milliseconds(), batch); err != nil {
				return nil, err
			}
			loaded += batch
		}
		var bytes float64
		if loaded > 0 {
			if _, err := db.ExecContext(ctx, "VACUUM ANALYZE "+table); err != nil {
				return nil, err
			}
			var size int64
			if err := db.QueryRowContext(ctx, `SELECT pg_total_relation_size($1::regclass)`, table).Scan(&size); err != nil {
				return nil, err
			}
			bytes = float64(size) / float64(loaded)
		}
		first, dup, err := latencies(store, samples)
		if err != nil {
			return nil, err
		}
		p := point("postgres", target, first, dup)
		p.BytesPerID = bytes
		printPoint(p)
		points = append(points, p)
	}
	return points, nil
}

// cleanupPerMillion times DeleteExpired on a table holding rows expired
// rows among as many live ones, and returns the seconds per million expired
// rows.
func cleanupPerMillion(ctx context.Context, dsn string, rows int) (float64, error) {
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return 0, err
	}
	defer db.Close()
	table := "scale_cleanup_" + testenv.RandomHex(3)
	store, err := postgresstore.New(db, postgresstore.WithTable(table), postgresstore.WithTTL(time.Hour))
	if err != nil {
		return 0, err
	}
	if err := store.Migrate(ctx); err != nil {
		return 0, err
	}
	defer db.ExecContext(context.Background(), "DROP TABLE "+table) //nolint:errcheck
	// Expired and live rows interleaved, as they are after a while.
	if _, err := db.ExecContext(ctx, `INSERT INTO `+table+` (key, expires_at, fingerprint)
		SELECT gen_random_uuid(), (extract(epoch from now()) * 1000)::bigint + CASE WHEN g % 2 = 0 THEN -1000 ELSE 3600000 END, g
		FROM generate_series(1, $1) g`, 2*rows); err != nil {
		return 0, err
	}
	if _, err := db.ExecContext(ctx, "VACUUM ANALYZE "+table); err != nil {
		return 0, err
	}
	start := time.Now()
	deleted, err := store.DeleteExpired(ctx)
	if err != nil {
		return 0, err
	}
	if deleted != int64(rows) {
		return 0, fmt.Errorf("deleted %d rows, want %d", deleted, rows)
	}
	return time.Since(start).Seconds() / (float64(rows) / 1e6), nil
}
