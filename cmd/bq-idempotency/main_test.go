package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/httpidempotency"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// binary is the command, built once for the tests: they run it as an
// operator would.
var binary string

func TestMain(m *testing.M) {
	testenv.SetParallelism()
	dir, err := os.MkdirTemp("", "bq-idempotency-test")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary = filepath.Join(dir, "bq-idempotency")
	if other := os.Getenv("BQ_IDEMPOTENCY_BINARY"); other != "" {
		binary = other // another build, e.g. an older one to compare with
	} else if out, err := testenv.GoBuild("-o", binary, ".").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "go build: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

type result struct {
	code           int
	stdout, stderr string
}

// cli runs the built command with args, the test's environment plus env,
// and stdin.
func cli(t *testing.T, env []string, stdin string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdin = strings.NewReader(stdin)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatalf("%v: %v", args, err)
	}
	return result{code: cmd.ProcessState.ExitCode(), stdout: out.String(), stderr: errOut.String()}
}

func run1(t *testing.T, args ...string) result { t.Helper(); return cli(t, nil, "", args...) }

func redisURL() string    { return testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL) }
func postgresDSN() string { return testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN) }

func TestUsageErrorsExit2WithOneMessage(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		nil,
		{"frobnicate"},
		{"help", "frobnicate"},
		{"effects"},
		{"effects", "frobnicate"},
		{"redrive"},
		{"redrive", "--from", "x.dlq", "--bogus"},
		{"redrive", "--from", "x.dlq", "--broker", "kafka9"},
		{"redrive", "--from", "x.dlq", "--max", "-1"},
		{"redrive", "--from", "x.dlq", "--rate", "NaN"},
		{"redrive", "--from", "x.dlq", "--rate", "+Inf"},
		{"redrive", "--from", "x.dlq", "--rate", "-1"},
		{"redrive", "--from", "x.dlq", "--idle", "0s"},
		{"redrive", "--from", "x.dlq", "extra"},
		{"redrive", "--from", "x.dlq", "--broker", "postgres", "--key-prefix", "laravel_database_"},
		{"redrive", "--from", "x.dlq", "--broker", "postgres", "--postgres-dsn", "host=localhost port=notaport"},
		{"redrive", "--from", "x.dlq", "--redis-url", "http://%zz"},
		{"forget", "--handler", "charge"},
		{"forget", "id-1"},
		{"forget", "--handler", "charge", "--unscoped", "id-1"},
		{"forget", "--handler", "charge", "--prefix", "has space", "id-1"},
		{"inspect", "--store", "mysql", "id-1"},
		{"inspect", "--store", "postgres", "--table", "x;drop", "id-1"},
		{"inspect", "--store", "php-redis", "--handler", "charge", "id-1"},
		{"forget", "--store", "go-postgres", "--handler", "charge", "id-1"},
		{"inspect", "--store", "go-redis", "--dialect", "mysql", "id-1"},
		{"inspect", "--store", "php-pdo", "--dialect", "sqlite", "id-1"},
		{"inspect", "--store", "go-postgres", "--claim-prefix", "bq:x-claim:", "id-1"},
		{"forget", "--store", "go-redis", "--claim-table", "claims", "id-1"},
		{"inspect", "--store", "php-pdo", "--prefix", "bq:idem:", "id-1"},
		{"inspect", "--store", "go-redis", "--table", "t", "id-1"},
		{"inspect", "--store", "go-redis", "--prefix", "has space", "id-1"},
		{"forget", "--store", "php-pdo", "--table", "x;drop", "id-1"},
		{"inspect", "--store", "php-pdo", "--dialect", "mysql", "--mysql-dsn", "no-slash-here", "id-1"},
	} {
		r := run1(t, args...)
		if r.code != 2 {
			t.Errorf("%q: exit %d, want 2; stderr %q", args, r.code, r.stderr)
			continue
		}
		if len(args) == 0 {
			continue // the overview
		}
		if args[0] == "effects" && !strings.Contains(r.stderr, "effects list, effects resolve") {
			t.Errorf("%q: want the subcommands named, got %q", args, r.stderr)
		}
		if lines := strings.Count(strings.TrimSpace(r.stderr), "\n") + 1; lines > 2 || strings.Contains(r.stderr, "usage:") {
			t.Errorf("%q: want one message (and where to find help), got %q", args, r.stderr)
		}
	}
}

func TestHelpIsOneStylePerCommand(t *testing.T) {
	t.Parallel()
	top := run1(t, "help")
	if top.code != 0 || !strings.Contains(top.stdout, "redrive") || !strings.Contains(top.stdout, "forget") {
		t.Fatalf("help: exit %d %q", top.code, top.stdout)
	}
	doc, err := os.ReadFile("main.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"redrive", "forget", "inspect"} {
		help := run1(t, "help", name)
		dashH := run1(t, name, "-h")
		if help.code != 0 || dashH.code != 0 || help.stdout != dashH.stdout {
			t.Fatalf("%s: `help %s` (exit %d) and `%s -h` (exit %d) differ:\n%s\n---\n%s", name, name, help.code, name, dashH.code, help.stdout, dashH.stdout)
		}
		if !strings.HasPrefix(help.stdout, "usage: bq-idempotency "+name+" ") || !strings.Contains(help.stdout, "\nflags:\n") {
			t.Fatalf("%s help:\n%s", name, help.stdout)
		}
		for _, line := range strings.Split(help.stdout, "\n") {
			if strings.Count(line, "default") > 1 || strings.Contains(line, `(default "`) {
				t.Fatalf("%s help shows a default twice: %q", name, line)
			}
		}
		// Every flag the help lists is described in the package doc.
		for _, m := range regexp.MustCompile(`(?m)^  --([a-z-]+)`).FindAllStringSubmatch(help.stdout, -1) {
			if !bytes.Contains(doc, []byte("//\t--"+m[1]+" ")) {
				t.Errorf("%s --%s: not described in the package doc", name, m[1])
			}
		}
	}
}

func TestSecretsAreNeverPrinted(t *testing.T) {
	t.Parallel()
	const secret = "s3cr3t-Pw"
	for _, c := range []struct {
		env  []string
		args []string
	}{
		{nil, []string{"inspect", "--handler", "h", "--redis-url", "redis://:" + secret + "@127.0.0.1:1/0", "id-1"}},
		{nil, []string{"inspect", "--handler", "h", "--redis-url", "redis://user:" + secret + "@127.0.0.1:1/0?addr=127.0.0.1:2", "id-1"}},
		{[]string{"REDIS_URL=redis://:" + secret + "@127.0.0.1:1/0"}, []string{"redrive", "--from", "x.dlq"}},
		{nil, []string{"redrive", "--from", "x.dlq", "--broker", "postgres", "--postgres-dsn", "postgres://u:" + secret + "@127.0.0.1:1/db"}},
		{nil, []string{"redrive", "--from", "x.dlq", "--broker", "postgres", "--postgres-dsn", "host=127.0.0.1 port=1 user=u password=" + secret}},
		{nil, []string{"redrive", "--from", "x.dlq", "--broker", "postgres", "--postgres-dsn", "host=127.0.0.1 port=nope password='" + secret + "'"}},
		{[]string{"POSTGRES_DSN=host=127.0.0.1 port=1 password=" + secret}, []string{"inspect", "--store", "postgres", "--handler", "h", "id-1"}},
		{[]string{"POSTGRES_DSN=postgres://u:" + secret + "@127.0.0.1:1/db"}, []string{"redrive", "-h"}},
		{nil, []string{"inspect", "--store", "php-pdo", "--dialect", "mysql", "--mysql-dsn", "u:" + secret + "@tcp(127.0.0.1:1)/db", "id-1"}},
		{nil, []string{"forget", "--store", "php-pdo", "--dialect", "mysql", "--mysql-dsn", "u:" + secret + "@tcp(127.0.0.1:1)/db?timeout=1s", "id-1"}},
		{nil, []string{"inspect", "--store", "php-pdo", "--dialect", "mysql", "--mysql-dsn", "u:" + secret + "@tcp(127.0.0.1:1", "id-1"}},
		{[]string{"MARIADB_DSN=u:" + secret + "@tcp(127.0.0.1:1)/db"}, []string{"inspect", "--store", "php-pdo", "--dialect", "mysql", "id-1"}},
		{[]string{"MARIADB_DSN=u:" + secret + "@tcp(127.0.0.1:1)/db"}, []string{"inspect", "-h"}},
		{nil, []string{"inspect", "--store", "go-postgres", "--postgres-dsn", "postgres://u:" + secret + "@127.0.0.1:1/db", "id-1"}},
		{nil, []string{"inspect", "--store", "php-redis", "--redis-url", "redis://:" + secret + "@127.0.0.1:1/0", "id-1"}},
	} {
		t.Run(strings.Join(c.args[:2], " "), func(t *testing.T) {
			t.Parallel() // each waits out its client's retries against a closed port
			r := cli(t, c.env, "", c.args...)
			if r.code == 0 && c.args[1] != "-h" {
				t.Errorf("%q: exit 0 against a closed port", c.args)
			}
			if strings.Contains(r.stdout+r.stderr, secret) {
				t.Errorf("%q printed the password:\n%s%s", c.args, r.stdout, r.stderr)
			}
		})
	}
}

// deadLetters is a Redis Streams dead-letter topic for a test, deleted
// with its original topic when the test ends.
type deadLetters struct {
	t          *testing.T
	client     *redis.Client
	topic, dlq string
	pub        message.Publisher
}

func newDeadLetters(t *testing.T) *deadLetters {
	client := testenv.Redis(t)
	d := &deadLetters{t: t, client: client, topic: "bq-test-cli-" + testenv.RandomHex(4)}
	d.dlq = d.topic + ".dlq"
	t.Cleanup(func() { client.Del(context.Background(), d.topic, d.dlq) })
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: redis.NewClient(client.Options())}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	d.pub = pub
	return d
}

// add dead-letters an envelope for reason, at failedAt (0: unknown).
func (d *deadLetters) add(reason string, failedAt int64) string {
	return addDeadLetter(d.t, d.pub, d.dlq, d.topic, reason, failedAt)
}

func addDeadLetter(t *testing.T, pub message.Publisher, dlq, topic, reason string, failedAt int64) string {
	t.Helper()
	e, err := envelope.New("urn:babel:orders:created", map[string]any{"reason": reason})
	if err != nil {
		t.Fatal(err)
	}
	e.DeadLetter = &envelope.DeadLetter{Reason: reason, OriginalQueue: topic, FailedAt: failedAt, Attempts: 3, Lang: "go"}
	payload, _ := e.Marshal()
	if err := pub.Publish(dlq, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
		t.Fatal(err)
	}
	return e.Meta.ID
}

func (d *deadLetters) xlen(stream string) int64 {
	n, _ := d.client.XLen(context.Background(), stream).Result()
	return n
}

func (d *deadLetters) groups() int {
	g, _ := d.client.XInfoGroups(context.Background(), d.dlq).Result()
	return len(g)
}

func (d *deadLetters) redrive(args ...string) result {
	d.t.Helper()
	return run1(d.t, append([]string{"redrive", "--redis-url", redisURL(), "--from", d.dlq, "--idle", "500ms"}, args...)...)
}

func TestRedriveRedis(t *testing.T) {
	t.Parallel()
	d := newDeadLetters(t)
	failedID := d.add(envelope.ReasonFailed, time.Now().UnixMilli())
	d.add(envelope.ReasonPoison, time.Now().UnixMilli())
	// The per-message table only when asked.
	if r := d.redrive("--reason", "failed", "--quiet", "--dry-run"); r.code != 0 || strings.Contains(r.stdout, failedID) ||
		strings.Contains(r.stdout, "RESULT") || !strings.Contains(r.stdout, "2 read, 1 would move, 1 would stay") {
		t.Fatalf("dry run without --verbose: exit %d, want the summary alone:\n%s%s", r.code, r.stdout, r.stderr)
	}
	r := d.redrive("--reason", "failed", "--quiet", "--verbose")
	if r.code != 0 {
		t.Fatalf("redrive: exit %d: %s", r.code, r.stderr)
	}
	if !strings.Contains(r.stdout, failedID) || !strings.Contains(r.stdout, "kept: not selected") ||
		!strings.Contains(r.stdout, "2 read, 1 moved, 1 kept on the dead-letter topic") {
		t.Fatalf("redrive output:\n%s", r.stdout)
	}
	entries, err := d.client.XRange(context.Background(), d.topic, "-", "+").Result()
	if err != nil || len(entries) != 1 {
		t.Fatalf("%d messages on %s, want 1 (err %v)", len(entries), d.topic, err)
	}
	moved, err := envelope.Parse([]byte(entries[0].Values["payload"].(string)))
	if err != nil || moved.DeadLetter != nil || moved.Meta.ID != failedID || moved.Attempts != 0 {
		t.Fatalf("redriven message %+v (err %v): want the failed one, dead_letter stripped, attempts 0", moved, err)
	}
}

// TestDryRunChangesNothingOnRedis: a dry run, as any group, leaves the
// dead-letter stream, the original topic and the groups as they were; the
// later real runs move each message once.
func TestDryRunChangesNothingOnRedis(t *testing.T) {
	t.Parallel()
	d := newDeadLetters(t)
	now := time.Now().UnixMilli()
	for range 3 {
		d.add(envelope.ReasonFailed, now)
	}
	d.add(envelope.ReasonPoison, now)
	d.add(envelope.ReasonPoison, now)
	for _, args := range [][]string{{"--dry-run"}, {"--dry-run"}, {"--dry-run", "--group", "audit"}, {"--dry-run", "--reason", "failed"}} {
		r := d.redrive(args...)
		if r.code != 0 || !strings.Contains(r.stdout, "5 read, ") || !strings.Contains(r.stdout, "nothing was moved") {
			t.Fatalf("%q: exit %d\n%s%s", args, r.code, r.stdout, r.stderr)
		}
		if n, o, g := d.xlen(d.dlq), d.xlen(d.topic), d.groups(); n != 5 || o != 0 || g != 0 {
			t.Fatalf("after %q: dead-letter stream %d entries (want 5), original topic %d (want 0), %d groups (want 0)", args, n, o, g)
		}
	}
	if r := d.redrive("--dry-run", "--reason", "failed"); !strings.Contains(r.stdout, "5 read, 3 would move, 2 would stay") {
		t.Fatalf("dry-run summary:\n%s", r.stdout)
	}
	for i, want := range []string{"3 moved", "0 moved"} {
		if r := d.redrive("--reason", "failed"); r.code != 0 || !strings.Contains(r.stdout, want) {
			t.Fatalf("real run %d: exit %d, want %q:\n%s%s", i+1, r.code, want, r.stdout, r.stderr)
		}
	}
	if o := d.xlen(d.topic); o != 3 {
		t.Fatalf("original topic has %d messages, want the 3 failed ones once", o)
	}
}

// postgresTopic is a watermill-sql topic on PostgreSQL for a test; its
// tables are dropped when the test ends. It is on the server of the
// watermill-sql subscriber tests (testenv.PostgresSubscriberDSN), where a
// redrive reads it with that subscriber.
func postgresTopic(t *testing.T) (topic string, pub message.Publisher, tables func() []string) {
	db := testenv.PostgresForSubscriber(t)
	topic = "bq_test_cli_" + testenv.RandomHex(4)
	t.Cleanup(func() {
		_, _ = db.Exec(`DROP TABLE IF EXISTS "watermill_` + topic + `", "watermill_offsets_` + topic + `",` +
			`"watermill_` + topic + `.dlq", "watermill_offsets_` + topic + `.dlq"`)
	})
	pub, err := wsql.NewPublisher(wsql.BeginnerFromStdSQL(db), wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, AutoInitializeSchema: true}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	return topic, pub, func() []string {
		return testenv.Column[string](context.Background(), t, db, `SELECT tablename FROM pg_tables WHERE tablename LIKE $1 ORDER BY 1`, "%"+topic+"%")
	}
}

// TestDryRunAndRunOnPostgres is serial: the run's 1 s idle timeout counts
// the watermill-sql subscriber's start, which other tests' load can delay
// past it.
func TestDryRunAndRunOnPostgres(t *testing.T) {
	topic, pub, tables := postgresTopic(t)
	dlq := topic + ".dlq"
	now := time.Now().UnixMilli()
	addDeadLetter(t, pub, dlq, topic, envelope.ReasonFailed, now)
	addDeadLetter(t, pub, dlq, topic, envelope.ReasonPoison, now)
	addDeadLetter(t, pub, topic, "", envelope.ReasonPoison, now) // creates the original topic's table
	before := tables()
	args := []string{"redrive", "--broker", "postgres", "--postgres-dsn", testenv.PostgresSubscriberDSN(t), "--from", dlq, "--idle", "1s", "--reason", "failed"}
	r := run1(t, append(args, "--dry-run")...)
	if r.code != 0 || !strings.Contains(r.stdout, "2 read, 1 would move, 1 would stay") {
		t.Fatalf("dry run: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if after := tables(); strings.Join(after, ",") != strings.Join(before, ",") {
		t.Fatalf("a dry run changed the tables: %v -> %v", before, after)
	}
	if r = run1(t, args...); r.code != 0 || !strings.Contains(r.stdout, "1 moved") {
		t.Fatalf("run: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if r = run1(t, append(args, "--dry-run")...); r.code != 0 || !strings.Contains(r.stdout, "0 would move") {
		t.Fatalf("dry run after the run: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
}

// TestMissingSourceIsAnError: a typo in --from is an error, and creates
// neither a stream nor tables.
func TestMissingSourceIsAnError(t *testing.T) {
	t.Parallel()
	d := newDeadLetters(t)
	for _, extra := range [][]string{nil, {"--dry-run"}} {
		r := d.redrive(extra...)
		if r.code != 1 || !strings.Contains(r.stderr, "does not exist") {
			t.Fatalf("redis %q: exit %d\n%s%s", extra, r.code, r.stdout, r.stderr)
		}
		if n, _ := d.client.Exists(context.Background(), d.dlq).Result(); n != 0 {
			t.Fatal("a redrive from a missing stream created it")
		}
	}
	topic, _, tables := postgresTopic(t)
	for _, extra := range [][]string{nil, {"--dry-run"}} {
		r := run1(t, append([]string{"redrive", "--broker", "postgres", "--postgres-dsn", testenv.PostgresSubscriberDSN(t), "--from", topic + ".dlq"}, extra...)...)
		if r.code != 1 || !strings.Contains(r.stderr, "does not exist") {
			t.Fatalf("postgres %q: exit %d\n%s%s", extra, r.code, r.stdout, r.stderr)
		}
		if made := tables(); len(made) != 0 {
			t.Fatalf("a redrive from a missing topic created %v", made)
		}
	}
	// A key of another type is an error too.
	d.client.RPush(context.Background(), d.dlq, "x")
	if r := d.redrive(); r.code != 1 || !strings.Contains(r.stderr, "not a stream") {
		t.Fatalf("list: exit %d\n%s", r.code, r.stderr)
	}
}

func TestUnknownAgeIsLeftAndCounted(t *testing.T) {
	t.Parallel()
	d := newDeadLetters(t)
	d.add(envelope.ReasonFailed, 0)
	oldID := d.add(envelope.ReasonFailed, time.Now().Add(-2*time.Hour).UnixMilli())
	for _, args := range [][]string{{"--min-age", "1h", "--dry-run"}, {"--max-age", "24h", "--dry-run"}, {"--min-age", "1h"}} {
		r := d.redrive(args...)
		if r.code != 0 || !strings.Contains(r.stdout, "1 left for an unknown age") || !strings.Contains(r.stdout, "2 read, 1 ") {
			t.Fatalf("%q: exit %d\n%s%s", args, r.code, r.stdout, r.stderr)
		}
	}
	entries, _ := d.client.XRange(context.Background(), d.topic, "-", "+").Result()
	if len(entries) != 1 || !strings.Contains(entries[0].Values["payload"].(string), oldID) {
		t.Fatalf("moved %d messages, want only the one of known age", len(entries))
	}
}

func TestMoveVerbatimOnlyWhenAsked(t *testing.T) {
	t.Parallel()
	d := newDeadLetters(t)
	msg := message.NewMessage(watermill.NewUUID(), []byte("{not json"))
	msg.Metadata.Set(deadletter.MetadataVerbatim, "1")
	msg.Metadata.Set(deadletter.MetadataReason, envelope.ReasonPoison)
	msg.Metadata.Set(deadletter.MetadataOriginalTopic, d.topic)
	if err := d.pub.Publish(d.dlq, msg); err != nil {
		t.Fatal(err)
	}
	if r := d.redrive("--verbose"); r.code != 0 || !strings.Contains(r.stdout, "0 moved") || !strings.Contains(r.stdout, "undecodable") {
		t.Fatalf("default: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if r := d.redrive("--move-verbatim", "--dry-run"); r.code != 0 || !strings.Contains(r.stdout, "1 would move") {
		t.Fatalf("dry run: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if r := d.redrive("--move-verbatim"); r.code != 0 || !strings.Contains(r.stdout, "1 moved") {
		t.Fatalf("--move-verbatim: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	entries, _ := d.client.XRange(context.Background(), d.topic, "-", "+").Result()
	if len(entries) != 1 || entries[0].Values["payload"] != "{not json" {
		t.Fatalf("original topic: %v; want the body, unchanged", entries)
	}
}

func TestInspectAndForgetRedis(t *testing.T) {
	t.Parallel()
	store, flags := redisRecords(t)
	inspectAndForget(t, store, append([]string{"--store", "redis"}, flags...)...)
}

// redisRecords returns a redisstore under a key prefix of the test's own
// (its keys dropped when the test ends), and the flags naming it.
func redisRecords(t *testing.T) (*redisstore.Store, []string) {
	t.Helper()
	client := testenv.Redis(t)
	prefix := "t" + testenv.RandomHex(4) + ":"
	t.Cleanup(func() { _ = testenv.DropKeys(context.Background(), client, prefix+"*") })
	return redisstore.New(client, redisstore.WithPrefix(prefix), redisstore.WithTTL(time.Hour)), []string{"--redis-url", redisURL(), "--prefix", prefix}
}

// TestInspectAndForgetPostgres: with the default claims (an advisory lock
// of the consumer's session: in flight, with no expiry, for as long as its
// holder lives) and with claims of rows (in flight until the lease's end).
func TestInspectAndForgetPostgres(t *testing.T) {
	t.Parallel()
	for name, opts := range map[string][]postgresstore.Option{"session claims": nil, "claims of rows": {postgresstore.WithRowClaims()}} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := testenv.Postgres(t)
			table := "cli_idem_" + testenv.RandomHex(4)
			store, err := postgresstore.New(db, append([]postgresstore.Option{postgresstore.WithTable(table)}, opts...)...)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = store.Close() })
			if err := store.Migrate(context.Background()); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _, _ = db.Exec(`DROP TABLE ` + table) })
			inspectAndForget(t, store, "--store", "postgres", "--postgres-dsn", postgresDSN(), "--table", table)
		})
	}
}

// TestInspectAndForgetCluster: a cluster node's URL, or the nodes' URLs.
func TestInspectAndForgetCluster(t *testing.T) {
	t.Parallel()
	client := testenv.RedisCluster(t)
	prefix := "t" + testenv.RandomHex(4) + ":"
	t.Cleanup(func() {
		_ = client.ForEachMaster(context.Background(), func(ctx context.Context, node *redis.Client) error {
			return testenv.DropKeys(ctx, node, prefix+"*")
		})
	})
	addrs := strings.Split(testenv.Getenv("REDIS_CLUSTER_ADDRS", testenv.DefaultRedisClusterAddrs), ",")
	store := redisstore.New(client, redisstore.WithPrefix(prefix), redisstore.WithTTL(time.Hour))
	inspectAndForget(t, store, "--prefix", prefix, "--redis-url", "redis://"+addrs[0])
	var urls []string
	for _, a := range addrs {
		urls = append(urls, "--redis-url", "redis://"+a)
	}
	inspectAndForget(t, store, append([]string{"--prefix", prefix}, urls...)...)
}

func inspectAndForget(t *testing.T, store stores.Store, flags ...string) {
	t.Helper()
	ctx := context.Background()
	if err := store.Remember(ctx, idempotency.Key("charge", "pay-1"), 0, nil); err != nil {
		t.Fatal(err)
	}
	if ok, _, err := store.Claim(ctx, idempotency.Key("charge", "pay-2"), time.Minute); err != nil || !ok {
		t.Fatal(ok, err)
	}
	cmd := func(name string, args ...string) result {
		return run1(t, append(append([]string{name}, flags...), args...)...)
	}
	r := cmd("inspect", "--handler", "charge", "pay-1", "pay-2", "pay-3")
	if r.code != 0 {
		t.Fatalf("inspect: exit %d: %s", r.code, r.stderr)
	}
	for _, want := range []string{"pay-1 remembered", "pay-2 in flight", "pay-3 unknown -"} {
		if !strings.Contains(strings.Join(strings.Fields(r.stdout), " "), want) {
			t.Fatalf("inspect output lacks %q:\n%s", want, r.stdout)
		}
	}
	// It says where it looked for what it did not find.
	if !strings.Contains(r.stderr, `1 of 3 ids have no record under handler "charge", `) ||
		!(strings.Contains(r.stderr, "key prefix") || strings.Contains(r.stderr, "table ")) {
		t.Fatalf("inspect does not say where it looked for pay-3:\n%s", r.stderr)
	}
	// The same as one JSON document, for scripts.
	r = cmd("inspect", "--handler", "charge", "--output", "json", "pay-1", "pay-2", "pay-3")
	var doc struct {
		Records []struct {
			ID, State string
			ExpiresAt *string `json:"expires_at"`
			Response  any
		}
		Unknown int
	}
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil || r.code != 0 || doc.Unknown != 1 || len(doc.Records) != 3 ||
		doc.Records[0].State != "remembered" || doc.Records[1].State != "in_flight" || doc.Records[2].State != "unknown" ||
		(doc.Records[1].ExpiresAt == nil) != sessionClaims(store) || doc.Records[2].ExpiresAt != nil || doc.Records[0].Response != nil || doc.Records[2].ID != "pay-3" {
		t.Fatalf("inspect --output json: exit %d, %v\n%s%s", r.code, err, r.stdout, r.stderr)
	}
	// The flags it suggests are the ones of this kind of store.
	if wrong := map[bool]string{true: "--table", false: "--prefix"}[strings.Contains(r.stderr, "key prefix")]; strings.Contains(r.stderr, wrong) {
		t.Fatalf("inspect suggests %s, a flag of another kind of store:\n%s", wrong, r.stderr)
	}
	// Without --handler: inspect says why it finds nothing, forget refuses.
	if r = cmd("inspect", "pay-1"); r.code != 0 || !strings.Contains(r.stdout, "unknown") || !strings.Contains(r.stderr, "handler name") {
		t.Fatalf("inspect without --handler: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if r = cmd("forget", "pay-1"); r.code != 2 || !strings.Contains(r.stderr, "--handler is required") {
		t.Fatalf("forget without --handler: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if seen, _ := stores.Seen(ctx, store, idempotency.Key("charge", "pay-1")); !seen {
		t.Fatal("a refused forget removed the record")
	}
	// Honest counts: the ids without a record are named, exit 3 (partial).
	r = cmd("forget", "--handler", "charge", "pay-1", "pay-9")
	if r.code != 3 || !strings.Contains(r.stdout, "forgot 1 of 2 record(s)") || !strings.Contains(r.stderr, "pay-9") || strings.Contains(r.stderr, "pay-1") {
		t.Fatalf("forget: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if seen, _ := stores.Seen(ctx, store, idempotency.Key("charge", "pay-1")); seen {
		t.Fatal("forget left the record")
	}
	// Ids on standard input; an in-flight claim is a record too.
	r = cli(t, nil, "pay-2\n\n", append(append([]string{"forget"}, flags...), "--handler", "charge")...)
	if r.code != 0 || !strings.Contains(r.stdout, "forgot 1 of 1 record(s)") {
		t.Fatalf("forget from stdin: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if r = cmd("forget", "--handler", "charge", "pay-1"); r.code != 3 || !strings.Contains(r.stdout, "forgot none of 1") || strings.Contains(r.stdout, "runs the handler again") {
		t.Fatalf("forget again: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if err := store.Remember(ctx, idempotency.Key("charge", "pay-4"), 0, nil); err != nil {
		t.Fatal(err)
	}
	r = cmd("forget", "--handler", "charge", "--output", "json", "pay-4", "pay-5")
	if r.code != 3 || strings.TrimSpace(r.stdout) != `{"forgotten":1,"requested":2,"missing":["pay-5"]}` {
		t.Fatalf("forget --output json: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
}

// TestInspectAndForgetThroughSentinel starts a Redis server and a Sentinel
// watching it, of the test's own, and reaches the store through the
// Sentinel.
func TestInspectAndForgetThroughSentinel(t *testing.T) {
	server, err := exec.LookPath("redis-server")
	if err != nil {
		testenv.Unavailable(t, "redis-server", err, "install Redis (the Sentinel test starts its own server and Sentinel)")
	}
	dir := t.TempDir()
	masterPort, sentinelPort := freePort(t), freePort(t)
	start := func(args ...string) {
		cmd := exec.Command(server, args...)
		cmd.Dir = dir
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	}
	start("--port", masterPort, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no")
	conf := filepath.Join(dir, "sentinel.conf")
	if err := os.WriteFile(conf, []byte("port "+sentinelPort+"\nbind 127.0.0.1\nsentinel monitor bqtest 127.0.0.1 "+masterPort+" 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	start(conf, "--sentinel")
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + masterPort})
	t.Cleanup(func() { _ = client.Close() })
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		s := redis.NewSentinelClient(&redis.Options{Addr: "127.0.0.1:" + sentinelPort})
		addr, err := s.GetMasterAddrByName(context.Background(), "bqtest").Result()
		_ = s.Close()
		if err == nil && len(addr) == 2 && client.Ping(context.Background()).Err() == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the Sentinel did not come up: %v", err)
		}
	}
	store := redisstore.New(client, redisstore.WithTTL(time.Hour))
	inspectAndForget(t, store, "--redis-url", "redis://127.0.0.1:"+sentinelPort+"?master_name=bqtest")
}

func freePort(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return fmt.Sprint(l.Addr().(*net.TCPAddr).Port)
}

// runCLI is run1 returning the exit code, standard output and error.
func runCLI(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	r := run1(t, args...)
	return r.code, r.stdout, r.stderr
}

// TestInspectAndForgetAPIRecords: API records (package httpidempotency)
// are found by --api-tenant, --operation and the client's key: inspect
// shows the saved response, forget drops the record, and another tenant's
// record with the same key is left alone.
func TestInspectAndForgetAPIRecords(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	prefix := "t" + testenv.RandomHex(4) + ":"
	store := redisstore.New(client, redisstore.WithPrefix(prefix), redisstore.WithTTL(time.Hour))
	ctx := context.Background()
	saved := httpidempotency.EncodeResponse(&httpidempotency.Response{Status: 201, Body: []byte(`{"order_id":"ord_1"}`), SavedAt: time.Now()})
	for _, tenant := range []string{"acme", "globex"} {
		if err := store.Remember(ctx, httpidempotency.RecordKey(tenant, "orders.create", "k-1"), 7, saved); err != nil {
			t.Fatal(err)
		}
	}
	flags := []string{"--store", "redis", "--redis-url", redisURL(), "--prefix", prefix, "--api-tenant", "acme", "--operation", "orders.create"}
	r := run1(t, append(append([]string{"inspect"}, flags...), "k-1", "k-2")...)
	out := strings.Join(strings.Fields(r.stdout), " ")
	if r.code != 0 || !strings.Contains(out, "k-1 remembered") || !strings.Contains(out, "201 (20 bytes, saved") || !strings.Contains(out, "k-2 unknown - -") {
		t.Fatalf("inspect: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	r = run1(t, append(append([]string{"inspect", "--output", "json"}, flags...), "k-1", "k-2")...)
	var doc struct {
		Records []struct {
			ID, State string
			Response  *struct {
				Status, Bytes int
				BodyKept      bool    `json:"body_kept"`
				SavedAt       *string `json:"saved_at"`
			}
		}
	}
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil || r.code != 0 || len(doc.Records) != 2 || doc.Records[0].Response == nil ||
		doc.Records[0].Response.Status != 201 || doc.Records[0].Response.Bytes != 20 || !doc.Records[0].Response.BodyKept ||
		doc.Records[0].Response.SavedAt == nil || doc.Records[1].State != "unknown" || doc.Records[1].Response != nil {
		t.Fatalf("inspect --output json: exit %d, %v\n%s%s", r.code, err, r.stdout, r.stderr)
	}
	if r = run1(t, append(append([]string{"forget"}, flags...), "k-1")...); r.code != 0 || !strings.Contains(r.stdout, "forgot 1 of 1") {
		t.Fatalf("forget: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if seen, _ := stores.Seen(ctx, store, httpidempotency.RecordKey("acme", "orders.create", "k-1")); seen {
		t.Fatal("forget left acme's record")
	}
	if seen, _ := stores.Seen(ctx, store, httpidempotency.RecordKey("globex", "orders.create", "k-1")); !seen {
		t.Fatal("forget removed globex's record")
	}
	for _, bad := range [][]string{
		{"inspect", "--api-tenant", "acme", "k-1"},
		{"forget", "--api-tenant", "acme", "--operation", "o", "--handler", "charge", "k-1"},
		{"inspect", "--store", "php-redis", "--api-tenant", "acme", "--operation", "o", "k-1"},
	} {
		if r := run1(t, bad...); r.code != 2 {
			t.Errorf("%v: exit %d, want 2\n%s", bad, r.code, r.stderr)
		}
	}
}

// sessionClaims reports whether store holds its claims as advisory locks
// of a session (postgresstore's default), which have no expiry.
func sessionClaims(store stores.Store) bool {
	pg, ok := store.(*postgresstore.Store)
	return ok && pg.SessionClaims()
}
