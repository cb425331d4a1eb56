package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/internal/testenv"
)

func TestRedriveExample(t *testing.T) {
	testenv.Redis(t) // skips (or fails under CI) when Redis is unreachable
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out bytes.Buffer
	if err := run(ctx, &out, testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL)); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	for _, want := range []string{"5 orders on", "reason=failed attempts=3", "redrive moved 5", "replayed 5", "no email sent twice"} {
		if !strings.Contains(out.String(), want) {
			t.Fatalf("output lacks %q:\n%s", want, out.String())
		}
	}
}
