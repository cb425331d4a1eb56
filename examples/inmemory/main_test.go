package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
)

func TestExampleChargesEachPaymentOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var out bytes.Buffer
	if err := run(ctx, &out); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	for _, want := range []string{
		"summary: 5 deliveries, 4 handler runs (1 failed), 2 skipped as duplicates",
		"pay-2 charged 1 time(s)", "pay-3 charged 1 time(s)", "every payment charged exactly once",
	} {
		if !strings.Contains(out.String(), want) {
			t.Fatalf("output lacks %q:\n%s", want, out.String())
		}
	}
}
