package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/internal/testenv"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
)

func runCLI(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = run(context.Background(), args, &out, &errOut)
	return code, out.String(), errOut.String()
}

func TestUsageErrors(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "usage: bq-idempotency"},
		{[]string{"frobnicate"}, `unknown command "frobnicate"`},
		{[]string{"redrive"}, "--from is required"},
		{[]string{"redrive", "--from", "x.dlq", "--broker", "kafka"}, `--broker "kafka"`},
		{[]string{"redrive", "--from", "x.dlq", "--max", "-1"}, "must not be negative"},
		{[]string{"forget", "--prefix", "has space", "id-1"}, "--prefix"},
		{[]string{"inspect", "--store", "mysql", "id-1"}, `--store "mysql"`},
		{[]string{"inspect", "--store", "postgres", "--table", "x;drop", "id-1"}, "not a plain identifier"},
	} {
		code, _, stderr := runCLI(t, c.args...)
		if code != 2 || !strings.Contains(stderr, c.want) {
			t.Fatalf("%v: exit %d, stderr %q; want exit 2 saying %q", c.args, code, stderr, c.want)
		}
	}
	if code, stdout, _ := runCLI(t, "help"); code != 0 || !strings.Contains(stdout, "redrive") {
		t.Fatalf("help: exit %d %q", code, stdout)
	}
}

func TestServerDownIsAClearFailure(t *testing.T) {
	code, _, stderr := runCLI(t, "inspect", "--redis-url", "redis://127.0.0.1:1/0", "id-1")
	if code != 1 || !strings.Contains(stderr, "redis at redis://127.0.0.1:1/0") {
		t.Fatalf("exit %d, stderr %q", code, stderr)
	}
}

func TestInspectAndForgetRedis(t *testing.T) {
	client := testenv.Redis(t)
	url := testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL)
	prefix := "t" + testenv.RandomHex(4) + ":"
	store := redisstore.New(client, redisstore.WithPrefix(prefix), redisstore.WithTTL(time.Hour))
	inspectAndForget(t, store, "--store", "redis", "--redis-url", url, "--prefix", prefix)
}

func TestInspectAndForgetPostgres(t *testing.T) {
	db := testenv.Postgres(t)
	table := "cli_idem_" + testenv.RandomHex(4)
	store, err := postgresstore.New(db, postgresstore.WithTable(table))
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = db.Exec(`DROP TABLE ` + table) })
	inspectAndForget(t, store, "--store", "postgres", "--postgres-dsn", testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN), "--table", table)
}

func inspectAndForget(t *testing.T, store stores.Store, flags ...string) {
	t.Helper()
	ctx := context.Background()
	if err := store.Remember(ctx, idempotency.Key("charge", "pay-1")); err != nil {
		t.Fatal(err)
	}
	if ok, err := store.(stores.Claimer).Claim(ctx, idempotency.Key("charge", "pay-2"), time.Minute); err != nil || !ok {
		t.Fatal(ok, err)
	}
	args := append(append([]string{"inspect"}, flags...), "--handler", "charge", "pay-1", "pay-2", "pay-3")
	code, out, stderr := runCLI(t, args...)
	if code != 0 {
		t.Fatalf("inspect: exit %d: %s", code, stderr)
	}
	for _, want := range []string{"pay-1 remembered", "pay-2 in flight", "pay-3 unknown -"} {
		if !strings.Contains(strings.Join(strings.Fields(out), " "), want) {
			t.Fatalf("inspect output lacks %q:\n%s", want, out)
		}
	}
	code, out, stderr = runCLI(t, append(append([]string{"forget"}, flags...), "--handler", "charge", "pay-1")...)
	if code != 0 || !strings.Contains(out, "forgot 1 message(s)") {
		t.Fatalf("forget: exit %d: %s %s", code, out, stderr)
	}
	if seen, _ := store.Seen(ctx, idempotency.Key("charge", "pay-1")); seen {
		t.Fatal("forget left the record")
	}
}

func TestRedriveRedis(t *testing.T) {
	client := testenv.Redis(t)
	url := testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL)
	topic := "bq-test-cli-" + testenv.RandomHex(4)
	dlq := topic + ".dlq"
	t.Cleanup(func() { client.Del(context.Background(), topic, dlq) })
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: redis.NewClient(client.Options())}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	var failedID string
	for _, reason := range []string{envelope.ReasonFailed, envelope.ReasonPoison} {
		e, _ := envelope.New("urn:babel:orders:created", map[string]any{"reason": reason})
		e.DeadLetter = &envelope.DeadLetter{Reason: reason, OriginalQueue: topic, FailedAt: time.Now().UnixMilli(), Attempts: 3, Lang: "go"}
		if reason == envelope.ReasonFailed {
			failedID = e.Meta.ID
		}
		payload, _ := e.Marshal()
		if err := pub.Publish(dlq, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
			t.Fatal(err)
		}
	}
	code, out, stderr := runCLI(t, "redrive", "--redis-url", url, "--from", dlq, "--reason", "failed", "--idle", "500ms", "--quiet")
	if code != 0 {
		t.Fatalf("redrive: exit %d: %s", code, stderr)
	}
	if !strings.Contains(out, failedID) || !strings.Contains(out, "kept: not selected") ||
		!strings.Contains(out, "2 read, 1 moved, 1 kept on the dead-letter topic") {
		t.Fatalf("redrive output:\n%s", out)
	}
	entries, err := client.XRange(context.Background(), topic, "-", "+").Result()
	if err != nil || len(entries) != 1 {
		t.Fatalf("%d messages on %s, want 1 (err %v)", len(entries), topic, err)
	}
	moved, err := envelope.Parse([]byte(entries[0].Values["payload"].(string)))
	if err != nil || moved.DeadLetter != nil || moved.Meta.ID != failedID || moved.Attempts != 0 {
		t.Fatalf("redriven message %+v (err %v): want the failed one, dead_letter stripped, attempts 0", moved, err)
	}
}
