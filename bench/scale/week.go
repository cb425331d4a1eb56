package main

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"

	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// weekConfig is the simulated week: days of day each (a partition period),
// perDay records a day, records kept for retention days.
type weekConfig struct {
	day       time.Duration
	perDay    int
	retention int // days
	live      int // days run after the history is loaded
	claimers  int
}

// layout is one table under the week: the store, and its name.
type layout struct {
	name  string
	table string
	store *postgresstore.Store
}

// week loads retention days of history into a plain table and into a
// partitioned one (each record time-shifted to the day it was written, so
// that the oldest day expires first), then runs live days: each adds a
// day of records, and at its end runs the store's cleanup (DeleteExpired:
// a DELETE by block ranges on the plain table, dropping the expired
// partition on the other) while claimers time first-seen Claims on the
// same table. It prints rows removed per second, table and index size
// every day, and the Claim latencies; then the cost of dropping a
// partition with a plain DROP against DETACH … CONCURRENTLY while a
// transaction holds the table.
func week(ctx context.Context, dsn string, c weekConfig) error {
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxOpenConns(c.claimers + 4)
	db.SetMaxIdleConns(c.claimers + 4)
	ttl := time.Duration(c.retention) * c.day
	suffix := testenv.RandomHex(3)
	var layouts []*layout
	for _, l := range []struct {
		name string
		opts []postgresstore.Option
	}{
		{"plain", nil},
		{"partitioned", []postgresstore.Option{postgresstore.WithPartitions(c.day)}},
	} {
		table := "week_" + l.name + "_" + suffix
		store, err := postgresstore.New(db, append(l.opts, postgresstore.WithTable(table), postgresstore.WithTTL(ttl))...)
		if err != nil {
			return err
		}
		if err := store.Migrate(ctx); err != nil {
			return err
		}
		defer db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+table) //nolint:errcheck
		layouts = append(layouts, &layout{name: l.name, table: table, store: store})
	}
	fmt.Printf("Simulated week: a day is %v (the partition period), %d records a day, kept %d days (TTL %v); %d claimers time first-seen Claims during each cleanup.\n\n",
		c.day, c.perDay, c.retention, ttl, c.claimers)
	var now int64
	if err := db.QueryRowContext(ctx, `SELECT (extract(epoch from statement_timestamp()) * 1000)::bigint`).Scan(&now); err != nil {
		return err
	}
	dayMS := c.day.Milliseconds()
	today := now / dayMS * dayMS
	// History: days retention+1 … 1 ago, written evenly over each day
	// (expiry = written + ttl): the oldest day has expired when the live
	// days start, the next one expires during the first live day.
	start := time.Now()
	history := c.retention + 1
	for _, l := range layouts {
		for d := history; d >= 1; d-- {
			bucket := today - int64(d)*dayMS
			cols, vals := "key, expires_at, fingerprint", "gen_random_uuid(), $1::bigint + (g * $3::bigint / $2::bigint) + $4::bigint, g"
			if l.name == "partitioned" {
				part := fmt.Sprintf(`"%s_p%d"`, l.table, bucket)
				if _, err := db.ExecContext(ctx, fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s PARTITION OF %s FOR VALUES FROM (%d) TO (%d)`,
					part, l.table, bucket, bucket+dayMS)); err != nil {
					return err
				}
				cols, vals = cols+", bucket", vals+", $1::bigint"
			}
			if _, err := db.ExecContext(ctx, `INSERT INTO `+l.table+` (`+cols+`) SELECT `+vals+` FROM generate_series(0, $2::bigint - 1) g`,
				bucket, c.perDay, dayMS, ttl.Milliseconds()); err != nil {
				return err
			}
		}
		if _, err := db.ExecContext(ctx, `VACUUM ANALYZE `+l.table); err != nil {
			return err
		}
	}
	fmt.Printf("Loaded %d days × %d records into each table in %v.\n\n", history, c.perDay, time.Since(start).Round(time.Second))
	fmt.Println("| day | layout | rows | table + indexes | cleanup removed | cleanup took | rows removed / s | first-seen Claim p50 | p99 | max |")
	fmt.Println("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
	for _, l := range layouts {
		if err := printSize(ctx, db, 0, l, 0, 0, nil); err != nil {
			return err
		}
	}
	for day := 1; day <= c.live; day++ {
		// The day's end on the database clock, when the next one expires.
		if err := db.QueryRowContext(ctx, `SELECT (extract(epoch from statement_timestamp()) * 1000)::bigint`).Scan(&now); err != nil {
			return err
		}
		end := (now/dayMS + 1) * dayMS
		// The partitions of the days to come (Migrate creates the
		// current one and those ahead; a load slower than the days ran
		// past them).
		if err := layouts[1].store.Migrate(ctx); err != nil {
			return err
		}
		for _, l := range layouts {
			// The day's new records, written now.
			if _, err := db.ExecContext(ctx, `INSERT INTO `+l.table+` (key, expires_at, fingerprint)
				SELECT gen_random_uuid(), (extract(epoch from statement_timestamp()) * 1000)::bigint + $1, g FROM generate_series(1, $2) g`,
				ttl.Milliseconds(), c.perDay); err != nil {
				return err
			}
		}
		time.Sleep(time.Until(time.UnixMilli(end)) + time.Second)
		for _, l := range layouts {
			var removed int64
			var took time.Duration
			lat, err := claimWhile(ctx, l, c.claimers, func() error {
				t0 := time.Now()
				n, err := l.store.DeleteExpired(ctx)
				removed, took = n, time.Since(t0)
				return err
			})
			if err != nil {
				return fmt.Errorf("%s: %w", l.name, err)
			}
			if err := printSize(ctx, db, day, l, removed, took, lat); err != nil {
				return err
			}
		}
	}
	return dropModes(ctx, db, layouts[1], c)
}

// claimWhile runs f while claimers claim fresh keys on l's store, and
// returns the Claims' latencies.
func claimWhile(ctx context.Context, l *layout, claimers int, f func() error) ([]time.Duration, error) {
	var (
		mu   sync.Mutex
		lat  []time.Duration
		stop atomic.Bool
		wg   sync.WaitGroup
		cerr atomic.Value
	)
	for range claimers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				t0 := time.Now()
				if _, _, err := l.store.Claim(ctx, uuid.NewString(), time.Minute); err != nil {
					cerr.Store(err)
					return
				}
				d := time.Since(t0)
				mu.Lock()
				lat = append(lat, d)
				mu.Unlock()
			}
		}()
	}
	time.Sleep(200 * time.Millisecond) // claims running before f starts
	err := f()
	stop.Store(true)
	wg.Wait()
	if e, _ := cerr.Load().(error); e != nil && err == nil {
		err = e
	}
	return lat, err
}

// printSize prints a row of the week's table for l.
func printSize(ctx context.Context, db *sql.DB, day int, l *layout, removed int64, took time.Duration, lat []time.Duration) error {
	var rows, size int64
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM `+l.table).Scan(&rows); err != nil {
		return err
	}
	// A plain table is its own partition tree's only member only when
	// partitioned; sum over the tree, or take the table.
	if err := db.QueryRowContext(ctx, `SELECT greatest(pg_total_relation_size($1::regclass),
		(SELECT coalesce(sum(pg_total_relation_size(relid)), 0) FROM pg_partition_tree($1::regclass)))`, l.table).Scan(&size); err != nil {
		return err
	}
	rate, p50, p99, worst := "-", "-", "-", "-"
	if took > 0 {
		rate = fmt.Sprintf("%.0f", float64(removed)/took.Seconds())
	}
	if len(lat) > 0 {
		p50, p99 = fmt.Sprintf("%.0f µs", percentile(lat, 0.5)), fmt.Sprintf("%.0f µs", percentile(lat, 0.99))
		worst = fmt.Sprintf("%.0f µs", percentile(lat, 1))
	}
	tookS := "-"
	if took > 0 {
		tookS = took.Round(time.Millisecond).String()
	}
	fmt.Printf("| %d | %s | %d | %.0f MiB | %d | %s | %s | %s | %s | %s |\n", day, l.name, rows, float64(size)/(1<<20), removed, tookS, rate, p50, p99, worst)
	return nil
}

// dropModes times first-seen Claims on l (partitioned) while a partition
// is dropped by a plain DROP TABLE and by DETACH … CONCURRENTLY then DROP,
// each while another transaction (a handler's, say) has read the table
// and stays open for hold.
func dropModes(ctx context.Context, db *sql.DB, l *layout, c weekConfig) error {
	const hold = 2 * time.Second
	fmt.Printf("\nDropping a partition while a transaction that read the table stays open %v (%d claimers):\n\n", hold, c.claimers)
	fmt.Println("| drop | took | first-seen Claim p50 | p99 | max |")
	fmt.Println("|---|---:|---:|---:|---:|")
	dayMS := c.day.Milliseconds()
	for i, mode := range []string{"DROP TABLE", "DETACH CONCURRENTLY, DROP TABLE"} {
		// A partition far in the past, with a few rows, to drop.
		bucket := int64(i+1) * dayMS
		part := fmt.Sprintf(`"%s_p%d"`, l.table, bucket)
		if _, err := db.ExecContext(ctx, fmt.Sprintf(`CREATE TABLE %s PARTITION OF %s FOR VALUES FROM (%d) TO (%d)`, part, l.table, bucket, bucket+dayMS)); err != nil {
			return err
		}
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `SELECT count(*) FROM (SELECT 1 FROM `+l.table+` LIMIT 1) x`); err != nil {
			_ = tx.Rollback()
			return err
		}
		timer := time.AfterFunc(hold, func() { _ = tx.Rollback() })
		var took time.Duration
		lat, err := claimWhile(ctx, l, c.claimers, func() error {
			t0 := time.Now()
			defer func() { took = time.Since(t0) }()
			if i == 0 {
				_, err := db.ExecContext(ctx, `DROP TABLE `+part)
				return err
			}
			if _, err := db.ExecContext(ctx, `ALTER TABLE `+l.table+` DETACH PARTITION `+part+` CONCURRENTLY`); err != nil {
				return err
			}
			_, err := db.ExecContext(ctx, `DROP TABLE `+part)
			return err
		})
		timer.Stop()
		_ = tx.Rollback()
		if err != nil {
			return fmt.Errorf("%s: %w", mode, err)
		}
		fmt.Printf("| %s | %v | %.0f µs | %.0f µs | %.0f µs |\n", mode, took.Round(time.Millisecond),
			percentile(lat, 0.5), percentile(lat, 0.99), percentile(lat, 1))
	}
	return nil
}
