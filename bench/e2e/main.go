// Command e2e measures end-to-end deliveries per second of Watermill
// routers consuming from Redis Streams: with no middleware, with Watermill's
// middleware.Deduplicator, and with this kit's middleware on each store, in
// one run on the same servers. Figures go to docs/benchmarks.md; -json writes
// them for bench/chart.
//
//	go run ./bench/e2e -n 100000 -consumers 32 -rounds 3 -placements shared,separate \
//	  -variants 'no middleware|Deduplicator|memstore|redisstore|kit, postgresstore$' -json docs/data/e2e.json
//
// (the chart's variants: without -variants every variant runs, the
// measurement-only ones included).
//
// For each variant it publishes n distinct envelopes to a fresh stream (not
// timed), starts the consumers (one consumer group, a router each), and
// times them from start until the group has read and acked every entry
// (after an untimed warm-up run with no middleware). It
// also reports the CPU time per delivery of this process and of the Redis
// server while the consumers ran, and the commands redisstore sent per
// delivery with the round trips they took. With -rounds it measures every
// variant that many times, in turns (every other round in reverse order),
// and reports medians: one run differs from the
// next by up to 30% on a small shared machine, and a ratio is only
// meaningful between variants measured under the same conditions.
//
// On a machine that also runs Redis, -placements measures both ways in
// every round (Linux, Redis on this machine): "shared" leaves this process
// and Redis on the same cores, as started; "separate" puts Redis on the
// last core and this process on the others (GOMAXPROCS to match), as
// separate hosts would; the chart's command above measures both. The
// PostgreSQL figures of docs/benchmarks.md (every PostgreSQL variant, the
// measurement-only bounds and the transactional inbox included):
//
//	go build -o /tmp/e2e ./bench/e2e && /tmp/e2e -n 100000 -consumers 32 -rounds 3 \
//	  -variants 'no middleware|postgresstore'
//
// The placements are restored when the run ends or is interrupted.
//
// With -handler write the handler does what a payment handler does: one
// PostgreSQL transaction per message (BEGIN, one INSERT, COMMIT) on a pool
// of its own sized like the store's, or, in the kit's transactional modes,
// that INSERT in the transaction the kit hands it. The variants that use
// pgx natively (its handler alone, WithPgxTransaction) are compared with
// the handler alone on pgx, the others with it on database/sql. -paired
// runs each variant beside a run of its baseline (after it in odd rounds,
// before it in even ones) and compares the two, so that the machine's
// drift between variants does not move the ratio, and neither does what
// one run leaves for the next. The variant "no middleware, again" is the
// baseline paired with itself: its kit CPU per delivery is what the
// pairing reads when nothing differs. The real-work figures of docs/benchmarks.md:
//
//	/tmp/e2e -handler write -paired -n 10000 -consumers 32 -rounds 7 \
//	  -variants '^no middleware|Deduplicator|redisstore|kit, postgresstore \(claims|WithTransaction|WithPgxTransaction' -json docs/data/e2e.json
//
// -interleave k measures each variant against its baseline within one run
// instead: the run's deliveries take turns, k through the variant's
// middleware, the next k through the baseline's, and so on (odd rounds
// start with the baseline). The CPU time (this process, Redis and
// PostgreSQL) is read at every block's edge, and each block of the
// variant is compared with the mean of the two baseline blocks around it,
// leaving out a run's first and last block. A block lasts a second or
// less, so the machine's drift, which moves a whole run by more than the
// kit costs on a small shared machine, hardly moves a block against its
// neighbours; the deliveries in flight at an edge (one per consumer) count
// in the block they end in. With -interleave-cycle 3 the turns go variant,
// baseline, baseline, and the baseline block right after each variant
// block is also compared with the baseline blocks around the pair: what
// the variant leaves behind for the block after it (its spill, which the
// comparison with the neighbours would take for the baseline's own
// cost). The variant "no middleware, 50 µs of CPU burnt
// a delivery" adds a known cost, to check what a measurement makes of it:
//
//	/tmp/e2e -handler write -interleave 2000 -n 40000 -consumers 32 -rounds 6 \
//	  -variants '^no middleware$|^no middleware, again|50 µs|postgresstore \(session claims, the default'
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"regexp"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/internal/proccpu"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// Result is one variant's figures.
type Result struct {
	Variant       string  `json:"variant"`
	Handler       string  `json:"handler"`   // noop or write (see -handler)
	Placement     string  `json:"placement"` // shared or separate (see -placements)
	Messages      int     `json:"messages"`
	Seconds       float64 `json:"seconds"`
	PerSecond     float64 `json:"deliveries_per_second"`
	Effects       int64   `json:"effects"`
	OfBaselinePct float64 `json:"of_baseline_pct"`
	// With -rounds above 1: the figures above are medians over the rounds
	// (the percentage is the median of each round's ratio to the baseline
	// measured in that round), and these the lowest and highest ratios.
	Rounds           int     `json:"rounds"`
	OfBaselineMinPct float64 `json:"of_baseline_min_pct"`
	OfBaselineMaxPct float64 `json:"of_baseline_max_pct"`
	// CPU time per delivery while the consumers ran: of this process (the
	// routers, the middleware and the clients) and of the Redis server.
	ConsumerCPUMicros float64 `json:"consumer_cpu_us_per_delivery"`
	RedisCPUMicros    float64 `json:"redis_cpu_us_per_delivery"`
	// The CPU time per delivery of the local PostgreSQL server's processes
	// (Linux; 0 where it cannot tell).
	PostgresCPUMicros float64 `json:"postgres_cpu_us_per_delivery"`
	// The baseline's CPU time per delivery (this process, Redis and
	// PostgreSQL together) over the variant's, in percent: the share of the
	// baseline's throughput the variant would keep were the machine's CPU
	// the only limit. It moves less with other work on the machine than
	// the throughput does.
	CPUSharePct float64 `json:"cpu_share_pct"`
	// The variant's CPU time per delivery (this process, Redis and
	// PostgreSQL together) less its baseline's: what the kit itself costs
	// a delivery. Read round by round against the baseline's run in the
	// same round (just before it, with -paired); its median over rounds.
	KitCPUMicros float64 `json:"kit_cpu_us_per_delivery"`
	// The commands redisstore sent per delivery and the round trips they
	// took (0 for the other variants).
	StoreCommands   float64 `json:"store_commands_per_delivery"`
	StoreRoundTrips float64 `json:"store_round_trips_per_delivery"`
	// The transactions the PostgreSQL database committed or rolled back
	// per delivery, the handler's own included (one per delivery with
	// -handler write): the kit's round trips to PostgreSQL show beside the
	// handler alone's.
	PostgresTransactions float64 `json:"postgres_transactions_per_delivery"`
	// The WAL the server wrote per delivery, in bytes, and the full-page
	// images in it (a page's first change after a checkpoint writes the
	// whole page), and the checkpoints that began during the run.
	WALBytes    float64 `json:"wal_bytes_per_delivery"`
	WALFPI      float64 `json:"wal_full_page_images_per_delivery"`
	Checkpoints int64   `json:"checkpoints"`
}

func main() {
	n := flag.Int("n", 100_000, "messages per variant")
	consumers := flag.Int("consumers", 8, "consumers in the group (one router each)")
	redisURL := flag.String("redis", testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL), "Redis URL (broker and redisstore)")
	dsn := flag.String("postgres", testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN), "PostgreSQL DSN")
	storeURL := flag.String("store-redis", "", "Redis URL for redisstore, when it is not the broker's Redis")
	only := flag.String("variants", "", "run only the variants whose names match this regular expression (the first one run is the baseline)")
	rounds := flag.Int("rounds", 1, "measure every variant this many times, in turns, and report medians")
	paired := flag.Bool("paired", false, "run each variant beside a run of its baseline (the first variant, or the pgx handler alone for the pgx variants), just before it in odd rounds and just after it in even ones, and compare it with that run: twice the runs, but a ratio that the machine's drift within a round does not move")
	jsonOut := flag.String("json", "", "also write the results as JSON to this file")
	interleave := flag.Int("interleave", 0, "instead of whole runs, measure each variant against its baseline in blocks of this many deliveries within one run, the two taking turns block by block (0: off); see the package doc")
	cycle := flag.Int("interleave-cycle", 2, "with -interleave: one variant block in this many (3: variant, baseline, baseline, which also reads what a variant block leaves to the block after it)")
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of the whole run to this file")
	handler := flag.String("handler", "noop", "what the handler does: noop (nothing) or write (one PostgreSQL transaction per message: BEGIN, one INSERT, COMMIT, on a pool of its own sized like the store's; in the transactional mode the INSERT goes in the transaction the kit hands it)")
	placements := flag.String("placements", "shared", "comma-separated placements, measured in turns in every round: shared (this process and Redis on the same cores, as started) and separate (Linux, Redis on this machine: Redis on the last core, this process on the others)")
	flag.Parse()
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err == nil {
			err = pprof.StartCPUProfile(f)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "e2e:", err)
			os.Exit(1)
		}
		defer pprof.StopCPUProfile()
	}
	if *handler != "noop" && *handler != "write" {
		fmt.Fprintf(os.Stderr, "e2e: -handler %q: want noop or write\n", *handler)
		os.Exit(2)
	}
	if err := run(context.Background(), *n, *consumers, *rounds, *redisURL, *storeURL, *dsn, *only, *jsonOut, *handler == "write", *paired, *interleave, *cycle, strings.Split(*placements, ",")); err != nil {
		pprof.StopCPUProfile()
		fmt.Fprintln(os.Stderr, "e2e:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, n, consumers, rounds int, redisURL, storeURL, dsn, only, jsonOut string, write, paired bool, interleave, cycle int, placements []string) error {
	opts, err := redis.ParseURL(redisURL)
	if err != nil {
		return err
	}
	admin := redis.NewClient(opts)
	defer admin.Close()
	// Every connection of this run names itself, so that the PostgreSQL CPU
	// column counts its backends (and the server's own processes) and not
	// those of other work on the same server.
	runID := testenv.RandomHex(3)
	appName := "bq-e2e-" + runID
	connConfig, err := pgx.ParseConfig(dsn)
	if err != nil {
		return err
	}
	connConfig.RuntimeParams["application_name"] = appName
	db := stdlib.OpenDB(*connConfig)
	defer db.Close()
	db.SetMaxOpenConns(consumers * 2)
	db.SetMaxIdleConns(consumers * 2) // database/sql keeps 2 by default: most statements would reconnect
	pgProcs := proccpu.Postgres{DB: db, App: appName}
	var w *work // the real-work handler's database (-handler write)
	if write {
		hdb := stdlib.OpenDB(*connConfig)
		defer hdb.Close()
		hdb.SetMaxOpenConns(consumers * 2) // sized like the store's pool
		hdb.SetMaxIdleConns(consumers * 2)
		w = &work{db: hdb, prefix: "e2e_effect_" + runID + "_"}
	}
	pgStore, err := postgresstore.New(db, postgresstore.WithTable("e2e_idem_"+runID), postgresstore.WithTTL(time.Hour))
	if err != nil {
		return err
	}
	made := []*postgresstore.Store{pgStore}
	defer func() {
		for _, s := range made {
			_ = s.Close()
		}
	}()
	pgVariant := func(opts ...postgresstore.Option) *postgresstore.Store {
		s, err := postgresstore.New(db, append([]postgresstore.Option{postgresstore.WithTable("e2e_idem_" + runID), postgresstore.WithTTL(time.Hour)}, opts...)...)
		if err != nil {
			panic(err) // the same options as pgStore's, which were accepted
		}
		made = append(made, s)
		return s
	}
	if err := pgStore.Migrate(ctx); err != nil {
		return err
	}
	defer db.ExecContext(context.Background(), "DROP TABLE e2e_idem_"+runID) //nolint:errcheck
	storeOpts := opts
	if storeURL != "" {
		if storeOpts, err = redis.ParseURL(storeURL); err != nil {
			return err
		}
	}
	storeClient := redis.NewClient(storeOpts)
	defer storeClient.Close()
	storeTrips := &testenv.RoundTrips{}
	storeClient.AddHook(storeTrips)
	defer testenv.DropKeys(context.Background(), storeClient, "e"+runID+"*") //nolint:errcheck // the kit's Redis records of this run
	newRedisStore := func() *redisstore.Store {
		return redisstore.New(storeClient, redisstore.WithPrefix("e"+runID+testenv.RandomHex(1)+":"), redisstore.WithTTL(time.Hour))
	}

	// The pool of the variants that use pgx natively: the handler's own
	// transactions (-handler write) and the transactional mode's.
	poolConfig, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return err
	}
	poolConfig.MaxConns = int32(consumers * 2) // sized like the database/sql pools
	poolConfig.ConnConfig.RuntimeParams["application_name"] = appName
	pool, err := pgxpool.NewWithConfig(ctx, poolConfig)
	if err != nil {
		return err
	}
	defer pool.Close()
	if w != nil {
		w.pool = pool
	}

	variants := []struct {
		name string
		mw   func() message.HandlerMiddleware
		// pgx: the handler's own transactions go through pool (pgx used
		// natively) rather than database/sql; such a variant is compared
		// with pgxBaseline, measured in the same round, when it runs.
		pgx bool
	}{
		{"no middleware", func() message.HandlerMiddleware { return nil }, false},
		{pgxBaseline, func() message.HandlerMiddleware { return nil }, true},
		// A known cost: 50 µs of CPU a delivery, spent in the handler's
		// goroutine before the handler. A measurement of what the kit
		// costs should read 50 µs for it.
		{"no middleware, 50 µs of CPU burnt a delivery (measurement only: a known cost)", func() message.HandlerMiddleware {
			return func(h message.HandlerFunc) message.HandlerFunc {
				return func(msg *message.Message) ([]*message.Message, error) {
					burn(50 * time.Microsecond)
					return h(msg)
				}
			}
		}, false},
		// The baseline measured against itself: what a pair reads when
		// nothing differs, that is the pairing's own spread and bias.
		{"no middleware, again (measurement only: the pairing against itself)", func() message.HandlerMiddleware { return nil }, false},
		{"watermill Deduplicator", func() message.HandlerMiddleware { return (&middleware.Deduplicator{}).Middleware }, false},
		{"kit, memstore", func() message.HandlerMiddleware {
			return idempotency.Middleware(memstore.New(memstore.WithTTL(time.Hour)))
		}, false},
		{"kit, redisstore, seen-set (WithoutClaim)", func() message.HandlerMiddleware {
			return idempotency.Middleware(newRedisStore(), idempotency.WithoutClaim())
		}, false},
		{"kit, redisstore (claims, the default)", func() message.HandlerMiddleware { return idempotency.Middleware(newRedisStore()) }, false},
		{"kit, records not awaited under claims (measurement only)", func() message.HandlerMiddleware {
			return idempotency.Middleware(&unawaited{Store: newRedisStore(), slots: make(chan struct{}, 1024)})
		}, false},
		{"kit, postgresstore, seen-set (WithoutClaim)", func() message.HandlerMiddleware {
			return idempotency.Middleware(pgStore, idempotency.WithoutClaim())
		}, false},
		{"kit, postgresstore (session claims, the default)", func() message.HandlerMiddleware { return idempotency.Middleware(pgStore) }, false},
		{"kit, postgresstore (session claims, WithGroupPause(0))", func() message.HandlerMiddleware {
			return idempotency.Middleware(pgVariant(postgresstore.WithGroupPause(0)))
		}, false},
		{"kit, postgresstore (session claims, WithGroupPause(250µs))", func() message.HandlerMiddleware {
			return idempotency.Middleware(pgVariant(postgresstore.WithGroupPause(250 * time.Microsecond)))
		}, false},
		{"kit, postgresstore (session claims, WithGroupPause(1ms))", func() message.HandlerMiddleware {
			return idempotency.Middleware(pgVariant(postgresstore.WithGroupPause(time.Millisecond)))
		}, false},
		{"kit, postgresstore (session claims, WithGroupPause(2ms))", func() message.HandlerMiddleware {
			return idempotency.Middleware(pgVariant(postgresstore.WithGroupPause(2 * time.Millisecond)))
		}, false},
		{"kit, postgresstore (session claims, WithAsynchronousCommit)", func() message.HandlerMiddleware {
			return idempotency.Middleware(pgVariant(postgresstore.WithAsynchronousCommit()))
		}, false},
		{"kit, postgresstore (claims of rows, WithRowClaims)", func() message.HandlerMiddleware {
			return idempotency.Middleware(pgVariant(postgresstore.WithRowClaims()))
		}, false},
		{"kit, postgresstore (claims held in transactions, WithTransactionClaims)", func() message.HandlerMiddleware {
			return idempotency.Middleware(pgVariant(postgresstore.WithTransactionClaims()))
		}, false},
		{"kit, postgresstore, WithStatementsInFlight(4)", func() message.HandlerMiddleware {
			return idempotency.Middleware(pgVariant(postgresstore.WithStatementsInFlight(4)), idempotency.WithoutClaim())
		}, false},
		{"kit, postgresstore, WithoutGrouping", func() message.HandlerMiddleware {
			return idempotency.Middleware(pgVariant(postgresstore.WithoutGrouping()), idempotency.WithoutClaim())
		}, false},
		{"kit, postgresstore, WithAsynchronousCommit", func() message.HandlerMiddleware {
			return idempotency.Middleware(pgVariant(postgresstore.WithAsynchronousCommit()), idempotency.WithoutClaim())
		}, false},
		{"kit, postgresstore, records not written (measurement only: a bound)", func() message.HandlerMiddleware {
			return idempotency.Middleware(bound{Store: pgStore, skipRecord: true}, idempotency.WithoutClaim())
		}, false},
		{"kit, postgresstore, lookups not sent (measurement only: a bound)", func() message.HandlerMiddleware {
			return idempotency.Middleware(bound{Store: pgStore, skipLookup: true}, idempotency.WithoutClaim())
		}, false},
		{"kit, postgresstore, transactional inbox (WithTransaction)", func() message.HandlerMiddleware {
			return idempotency.Middleware(pgStore, idempotency.WithTransaction(w.txDB(db)))
		}, false},
		{"kit, postgresstore, transactional inbox on pgxpool (WithPgxTransaction)", func() message.HandlerMiddleware {
			return idempotency.Middleware(pgStore, idempotency.WithPgxTransaction(pool))
		}, true},
	}
	pick, err := regexp.Compile(only)
	if err != nil {
		return fmt.Errorf("-variants: %w", err)
	}
	if rounds < 1 {
		return fmt.Errorf("-rounds %d: want at least 1", rounds)
	}
	var picked []int // indexes of the variants to run
	for i, v := range variants {
		if pick.MatchString(v.name) {
			picked = append(picked, i)
		}
	}
	if len(picked) == 0 {
		return fmt.Errorf("-variants %q matches no variant", only)
	}
	// baselineOf is the variant i is compared with: the pgx baseline for a
	// pgx variant when it runs, the first variant otherwise.
	baselineOf := func(i int) int {
		if variants[i].pgx {
			for _, j := range picked {
				if variants[j].name == pgxBaseline {
					return j
				}
			}
		}
		return picked[0]
	}
	placer, err := newPlacer(ctx, admin, placements)
	if err != nil {
		return err
	}
	defer placer.restore()
	fmt.Printf("%d messages per variant, %d consumers, %d round(s), placements %s, Redis Streams at %s\n\n",
		n, consumers, rounds, strings.Join(placements, " and "), redisURL)
	// Warm up (not timed): the first run in a fresh process and on a
	// fresh stream is slower than the ones after it.
	if _, err := measure(ctx, admin, opts, pgProcs, "warm-up", nil, w, false, max(n/10, 1000), consumers, runID); err != nil {
		return fmt.Errorf("warm-up: %w", err)
	}
	if interleave > 0 {
		var pairs []blockPair
		for _, i := range picked {
			b := baselineOf(i)
			if i == b {
				continue
			}
			if variants[i].pgx != variants[b].pgx {
				return fmt.Errorf("-interleave: %s and its baseline use different handlers", variants[i].name)
			}
			pairs = append(pairs, blockPair{name: variants[i].name, baseline: variants[b].name,
				kit: variants[i].mw(), plain: variants[b].mw(), pgx: variants[i].pgx})
		}
		return runInterleaved(ctx, admin, opts, pgProcs, pairs, w, n, consumers, rounds, interleave, cycle, runID)
	}
	// measured[p][i]: placement p, variant i, one Result a round.
	measured := make([][][]Result, len(placements))
	for p := range measured {
		measured[p] = make([][]Result, len(variants))
	}
	for round := 1; round <= rounds; round++ {
		// Every other round runs the placements and variants in reverse
		// order, so that a machine speeding up or slowing down during a
		// round does not always favour the same ones.
		pOrder := make([]int, len(placements))
		for p := range pOrder {
			pOrder[p] = p
		}
		order := slices.Clone(picked)
		if round%2 == 0 {
			slices.Reverse(order)
			slices.Reverse(pOrder)
		}
		for _, p := range pOrder {
			if err := placer.place(placements[p]); err != nil {
				return err
			}
			run := func(i int) (Result, error) {
				v := variants[i]
				cmds0, trips0 := storeTrips.Totals()
				r, err := measure(ctx, admin, opts, pgProcs, v.name, v.mw(), w, v.pgx, n, consumers, runID)
				if err != nil {
					return r, fmt.Errorf("%s: %w", v.name, err)
				}
				cmds, trips := storeTrips.Totals()
				r.StoreCommands, r.StoreRoundTrips = float64(cmds-cmds0)/float64(n), float64(trips-trips0)/float64(n)
				r.Placement = placements[p]
				r.Handler = map[bool]string{false: "noop", true: "write"}[write]
				r.OfBaselinePct, r.CPUSharePct = 100, 100
				measured[p][i] = append(measured[p][i], r)
				return r, nil
			}
			if paired {
				// Each variant right after a run of its own baseline,
				// its ratio to that run.
				for _, i := range order {
					b := baselineOf(i)
					if i == b {
						continue // baselines run before each variant
					}
					// Every other round runs the variant first: a run
					// that pays for what the one before it left (dirty
					// pages, a vacuum, a freed stream) then pays for it
					// as often in either place of the pair.
					var base, r Result
					var err error
					if round%2 == 1 {
						if base, err = run(b); err == nil {
							r, err = run(i)
						}
					} else if r, err = run(i); err == nil {
						base, err = run(b)
					}
					if err != nil {
						return err
					}
					last := &measured[p][i][len(measured[p][i])-1]
					last.OfBaselinePct = 100 * r.PerSecond / base.PerSecond
					last.CPUSharePct = 100 * base.cpu() / r.cpu()
					last.KitCPUMicros = r.cpu() - base.cpu()
					fmt.Fprintf(os.Stderr, "round %d, %s: %s: %.0f/s, %.0f%% of %s run beside it (%.0f/s); CPU %.0f µs against %.0f µs per delivery (%.0f%%, the kit %.0f µs); PostgreSQL transactions %.2f against %.2f per delivery; WAL %.0f bytes (%.2f full pages) against %.0f (%.2f), %d checkpoints against %d\n",
						round, placements[p], r.Variant, r.PerSecond, last.OfBaselinePct, variants[b].name, base.PerSecond, r.cpu(), base.cpu(), last.CPUSharePct, last.KitCPUMicros, r.PostgresTransactions, base.PostgresTransactions,
						r.WALBytes, r.WALFPI, base.WALBytes, base.WALFPI, r.Checkpoints, base.Checkpoints)
				}
				continue
			}
			for _, i := range order {
				if _, err := run(i); err != nil {
					return err
				}
			}
			for _, i := range picked {
				r := &measured[p][i][round-1]
				b := measured[p][baselineOf(i)][round-1]
				r.OfBaselinePct = 100 * r.PerSecond / b.PerSecond
				r.CPUSharePct = 100 * b.cpu() / r.cpu()
				r.KitCPUMicros = r.cpu() - b.cpu()
				if rounds > 1 || len(placements) > 1 {
					fmt.Fprintf(os.Stderr, "round %d, %s: %s: %.0f/s, %.0f%%\n", round, placements[p], r.Variant, r.PerSecond, r.OfBaselinePct)
				}
			}
		}
	}
	var results []Result // of the first placement, for -json
	for p, placement := range placements {
		fmt.Printf("\nPlacement %s:\n\n", placement)
		fmt.Println("| variant | deliveries/s | of its baseline | effects | consumer CPU per delivery | Redis CPU per delivery | PostgreSQL CPU per delivery | CPU share of its baseline | kit CPU per delivery | store commands (round trips) per delivery | PostgreSQL transactions per delivery |")
		fmt.Println("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
		for _, i := range picked {
			r := summarize(measured[p][i])
			if p == 0 {
				results = append(results, r)
			}
			spread := ""
			if rounds > 1 {
				spread = fmt.Sprintf(" (%.0f–%.0f%%)", r.OfBaselineMinPct, r.OfBaselineMaxPct)
			}
			store := "–"
			if r.StoreCommands > 0 {
				store = fmt.Sprintf("%.2f (%.2f)", r.StoreCommands, r.StoreRoundTrips)
			}
			fmt.Printf("| %s | %.0f | %.0f%%%s | %d | %.1f µs | %.1f µs | %.1f µs | %.0f%% | %.0f µs | %s | %.2f |\n", r.Variant, r.PerSecond, r.OfBaselinePct, spread, r.Effects,
				r.ConsumerCPUMicros, r.RedisCPUMicros, r.PostgresCPUMicros, r.CPUSharePct, r.KitCPUMicros, store, r.PostgresTransactions)
		}
	}
	if jsonOut != "" {
		b, _ := json.MarshalIndent(results, "", "  ")
		if err := os.WriteFile(jsonOut, append(b, '\n'), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// cpu is the CPU time per delivery of this process, Redis and PostgreSQL.
func (r Result) cpu() float64 { return r.ConsumerCPUMicros + r.RedisCPUMicros + r.PostgresCPUMicros }

// summarize returns the medians of a variant's rounds.
func summarize(rs []Result) Result {
	medianOf := func(f func(Result) float64) float64 {
		v := make([]float64, len(rs))
		for i, r := range rs {
			v[i] = f(r)
		}
		return median(v)
	}
	out := rs[0]
	out.Rounds = len(rs)
	out.Seconds = medianOf(func(r Result) float64 { return r.Seconds })
	out.PerSecond = medianOf(func(r Result) float64 { return r.PerSecond })
	out.OfBaselinePct = medianOf(func(r Result) float64 { return r.OfBaselinePct })
	out.ConsumerCPUMicros = medianOf(func(r Result) float64 { return r.ConsumerCPUMicros })
	out.RedisCPUMicros = medianOf(func(r Result) float64 { return r.RedisCPUMicros })
	out.PostgresCPUMicros = medianOf(func(r Result) float64 { return r.PostgresCPUMicros })
	out.CPUSharePct = medianOf(func(r Result) float64 { return r.CPUSharePct })
	out.KitCPUMicros = medianOf(func(r Result) float64 { return r.KitCPUMicros })
	out.StoreCommands = medianOf(func(r Result) float64 { return r.StoreCommands })
	out.StoreRoundTrips = medianOf(func(r Result) float64 { return r.StoreRoundTrips })
	out.PostgresTransactions = medianOf(func(r Result) float64 { return r.PostgresTransactions })
	out.Effects = int64(medianOf(func(r Result) float64 { return float64(r.Effects) }))
	out.OfBaselineMinPct, out.OfBaselineMaxPct = out.OfBaselinePct, out.OfBaselinePct
	for _, r := range rs {
		out.OfBaselineMinPct = min(out.OfBaselineMinPct, r.OfBaselinePct)
		out.OfBaselineMaxPct = max(out.OfBaselineMaxPct, r.OfBaselinePct)
	}
	return out
}

func measure(ctx context.Context, admin *redis.Client, opts *redis.Options, pgProcs proccpu.Postgres, name string, mw message.HandlerMiddleware, w *work, usePgx bool,
	n, consumers int, runID string) (Result, error) {
	topic, effect, cleanup, err := prepare(ctx, admin, w, usePgx, n, runID)
	if err != nil {
		return Result{}, err
	}
	defer cleanup()
	var effects atomic.Int64
	cpu0, redis0, pg0, work0 := processCPU(), redisCPU(ctx, admin), pgProcs.CPU(ctx), pgProcs.Counters(ctx)
	start := time.Now()
	stop, err := consume(ctx, opts, topic, mw, effect, &effects, consumers)
	if err != nil {
		return Result{}, err
	}
	defer stop()
	if err := drained(ctx, admin, topic, n, start); err != nil {
		return Result{}, err
	}
	elapsed := time.Since(start)
	cpu, redisUsed, pgUsed, work := processCPU()-cpu0, redisCPU(ctx, admin)-redis0, pgProcs.Used(ctx, pg0), pgProcs.Counters(ctx).Sub(work0)
	return Result{Variant: name, Messages: n, Seconds: elapsed.Seconds(), PerSecond: float64(n) / elapsed.Seconds(), Effects: effects.Load(),
		ConsumerCPUMicros: float64(cpu.Microseconds()) / float64(n), RedisCPUMicros: float64(redisUsed.Microseconds()) / float64(n),
		PostgresCPUMicros: float64(pgUsed.Microseconds()) / float64(n), PostgresTransactions: float64(work.Transactions) / float64(n),
		WALBytes: float64(work.WALBytes) / float64(n), WALFPI: float64(work.WALFullPages) / float64(n), Checkpoints: work.Checkpoints}, nil
}

// prepare publishes n envelopes to a fresh stream (topic) and, with a
// real-work handler, makes the table its effects go to; effect is the
// handler's work (nil: none), and cleanup drops both.
func prepare(ctx context.Context, admin *redis.Client, w *work, usePgx bool, n int, runID string) (topic string, effect func(*message.Message) error, cleanup func(), err error) {
	topic = "bq-e2e-" + runID + "-" + testenv.RandomHex(3)
	cleanup = func() { admin.Del(context.Background(), topic) }
	if err := publish(ctx, admin, topic, n); err != nil {
		cleanup()
		return "", nil, nil, err
	}
	if w != nil {
		table, err := w.newTable(ctx)
		if err != nil {
			cleanup()
			return "", nil, nil, err
		}
		dropStream := cleanup
		cleanup = func() {
			dropStream()
			w.db.ExecContext(context.Background(), "DROP TABLE "+table) //nolint:errcheck
		}
		effect = func(msg *message.Message) error { return w.write(msg, table, usePgx) }
	}
	return topic, effect, cleanup, nil
}

// consume starts consumers routers on topic, each with mw (nil: none) and
// a handler that runs effect (nil: nothing) and counts the delivery in
// effects. stop ends them and waits for them to end.
func consume(ctx context.Context, opts *redis.Options, topic string, mw message.HandlerMiddleware, effect func(*message.Message) error, effects *atomic.Int64, consumers int) (stop func(), err error) {
	logger := watermill.NopLogger{}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, consumers)
	started := 0
	stop = func() {
		cancel()
		for range started {
			<-done
		}
	}
	for i := range consumers {
		sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
			Client: redis.NewClient(opts), ConsumerGroup: "e2e", Consumer: fmt.Sprintf("c%d", i), OldestId: "0",
			BlockTime: 50 * time.Millisecond, DisableIndefiniteInitialBlock: true,
		}, logger)
		if err != nil {
			stop()
			return nil, err
		}
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
		if err != nil {
			stop()
			return nil, err
		}
		if mw != nil {
			router.AddMiddleware(mw)
		}
		router.AddConsumerHandler("e2e", topic, sub, func(msg *message.Message) error {
			if effect != nil {
				if err := effect(msg); err != nil {
					return err
				}
			}
			effects.Add(1)
			return nil
		})
		started++
		go func() { done <- router.Run(runCtx) }()
	}
	return stop, nil
}

// drained waits until the group consumed and acked all n messages of
// topic, for at most half an hour from start.
func drained(ctx context.Context, admin *redis.Client, topic string, n int, start time.Time) error {
	for !testenv.StreamDrained(ctx, admin, topic, "e2e", n) {
		if time.Since(start) > 30*time.Minute {
			return fmt.Errorf("not drained")
		}
		time.Sleep(5 * time.Millisecond)
	}
	return nil
}

// publish writes n distinct envelopes to topic in redisstream's format,
// pipelined.
func publish(ctx context.Context, client *redis.Client, topic string, n int) error {
	marshaller := redisstream.DefaultMarshallerUnmarshaller{}
	pipe := client.Pipeline()
	for i := range n {
		e, err := envelope.New("urn:babel:orders:created", map[string]any{
			"order_id": i, "customer_id": "c-8812", "amount_cents": 129900, "currency": "EUR",
			"items": []map[string]any{{"sku": "SKU-1", "qty": 2}, {"sku": "SKU-9", "qty": 1}},
		}, envelope.WithQueue(topic))
		if err != nil {
			return err
		}
		payload, _ := e.Marshal()
		values, err := marshaller.Marshal(topic, message.NewMessage(watermill.NewUUID(), payload))
		if err != nil {
			return err
		}
		pipe.XAdd(ctx, &redis.XAddArgs{Stream: topic, Values: values})
		if pipe.Len() >= 1000 {
			if _, err := pipe.Exec(ctx); err != nil {
				return err
			}
		}
	}
	_, err := pipe.Exec(ctx)
	return err
}

// processCPU returns the CPU time (user and system) this process used so far.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// redisCPU returns the CPU time (user and system) the Redis server used so
// far, from INFO cpu; 0 if it cannot tell.
func redisCPU(ctx context.Context, client *redis.Client) time.Duration {
	info, err := testenv.RedisInfo(ctx, client, "cpu")
	if err != nil {
		return 0
	}
	var total float64
	for _, field := range []string{"used_cpu_sys", "used_cpu_user"} {
		f, _ := strconv.ParseFloat(info[field], 64)
		total += f
	}
	return time.Duration(total * float64(time.Second))
}

// unawaited is redisstore with records written behind the delivery's back:
// the delivery goes on (and is acked) while its record is on its way, the
// claim keeping concurrent copies out meanwhile. It measures what the
// "record not awaited under WithClaim" lever could gain end to end; it is
// no design (a record in flight at exit is lost, and a failed one unlogged).
// At most cap(slots) records are in flight; beyond, a delivery waits.
type unawaited struct {
	*redisstore.Store
	slots chan struct{}
	wg    sync.WaitGroup
}

// Remember sends the record and returns before its answer.
func (u *unawaited) Remember(ctx context.Context, key string, fp uint64, value []byte) error {
	u.slots <- struct{}{}
	u.wg.Go(func() {
		defer func() { <-u.slots }()
		_ = u.Store.Remember(context.WithoutCancel(ctx), key, fp, value)
	})
	return nil
}

// bound is a measurement-only store that skips one of the two statements a
// delivery costs, to show how far the other one alone lets the kit go: with
// skipRecord nothing is recorded (every message would run again), with
// skipLookup every delivery runs as if first seen. Neither is a store
// anyone should use.
type bound struct {
	*postgresstore.Store
	skipRecord, skipLookup bool
}

// Lookup looks the key up unless lookups are skipped.
func (b bound) Lookup(ctx context.Context, key string) (stores.Record, error) {
	if b.skipLookup {
		return stores.Record{}, nil
	}
	return b.Store.Lookup(ctx, key)
}

// Remember records the key unless records are skipped.
func (b bound) Remember(ctx context.Context, key string, fp uint64, value []byte) error {
	if b.skipRecord {
		return nil
	}
	return b.Store.Remember(ctx, key, fp, value)
}

// work is the real-work handler (-handler write): what a payment handler
// does, one PostgreSQL transaction per message (BEGIN, one INSERT, COMMIT)
// on a pool of its own, or, in the kit's transactional mode, that INSERT in
// the transaction the kit hands it. Every measured run writes to a fresh
// table, dropped after it.
type work struct {
	db     *sql.DB       // the handler's pool, sized like the store's
	pool   *pgxpool.Pool // the same for the pgx variants
	prefix string
}

// txDB is the pool the transactional mode opens its transactions on: the
// handler's own with -handler write (the handler's transaction is the one
// the record joins), the store's otherwise.
func (w *work) txDB(storeDB *sql.DB) *sql.DB {
	if w == nil {
		return storeDB
	}
	return w.db
}

// newTable creates the table of one measured run.
func (w *work) newTable(ctx context.Context) (string, error) {
	table := w.prefix + testenv.RandomHex(3)
	_, err := w.db.ExecContext(ctx, "CREATE TABLE "+table+" (message_id text PRIMARY KEY, amount_cents bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now())")
	return table, err
}

// write is the handler's effect: one INSERT in the transaction the kit
// handed it, or in a transaction of its own (on the pgx pool with usePgx).
func (w *work) write(msg *message.Message, table string, usePgx bool) error {
	ctx := msg.Context()
	insert := "INSERT INTO " + table + " (message_id, amount_cents) VALUES ($1, $2)"
	if tx, ok := stores.TxFromContext(ctx); ok {
		_, err := tx.ExecContext(ctx, insert, msg.UUID, 129900)
		return err
	}
	if tx, ok := idempotency.PgxTxFromContext(ctx); ok {
		_, err := tx.Exec(ctx, insert, msg.UUID, 129900)
		return err
	}
	if usePgx {
		tx, err := w.pool.Begin(ctx)
		if err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, insert, msg.UUID, 129900); err != nil {
			_ = tx.Rollback(ctx)
			return err
		}
		return tx.Commit(ctx)
	}
	tx, err := w.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, insert, msg.UUID, 129900); err != nil {
		_ = tx.Rollback()
		return err
	}
	return tx.Commit()
}

// pgxBaseline is the variant the pgx variants are compared with: no
// middleware, the handler's transactions on the pgx pool.
const pgxBaseline = "no middleware, handler on pgxpool"
