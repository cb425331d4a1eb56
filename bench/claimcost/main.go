// Command claimcost measures what a claim and its record cost PostgreSQL and
// the client, per message, for postgresstore's claims of rows and its
// session claims side by side in one run: concurrent workers each claim a
// message never seen and record it, as the middleware does for a
// first-seen delivery, with no handler and no broker in between.
//
//	go run ./bench/claimcost -n 20000 -workers 32 -rounds 3
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"regexp"
	"runtime/pprof"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/babelqueue/watermill-idempotency/internal/proccpu"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func main() {
	n := flag.Int("n", 20000, "messages per mode and round")
	workers := flag.Int("workers", 32, "concurrent deliveries")
	rounds := flag.Int("rounds", 3, "rounds (the modes alternate within each)")
	only := flag.String("modes", "", "run only the modes whose names match this regular expression")
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of this process (the client) to this file")
	flag.Parse()
	pick, err := regexp.Compile(*only)
	if err != nil {
		log.Fatalf("-modes: %v", err)
	}
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			log.Fatal(err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			log.Fatal(err)
		}
		defer pprof.StopCPUProfile()
	}
	ctx := context.Background()

	app := "bq-claimcost-" + strconv.Itoa(os.Getpid())
	cfg, err := pgx.ParseConfig(testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN))
	if err != nil {
		log.Fatal(err)
	}
	cfg.RuntimeParams["application_name"] = app
	db := stdlib.OpenDB(*cfg)
	defer db.Close()
	db.SetMaxOpenConns(2 * *workers)
	db.SetMaxIdleConns(2 * *workers)
	pg := proccpu.Postgres{DB: db, App: app}

	modes := []struct {
		name string
		opts []postgresstore.Option
	}{
		{"claims of rows (WithRowClaims)", []postgresstore.Option{postgresstore.WithRowClaims()}},
		{"session claims (the default)", nil},
	}
	fmt.Printf("%d messages per mode and round, %d workers, load %s\n", *n, *workers, loadavg())
	fmt.Println("| round | mode | messages/s | client CPU per message | PostgreSQL CPU per message | transactions per message |")
	fmt.Println("|---:|---|---:|---:|---:|---:|")
	for r := 1; r <= *rounds; r++ {
		for _, m := range modes {
			if !pick.MatchString(m.name) {
				continue
			}
			table := "bq_claimcost_" + strconv.Itoa(os.Getpid())
			s, err := postgresstore.New(db, append([]postgresstore.Option{postgresstore.WithTable(table)}, m.opts...)...)
			if err != nil {
				log.Fatal(err)
			}
			if err := s.Migrate(ctx); err != nil {
				log.Fatal(err)
			}
			pgBefore, wBefore, cBefore := pg.CPU(ctx), pg.Counters(ctx), selfCPU()
			start := time.Now()
			var wg sync.WaitGroup
			for w := range *workers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := w; i < *n; i += *workers {
						key := fmt.Sprintf("msg-%d-%d", r, i)
						cctx := stores.WithClaimToken(ctx, key)
						ok, _, err := s.Claim(cctx, key, 5*time.Second)
						if err != nil || !ok {
							log.Fatalf("claim %s: %v %v", key, ok, err)
						}
						if err := s.Remember(cctx, key, 1, nil); err != nil {
							log.Fatalf("remember %s: %v", key, err)
						}
					}
				}()
			}
			wg.Wait()
			took := time.Since(start)
			pgUsed, x, c := pg.Used(ctx, pgBefore), pg.Counters(ctx).Sub(wBefore).Transactions, selfCPU()-cBefore
			per := func(d time.Duration) string { return fmt.Sprintf("%.1f µs", float64(d.Microseconds())/float64(*n)) }
			fmt.Printf("| %d | %s | %.0f | %s | %s | %.2f |\n", r, m.name, float64(*n)/took.Seconds(), per(c), per(pgUsed), float64(x)/float64(*n))
			_ = s.ReleaseAll(ctx)
			if _, err := db.ExecContext(ctx, `DROP TABLE `+table); err != nil {
				log.Fatal(err)
			}
		}
	}
	fmt.Printf("load at the end %s\n", loadavg())
}

func selfCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	return string(b[:len(b)-1])
}
