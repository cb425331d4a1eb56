package main

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func TestOrdersAPIExample(t *testing.T) {
	testenv.Postgres(t) // skips (or fails under CI) when PostgreSQL is unreachable
	dsn := testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN)
	testenv.RunExample(t, time.Minute, func(ctx context.Context, out io.Writer) error { return run(ctx, out, dsn) },
		"one order and one shipment per key", "skipped by the inbox")
}
