package main

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func TestOrdersAPIExample(t *testing.T) {
	dsn := testenv.PostgresSubscriberDSN(t) // the example consumes with watermill-sql's subscriber
	testenv.RunExample(t, time.Minute, func(ctx context.Context, out io.Writer) error { return run(ctx, out, dsn) },
		"one order and one shipment per key", "skipped by the inbox")
}
