// Command bq-idempotency is the operator's tool for the idempotency kit:
//
//	bq-idempotency redrive --from orders.dlq [--dry-run] [--max N] [--reason failed] [--urn U] [--id ID]
//	                       [--min-age 1h] [--max-age 24h] [--rate 50] [--to topic] [--replay-bypass]
//	bq-idempotency forget  --handler charge ID...   # a planned replay: the next delivery runs again
//	bq-idempotency inspect --handler charge ID...   # remembered, in flight, or unknown
//
// redrive moves dead-lettered envelopes back to their original queue (see
// package redrive) over Redis Streams (--broker redis, the default) or
// watermill-sql on PostgreSQL (--broker postgres). forget and inspect work on
// a Redis store (--store redis, the default) or a PostgreSQL store (--store
// postgres). Connections come from --redis-url / --postgres-dsn, or from
// REDIS_URL / POSTGRES_DSN. The exit status is 0 on success, 1 on failure, 2
// on bad usage.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

// errUsage marks a usage error (exit status 2).
var errUsage = errors.New("usage")

const usage = `usage: bq-idempotency <command> [flags]

commands:
  redrive   move dead-lettered messages back to their queue
  forget    drop message records from a store, so the next delivery runs again
  inspect   tell whether messages are remembered, in flight, or unknown

Run "bq-idempotency <command> -h" for a command's flags.
`

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	var err error
	switch args[0] {
	case "redrive":
		err = redriveCommand(ctx, args[1:], stdout, stderr)
	case "forget":
		err = storeCommand(ctx, "forget", args[1:], stdout, stderr)
	case "inspect":
		err = storeCommand(ctx, "inspect", args[1:], stdout, stderr)
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, usage)
		return 0
	default:
		fmt.Fprintf(stderr, "bq-idempotency: unknown command %q\n\n%s", args[0], usage)
		return 2
	}
	switch {
	case err == nil:
		return 0
	case errors.Is(err, flag.ErrHelp):
		return 0
	case errors.Is(err, errUsage):
		fmt.Fprintf(stderr, "bq-idempotency %s: %v\n", args[0], err)
		return 2
	default:
		fmt.Fprintf(stderr, "bq-idempotency %s: %v\n", args[0], err)
		return 1
	}
}

// connection holds the flags every command shares.
type connection struct {
	redisURL, postgresDSN string
}

func (c *connection) register(fs *flag.FlagSet) {
	fs.StringVar(&c.redisURL, "redis-url", envOr("REDIS_URL", "redis://localhost:6379/0"), "Redis URL (default $REDIS_URL)")
	fs.StringVar(&c.postgresDSN, "postgres-dsn", envOr("POSTGRES_DSN", "postgres://postgres@localhost:5432/test?sslmode=disable"),
		"PostgreSQL DSN (default $POSTGRES_DSN)")
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func usageErr(format string, args ...any) error {
	return fmt.Errorf("%w: %s", errUsage, fmt.Sprintf(format, args...))
}
