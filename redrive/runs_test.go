package redrive_test

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/redrive"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// consumerNamed is w.subscriber with a consumer name of its own, for runs
// sharing one consumer group.
func (w *world) consumerNamed(group, consumer string) message.Subscriber {
	sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
		Client: redis.NewClient(w.client.Options()), ConsumerGroup: group, Consumer: consumer, OldestId: "0",
		NackResendSleep: 20 * time.Millisecond, BlockTime: 50 * time.Millisecond, DisableIndefiniteInitialBlock: true,
		MaxIdleTime: time.Millisecond, ClaimInterval: time.Hour,
	}, watermill.NopLogger{})
	if err != nil {
		w.t.Fatal(err)
	}
	return sub
}

// TestManyCopiesDoNotHideASelectedDeadLetter: a topic that holds many
// identical dead letters (one body dead-lettered over and over, same
// reason) followed by one the filters select. The metadata is carried
// (Redis Streams), so the run tells its own put-backs by their mark; it goes
// round the whole topic and moves the selected one (a guard that counted
// put-backs per distinct body stopped it after 81).
func TestManyCopiesDoNotHideASelectedDeadLetter(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	var msgs []*message.Message
	for range 120 {
		msgs = append(msgs, verbatimDeadLetter(w.topic, "same poison body", "failed"))
	}
	msgs = append(msgs, verbatimDeadLetter(w.topic, "the one to move", "poison"))
	if err := w.pub.Publish(w.dlq, msgs...); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	report, err := w.redrive(ctx, redrive.WithVerbatim(), redrive.WithReasons("poison"))
	if err != nil {
		t.Fatal(err)
	}
	if report.Moved != 1 {
		t.Fatalf("moved %d, put back %d, read %d, err %v: the run ended (nil error, as if it had gone round the topic) "+
			"before reaching the selected dead letter behind 120 copies", report.Moved, report.PutBack, len(report.Entries), err)
	}
}

// TestConcurrentRunsStopAtTheirOwnMarks: two operators start a run on
// the same dead-letter topic and group at once (competing consumers). Each
// run must stop once it has gone round: neither may put back far more
// messages than the topic holds.
func TestConcurrentRunsStopAtTheirOwnMarks(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	const n = 4
	var msgs []*message.Message
	for i := range n {
		msgs = append(msgs, verbatimDeadLetter(w.topic, fmt.Sprintf("kept-%d", i), "failed"))
	}
	if err := w.pub.Publish(w.dlq, msgs...); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	reports := make([]redrive.Report, 2)
	errs := make([]error, 2)
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sub := w.consumerNamed("redrive", fmt.Sprintf("op-%d", i))
			defer func() { time.Sleep(100 * time.Millisecond); _ = sub.Close() }()
			reports[i], errs[i] = redrive.Run(ctx, sub, w.pub, w.dlq,
				redrive.WithIdleTimeout(time.Second), redrive.WithVerbatim(), redrive.WithReasons("poison"))
		}()
	}
	wg.Wait()
	xlen, _ := w.client.XLen(context.Background(), w.dlq).Result()
	t.Logf("run 0: read %d put back %d; run 1: read %d put back %d; stream %d entries", len(reports[0].Entries), reports[0].PutBack, len(reports[1].Entries), reports[1].PutBack, xlen)
	for i := range 2 {
		if errs[i] != nil {
			t.Errorf("run %d: %v", i, errs[i])
		}
		if reports[i].PutBack > 2*n {
			t.Errorf("run %d put back %d messages of a %d-message topic (the stream grew to %d entries): "+
				"each run overwrote the other's mark, so neither met its own", i, reports[i].PutBack, n, xlen)
		}
	}
}

// TestRedrivenMessageDoesNotCarryTheMark: a dead letter put back by
// one run (not selected) and moved by the next arrives on its original
// topic without bq-dead-letter-put-back.
func TestRedrivenMessageDoesNotCarryTheMark(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	e, _ := envelope.New("urn:babel:orders:created", map[string]int{"order": 1}, envelope.WithQueue(w.topic))
	e.DeadLetter = &envelope.DeadLetter{Reason: envelope.ReasonFailed, OriginalQueue: w.topic, FailedAt: time.Now().UnixMilli(), Lang: "go"}
	body, _ := e.Marshal()
	dead := message.NewMessage(watermill.NewUUID(), body)
	dead.Metadata.Set(redrive.MetadataPutBack, "someone-elses-run") // a mark from an older run
	if err := w.pub.Publish(w.dlq, dead); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r1, err := w.redrive(ctx, redrive.WithReasons(envelope.ReasonPoison))
	if err != nil || r1.Moved != 0 || r1.PutBack != 1 {
		t.Fatalf("first run: moved %d put back %d: %v", r1.Moved, r1.PutBack, err)
	}
	r2, err := w.redrive(ctx, redrive.WithVerbatim())
	if err != nil || r2.Moved != 1 {
		t.Fatalf("second run: moved %d put back %d: %v", r2.Moved, r2.PutBack, err)
	}
	entries, err := w.client.XRange(ctx, w.topic, "-", "+").Result()
	if err != nil || len(entries) != 1 {
		t.Fatalf("%d entries on the original topic: %v", len(entries), err)
	}
	if meta, _ := entries[0].Values["metadata"].(string); strings.Contains(meta, redrive.MetadataPutBack) {
		t.Fatalf("the redriven message carries the put-back mark: %s", meta)
	}
}

// TestInterruptedRunThenAnother: a run cut short by its context
// after putting messages back (marked), then a second run: the second must
// read the first run's marked put-backs afresh and move what it selects,
// and stop by its own mark, not by the guard.
func TestInterruptedRunThenAnother(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	var msgs []*message.Message
	for i := range 6 {
		msgs = append(msgs, verbatimDeadLetter(w.topic, fmt.Sprintf("m-%d", i), "failed"))
	}
	if err := w.pub.Publish(w.dlq, msgs...); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	seen := 0
	_, err := w.redrive(ctx, redrive.WithVerbatim(), redrive.WithReasons("poison"), redrive.WithProgress(func(redrive.Entry) {
		seen++
		if seen == 3 {
			cancel()
		}
	}))
	cancel()
	if err == nil {
		t.Fatal("interrupted run returned no error")
	}
	ctx2, cancel2 := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel2()
	r, err := w.redrive(ctx2, redrive.WithVerbatim(), redrive.WithReasons("failed"))
	// 6, or 7 when the interrupted run's last ack raced with the close of
	// its subscriber (the package doc's caveat: the copy is skipped by the
	// idempotency middleware downstream).
	if err != nil || r.Moved < 6 || r.Moved > 7 || r.PutBack != 0 {
		t.Fatalf("second run: moved %d put back %d (%v); want all 6 moved", r.Moved, r.PutBack, err)
	}
}

// TestMarkSurvivesWatermillSQL: on watermill-sql (PostgreSQL) a run
// putting back unselected dead letters stops at its own mark: it puts each
// back once, not until the guard trips.
// Serial: the run's 1 s idle timeout counts the watermill-sql subscriber's
// start, which other tests' load can delay past it.
func TestMarkSurvivesWatermillSQL(t *testing.T) {
	s := newSQLTopics(t, "bq_test_runs_")
	topic, dlq, pub := s.topic, s.dlq, s.pub
	for i, reason := range []string{"failed", "failed", "failed", "poison"} {
		e, _ := envelope.New("urn:babel:orders:created", map[string]int{"order": i}, envelope.WithQueue(topic))
		e.DeadLetter = &envelope.DeadLetter{Reason: reason, OriginalQueue: topic, FailedAt: time.Now().UnixMilli(), Lang: "go"}
		body, _ := e.Marshal()
		if err := pub.Publish(dlq, message.NewMessage(watermill.NewUUID(), body)); err != nil {
			t.Fatal(err)
		}
	}
	r, err := s.run(redrive.WithReasons("poison"))
	if err != nil || r.Moved != 1 || r.PutBack != 3 {
		t.Fatalf("moved %d put back %d (%v); want 1 and 3", r.Moved, r.PutBack, err)
	}
}

// sqlTopics is a watermill-sql topic on PostgreSQL and its dead-letter
// topic, their tables dropped when the test ends.
type sqlTopics struct {
	t          *testing.T
	db         *sql.DB
	topic, dlq string
	pub        message.Publisher
}

func newSQLTopics(t *testing.T, prefix string) *sqlTopics {
	t.Helper()
	s := &sqlTopics{t: t, db: testenv.PostgresForSubscriber(t), topic: prefix + testenv.RandomHex(4)}
	s.dlq = s.topic + ".dlq"
	t.Cleanup(func() {
		_, _ = s.db.Exec(`DROP TABLE IF EXISTS "watermill_` + s.topic + `", "watermill_offsets_` + s.topic + `",` +
			`"watermill_` + s.dlq + `", "watermill_offsets_` + s.dlq + `"`)
	})
	pub, err := wsql.NewPublisher(wsql.BeginnerFromStdSQL(s.db), wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, AutoInitializeSchema: true}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	s.pub = pub
	return s
}

// run redrives the dead-letter topic once, in consumer group "redrive",
// with a 5 s idle timeout and opts. A run that read nothing at all is run
// again, for 60 s at most: watermill-sql reads nothing while an older
// transaction is open anywhere on its server, and other tests' subscribers
// hold theirs open for seconds while a slow handler runs (every caller has
// dead letters waiting, so a run that read none saw the server's stall,
// not an empty topic).
func (s *sqlTopics) run(opts ...redrive.Option) (redrive.Report, error) {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for {
		sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(s.db), wsql.SubscriberConfig{
			ConsumerGroup: "redrive", PollInterval: 50 * time.Millisecond, SchemaAdapter: wsql.DefaultPostgreSQLSchema{},
			OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{}, InitializeSchema: true,
		}, watermill.NopLogger{})
		if err != nil {
			s.t.Fatal(err)
		}
		r, err := redrive.Run(ctx, sub, s.pub, s.dlq, append([]redrive.Option{redrive.WithIdleTimeout(5 * time.Second)}, opts...)...)
		time.Sleep(100 * time.Millisecond) // let the last ack reach PostgreSQL
		_ = sub.Close()
		if err != nil || len(r.Entries) > 0 || ctx.Err() != nil {
			return r, err
		}
		s.t.Logf("a run read no dead letter in 5 s (the server's oldest transaction holds the subscriber back); running it again")
	}
}
