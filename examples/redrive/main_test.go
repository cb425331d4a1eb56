package main

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/internal/testenv"
)

func TestRedriveExample(t *testing.T) {
	testenv.Redis(t) // skips (or fails under CI) when Redis is unreachable
	url := testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL)
	testenv.RunExample(t, time.Minute, func(ctx context.Context, out io.Writer) error { return run(ctx, out, url) },
		"5 orders on", "reason=failed attempts=3", "redrive moved 5", "replayed 5", "no email sent twice")
}
