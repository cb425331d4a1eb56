package main

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func TestPolyglotExample(t *testing.T) {
	client := testenv.Redis(t) // skips (or fails under CI) when Redis is unreachable
	amqpURL := testenv.AMQPURL(t)
	// The example keeps its records under "polyglot-" and 4 hex digits of
	// its run (examples/redrive's are under "ex": the two packages' tests
	// run at once, and neither cleanup may drop the other's keys).
	t.Cleanup(func() {
		_ = testenv.DropKeys(context.Background(), client, "polyglot-[0-9a-f][0-9a-f][0-9a-f][0-9a-f]:*")
	})
	redisURL := testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL)
	testenv.RunExample(t, time.Minute, func(ctx context.Context, out io.Writer) error { return run(ctx, out, redisURL, amqpURL) },
		"charged order-1002 (sent by go, attempts 0, UUID = meta.id: true, traceparent 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01)",
		"skipped a duplicate of order-1001",
		"reason=failed attempts=3 original_queue=payments-",
		"redis: 3 payments charged once each, 1 duplicate skipped, 1 dead-lettered and redriven",
		"charged order-2001 (sent by python, attempts 0, UUID = meta.id: true, traceparent 00-4bf92f",
		"skipped a duplicate of order-2001",
		"rabbitmq: 3 payments charged once each, 1 duplicate skipped, 1 dead-lettered and redriven",
		"every payment charged once on both brokers")
}
