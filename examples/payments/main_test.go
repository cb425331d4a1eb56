package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/internal/testenv"
)

func TestPaymentsExample(t *testing.T) {
	testenv.Redis(t) // skips (or fails under CI) when Redis is unreachable
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out bytes.Buffer
	if err := run(ctx, &out, testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL), "127.0.0.1:0", 60); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "60 charges for 60 payments") || !strings.Contains(out.String(), "every payment charged exactly once") ||
		!strings.Contains(out.String(), `bq_idempotency_deliveries_total{handler="charge-card",`) ||
		!strings.Contains(out.String(), `outcome="run"`) || !strings.Contains(out.String(), `outcome="skip"`) {
		t.Fatalf("unexpected output:\n%s", out.String())
	}
}
