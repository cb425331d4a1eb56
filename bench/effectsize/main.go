// Command effectsize measures how many bytes one effect record costs in
// Redis and in PostgreSQL with its provider result kept, and once the
// result was dropped (the stores' WithResultTTL), side by side. Figures go
// to docs/benchmarks.md.
//
//	go run ./bench/effectsize -n 1000000 -result 256
//
// Each layout is taken from a record the real store wrote (Begin, then a
// succeeded Transition with a result of -result bytes), copied n times
// under fresh provider keys. Redis: the growth of INFO memory's
// used_memory over the n records: the hash with the result in it (no
// result lifetime), the hash and its sibling result key (within the
// lifetime), the hash alone (dropped). PostgreSQL: pg_total_relation_size
// (heap, indexes, TOAST) after VACUUM FULL, with the results held, then
// after the store's Purge cleared them. Everything it writes is removed at
// the end.
package main

import (
	"context"
	"database/sql"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/google/uuid"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func main() {
	n := flag.Int("n", 1_000_000, "effect records per layout")
	size := flag.Int("result", 256, "bytes of each provider result")
	redisURL := flag.String("redis", testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL), "Redis URL")
	dsn := flag.String("postgres", testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN), "PostgreSQL DSN")
	flag.Parse()
	ctx := context.Background()
	fmt.Printf("effect records per layout: %d, provider result %d bytes\n\n", *n, *size)
	fmt.Println("| store | record | bytes per effect | at 1 M effects |")
	fmt.Println("|---|---|---:|---:|")
	err := measureRedis(ctx, *n, *size, *redisURL)
	if err == nil {
		err = measurePostgres(ctx, *n, *size, *dsn)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "effectsize:", err)
		os.Exit(1)
	}
}

// succeed records a succeeded effect key with result through s.
func succeed(ctx context.Context, s stores.EffectStore, key string, result []byte) error {
	if _, _, err := s.Begin(ctx, stores.EffectIntent{Key: key, Name: "charge", Scope: "billing", MessageID: uuid.NewString(), Fingerprint: 0x1234567890abcdef}, time.Minute); err != nil {
		return err
	}
	_, _, err := s.Transition(ctx, key, stores.EffectTransition{To: stores.EffectSucceeded, Result: result, Evidence: "call"})
	return err
}

func measureRedis(ctx context.Context, n, size int, url string) error {
	opts, err := redis.ParseURL(url)
	if err != nil {
		return err
	}
	opts.ReadTimeout = time.Minute // a pipeline of thousands of hashes, on a loaded machine
	client := redis.NewClient(opts)
	defer client.Close()
	prefix := "fxsize" + testenv.RandomHex(4)
	defer testenv.DropKeys(context.Background(), client, prefix+"*") //nolint:errcheck // whatever an error left
	result := []byte(strings.Repeat("r", size))
	kept := redisstore.NewEffects(client, redisstore.WithEffectsPrefix(prefix))
	tiered := redisstore.NewEffects(client, redisstore.WithEffectsPrefix(prefix), redisstore.WithResultTTL(24*time.Hour))
	probe := func(s *redisstore.Effects) (map[string]string, error) {
		key := uuid.NewString()
		if err := succeed(ctx, s, key, result); err != nil {
			return nil, err
		}
		h, err := client.HGetAll(ctx, s.EffectKey(key)).Result()
		if err == nil {
			err = s.Forget(ctx, key)
		}
		return h, err
	}
	plainHash, err := probe(kept)
	if err != nil {
		return err
	}
	tieredHash, err := probe(tiered)
	if err != nil {
		return err
	}
	if _, ok := tieredHash["result"]; ok {
		return fmt.Errorf("the tiered store kept the result in the hash")
	}
	for _, l := range []struct {
		name    string
		hash    map[string]string
		sibling bool
	}{
		{"result in the hash (no result lifetime)", plainHash, false},
		{"hash + result key (within the result lifetime)", tieredHash, true},
		{"hash alone (result dropped)", tieredHash, false},
	} {
		keys := make([]string, n)
		for i := range keys {
			keys[i] = uuid.NewString()
		}
		perKey, err := testenv.RedisBytesPerKey(ctx, client, keys, func(p redis.Pipeliner, k string) {
			h := make(map[string]any, len(l.hash))
			for f, v := range l.hash {
				h[f] = v
			}
			h["key"] = k
			p.HSet(ctx, kept.EffectKey(k), h)
			p.PExpire(ctx, kept.EffectKey(k), stores.DefaultEffectsTTL)
			if l.sibling {
				p.Set(ctx, kept.ResultKey(k), result, 24*time.Hour)
			}
		}, func(p redis.Pipeliner, k string) { p.Unlink(ctx, kept.EffectKey(k), kept.ResultKey(k)) })
		if err != nil {
			return err
		}
		row(fmt.Sprintf("Redis | %s", l.name), perKey)
	}
	return nil
}

func measurePostgres(ctx context.Context, n, size int, dsn string) error {
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	random := fmt.Sprintf(`substring(decode(repeat(md5(g::text || random()::text), %d), 'hex') from 1 for %d)`, size/16+1, size)
	// A table of its own for each: a VACUUM keeps the dead rows any open
	// snapshot of the server may still see, so a table measured after an
	// UPDATE would count both versions.
	for _, l := range []struct{ what, result string }{
		{"result held", random},
		{"result dropped (NULL, as Purge leaves it)", "NULL"},
	} {
		if err := measureTable(ctx, db, n, size, l.what, l.result); err != nil {
			return err
		}
	}
	return nil
}

// measureTable fills a table of an Effects store with n copies of a row
// the store wrote, under fresh keys (random order, as provider keys
// arrive), with result (an SQL expression of g), and prints its size; for
// held results, it then times the store's Purge clearing them.
func measureTable(ctx context.Context, db *sql.DB, n, size int, what, result string) error {
	s, err := postgresstore.NewEffects(db, postgresstore.WithEffectsTable("effectsize_"+testenv.RandomHex(4)), postgresstore.WithResultTTL(time.Second))
	if err != nil {
		return err
	}
	if err := s.Migrate(ctx); err != nil {
		return err
	}
	table, events := s.Tables()
	defer db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+table+", "+events) //nolint:errcheck
	if err := succeed(ctx, s, "probe", []byte(strings.Repeat("r", size))); err != nil {
		return err
	}
	if _, err := db.ExecContext(ctx, `INSERT INTO `+table+` (key, name, scope, message_id, fingerprint, state, result, note, evidence,
			attempts, holder, lease_until, created_at, state_since, updated_at, expires_at, result_expires_at)
		SELECT convert_to(gen_random_uuid()::text, 'UTF8'), name, scope, convert_to(gen_random_uuid()::text, 'UTF8'), fingerprint,
			state, `+result+`, note, evidence, attempts, holder, lease_until, created_at, state_since, updated_at, expires_at,
			result_expires_at
		FROM `+table+`, generate_series(1, $1) AS g WHERE key = 'probe'`, n); err != nil {
		return err
	}
	if _, err := db.ExecContext(ctx, "VACUUM FULL ANALYZE "+table); err != nil {
		return err
	}
	var bytes int64
	if err := db.QueryRowContext(ctx, `SELECT pg_total_relation_size($1::regclass)`, table).Scan(&bytes); err != nil {
		return err
	}
	row("PostgreSQL | "+what, float64(bytes)/float64(n))
	if result == "NULL" {
		return nil
	}
	// Their lifetime passed (a second after the probe succeeded): the
	// store's Purge clears them in one statement.
	start := time.Now()
	for e, _ := s.Lookup(ctx, "probe"); !e.ResultDropped; e, _ = s.Lookup(ctx, "probe") {
		if time.Since(start) > time.Minute {
			return fmt.Errorf("the probe's result was not dropped after a minute")
		}
		time.Sleep(50 * time.Millisecond)
	}
	start = time.Now()
	if _, err := s.Purge(ctx, time.Now().Add(-time.Hour)); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "PostgreSQL: Purge cleared %d results in %v\n", n, time.Since(start).Round(time.Millisecond))
	return nil
}

func row(what string, perEffect float64) {
	fmt.Printf("| %s | %.1f | %.1f MiB |\n", what, perEffect, perEffect*1e6/(1<<20))
}
