package main

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func TestExampleChargesEachPaymentOnce(t *testing.T) {
	testenv.RunExample(t, 20*time.Second, func(ctx context.Context, out io.Writer) error { return run(ctx, out) },
		"summary: 5 messages published, 4 handler runs (1 failed and redelivered), 2 skipped as duplicates",
		"pay-2 charged 1 time(s)", "pay-3 charged 1 time(s)", "every payment charged exactly once")
}
