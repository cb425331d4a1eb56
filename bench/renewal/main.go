// Command renewal measures what keeping claims alive costs the store:
// 1,000 claims in flight (default), each renewed by the kit's keep-alive
// every third of its lease through Store.Extend, all kept by one
// keepalive.Keeper as a Guard's claims are, on Redis and on
// PostgreSQL, for a while; it prints the renewals per second and the round
// trips (Redis: commands and pipelines; PostgreSQL: statements and batches
// the client sent, counted by a pgx tracer on every connection, the
// session claims' own included) they took, beside what one session per
// worker (every claim bound to a session key kept alive by one renewal)
// would send: one round trip a third of the lease.
//
//	go run ./bench/renewal -claims 1000 -lease 5s -for 20s
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/internal/keepalive"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func main() {
	claims := flag.Int("claims", 1000, "claims in flight")
	lease := flag.Duration("lease", 5*time.Second, "the claims' lease (renewed every third of it)")
	run := flag.Duration("for", 20*time.Second, "how long to keep them alive")
	flag.Parse()
	ctx := context.Background()

	ropts, err := redis.ParseURL(testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL))
	if err != nil {
		log.Fatal(err)
	}
	client := redis.NewClient(ropts)
	trips := &testenv.RoundTrips{}
	client.AddHook(trips)
	prefix := "bqrenew" + strconv.Itoa(os.Getpid()) + ":"
	defer func() { _ = testenv.DropKeys(ctx, client, prefix+"*") }()
	rs := redisstore.New(client, redisstore.WithPrefix(prefix))
	redisTrips := func() (int64, int64) { return trips.Totals() }

	cfg, err := pgx.ParseConfig(testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN))
	if err != nil {
		log.Fatal(err)
	}
	sent := &statements{}
	cfg.Tracer = sent // copied by the session claims' own connection too
	db := stdlib.OpenDB(*cfg)
	defer db.Close()
	db.SetMaxOpenConns(64)
	db.SetMaxIdleConns(64)
	table := "bq_renewal_" + strconv.Itoa(os.Getpid())
	ps, err := postgresstore.New(db, postgresstore.WithTable(table))
	if err != nil {
		log.Fatal(err)
	}
	if err := ps.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	defer db.ExecContext(ctx, `DROP TABLE IF EXISTS `+table) //nolint:errcheck
	// Session claims: the claims are advisory locks on one session, and a
	// renewal asks the session only when it was not heard from for a third
	// of the lease.
	ss, err := postgresstore.New(db, postgresstore.WithTable(table), postgresstore.WithSessionClaims())
	if err != nil {
		log.Fatal(err)
	}
	defer ss.ReleaseAll(ctx) //nolint:errcheck
	pgTrips := func() (int64, int64) { n := sent.n.Load(); return n, n }

	fmt.Printf("%d claims in flight, lease %v (renewed every %v), kept %v; load %s\n", *claims, *lease, *lease/3, *run, loadavg())
	fmt.Printf("%-30s %14s %14s %16s %22s\n", "store", "renewals/s", "commands/s", "round trips/s", "one session: trips/s")
	for _, side := range []struct {
		name  string
		store stores.Store
		trips func() (int64, int64)
	}{{"redisstore", rs, redisTrips}, {"postgresstore", ps, pgTrips}, {"postgresstore, session claims", ss, pgTrips}} {
		renewals := keep(ctx, side.store, *claims, *lease, *run, side.trips)
		fmt.Printf("%-30s %14.0f %14.0f %16.0f %22.1f\n", side.name, renewals.perSecond, renewals.commands, renewals.trips, 3/lease.Seconds())
	}
}

type figures struct{ perSecond, commands, trips float64 }

// keep claims n keys on s, keeps them alive for d, and returns the
// renewals and the store's commands and round trips per second meanwhile
// (the claims themselves excluded).
func keep(ctx context.Context, s stores.Store, n int, lease, d time.Duration, trips func() (int64, int64)) figures {
	var renewals atomic.Int64
	keeper := new(keepalive.Keeper) // one for all the claims, as a Guard's
	leases := make([]*keepalive.Lease, n)
	for i := range n {
		cctx := stores.WithClaimToken(ctx, "holder-"+strconv.Itoa(i))
		key := "renewal:" + strconv.Itoa(i)
		taken := time.Now()
		if ok, _, err := s.Claim(cctx, key, lease); err != nil || !ok {
			log.Fatalf("claim %s: %v %v", key, ok, err)
		}
		leases[i] = keeper.KeepFrom(cctx, taken, lease, func(ctx context.Context, lease time.Duration) (bool, error) {
			renewals.Add(1)
			return s.Extend(ctx, key, lease)
		})
	}
	time.Sleep(lease) // every claim in its renewal rhythm
	r0 := renewals.Load()
	c0, t0 := trips()
	start := time.Now()
	time.Sleep(d)
	took := time.Since(start).Seconds()
	c1, t1 := trips()
	r1 := renewals.Load()
	lost := 0
	for i, l := range leases {
		if l.Stop() != nil {
			lost++
		}
		_ = s.Release(stores.WithClaimToken(ctx, "holder-"+strconv.Itoa(i)), "renewal:"+strconv.Itoa(i))
	}
	if lost > 0 {
		log.Printf("%d claims lost", lost)
	}
	return figures{perSecond: float64(r1-r0) / took, commands: float64(c1-c0) / took, trips: float64(t1-t0) / took}
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	return string(b[:len(b)-1])
}

// statements counts the round trips pgx sends: a statement, or a batch.
type statements struct{ n atomic.Int64 }

func (c *statements) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (c *statements) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *statements) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (c *statements) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (c *statements) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}
