package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/pubsub/redislist"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// listDeadLetters is a dead-letter list of an SDK queue for a test, in
// one of the redislist layouts, under an optional key prefix; every key
// of the queue, of its dead-letter list and the redrive marker are deleted
// when the test ends.
type listDeadLetters struct {
	t                *testing.T
	client           *redis.Client
	layout           redislist.Layout
	prefix           string
	queue, dlq       string
	readyQ, readyDLQ string // the keys of the two ready lists
}

func newListDeadLetters(t *testing.T, layout redislist.Layout, prefix string) *listDeadLetters {
	t.Helper()
	client := testenv.Redis(t)
	d := &listDeadLetters{t: t, client: client, layout: layout, prefix: prefix, queue: "bq-test-cli-lst-" + testenv.RandomHex(4)}
	d.dlq = d.queue + ".dlq"
	d.readyQ, d.readyDLQ = d.key(d.queue), d.key(d.dlq)
	t.Cleanup(func() {
		var keys []string
		for _, ready := range []string{d.readyQ, d.readyDLQ} {
			keys = append(keys, ready, ready+":processing", ready+":processing:leases", ready+":reserved", ready+":delayed", ready+":notify")
		}
		keys = append(keys, d.prefix+"bq-redrive:seen:"+layout.String()+":"+d.dlq)
		client.Del(context.Background(), keys...)
	})
	return d
}

// key is the ready list of queue in the layout.
func (d *listDeadLetters) key(queue string) string {
	if d.layout == redislist.LayoutLaravel {
		return d.prefix + "queues:" + queue
	}
	return d.prefix + queue
}

// push puts values on the dead-letter list as an SDK does (RPUSH).
func (d *listDeadLetters) push(values ...[]byte) {
	d.t.Helper()
	for _, v := range values {
		if err := d.client.RPush(context.Background(), d.readyDLQ, v).Err(); err != nil {
			d.t.Fatal(err)
		}
	}
}

// deadLetter is an SDK's dead letter of d.queue.
func (d *listDeadLetters) deadLetter(i int) []byte {
	d.t.Helper()
	e, err := envelope.New("urn:babel:orders:created", map[string]any{"i": i}, envelope.WithQueue(d.queue))
	if err != nil {
		d.t.Fatal(err)
	}
	e.Attempts = 3
	e.DeadLetter = &envelope.DeadLetter{Reason: envelope.ReasonFailed, OriginalQueue: d.queue, FailedAt: time.Now().UnixMilli(), Attempts: 3, Lang: "php"}
	payload, _ := e.Marshal()
	return payload
}

func (d *listDeadLetters) broker() string {
	if d.layout == redislist.LayoutLaravel {
		return "redis-laravel"
	}
	return "redis-list"
}

func (d *listDeadLetters) redrive(args ...string) result {
	d.t.Helper()
	base := []string{"redrive", "--broker", d.broker(), "--redis-url", redisURL(), "--from", d.dlq, "--idle", "500ms", "--quiet"}
	if d.prefix != "" {
		base = append(base, "--key-prefix", d.prefix)
	}
	return run1(d.t, append(base, args...)...)
}

// moved returns the envelopes on the original queue's ready list.
func (d *listDeadLetters) moved() []envelope.Envelope {
	d.t.Helper()
	values, err := d.client.LRange(context.Background(), d.readyQ, 0, -1).Result()
	if err != nil {
		d.t.Fatal(err)
	}
	var out []envelope.Envelope
	for _, v := range values {
		e, err := envelope.Parse(redrivenBody(d.t, v))
		if err != nil || e.DeadLetter != nil || e.Attempts != 0 {
			d.t.Fatalf("redriven value %q (err %v): want an envelope, dead_letter stripped, attempts 0", v, err)
		}
		out = append(out, e)
	}
	return out
}

// redrivenBody returns the body of a value redrive wrote to an SDK list,
// and checks that it carries the redrive's mark (envelope.MetadataRedrive),
// which the SDKs' consumers ignore: a frame with the mark in its headers
// (the reliable list), or a Laravel job with it in the member
// redislist.LaravelRedriveKey, which the body is without.
func redrivenBody(t testing.TB, value string) []byte {
	t.Helper()
	var frame struct {
		Frame   any               `json:"__bq_frame"`
		Headers map[string]string `json:"headers"`
		Body    *string           `json:"body"`
	}
	if err := json.Unmarshal([]byte(value), &frame); err == nil && frame.Frame != nil && frame.Body != nil {
		if frame.Headers[envelope.MetadataRedrive] == "" {
			t.Fatalf("redriven value %q carries no %s header", value, envelope.MetadataRedrive)
		}
		return []byte(*frame.Body)
	}
	var job map[string]json.RawMessage
	if err := json.Unmarshal([]byte(value), &job); err != nil || job[redislist.LaravelRedriveKey] == nil {
		t.Fatalf("redriven value %q (err %v) carries no redrive mark", value, err)
	}
	delete(job, redislist.LaravelRedriveKey)
	body, err := json.Marshal(job)
	if err != nil {
		t.Fatal(err)
	}
	return body
}

// waiting returns the payloads waiting on the dead-letter topic, as the
// redislist binding reads them (its dry run): the ready list, and for
// Laravel its delayed set (a released job is due at once).
func (d *listDeadLetters) waiting() [][]byte {
	d.t.Helper()
	ctx := context.Background()
	sub, err := redislist.NewSubscriber(d.client, redislist.WithLayout(d.layout), redislist.WithKeyPrefix(d.prefix))
	if err != nil {
		d.t.Fatal(err)
	}
	defer sub.Close()
	var out [][]byte
	if err := sub.Browse(ctx, d.dlq, func(m *message.Message) bool { out = append(out, m.Payload); return true }); err != nil && !strings.Contains(err.Error(), "no Redis list") {
		d.t.Fatal(err)
	}
	if d.layout == redislist.LayoutLaravel {
		delayed, _ := d.client.ZRange(ctx, d.readyDLQ+":delayed", 0, -1).Result()
		for _, v := range delayed {
			out = append(out, []byte(v))
		}
	}
	return out
}

// reserved counts what is left reserved on the dead-letter topic.
func (d *listDeadLetters) reserved() int64 {
	ctx := context.Background()
	if d.layout == redislist.LayoutLaravel {
		n, _ := d.client.ZCard(ctx, d.readyDLQ+":reserved").Result()
		return n
	}
	n, _ := d.client.LLen(ctx, d.readyDLQ+":processing").Result()
	return n
}

// TestRedrivePutsBackAValueThatIsNotALaravelJob: a value on a Laravel
// dead-letter list that is not a Laravel job (another producer pushed it)
// is put back wrapped in a Laravel job that carries it: it stays on the
// dead-letter queue, read back unchanged, and the run moves the dead
// letters behind it and exits 0, with nothing skipped. It used to be
// refused (ErrNotLaravelJob) and left where it was, counted as skipped.
func TestRedrivePutsBackAValueThatIsNotALaravelJob(t *testing.T) {
	t.Parallel()
	d := newListDeadLetters(t, redislist.LayoutLaravel, "")
	junk := []byte("not a laravel job")
	d.push(d.deadLetter(0), junk, d.deadLetter(1), d.deadLetter(2))
	r := d.redrive()
	if r.code != 0 {
		t.Fatalf("exit %d: one value that is not a Laravel job stopped the run\n%s%s", r.code, r.stdout, r.stderr)
	}
	if !strings.Contains(r.stdout, "4 read, 3 moved, 1 kept on the dead-letter topic") || strings.Contains(r.stdout, "skipped") {
		t.Fatalf("summary:\n%s", r.stdout)
	}
	if got := d.moved(); len(got) != 3 {
		t.Fatalf("%d moved to %s, want 3", len(got), d.queue)
	}
	if got := d.waiting(); len(got) != 1 || !bytes.Equal(got[0], junk) {
		t.Fatalf("left on the dead-letter queue: %q, want the value, unchanged", got)
	}
	if stored, _ := d.client.LIndex(context.Background(), d.readyDLQ, 0).Result(); !strings.Contains(stored, `"attempts":0`) {
		t.Fatalf("put back as %s, want a Laravel job that wraps it", stored)
	}
	if n := d.reserved(); n != 0 {
		t.Fatalf("%d left reserved", n)
	}
	// A later run meets it again, puts it back again, and ends.
	if r := d.redrive(); r.code != 0 || !strings.Contains(r.stdout, "1 read, 0 moved, 1 kept") || strings.Contains(r.stdout, "skipped") {
		t.Fatalf("second run: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if got := d.waiting(); len(got) != 1 || !bytes.Equal(got[0], junk) {
		t.Fatalf("after the second run: %q", got)
	}
}

// TestRedriveGoesOnPastABinaryDeadLetter: a dead letter whose body is not
// UTF-8 on the SDKs' reliable list. The run moves the dead letters around
// it and exits 0; the binary one stays on the dead-letter list with its
// body byte for byte (skipped when the binding cannot write it back,
// put back when it can).
func TestRedriveGoesOnPastABinaryDeadLetter(t *testing.T) {
	t.Parallel()
	d := newListDeadLetters(t, redislist.LayoutReliableList, "")
	binary := []byte{0xff, 0xfe, 'b', 'i', 'n', 0x00, 0xc3}
	d.push(d.deadLetter(0), binary, d.deadLetter(1), d.deadLetter(2))
	r := d.redrive()
	if r.code != 0 || !strings.Contains(r.stdout, "4 read, 3 moved, 1 kept on the dead-letter topic") {
		t.Fatalf("exit %d: a binary dead letter stopped the run\n%s%s", r.code, r.stdout, r.stderr)
	}
	if got := d.moved(); len(got) != 3 {
		t.Fatalf("%d moved to %s, want 3", len(got), d.queue)
	}
	if got := d.waiting(); len(got) != 1 || !bytes.Equal(got[0], binary) {
		t.Fatalf("left on the dead-letter list: %q, want the binary body, unchanged", got)
	}
	if n := d.reserved(); n != 0 {
		t.Fatalf("%d left reserved", n)
	}
}

// TestScheduledRedriveOfAnEmptiedList: a run empties a dead-letter list
// and Redis deletes it; the next (scheduled) run has nothing to move and
// says so, exit 0, in both layouts, dry run or not. A --from no run ever
// saw (a typo) is still an error, and creates nothing.
func TestScheduledRedriveOfAnEmptiedList(t *testing.T) {
	t.Parallel()
	for _, layout := range []redislist.Layout{redislist.LayoutReliableList, redislist.LayoutLaravel} {
		t.Run(layout.String(), func(t *testing.T) {
			t.Parallel()
			d := newListDeadLetters(t, layout, "")
			d.push(d.deadLetter(0), d.deadLetter(1))
			if r := d.redrive(); r.code != 0 || !strings.Contains(r.stdout, "2 moved") {
				t.Fatalf("first run: exit %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			if n, _ := d.client.Exists(context.Background(), d.readyDLQ).Result(); n != 0 {
				t.Fatalf("the emptied list %s still exists", d.readyDLQ)
			}
			for _, extra := range [][]string{nil, {"--dry-run"}} {
				r := d.redrive(extra...)
				if r.code != 0 || !strings.Contains(r.stdout, "0 read") || !strings.Contains(r.stdout, "nothing to move") {
					t.Fatalf("next run %q on the emptied list: exit %d\n%s%s", extra, r.code, r.stdout, r.stderr)
				}
			}
			typo := d.dlq + "x"
			for _, extra := range [][]string{nil, {"--dry-run"}} {
				r := run1(t, append([]string{"redrive", "--broker", d.broker(), "--redis-url", redisURL(), "--from", typo, "--idle", "500ms", "--quiet"}, extra...)...)
				if r.code != 1 || !strings.Contains(r.stderr, "does not exist") {
					t.Fatalf("--from %s (never written) %q: exit %d\n%s%s", typo, extra, r.code, r.stdout, r.stderr)
				}
			}
			if keys, _ := d.client.Keys(context.Background(), "*"+typo+"*").Result(); len(keys) != 0 {
				t.Fatalf("a redrive from a missing list created %v", keys)
			}
		})
	}
}

// TestRedriveLaravelUnderAKeyPrefix: a Laravel connection with a prefix
// (laravel_database_ by default) keeps its queues under it; --key-prefix
// reaches them, in a dry run and a real one, and the moved jobs land under
// the same prefix. --key-prefix with a broker that has no use for it is a
// usage error.
func TestRedriveLaravelUnderAKeyPrefix(t *testing.T) {
	t.Parallel()
	prefix := "bq_test_" + testenv.RandomHex(3) + "_laravel_database_"
	for _, layout := range []redislist.Layout{redislist.LayoutLaravel, redislist.LayoutReliableList} {
		t.Run(layout.String(), func(t *testing.T) {
			t.Parallel()
			d := newListDeadLetters(t, layout, prefix)
			d.push(d.deadLetter(0), d.deadLetter(1))
			if r := d.redrive("--dry-run"); r.code != 0 || !strings.Contains(r.stdout, "2 read, 2 would move") {
				t.Fatalf("dry run: exit %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			if r := d.redrive(); r.code != 0 || !strings.Contains(r.stdout, "2 read, 2 moved") {
				t.Fatalf("run: exit %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			if got := d.moved(); len(got) != 2 {
				t.Fatalf("%d moved to %s, want 2", len(got), d.readyQ)
			}
			if n, _ := d.client.Exists(context.Background(), d.readyDLQ).Result(); n != 0 {
				t.Fatalf("%s still holds dead letters", d.readyDLQ)
			}
		})
	}
	r := run1(t, "redrive", "--from", "x.dlq", "--key-prefix", prefix)
	if r.code != 2 || !strings.Contains(r.stderr, "--key-prefix") {
		t.Fatalf("--key-prefix with --broker redis: exit %d %q", r.code, r.stderr)
	}
}

// TestRedriveStopsOnABrokerOutage: Redis goes down during a run on a list
// (which skips what the binding refuses for good): while the run waits to
// move its second dead letter, or once it has moved them all and waits for
// more. An outage is no such refusal: the run stops with an error (exit
// 1), whether a publish failed or the subscriber could not read (a run
// that waited --idle for nothing asks the broker before it reports
// success), and no dead letter is lost: each is moved, still on the
// dead-letter list, or reserved there until its lease lapses.
func TestRedriveStopsOnABrokerOutage(t *testing.T) {
	if testing.Short() {
		t.Skip("an outage: several seconds")
	}
	t.Parallel()
	for _, c := range []struct {
		name     string
		cutAfter int           // moves
		settle   time.Duration // from the last of them to the cut
		args     []string
		want     string // in the error
	}{
		// The cut may also take the reply to a publish Redis carried out:
		// the run stops then too, that dead letter moved and still reserved.
		{"mid-run", 1, 0, []string{"--rate", "1"}, "stopped after"},
		{"waiting", 4, 300 * time.Millisecond, []string{"--idle", "1s"}, "stopped after 4 moved: the dead-letter topic cannot be read after the run"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			d := newListDeadLetters(t, redislist.LayoutReliableList, "")
			const n = 4
			for i := range n {
				d.push(d.deadLetter(i))
			}
			proxy := testenv.NewFaultProxy(t, d.client.Options().Addr)
			proxied := strings.Replace(redisURL(), d.client.Options().Addr, proxy.Addr(), 1)
			if proxied == redisURL() {
				t.Skipf("REDIS_URL %s does not name %s", redisURL(), d.client.Options().Addr)
			}
			done := make(chan result, 1)
			go func() {
				done <- run1(t, append([]string{"redrive", "--broker", "redis-list", "--redis-url", proxied, "--from", d.dlq, "--quiet"}, c.args...)...)
			}()
			deadline := time.Now().Add(20 * time.Second)
			for {
				if moved, _ := d.client.LLen(context.Background(), d.readyQ).Result(); moved >= int64(c.cutAfter) {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("the run did not move enough")
				}
				time.Sleep(5 * time.Millisecond)
			}
			time.Sleep(c.settle)
			proxy.Cut()
			r := <-done
			proxy.Restore()
			t.Logf("exit %d: %s", r.code, strings.TrimSpace(r.stderr))
			if r.code != 1 || !strings.Contains(r.stderr, c.want) || strings.Contains(r.stdout, "skipped") {
				t.Fatalf("exit %d: want the outage to stop the run (%s), nothing skipped\n%s%s", r.code, c.want, r.stdout, r.stderr)
			}
			// Each dead letter is somewhere: moved, waiting, or reserved
			// with a lease (one whose ack the outage cut is in two of
			// these: at least once).
			ctx := context.Background()
			found := map[string]bool{}
			for _, e := range d.moved() {
				found[e.Meta.ID] = true
			}
			for _, key := range []string{d.readyDLQ, d.readyDLQ + ":processing"} {
				values, _ := d.client.LRange(ctx, key, 0, -1).Result()
				for _, v := range values {
					e, err := envelope.Parse([]byte(v))
					if err != nil {
						t.Fatalf("%s holds %q: %v", key, v, err)
					}
					found[e.Meta.ID] = true
				}
			}
			reserved, _ := d.client.LLen(ctx, d.readyDLQ+":processing").Result()
			leased, _ := d.client.ZCard(ctx, d.readyDLQ+":processing:leases").Result()
			if len(found) != n || leased != reserved {
				t.Fatalf("%d of the %d dead letters found; %d reserved, %d leased", len(found), n, reserved, leased)
			}
		})
	}
}
