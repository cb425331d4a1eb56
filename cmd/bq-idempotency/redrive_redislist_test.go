package main

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// listQueue returns a Redis client and its URL, and a queue name whose
// keys (and its dead-letter queue's) are removed when the test ends.
func listQueue(t *testing.T) (redis.UniversalClient, string, string) {
	t.Helper()
	client := testenv.Redis(t)
	queue := "bq-test-cli-list-" + testenv.RandomHex(4)
	dlq := queue + ".dlq"
	t.Cleanup(func() {
		client.Del(context.Background(), queue, dlq, dlq+":processing", dlq+":processing:leases",
			"bq-redrive:seen:reliable-list:"+dlq) // the marker a run that found the list leaves
	})
	return client, testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL), queue
}

// TestRedriveRedisList: dead letters an SDK pushed on <queue>.dlq (bare
// envelopes on a list) are redriven from the reliable-list binding: the
// selected ones go back to their queue with dead_letter stripped and
// attempts 0, the others stay, and nothing is left reserved.
func TestRedriveRedisList(t *testing.T) {
	t.Parallel()
	client, url, queue := listQueue(t)
	dlq := queue + ".dlq"
	ctx := context.Background()
	poison := map[string]bool{}
	for i, reason := range []string{envelope.ReasonFailed, envelope.ReasonPoison, envelope.ReasonFailed, envelope.ReasonPoison} {
		e, _ := envelope.New("urn:babel:orders:created", map[string]any{"i": i}, envelope.WithQueue(queue))
		e.Attempts = 3
		e.DeadLetter = &envelope.DeadLetter{Reason: reason, OriginalQueue: queue, FailedAt: time.Now().UnixMilli(), Attempts: 3, Lang: "python"}
		if reason == envelope.ReasonPoison {
			poison[e.Meta.ID] = true
		}
		payload, _ := e.Marshal()
		if err := client.RPush(ctx, dlq, payload).Err(); err != nil {
			t.Fatal(err)
		}
	}
	// A dry run reads the list without taking anything from it.
	code, out, stderr := runCLI(t, "redrive", "--broker", "redis-list", "--redis-url", url, "--from", dlq, "--reason", "poison", "--dry-run", "--quiet")
	if code != 0 || !strings.Contains(out, "4 read") {
		t.Fatalf("dry run: exit %d\n%s\n%s", code, out, stderr)
	}
	if n, _ := client.LLen(ctx, dlq).Result(); n != 4 {
		t.Fatalf("after the dry run %s holds %d values, want the 4 it had", dlq, n)
	}
	if n, _ := client.Exists(ctx, dlq+":processing", queue).Result(); n != 0 {
		t.Fatalf("the dry run created %d keys", n)
	}
	code, out, stderr = runCLI(t, "redrive", "--broker", "redis-list", "--redis-url", url, "--from", dlq, "--reason", "poison", "--idle", "500ms", "--quiet")
	if code != 0 {
		t.Fatalf("redrive: exit %d: %s", code, stderr)
	}
	if !strings.Contains(out, "4 read, 2 moved, 2 kept on the dead-letter topic") {
		t.Fatalf("redrive output:\n%s", out)
	}
	moved, _ := client.LRange(ctx, queue, 0, -1).Result()
	if len(moved) != 2 {
		t.Fatalf("%d messages on %s, want 2", len(moved), queue)
	}
	for _, v := range moved {
		e, err := envelope.Parse(redrivenBody(t, v))
		if err != nil || e.DeadLetter != nil || e.Attempts != 0 || !poison[e.Meta.ID] {
			t.Fatalf("redriven %s (err %v): want a poison one, dead_letter stripped, attempts 0", v, err)
		}
	}
	kept, _ := client.LRange(ctx, dlq, 0, -1).Result()
	if len(kept) != 2 {
		t.Fatalf("%d left on %s, want the 2 failed ones", len(kept), dlq)
	}
	for _, v := range kept {
		if e, err := envelope.Parse([]byte(v)); err != nil || e.DeadLetter == nil || e.DeadLetter.Reason != envelope.ReasonFailed || e.Attempts != 3 {
			t.Fatalf("kept %s (err %v): want a failed dead letter, unchanged", v, err)
		}
	}
	if n, _ := client.Exists(ctx, dlq+":processing", dlq+":processing:leases").Result(); n != 0 {
		t.Fatalf("%d reservation keys left on %s", n, dlq)
	}
}

// TestRedriveRedisListPutsBackByteForByte: dead letters a run does not
// move go back on the list as the very values they were: a frame an SDK
// wrote (its spelling, a header that is not a string) and a bare value
// without meta.id (not wrapped in a frame with a made-up UUID). The kit used
// to write them afresh from the string headers.
func TestRedriveRedisListPutsBackByteForByte(t *testing.T) {
	t.Parallel()
	client, url, queue := listQueue(t)
	dlq := queue + ".dlq"
	ctx := context.Background()
	e, _ := envelope.New("urn:babel:orders:created", map[string]any{"note": "café"}, envelope.WithQueue(queue))
	e.Attempts = 3
	e.DeadLetter = &envelope.DeadLetter{Reason: envelope.ReasonFailed, OriginalQueue: queue, FailedAt: time.Now().UnixMilli(), Attempts: 3, Lang: "python"}
	body, _ := e.Marshal()
	escaped, _ := json.Marshal(string(body)) // Go's encoder: <, > and & escaped
	values := []string{
		`{"__bq_frame": 1, "headers": {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "x-retries": 3}, "body": ` + string(escaped) + `}`,
		`a dead letter that is not an envelope`,
	}
	for _, v := range values {
		if err := client.RPush(ctx, dlq, v).Err(); err != nil {
			t.Fatal(err)
		}
	}
	code, out, stderr := runCLI(t, "redrive", "--broker", "redis-list", "--redis-url", url, "--from", dlq, "--reason", "poison", "--idle", "500ms", "--quiet")
	if code != 0 || !strings.Contains(out, "2 read, 0 moved, 2 kept on the dead-letter topic") {
		t.Fatalf("redrive: exit %d\n%s\n%s", code, out, stderr)
	}
	// The run goes round the list once: the values come back rotated.
	kept, _ := client.LRange(ctx, dlq, 0, -1).Result()
	slices.Sort(kept)
	slices.Sort(values)
	if strings.Join(kept, "\n") != strings.Join(values, "\n") {
		t.Fatalf("put back as\n%s\nwant\n%s", strings.Join(kept, "\n"), strings.Join(values, "\n"))
	}
	if n, _ := client.Exists(ctx, queue, dlq+":processing", dlq+":processing:leases").Result(); n != 0 {
		t.Fatalf("%d keys left beside %s", n, dlq)
	}
}
