package main

import (
	"bufio"
	"context"
	"database/sql"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
)

// storeCommand runs forget or inspect.
func storeCommand(ctx context.Context, name string, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	var conn connection
	conn.register(fs)
	var kind, scope, prefix, table string
	fs.StringVar(&kind, "store", "redis", "redis or postgres")
	fs.StringVar(&scope, "handler", "", "the Watermill handler name the records are scoped by (or the WithScope value); empty: meta.id alone")
	fs.StringVar(&prefix, "prefix", redisstore.DefaultPrefix, "redisstore key prefix")
	fs.StringVar(&table, "table", postgresstore.DefaultTable, "postgresstore table")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: bq-idempotency %s [flags] ID... (or IDs on standard input, one a line)\n", name)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	ids := fs.Args()
	if len(ids) == 0 {
		var err error
		if ids, err = readIDs(os.Stdin); err != nil {
			return err
		}
	}
	if len(ids) == 0 {
		return usageErr("no message ids given")
	}
	store, closeStore, err := openStore(ctx, kind, prefix, table, conn)
	if err != nil {
		return err
	}
	defer closeStore()

	switch name {
	case "forget":
		for i, id := range ids {
			if err := store.Forget(ctx, idempotency.Key(scope, id)); err != nil {
				return fmt.Errorf("forgot %d of %d; %s: %w", i, len(ids), id, err)
			}
		}
		fmt.Fprintf(stdout, "forgot %d message(s); their next delivery runs the handler again\n", len(ids))
		return nil
	default:
		inspector, ok := store.(stores.Inspector)
		if !ok {
			return fmt.Errorf("%T cannot be inspected", store)
		}
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "ID\tSTATE\tEXPIRES")
		for _, id := range ids {
			r, err := inspector.Inspect(ctx, idempotency.Key(scope, id))
			if err != nil {
				_ = tw.Flush()
				return fmt.Errorf("%s: %w", id, err)
			}
			expires := "-"
			if !r.ExpiresAt.IsZero() {
				expires = r.ExpiresAt.UTC().Format(time.RFC3339)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\n", id, r.State, expires)
		}
		return tw.Flush()
	}
}

func readIDs(r io.Reader) ([]string, error) {
	if f, ok := r.(*os.File); ok {
		if info, err := f.Stat(); err == nil && info.Mode()&os.ModeCharDevice != 0 {
			return nil, nil // a terminal: no piped ids
		}
	}
	var ids []string
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		if id := strings.TrimSpace(sc.Text()); id != "" {
			ids = append(ids, id)
		}
	}
	return ids, sc.Err()
}

func openStore(ctx context.Context, kind, prefix, table string, conn connection) (stores.Store, func(), error) {
	switch kind {
	case "redis":
		if err := redisstore.ValidatePrefix(prefix); err != nil {
			return nil, nil, usageErr("--prefix: %v", err)
		}
		opts, err := redis.ParseURL(conn.redisURL)
		if err != nil {
			return nil, nil, usageErr("--redis-url: %v", err)
		}
		client := redis.NewClient(opts)
		if err := client.Ping(ctx).Err(); err != nil {
			_ = client.Close()
			return nil, nil, fmt.Errorf("redis at %s: %w", conn.redisURL, err)
		}
		return redisstore.New(client, redisstore.WithPrefix(prefix)), func() { _ = client.Close() }, nil
	case "postgres":
		db, err := sql.Open("pgx", conn.postgresDSN)
		if err != nil {
			return nil, nil, usageErr("--postgres-dsn: %v", err)
		}
		s, err := postgresstore.New(db, postgresstore.WithTable(table))
		if err != nil {
			_ = db.Close()
			return nil, nil, usageErr("%v", err)
		}
		if err := db.PingContext(ctx); err != nil {
			_ = db.Close()
			return nil, nil, fmt.Errorf("postgres at %s: %w", conn.postgresDSN, err)
		}
		return s, func() { _ = db.Close() }, nil
	}
	return nil, nil, usageErr("--store %q: want redis or postgres", kind)
}
