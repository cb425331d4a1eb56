package main

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/internal/testenv"
)

func TestPaymentsExample(t *testing.T) {
	testenv.Redis(t) // skips (or fails under CI) when Redis is unreachable
	url := testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL)
	testenv.RunExample(t, time.Minute, func(ctx context.Context, out io.Writer) error { return run(ctx, out, url, "127.0.0.1:0", 60) },
		"60 charges for 60 payments", "every payment charged exactly once",
		`bq_idempotency_deliveries_total{handler="charge-card",`, `outcome="run"`, `outcome="skip"`)
}
