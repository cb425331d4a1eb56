// Command txcost measures what PostgreSQL spends, in CPU time of the
// backend serving the connection, on one transaction of a handler that
// writes (BEGIN, one INSERT, COMMIT), alone and with the kit's record in the
// same transaction, as each transactional mode sends it. It runs the
// transactions one after the other on one connection per variant and reads
// that backend's CPU time from /proc (Linux, PostgreSQL on this machine),
// so the figures depend less on what else runs on the machine than a
// throughput would. The connections commit without waiting for the disk
// (synchronous_commit off: the flush is one per transaction whatever the
// variant, and another process's work); WAL written by other processes is
// not counted.
//
//	go run ./bench/txcost -n 3000 -rounds 3
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver

	"github.com/babelqueue/watermill-idempotency/internal/proccpu"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func main() {
	n := flag.Int("n", 3000, "transactions per variant and round")
	rounds := flag.Int("rounds", 3, "rounds, the variants in turns")
	rows := flag.Int("rows", 200_000, "records in the table before measuring")
	dsn := flag.String("postgres", testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN), "PostgreSQL DSN")
	flag.Parse()
	if err := run(context.Background(), *dsn, *n, *rounds, *rows); err != nil {
		fmt.Fprintln(os.Stderr, "txcost:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, dsn string, n, rounds, rows int) error {
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	suffix := testenv.RandomHex(3)
	records, effects := "txcost_idem_"+suffix, "txcost_effect_"+suffix
	defer conn.Exec(context.Background(), "DROP TABLE IF EXISTS "+records+", "+effects) //nolint:errcheck
	if _, err := conn.Exec(ctx, "CREATE TABLE "+effects+" (message_id text PRIMARY KEY, amount_cents bigint NOT NULL)"); err != nil {
		return err
	}
	db, err := sql.Open("pgx", dsn) // database/sql, for WithTransaction's path
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxOpenConns(1) // one connection, one backend to watch
	db.SetMaxIdleConns(1)
	store, err := postgresstore.New(db, postgresstore.WithTable(records), postgresstore.WithTTL(time.Hour))
	if err != nil {
		return err
	}
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	for _, fill := range []string{
		"INSERT INTO " + records + " (key, expires_at, fingerprint) SELECT gen_random_uuid(), 1, 1 FROM generate_series(1, $1::int)",
		"INSERT INTO " + effects + " SELECT gen_random_uuid()::text, 1 FROM generate_series(1, $1::int)",
	} {
		if _, err := conn.Exec(ctx, fill, rows); err != nil {
			return err
		}
	}
	for _, t := range []string{records, effects} {
		if _, err := conn.Exec(ctx, "VACUUM ANALYZE "+t); err != nil {
			return err
		}
	}
	insert := "INSERT INTO " + effects + " (message_id, amount_cents) VALUES ($1, 129900)"
	expires := "(extract(epoch from statement_timestamp()) * 1000)::bigint + 3600000" // the store's, with its TTL of an hour
	notRecorded := errors.New("not recorded")
	// onPgx and onSQL make a variant: a transaction begun by begin (with
	// the record, or without), the handler's INSERT in it, COMMIT.
	onPgx := func(begin func() (pgx.Tx, error)) func() error {
		return func() error {
			tx, err := begin()
			if err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, insert, watermill.NewUUID()); err != nil {
				_ = tx.Rollback(ctx)
				return err
			}
			return tx.Commit(ctx)
		}
	}
	onSQL := func(begin func() (*sql.Tx, error)) func() error {
		return func() error {
			tx, err := begin()
			if err != nil {
				return err
			}
			if _, err := tx.ExecContext(ctx, insert, watermill.NewUUID()); err != nil {
				_ = tx.Rollback()
				return err
			}
			return tx.Commit()
		}
	}
	variants := []struct {
		name string
		pgx  bool // on the pgx connection, else on database/sql's
		tx   func() error
	}{
		{"handler alone, pgx: BEGIN, INSERT, COMMIT", true, onPgx(func() (pgx.Tx, error) { return conn.Begin(ctx) })},
		{"handler alone, database/sql: BEGIN, INSERT, COMMIT", false, onSQL(func() (*sql.Tx, error) { return db.BeginTx(ctx, nil) })},
		{"WithTransaction (database/sql): BEGIN, the record as a plain INSERT (BeginTx), INSERT, COMMIT", false, onSQL(func() (*sql.Tx, error) {
			tx, recorded, _, err := store.BeginTx(ctx, db, nil, watermill.NewUUID(), 12345, nil)
			if err == nil && !recorded {
				_ = tx.Rollback()
				return nil, notRecorded
			}
			return tx, err
		})},
		{"WithSubscriberTx, or a TxStore without BeginTx (database/sql): BEGIN, the record as an upsert (RememberTx), INSERT, COMMIT", false, onSQL(func() (*sql.Tx, error) {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				return nil, err
			}
			recorded, _, err := store.RememberTx(ctx, tx, watermill.NewUUID(), 12345, nil)
			if err == nil && !recorded {
				err = notRecorded
			}
			if err != nil {
				_ = tx.Rollback()
				return nil, err
			}
			return tx, nil
		})},
		{"BeginPgx's fallback (and its way before the prepared statement), pgx: BEGIN and the record as an INSERT with literals (parsed and planned each time) in one round trip, INSERT, COMMIT", true, onPgx(func() (pgx.Tx, error) {
			return conn.BeginTx(ctx, pgx.TxOptions{BeginQuery: "BEGIN; INSERT INTO " + records + " (key, expires_at, fingerprint, value) VALUES ('" +
				postgresstore.RowKey(watermill.NewUUID()) + "', " + expires + ", 12345, NULL)"})
		})},
		{"WithPgxTransaction (pgx): BEGIN and EXECUTE of the record's INSERT, prepared once per connection (BeginPgx), in one round trip, INSERT, COMMIT", true, onPgx(func() (pgx.Tx, error) {
			tx, recorded, _, err := store.BeginPgx(ctx, conn, pgx.TxOptions{}, watermill.NewUUID(), 12345, nil)
			if err == nil && !recorded {
				_ = tx.Rollback(ctx)
				return nil, notRecorded
			}
			return tx, err
		})},
	}
	// Without the commit's wait for the disk, one per transaction whatever
	// the variant (its CPU would hide the statements' own).
	if _, err := conn.Exec(ctx, "SET synchronous_commit = off"); err != nil {
		return err
	}
	if _, err := db.ExecContext(ctx, "SET synchronous_commit = off"); err != nil {
		return err
	}
	var pgxPID, sqlPID int
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pgxPID); err != nil {
		return err
	}
	if err := db.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&sqlPID); err != nil {
		return err
	}
	used := make([][]float64, len(variants)) // µs of backend CPU per transaction, per round
	for round := range rounds {
		order := make([]int, len(variants))
		for i := range order {
			order[i] = i
		}
		if round%2 == 1 {
			slices.Reverse(order)
		}
		for _, i := range order {
			for range 50 { // warm: prepared statements, caches
				if err := variants[i].tx(); err != nil {
					return fmt.Errorf("%s: %w", variants[i].name, err)
				}
			}
			pid := sqlPID
			if variants[i].pgx {
				pid = pgxPID
			}
			cpu0 := proccpu.Of(pid)
			for range n {
				if err := variants[i].tx(); err != nil {
					return fmt.Errorf("%s: %w", variants[i].name, err)
				}
			}
			used[i] = append(used[i], float64((proccpu.Of(pid)-cpu0).Microseconds())/float64(n))
		}
	}
	fmt.Printf("PostgreSQL backend CPU per transaction, %d transactions per variant and round, %d rounds, %d records in the table first\n\n", n, rounds, rows)
	fmt.Println("| transaction | backend CPU per transaction: median (rounds) | beyond the handler alone on the same driver |")
	fmt.Println("|---|---:|---:|")
	for i, v := range variants {
		base := median(used[0])
		if !v.pgx {
			base = median(used[1])
		}
		var each []string
		for _, u := range used[i] {
			each = append(each, fmt.Sprintf("%.0f", u))
		}
		fmt.Printf("| %s | %.0f µs (%s) | %+.0f µs |\n", v.name, median(used[i]), strings.Join(each, ", "), median(used[i])-base)
	}
	return nil
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
