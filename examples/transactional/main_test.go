package main

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func TestTransactionalExample(t *testing.T) {
	dsn := testenv.PostgresSubscriberDSN(t) // the example consumes with watermill-sql's subscriber
	testenv.RunExample(t, time.Minute, func(ctx context.Context, out io.Writer) error { return run(ctx, out, dsn) },
		"placed 8 orders", "relayed 8 follow-ups", "each placed exactly once, its follow-up relayed once")
}
