// Command apirecordsize measures how many bytes one API record of package
// httpidempotency costs in Redis and in PostgreSQL: the full record (the
// saved response: one tier, or the response tier of WithResponseStore)
// and the compact identity record of the identity tier. Figures go to
// docs/benchmarks.md ("API records in two tiers").
//
//	go run ./bench/apirecordsize -full 1000000 -identity 1000000,10000000
//
// The values are the ones a real Guard writes: one request is answered by
// a Guard with two memstore tiers, and its two records are copied, so the
// layouts follow the code. The response: 201, Content-Type, a Location
// naming the order, and a JSON body of -body bytes. Redis: the growth of
// INFO memory's used_memory over n records with a TTL, written with the
// exact string redisstore keeps (read back from a real Remember). PostgreSQL:
// pg_total_relation_size (heap, indexes, TOAST, maps) after VACUUM of a
// postgresstore table of n rows, keys in random order. Everything it writes
// is removed at the end.
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/middleware/httpidempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

const (
	tenant    = "acme-payments"
	operation = "orders.create"
	ttl       = 7 * 24 * time.Hour
)

func main() {
	full := flag.String("full", "1000000", "record counts for the full record (comma-separated; empty: none)")
	identity := flag.String("identity", "1000000,10000000", "record counts for the identity record")
	body := flag.Int("body", 512, "bytes of the saved response body")
	only := flag.String("only", "", "redis or postgres: measure one store only")
	redisURL := flag.String("redis", testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL), "Redis URL")
	dsn := flag.String("postgres", testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN), "PostgreSQL DSN")
	flag.Parse()
	if err := run(context.Background(), *full, *identity, *body, *only, *redisURL, *dsn); err != nil {
		fmt.Fprintln(os.Stderr, "apirecordsize:", err)
		os.Exit(1)
	}
}

// layout is one kind of record with the value a Guard writes.
type layout struct {
	name   string
	fp     uint64
	value  []byte
	counts []int
}

func run(ctx context.Context, fullCounts, identityCounts string, body int, only, redisURL, dsn string) error {
	full, identity, err := guardValues(body)
	if err != nil {
		return err
	}
	layouts := []layout{
		{name: fmt.Sprintf("full record (one tier, or the response tier): %d-byte value", len(full.Value)), fp: full.Fingerprint, value: full.Value},
		{name: fmt.Sprintf("identity record (the identity tier): %d-byte value", len(identity.Value)), fp: identity.Fingerprint, value: identity.Value},
	}
	if layouts[0].counts, err = counts(fullCounts); err != nil {
		return err
	}
	if layouts[1].counts, err = counts(identityCounts); err != nil {
		return err
	}
	fmt.Printf("response: 201, Content-Type, Location, %d-byte body; scoped keys: tenant %q, operation %q, UUIDv4 key; TTL %v\n\n", body, tenant, operation, ttl)
	fmt.Println("| store | record | records | bytes per record |")
	fmt.Println("|---|---|---:|---:|")
	if only != "postgres" {
		if err := measureRedis(ctx, redisURL, layouts); err != nil {
			return err
		}
	}
	if only != "redis" {
		return measurePostgres(ctx, dsn, layouts)
	}
	return nil
}

func counts(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("record count %q", f)
		}
		out = append(out, n)
	}
	return out, nil
}

// guardValues answers one request with a Guard keeping two memstore tiers
// and returns the records it wrote: the full response, the identity.
func guardValues(body int) (full, identity stores.Record, err error) {
	identities := memstore.New(memstore.WithTTL(ttl))
	responses := memstore.New(memstore.WithTTL(24 * time.Hour))
	guard, err := httpidempotency.New(identities, func(*http.Request) (string, error) { return tenant, nil },
		httpidempotency.WithResponseStore(responses), httpidempotency.WithLogger(nil))
	if err != nil {
		return full, identity, err
	}
	orderID := "ord_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:22]
	h := guard.Wrap(httpidempotency.Operation{Name: operation, SaveHeaders: []string{"Location"}, Expired: httpidempotency.ExpiredIsNew},
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Location", "/v1/orders/"+orderID)
			w.WriteHeader(http.StatusCreated)
			prefix := `{"id":"` + orderID + `","status":"accepted","amount":1299,"currency":"EUR","note":"`
			pad := max(body-len(prefix)-2, 0)
			_, _ = w.Write([]byte(prefix + strings.Repeat("x", pad) + `"}`))
		}))
	key := uuid.NewString()
	req := httptest.NewRequest(http.MethodPost, "/v1/orders", strings.NewReader(`{"amount":1299,"currency":"EUR"}`))
	req.Header.Set(httpidempotency.HeaderKey, key)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code != http.StatusCreated {
		return full, identity, fmt.Errorf("the guarded request got %d", rec.Code)
	}
	ctx := context.Background()
	rk := httpidempotency.RecordKey(tenant, operation, key)
	if full, err = responses.Lookup(ctx, rk); err != nil {
		return full, identity, err
	}
	if identity, err = identities.Lookup(ctx, rk); err != nil {
		return full, identity, err
	}
	if _, err := httpidempotency.DecodeIdentity(identity.Value); err != nil || full.Value == nil {
		return full, identity, fmt.Errorf("the guard wrote no two tiers: %v", err)
	}
	return full, identity, nil
}

func measureRedis(ctx context.Context, url string, layouts []layout) error {
	opts, err := redis.ParseURL(url)
	if err != nil {
		return err
	}
	client := redis.NewClient(opts)
	defer client.Close()
	prefix := "apirs" + testenv.RandomHex(4) + ":"
	defer testenv.DropKeys(context.Background(), client, prefix+"*") //nolint:errcheck
	store := redisstore.New(client, redisstore.WithPrefix(prefix), redisstore.WithTTL(ttl))
	for _, l := range layouts {
		// The string redisstore keeps for this record, from a real Remember.
		probe := httpidempotency.RecordKey(tenant, operation, uuid.NewString())
		if err := store.Remember(ctx, probe, l.fp, l.value); err != nil {
			return err
		}
		kept, err := client.Get(ctx, store.RedisKey(probe)).Result()
		if err != nil {
			return err
		}
		if !strings.HasSuffix(kept, string(l.value)) {
			return errors.New("redisstore keeps the value otherwise than read here")
		}
		if err := store.Forget(ctx, probe); err != nil {
			return err
		}
		for _, n := range l.counts {
			keys := make([]string, n)
			for i := range keys {
				keys[i] = store.RedisKey(httpidempotency.RecordKey(tenant, operation, uuid.NewString()))
			}
			perKey, err := testenv.RedisBytesPerKey(ctx, client, keys,
				func(p redis.Pipeliner, k string) { p.Set(ctx, k, kept, ttl) },
				func(p redis.Pipeliner, k string) { p.Unlink(ctx, k) })
			if err != nil {
				return err
			}
			fmt.Printf("| Redis | %s | %d | %.1f |\n", l.name, n, perKey)
		}
	}
	return nil
}

func measurePostgres(ctx context.Context, dsn string, layouts []layout) error {
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	table := "apirecordsize_" + testenv.RandomHex(4)
	defer db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+table) //nolint:errcheck
	store, err := postgresstore.New(db, postgresstore.WithTable(table), postgresstore.WithTTL(ttl), postgresstore.WithLogger(nil))
	if err != nil {
		return err
	}
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	for _, l := range layouts {
		// Rows as Remember writes them (checked against a real one): a uuid
		// key, an expiry, the fingerprint, the value, no claim.
		if err := store.Remember(ctx, "probe", l.fp, l.value); err != nil {
			return err
		}
		var kept []byte
		var fp int64
		var claim sql.NullString
		if err := db.QueryRowContext(ctx, "SELECT value, fingerprint, claim FROM "+table).Scan(&kept, &fp, &claim); err != nil {
			return err
		}
		if string(kept) != string(l.value) || uint64(fp) != l.fp || claim.Valid {
			return errors.New("postgresstore keeps the record otherwise than written here")
		}
		for _, n := range l.counts {
			if _, err := db.ExecContext(ctx, "TRUNCATE "+table); err != nil {
				return err
			}
			if _, err := db.ExecContext(ctx, `INSERT INTO `+table+` (key, expires_at, fingerprint, value)
				SELECT gen_random_uuid(), (extract(epoch from now()) * 1000)::bigint + $1, (random() * 9e18)::bigint, $2::bytea FROM generate_series(1, $3)`,
				ttl.Milliseconds(), l.value, n); err != nil {
				return err
			}
			if _, err := db.ExecContext(ctx, "VACUUM ANALYZE "+table); err != nil {
				return err
			}
			var size int64
			if err := db.QueryRowContext(ctx, `SELECT pg_total_relation_size($1::regclass)`, table).Scan(&size); err != nil {
				return err
			}
			fmt.Printf("| PostgreSQL | %s | %d | %.1f |\n", l.name, n, float64(size)/float64(n))
		}
		if _, err := db.ExecContext(ctx, "TRUNCATE "+table); err != nil {
			return err
		}
	}
	return nil
}
