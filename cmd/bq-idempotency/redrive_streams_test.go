package main

import (
	"context"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/envelope"
)

// movedCount reads "N moved" from a run's summary (0 when there is none).
func movedCount(out string) int {
	m := regexp.MustCompile(`(\d+) moved`).FindStringSubmatch(out)
	if m == nil {
		return 0
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

// TestConcurrentRedriveRunsMoveEachDeadLetterOnce: two operators (or an
// operator and the schedule) start a redrive of one Redis Streams
// dead-letter topic and group, the second while the first is moving.
// Every dead letter reaches its queue once: the first run holds the
// group's run lock and moves them all, the second says a run is in
// progress and moves nothing.
func TestConcurrentRedriveRunsMoveEachDeadLetterOnce(t *testing.T) {
	t.Parallel()
	d := newDeadLetters(t)
	t.Cleanup(func() { d.client.Del(context.Background(), d.dlq+":bq-redrive-lock:bq-redrive") })
	const n = 12
	for range n {
		d.add(envelope.ReasonFailed, time.Now().UnixMilli())
	}
	// The second run starts while the first is moving: the first holds
	// entries it has read and not yet acked.
	results := make([]result, 2)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		results[0] = d.redrive("--rate", "10", "--quiet")
	}()
	deadline := time.Now().Add(20 * time.Second)
	for d.xlen(d.topic) < 2 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	results[1] = d.redrive("--rate", "10", "--quiet")
	wg.Wait()
	total := 0
	for i, r := range results {
		t.Logf("run %d: exit %d, %d moved; %s", i, r.code, movedCount(r.stdout), strings.TrimSpace(r.stderr))
		total += movedCount(r.stdout)
		if r.code != 0 && !strings.Contains(r.stderr, "another redrive run") {
			t.Errorf("run %d: exit %d\n%s%s", i, r.code, r.stdout, r.stderr)
		}
	}
	if published := d.xlen(d.topic); published != n || total != n {
		t.Fatalf("%d dead letters, %d published to %s, the runs report %d moved: a dead letter was moved twice", n, published, d.topic, total)
	}
	if n, _ := d.client.Exists(context.Background(), d.dlq+":bq-redrive-lock:bq-redrive").Result(); n != 0 {
		t.Fatal("the run lock was left behind")
	}
}

// TestRateSlowerThanIdleMovesEverything: --rate 2 waits 500ms between
// moves, longer than --idle 300ms (not shorter, so that a loaded machine's
// pause in handing over the next message does not end the run by itself:
// 100ms did at load 48). --idle counts only the wait for a message, so the
// run moves every dead letter and does not end early reporting success.
func TestRateSlowerThanIdleMovesEverything(t *testing.T) {
	t.Parallel()
	d := newDeadLetters(t)
	t.Cleanup(func() { d.client.Del(context.Background(), d.dlq+":bq-redrive-lock:bq-redrive") })
	const n = 4
	for range n {
		d.add(envelope.ReasonFailed, time.Now().UnixMilli())
	}
	r := run1(t, "redrive", "--redis-url", redisURL(), "--from", d.dlq, "--rate", "2", "--idle", "300ms", "--quiet")
	if r.code != 0 || movedCount(r.stdout) != n || d.xlen(d.topic) != n {
		t.Fatalf("exit %d, %d moved, %d on %s; want all %d\n%s%s", r.code, movedCount(r.stdout), d.xlen(d.topic), d.topic, n, r.stdout, r.stderr)
	}
}
