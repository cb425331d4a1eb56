package main

import (
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestRedriveNATS redrives dead letters on NATS JetStream, a stream per
// topic as watermill-nats makes them: the dry run reads them without a
// consumer, a run moves the selected ones to their original stream (dead
// letter block stripped, attempts reset) and puts the others back, and
// its durable consumer outlives it, so that the next run reads only what
// the last one put back.
func TestRedriveNATS(t *testing.T) {
	topic := "bq_test_orders_" + testenv.RandomHex(4)
	dlq := topic + "_dlq"
	url, js := testenv.JetStream(t, topic, dlq)
	t.Setenv("NATS_URL", url)
	for _, s := range []string{topic, dlq} {
		testenv.AddStream(t, js, &nats.StreamConfig{Name: s, Subjects: []string{s}})
	}
	pub, err := wnats.NewPublisher(wnats.PublisherConfig{URL: url}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	poison := map[string]bool{}
	for i, reason := range []string{envelope.ReasonPoison, envelope.ReasonFailed, envelope.ReasonPoison, envelope.ReasonFailed} {
		e, err := envelope.New("urn:babel:orders:created", map[string]int{"order": i}, envelope.WithQueue(topic))
		if err != nil {
			t.Fatal(err)
		}
		e.Attempts = 3
		e.DeadLetter = &envelope.DeadLetter{Reason: reason, OriginalQueue: topic, Attempts: 3, Lang: "go", FailedAt: 1}
		if reason == envelope.ReasonPoison {
			poison[e.Meta.ID] = true
		}
		body, _ := e.Marshal()
		if err := pub.Publish(dlq, message.NewMessage(watermill.NewUUID(), body)); err != nil {
			t.Fatal(err)
		}
	}
	code, stdout, stderr := runCLI(t, "redrive", "--broker", "nats", "--from", dlq, "--reason", "poison", "--dry-run", "--quiet")
	if code != 0 || !strings.Contains(stdout, "4 read, 2 would move, 2 would stay") {
		t.Fatalf("dry run: exit %d\n%s\n%s", code, stdout, stderr)
	}
	if names := js.ConsumerNames(dlq); len(drain(names)) != 0 {
		t.Fatal("the dry run created a consumer")
	}
	code, stdout, stderr = runCLI(t, "redrive", "--broker", "nats", "--from", dlq, "--reason", "poison", "--idle", "500ms", "--quiet")
	if code != 0 || !strings.Contains(stdout, "4 read, 2 moved, 2 kept") {
		t.Fatalf("exit %d\n%s\n%s", code, stdout, stderr)
	}
	info, err := js.StreamInfo(topic)
	if err != nil || info.State.Msgs != 2 {
		t.Fatalf("original stream: %+v, %v; want the 2 poison messages", info, err)
	}
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		raw, err := js.GetMsg(topic, seq)
		if err != nil {
			t.Fatal(err)
		}
		e, err := envelope.Parse(raw.Data)
		if err != nil || !poison[e.Meta.ID] || e.DeadLetter != nil || e.Attempts != 0 {
			t.Fatalf("redriven %s: %v", raw.Data, err)
		}
	}
	code, stdout, stderr = runCLI(t, "redrive", "--broker", "nats", "--from", dlq, "--idle", "500ms", "--quiet")
	if code != 0 || !strings.Contains(stdout, "2 read, 2 moved, 0 kept") {
		t.Fatalf("second run: exit %d, want only the 2 put back by the first\n%s\n%s", code, stdout, stderr)
	}
}

// TestRedriveNATSMissingStream: a --from no stream captures is an error,
// and redrive creates no stream.
func TestRedriveNATSMissingStream(t *testing.T) {
	url := testenv.NATSURL(t)
	t.Setenv("NATS_URL", url)
	dlq := "bq_test_missing_" + testenv.RandomHex(4) + "_dlq"
	code, stdout, stderr := runCLI(t, "redrive", "--broker", "nats", "--from", dlq, "--idle", "300ms", "--quiet")
	if code != 1 || !strings.Contains(stderr, "does not exist") {
		t.Errorf("exit %d, want 1 with \"does not exist\"\n%s\n%s", code, stdout, stderr)
	}
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := nc.JetStream()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.StreamInfo(dlq); !errors.Is(err, nats.ErrStreamNotFound) {
		_ = js.DeleteStream(dlq)
		t.Errorf("redrive created the stream %s (%v)", dlq, err)
	}
}

func drain(names <-chan string) []string {
	var out []string
	for n := range names {
		out = append(out, n)
	}
	return out
}
