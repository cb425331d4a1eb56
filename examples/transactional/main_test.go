package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/internal/testenv"
)

func TestTransactionalExample(t *testing.T) {
	testenv.Postgres(t) // skips (or fails under CI) when PostgreSQL is unreachable
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out bytes.Buffer
	if err := run(ctx, &out, testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN)); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "applied 8 transfers") || !strings.Contains(out.String(), "each applied exactly once") {
		t.Fatalf("unexpected output:\n%s", out.String())
	}
}
