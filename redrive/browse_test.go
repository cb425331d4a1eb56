package redrive_test

import (
	"context"
	"errors"
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
	"github.com/babelqueue/watermill-idempotency/redrive"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// deadLetters is a Redis stream dead-letter topic and its original topic,
// both deleted when the test ends.
type deadLetters struct {
	t            *testing.T
	client       *redis.Client
	topic, dlq   string
	pub          message.Publisher
	publishedIDs []string
}

func newDeadLetters(t *testing.T) *deadLetters {
	client := testenv.Redis(t)
	d := &deadLetters{t: t, client: client, topic: "bq-test-dl-" + testenv.RandomHex(4)}
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

// add publishes a dead letter with reason, dead-lettered failedAt (0:
// unknown), under Watermill UUID uuid.
func (d *deadLetters) add(uuid, reason string, failedAt int64) string {
	e, err := envelope.New("urn:babel:orders:created", map[string]any{"n": len(d.publishedIDs)})
	if err != nil {
		d.t.Fatal(err)
	}
	e.DeadLetter = &envelope.DeadLetter{Reason: reason, OriginalQueue: d.topic, FailedAt: failedAt, Attempts: 3, Lang: "go"}
	payload, _ := e.Marshal()
	if err := d.pub.Publish(d.dlq, message.NewMessage(uuid, payload)); err != nil {
		d.t.Fatal(err)
	}
	d.publishedIDs = append(d.publishedIDs, e.Meta.ID)
	return e.Meta.ID
}

func (d *deadLetters) len(stream string) int64 {
	n, err := d.client.XLen(context.Background(), stream).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		d.t.Fatal(err)
	}
	return n
}

func (d *deadLetters) run(opts ...redrive.Option) redrive.Report {
	d.t.Helper()
	sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
		Client: redis.NewClient(d.client.Options()), ConsumerGroup: "redrive", Consumer: "c", OldestId: "0",
		BlockTime: 50 * time.Millisecond, DisableIndefiniteInitialBlock: true, MaxIdleTime: time.Millisecond, ClaimInterval: time.Hour,
	}, watermill.NopLogger{})
	if err != nil {
		d.t.Fatal(err)
	}
	defer func() {
		time.Sleep(100 * time.Millisecond) // let the last ack reach Redis
		_ = sub.Close()
	}()
	report, err := redrive.Run(context.Background(), sub, d.pub, d.dlq, append([]redrive.Option{redrive.WithIdleTimeout(time.Second)}, opts...)...)
	if err != nil {
		d.t.Fatal(err)
	}
	return report
}

// TestPreviewWritesNothingOnRedisStreams: a dry run publishes nothing,
// acks nothing and creates no consumer group, whatever group it reads as.
func TestPreviewWritesNothingOnRedisStreams(t *testing.T) {
	t.Parallel()
	d := newDeadLetters(t)
	now := time.Now().UnixMilli()
	for range 3 {
		d.add(watermill.NewUUID(), envelope.ReasonFailed, now)
	}
	d.add(watermill.NewUUID(), envelope.ReasonPoison, now)
	for _, group := range []string{"redrive", "audit", "audit"} {
		report, err := redrive.Preview(context.Background(), redrive.RedisStreamBrowser(d.client, group), d.dlq, redrive.WithReasons(envelope.ReasonFailed))
		if err != nil || report.Moved != 3 || report.PutBack != 1 || len(report.Entries) != 4 {
			t.Fatalf("preview as %s: %+v, err %v; want 3 of 4 to move", group, report, err)
		}
		for _, e := range report.Entries {
			if e.Selected != (e.Reason == envelope.ReasonFailed) {
				t.Fatalf("entry %+v: Selected is whether the reason filter chose it", e)
			}
		}
		if n := d.len(d.dlq); n != 4 {
			t.Fatalf("after a preview the dead-letter stream has %d entries, want 4", n)
		}
		if n := d.len(d.topic); n != 0 {
			t.Fatalf("after a preview the original topic has %d entries, want 0", n)
		}
		if groups, _ := d.client.XInfoGroups(context.Background(), d.dlq).Result(); len(groups) != 0 {
			t.Fatalf("a preview created consumer groups %+v", groups)
		}
	}
	// After a real run moved the failed ones, the preview as the same
	// group sees what is left.
	if report := d.run(redrive.WithReasons(envelope.ReasonFailed)); report.Moved != 3 {
		t.Fatalf("run: %+v", report)
	}
	report, err := redrive.Preview(context.Background(), redrive.RedisStreamBrowser(d.client, "redrive"), d.dlq)
	if err != nil || report.Moved != 1 || len(report.Entries) != 1 || report.Entries[0].Reason != envelope.ReasonPoison {
		t.Fatalf("preview after the run: %+v, err %v; want only the poison message", report, err)
	}
}

func TestPreviewOfAMissingTopicIsAnError(t *testing.T) {
	t.Parallel()
	d := newDeadLetters(t)
	_, err := redrive.Preview(context.Background(), redrive.RedisStreamBrowser(d.client, "redrive"), d.dlq)
	if !errors.Is(err, redrive.ErrTopicNotFound) {
		t.Fatalf("err %v, want ErrTopicNotFound", err)
	}
	if n, _ := d.client.Exists(context.Background(), d.dlq).Result(); n != 0 {
		t.Fatal("browsing a missing stream created it")
	}
	db := testenv.Postgres(t)
	topic := "bq_test_missing_" + testenv.RandomHex(4)
	_, err = redrive.Preview(context.Background(), redrive.PostgresBrowser(db, "redrive"), topic)
	if !errors.Is(err, redrive.ErrTopicNotFound) {
		t.Fatalf("postgres: err %v, want ErrTopicNotFound", err)
	}
	var tables int
	if err := db.QueryRow(`SELECT count(*) FROM pg_tables WHERE tablename LIKE $1`, "%"+topic+"%").Scan(&tables); err != nil || tables != 0 {
		t.Fatalf("browsing a missing topic created %d tables (err %v)", tables, err)
	}
}

// TestPreviewOnPostgres: a dry run over watermill-sql reads with SELECTs
// only, and follows the consumer group's offset.
func TestPreviewOnPostgres(t *testing.T) {
	t.Parallel()
	db := testenv.PostgresForSubscriber(t)
	topic := "bq_test_dl_" + testenv.RandomHex(4)
	t.Cleanup(func() {
		_, _ = db.Exec(`DROP TABLE IF EXISTS "watermill_` + topic + `", "watermill_offsets_` + topic + `"`)
	})
	logger := watermill.NopLogger{}
	beginner := wsql.BeginnerFromStdSQL(db)
	pub, err := wsql.NewPublisher(beginner, wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, AutoInitializeSchema: true}, logger)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for i := range 3 {
		e, _ := envelope.New("urn:babel:orders:created", map[string]any{"n": i})
		e.DeadLetter = &envelope.DeadLetter{Reason: envelope.ReasonFailed, OriginalQueue: "orders", FailedAt: time.Now().UnixMilli()}
		payload, _ := e.Marshal()
		if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, e.Meta.ID)
	}
	tables := func() int {
		var n int
		if err := db.QueryRow(`SELECT count(*) FROM pg_tables WHERE tablename LIKE $1`, "%"+topic).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	before := tables()
	report, err := redrive.Preview(context.Background(), redrive.PostgresBrowser(db, "redrive"), topic, redrive.WithMax(2))
	if err != nil || report.Moved != 2 || len(report.Entries) != 2 || report.Entries[0].ID != ids[0] {
		t.Fatalf("preview: %+v, err %v", report, err)
	}
	if after := tables(); after != before {
		t.Fatalf("a preview changed the tables: %d before, %d after", before, after)
	}
	// A consumer group that acked the first message: the preview starts
	// after it.
	sub, err := wsql.NewSubscriber(beginner, wsql.SubscriberConfig{
		ConsumerGroup: "redrive", PollInterval: 50 * time.Millisecond, InitializeSchema: true,
		SchemaAdapter: wsql.DefaultPostgreSQLSchema{SubscribeBatchSize: 1}, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{},
	}, logger)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	(<-msgs).Ack()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var acked int
		err := db.QueryRow(`SELECT count(*) FROM "watermill_offsets_` + topic + `" WHERE consumer_group = 'redrive' AND offset_acked > 0`).Scan(&acked)
		if err == nil && acked == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the group's ack was not committed (err %v)", err)
		}
	}
	cancel()
	_ = sub.Close()
	report, err = redrive.Preview(context.Background(), redrive.PostgresBrowser(db, "redrive"), topic)
	if err != nil || len(report.Entries) != 2 || report.Entries[0].ID != ids[1] {
		t.Fatalf("preview after one ack: %+v, err %v; want the last two", report, err)
	}
}

// TestRoundDetectionDoesNotNeedUUIDs: messages published by other runtimes
// may all carry the same empty Watermill UUID; a run still reads every one.
func TestRoundDetectionDoesNotNeedUUIDs(t *testing.T) {
	t.Parallel()
	d := newDeadLetters(t)
	now := time.Now().UnixMilli()
	for i := range 4 {
		reason := envelope.ReasonFailed
		if i%2 == 1 {
			reason = envelope.ReasonPoison
		}
		d.add("", reason, now)
	}
	report := d.run(redrive.WithReasons(envelope.ReasonPoison))
	if len(report.Entries) != 4 || report.Moved != 2 || report.PutBack != 2 {
		t.Fatalf("read %d of 4, moved %d, put back %d; want 4 read, 2 moved, 2 put back", len(report.Entries), report.Moved, report.PutBack)
	}
	if n := d.len(d.topic); n != 2 {
		t.Fatalf("%d messages on the original topic, want the 2 poison ones", n)
	}
}

// TestUnknownAgeMatchesNoAgeFilter: a dead letter without failed_at is
// never taken for one dead-lettered in 1970 (or just now).
func TestUnknownAgeMatchesNoAgeFilter(t *testing.T) {
	t.Parallel()
	d := newDeadLetters(t)
	old := time.Now().Add(-3 * time.Hour).UnixMilli()
	oldID := d.add(watermill.NewUUID(), envelope.ReasonFailed, old)
	d.add(watermill.NewUUID(), envelope.ReasonFailed, 0)
	browser := redrive.RedisStreamBrowser(d.client, "redrive")
	for _, opt := range []redrive.Option{redrive.WithMinAge(time.Hour), redrive.WithMaxAge(100 * 365 * 24 * time.Hour)} {
		report, err := redrive.Preview(context.Background(), browser, d.dlq, opt)
		if err != nil || report.Moved != 1 || report.UnknownAge != 1 || !report.Entries[0].Moved || report.Entries[0].ID != oldID ||
			!strings.Contains(report.Entries[1].Note, "unknown age") {
			t.Fatalf("preview: %+v, err %v; want the old one moved and the unknown one left for its age", report, err)
		}
	}
	report := d.run(redrive.WithMinAge(time.Hour))
	if report.Moved != 1 || report.UnknownAge != 1 {
		t.Fatalf("run: %+v; want 1 moved, 1 left for its unknown age", report)
	}
}

// TestVerbatimDeadLettersMoveOnlyWhenAsked: a body that is not an envelope
// stays by default; WithVerbatim moves it, unchanged, to the original topic
// the dead-letter middleware recorded.
func TestVerbatimDeadLettersMoveOnlyWhenAsked(t *testing.T) {
	t.Parallel()
	d := newDeadLetters(t)
	body := []byte("not an envelope")
	verbatim := message.NewMessage(watermill.NewUUID(), body)
	verbatim.Metadata.Set(deadletter.MetadataVerbatim, "1")
	verbatim.Metadata.Set(deadletter.MetadataReason, envelope.ReasonPoison)
	verbatim.Metadata.Set(deadletter.MetadataOriginalTopic, d.topic)
	verbatim.Metadata.Set("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
	if err := d.pub.Publish(d.dlq, verbatim); err != nil {
		t.Fatal(err)
	}
	if report := d.run(); report.Moved != 0 || !strings.HasPrefix(report.Entries[0].Note, "undecodable") || report.Entries[0].Selected {
		t.Fatalf("default run: %+v; want the verbatim body kept, not selected", report)
	}
	if report := d.run(redrive.WithVerbatim(), redrive.WithReasons(envelope.ReasonFailed)); report.Moved != 0 || report.Entries[0].Selected {
		t.Fatalf("run for reason failed moved a poison body: %+v", report)
	}
	if report := d.run(redrive.WithVerbatim(), redrive.WithMinAge(time.Second)); report.Moved != 0 || report.UnknownAge != 1 {
		t.Fatalf("run with an age filter: %+v; want it left for its unknown age", report)
	}
	report := d.run(redrive.WithVerbatim(), redrive.WithReasons(envelope.ReasonPoison))
	if report.Moved != 1 || report.Entries[0].To != d.topic || !report.Entries[0].Selected {
		t.Fatalf("verbatim run: %+v", report)
	}
	entries, err := d.client.XRange(context.Background(), d.topic, "-", "+").Result()
	if err != nil || len(entries) != 1 {
		t.Fatalf("%d entries on %s (err %v), want 1", len(entries), d.topic, err)
	}
	moved, err := redisstream.DefaultMarshallerUnmarshaller{}.Unmarshal(entries[0].Values)
	if err != nil {
		t.Fatal(err)
	}
	if string(moved.Payload) != string(body) || moved.Metadata.Get(deadletter.MetadataVerbatim) != "" ||
		moved.Metadata.Get(deadletter.MetadataOriginalTopic) != "" || moved.Metadata.Get("traceparent") == "" {
		t.Fatalf("moved %q with metadata %v; want the body unchanged, the dead-letter keys gone, traceparent kept", moved.Payload, moved.Metadata)
	}
}
