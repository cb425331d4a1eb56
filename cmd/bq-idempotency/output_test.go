package main

import (
	"context"
	"encoding/json"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/pubsub/redislist"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// The help lists the exit statuses, the partial one included.
func TestHelpListsExitStatuses(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"help"}, {"help", "redrive"}, {"forget", "-h"}, {"help", "effects", "list"}} {
		r := run1(t, args...)
		if r.code != 0 || !strings.Contains(r.stdout, "Exit status:") || !strings.Contains(r.stdout, "  3  partial") ||
			!strings.Contains(r.stdout, "  2  bad usage") {
			t.Errorf("%q: exit %d, want the exit statuses listed:\n%s", args, r.code, r.stdout)
		}
	}
	for _, args := range [][]string{
		{"redrive", "--from", "x.dlq", "--output", "yaml"},
		{"redrive", "--from", "x.dlq", "--progress-every", "0s"},
		{"inspect", "--handler", "h", "--output", "xml", "id-1"},
	} {
		if r := run1(t, args...); r.code != 2 {
			t.Errorf("%q: exit %d, want 2 (usage)\n%s", args, r.code, r.stderr)
		}
	}
}

// A dead letter the run selects but cannot move (no original queue)
// stays, and the run exits 3 (partial); --output json reports it with
// stable field names, each message with --verbose. A run whose filters
// leave it exits 0.
func TestRedriveJSONAndPartialExit(t *testing.T) {
	t.Parallel()
	d := newDeadLetters(t)
	movable := d.add(envelope.ReasonFailed, time.Now().UnixMilli())
	e, err := envelope.New("urn:babel:orders:created", map[string]any{})
	if err != nil {
		t.Fatal(err)
	}
	e.DeadLetter = &envelope.DeadLetter{Reason: envelope.ReasonPoison, FailedAt: time.Now().UnixMilli(), Attempts: 1, Lang: "php"}
	payload, _ := e.Marshal()
	if err := d.pub.Publish(d.dlq, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
		t.Fatal(err)
	}

	// Filtered out: exit 0.
	if r := d.redrive("--quiet", "--dry-run", "--reason", "failed"); r.code != 0 || !strings.Contains(r.stdout, "1 would move, 1 would stay") {
		t.Fatalf("dry run without the unmovable one selected: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	// Selected: the dry run says so and exits as the run will.
	if r := d.redrive("--quiet", "--dry-run"); r.code != 3 || !strings.Contains(r.stdout, "1 selected but not moved") {
		t.Fatalf("dry run: exit %d, want 3\n%s%s", r.code, r.stdout, r.stderr)
	}
	// A dry run moves nothing: "moved" is 0 and false, "would_move" says
	// what the run would move.
	r := d.redrive("--quiet", "--dry-run", "--output", "json", "--verbose")
	var dry struct {
		DryRun    bool `json:"dry_run"`
		Moved     int
		WouldMove int `json:"would_move"`
		Messages  []struct {
			ID        string
			Moved     bool
			WouldMove bool `json:"would_move"`
		}
	}
	if err := json.Unmarshal([]byte(r.stdout), &dry); err != nil || !dry.DryRun || dry.Moved != 0 || dry.WouldMove != 1 || len(dry.Messages) != 2 {
		t.Fatalf("dry run: exit %d, %v, document %+v\n%s%s", r.code, err, dry, r.stdout, r.stderr)
	}
	for _, m := range dry.Messages {
		if m.Moved || m.WouldMove != (m.ID == movable) {
			t.Errorf("dry run, message %+v: moved must be false, would_move true for %s only", m, movable)
		}
	}
	r = d.redrive("--quiet", "--output", "json", "--verbose")
	type msg struct {
		ID, URN, Reason, From, To, Note string
		Moved                           bool
	}
	var doc struct {
		From                 string
		DryRun               bool `json:"dry_run"`
		Read, Moved, Kept    int
		NotMoved             int `json:"not_moved"`
		Skipped              int
		UnknownAge           int `json:"unknown_age"`
		Emptied              bool
		Error                string
		Messages             []msg
		UnexpectedlyAbsentOK *int `json:"-"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil || strings.Count(strings.TrimSpace(r.stdout), "\n") != 0 {
		t.Fatalf("want one JSON object on one line: %v\n%s", err, r.stdout)
	}
	if r.code != 3 || doc.From != d.dlq || doc.DryRun || doc.Read != 2 || doc.Moved != 1 || doc.Kept != 1 || doc.NotMoved != 1 ||
		doc.Error != "" || len(doc.Messages) != 2 {
		t.Fatalf("exit %d (want 3), document %+v\n%s", r.code, doc, r.stderr)
	}
	for _, m := range doc.Messages {
		switch m.ID {
		case movable:
			if !m.Moved || m.To != d.topic || m.Reason != "failed" || m.URN != "urn:babel:orders:created" {
				t.Errorf("moved message: %+v", m)
			}
		case e.Meta.ID:
			if m.Moved || m.To != "" || !strings.Contains(m.Note, "no original queue") {
				t.Errorf("unmovable message: %+v", m)
			}
		default:
			t.Errorf("unexpected message %+v", m)
		}
	}
	// Without --verbose, the summary alone; for the raw names too.
	r = d.redrive("--quiet", "--output", "json")
	var raw map[string]any
	if err := json.Unmarshal([]byte(r.stdout), &raw); err != nil || r.code != 3 {
		t.Fatalf("exit %d, %v\n%s%s", r.code, err, r.stdout, r.stderr)
	}
	for _, k := range []string{"from", "dry_run", "read", "moved", "kept", "not_moved", "skipped", "unknown_age", "emptied"} {
		if _, ok := raw[k]; !ok {
			t.Errorf("field %q missing: %s", k, r.stdout)
		}
	}
	if _, ok := raw["messages"]; ok {
		t.Errorf("messages without --verbose: %s", r.stdout)
	}
}

// The totals the progress reports show are what each broker holds for the
// run: Redis Streams the group's pending and undelivered entries (the
// whole stream without the group), the Redis lists LLEN, RabbitMQ the
// ready messages, PostgreSQL the rows after the group's offset.
func TestRedriveTotals(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	count := func(t *testing.T, broker, topic string, conn *connection, extra ...func(*brokerConfig)) int64 {
		t.Helper()
		cfg := brokerConfig{conn: conn, group: "bq-redrive", dryRun: true}
		for _, f := range extra {
			f(&cfg)
		}
		if broker == "amqp" {
			cfg.dryRun = false // no dry run on RabbitMQ
		}
		b, err := openBroker(ctx, broker, cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer b.close()
		if b.count == nil {
			t.Fatalf("%s: no count", broker)
		}
		n, err := b.count(ctx, topic)
		if err != nil {
			t.Fatalf("%s: %v", broker, err)
		}
		return n
	}
	redisConn := func() *connection { return &connection{redactor: newRedactor(), redisURLs: urlList{redisURL()}} }

	t.Run("redis", func(t *testing.T) {
		t.Parallel()
		d := newDeadLetters(t)
		for range 3 {
			d.add(envelope.ReasonFailed, time.Now().UnixMilli())
		}
		if n := count(t, "redis", d.dlq, redisConn()); n != 3 {
			t.Fatalf("no group: %d, want the stream's 3", n)
		}
		// The group has read one (pending) and not the two others.
		if err := d.client.XGroupCreate(ctx, d.dlq, "bq-redrive", "0").Err(); err != nil {
			t.Fatal(err)
		}
		read, err := d.client.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "bq-redrive", Consumer: "c", Streams: []string{d.dlq, ">"}, Count: 1}).Result()
		if err != nil {
			t.Fatal(err)
		}
		if n := count(t, "redis", d.dlq, redisConn()); n != 3 {
			t.Fatalf("1 pending, 2 undelivered: %d, want 3", n)
		}
		if err := d.client.XAck(ctx, d.dlq, "bq-redrive", read[0].Messages[0].ID).Err(); err != nil {
			t.Fatal(err)
		}
		if n := count(t, "redis", d.dlq, redisConn()); n != 2 {
			t.Fatalf("1 acked, 2 undelivered: %d, want 2", n)
		}
	})

	t.Run("redis-list", func(t *testing.T) {
		t.Parallel()
		for _, layout := range []redislist.Layout{redislist.LayoutReliableList, redislist.LayoutLaravel} {
			d := newListDeadLetters(t, layout, "")
			d.push(d.deadLetter(1), d.deadLetter(2))
			if n := count(t, d.broker(), d.dlq, redisConn()); n != 2 {
				t.Fatalf("%s: %d, want 2", d.broker(), n)
			}
		}
	})

	t.Run("amqp", func(t *testing.T) {
		t.Parallel()
		url := testenv.AMQPURL(t)
		ch, err := testenv.AMQP(t).Channel()
		if err != nil {
			t.Fatal(err)
		}
		queue := "bq-test-count-" + testenv.RandomHex(4)
		if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _, _ = ch.QueueDelete(queue, false, false, false) })
		if err := ch.Confirm(false); err != nil {
			t.Fatal(err)
		}
		for range 3 {
			c, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, false, false, amqp.Publishing{Body: []byte("{}")})
			if err != nil {
				t.Fatal(err)
			}
			if ok, err := c.WaitContext(ctx); !ok || err != nil {
				t.Fatalf("not confirmed: %v", err)
			}
		}
		conn := &connection{redactor: newRedactor(), amqpURL: url}
		if n := count(t, "amqp", queue, conn); n != 3 {
			t.Fatalf("%d, want the 3 confirmed", n)
		}
	})

	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		topic, pub, _ := postgresTopic(t)
		dlq := topic + ".dlq"
		for range 2 {
			addDeadLetter(t, pub, dlq, topic, envelope.ReasonFailed, time.Now().UnixMilli())
		}
		conn := &connection{redactor: newRedactor(), postgresDSN: testenv.PostgresSubscriberDSN(t)}
		if n := count(t, "postgres", dlq, conn); n != 2 {
			t.Fatalf("%d, want 2", n)
		}
	})
}

// effects list's table has one word in every column but the last (NOTE),
// the lease in a column of its own; --output json has the same effects
// with stable field names.
func TestEffectsListIsScriptable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb := testenv.Redis(t)
	prefix := "cli" + testenv.RandomHex(5)
	store := redisstore.NewEffects(rdb, redisstore.WithEffectsPrefix(prefix))
	lapsed := stores.EffectIntent{Key: "pk lapsed", Name: "send email", Scope: "notify", MessageID: "m 1"}
	if _, _, err := store.Begin(ctx, lapsed, time.Millisecond); err != nil {
		t.Fatal(err)
	}
	unknown := stores.EffectIntent{Key: "pk-unknown", Name: "charge", Scope: "charge", MessageID: "m-2"}
	if _, _, err := store.Begin(ctx, unknown, time.Minute); err != nil {
		t.Fatal(err)
	}
	if _, _, err := store.Transition(ctx, unknown.Key, stores.EffectTransition{To: stores.EffectUnknown, Note: "read tcp: i/o timeout", Evidence: "call timed out"}); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		list, err := store.List(ctx, stores.EffectQuery{States: []stores.EffectState{stores.EffectPending}, Limit: 10})
		if err == nil && len(list) == 1 && list[0].LeaseLapsed {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the pending effect's lease did not lapse: %v %v", list, err)
		}
	}
	flags := []string{"effects", "list", "--redis-url", redisURL(), "--prefix", prefix}
	r := run1(t, flags...)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	if r.code != 0 || len(lines) != 3 {
		t.Fatalf("exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	header := strings.Fields(lines[0])
	if strings.Join(header, " ") != "PROVIDER-KEY STATE LEASE AGE ATTEMPTS EFFECT HANDLER MESSAGE-ID EVIDENCE RESULT UNTIL NOTE" {
		t.Fatalf("header %q", lines[0])
	}
	rows := map[string][]string{}
	for _, line := range lines[1:] {
		f := strings.Fields(line)
		if len(f) < len(header) {
			t.Fatalf("row %q has %d fields, want at least %d", line, len(f), len(header))
		}
		rows[f[0]] = f
	}
	if f := rows["pk_lapsed"]; f == nil || f[1] != "pending" || f[2] != "lapsed" || f[5] != "send_email" || f[7] != "m_1" {
		t.Errorf("the lapsed pending effect: %q", f)
	}
	// Unknown within its attempt's lease of a minute: its request may still land.
	if f := rows["pk-unknown"]; f == nil || f[1] != "unknown" || f[2] != "landing" || f[8] != "call_timed_out" || f[9] != "-" || strings.Join(f[11:], " ") != "read tcp: i/o timeout" {
		t.Errorf("the unknown effect: %q", f)
	}

	r = run1(t, append(flags, "--output", "json")...)
	var doc struct {
		Effects []struct {
			ProviderKey string  `json:"provider_key"`
			State       string  `json:"state"`
			LeaseLapsed bool    `json:"lease_lapsed"`
			StateSince  *string `json:"state_since"`
			AgeSeconds  float64 `json:"age_seconds"`
			Attempts    int     `json:"attempts"`
			Effect      string  `json:"effect"`
			Handler     string  `json:"handler"`
			MessageID   string  `json:"message_id"`
			Evidence    string  `json:"evidence"`
			Note        string  `json:"note"`
		}
	}
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil || r.code != 0 || len(doc.Effects) != 2 {
		t.Fatalf("exit %d, %v\n%s%s", r.code, err, r.stdout, r.stderr)
	}
	for _, e := range doc.Effects {
		switch e.ProviderKey {
		case "pk lapsed":
			if e.State != "pending" || !e.LeaseLapsed || e.Effect != "send email" || e.MessageID != "m 1" || e.StateSince == nil {
				t.Errorf("lapsed: %+v", e)
			}
		case "pk-unknown":
			if e.State != "unknown" || e.LeaseLapsed || e.Note != "read tcp: i/o timeout" || e.Evidence != "call timed out" || e.Handler != "charge" || e.AgeSeconds < 0 {
				t.Errorf("unknown: %+v", e)
			}
		default:
			t.Errorf("unexpected %+v", e)
		}
	}
}

// The help lists every field of each --output json document, and no other:
// its names are the JSON tags of the types written.
func TestJSONHelpNamesTheFields(t *testing.T) {
	t.Parallel()
	docs := map[string][]any{
		"redrive":      {redriveJSON{}, messageJSON{}},
		"inspect":      {inspectJSON{}, recordJSON{}, endJSON{}, responseJSON{}},
		"forget":       {forgetJSON{}},
		"effects list": {effectsJSON{}, effectJSON{}},
		"effects show": {effectsShowJSON{}, effectShowJSON{}},
	}
	quoted := regexp.MustCompile(`"([a-z_]+)"`)
	for name, types := range docs {
		var tags []string
		for _, v := range types {
			rt := reflect.TypeOf(v)
			for i := range rt.NumField() {
				tag, _, _ := strings.Cut(rt.Field(i).Tag.Get("json"), ",")
				tags = append(tags, tag)
			}
		}
		var listed []string
		for _, m := range quoted.FindAllStringSubmatch(jsonShapes[name], -1) {
			listed = append(listed, m[1])
		}
		slices.Sort(tags)
		slices.Sort(listed)
		if !slices.Equal(tags, listed) {
			t.Errorf("%s: the help lists %v, the document has %v", name, listed, tags)
		}
		help := run1(t, append([]string{"help"}, strings.Fields(name)...)...)
		if !strings.Contains(help.stdout, "--output json writes one JSON object") {
			t.Errorf("help %s does not describe --output json:\n%s", name, help.stdout)
		}
	}
}
