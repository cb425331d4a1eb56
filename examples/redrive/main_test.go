package main

import (
	"bytes"
	"context"
	"io"
	"regexp"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func TestRedriveExample(t *testing.T) {
	client := testenv.Redis(t) // skips (or fails under CI) when Redis is unreachable
	// The example keeps its records under "ex" and 4 hex digits of its run.
	t.Cleanup(func() { _ = testenv.DropKeys(context.Background(), client, "ex[0-9a-f][0-9a-f][0-9a-f][0-9a-f]:*") })
	url := testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL)
	var out bytes.Buffer
	testenv.RunExample(t, time.Minute, func(ctx context.Context, w io.Writer) error { return run(ctx, io.MultiWriter(w, &out), url) },
		"5 orders on", "reason=failed attempts=3", "redrive moved 5", "replayed 5", "no email sent twice")

	// Like the payments example, it leaves nothing behind: no stream, no record.
	m := regexp.MustCompile(`orders-([0-9a-f]{8})\.dlq`).FindStringSubmatch(out.String())
	if m == nil {
		t.Fatalf("output names no orders-<run>.dlq topic:\n%s", out.String())
	}
	ctx := context.Background()
	for _, pattern := range []string{"ex" + m[1][:4] + ":*", "orders-" + m[1] + "*"} {
		var left []string
		iter := client.Scan(ctx, 0, pattern, 1000).Iterator()
		for iter.Next(ctx) {
			left = append(left, iter.Val())
		}
		if err := iter.Err(); err != nil {
			t.Fatal(err)
		}
		if len(left) > 0 {
			t.Errorf("the example left %d keys matching %q behind", len(left), pattern)
		}
	}
}
