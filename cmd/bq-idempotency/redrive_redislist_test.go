package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/internal/testenv"
)

// TestRedriveRedisList: dead letters an SDK pushed on <queue>.dlq (bare
// envelopes on a list) are redriven from the reliable-list binding: the
// selected ones go back to their queue with dead_letter stripped and
// attempts 0, the others stay, and nothing is left reserved.
func TestRedriveRedisList(t *testing.T) {
	client := testenv.Redis(t)
	url := testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL)
	queue := "bq-test-cli-list-" + testenv.RandomHex(4)
	dlq := queue + ".dlq"
	ctx := context.Background()
	t.Cleanup(func() {
		client.Del(ctx, queue, dlq, dlq+":processing", dlq+":processing:leases", "bq-redrive:seen:reliable-list:"+dlq)
	})
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
		e, err := envelope.Parse([]byte(v))
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
