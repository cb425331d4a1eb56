package main

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/internal/testenv"
)

func TestRedriveExample(t *testing.T) {
	client := testenv.Redis(t) // skips (or fails under CI) when Redis is unreachable
	// The example keeps its records under "ex" and 4 hex digits of its run.
	t.Cleanup(func() { _ = testenv.DropKeys(context.Background(), client, "ex[0-9a-f][0-9a-f][0-9a-f][0-9a-f]:*") })
	url := testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL)
	testenv.RunExample(t, time.Minute, func(ctx context.Context, out io.Writer) error { return run(ctx, out, url) },
		"5 orders on", "reason=failed attempts=3", "redrive moved 5", "replayed 5", "no email sent twice")
}
