package main

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func TestTransactionalExample(t *testing.T) {
	testenv.Postgres(t) // skips (or fails under CI) when PostgreSQL is unreachable
	dsn := testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN)
	testenv.RunExample(t, time.Minute, func(ctx context.Context, out io.Writer) error { return run(ctx, out, dsn) },
		"placed 8 orders", "relayed 8 follow-ups", "each placed exactly once, its follow-up relayed once")
}
