package main

import (
	"strings"
	"testing"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/marshal/kafkamarshal"
	"github.com/babelqueue/watermill-idempotency/testkit/kafkatest"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestRedriveKafka redrives dead letters on a Kafka topic written in the
// BabelQueue Kafka binding: a dry run reads them and commits nothing, the
// run moves the selected ones to their original topic (attempts reset, the
// bq-attempts header too, out-of-band headers kept) and puts the others
// back, and a second run finds only those.
func TestRedriveKafka(t *testing.T) {
	t.Parallel()
	k := kafkatest.Start(t)
	topic := "bq-test-orders-" + testenv.RandomHex(4)
	dlq := topic + ".dlq"
	k.Topic(t, topic, 2)
	k.Topic(t, dlq, 3)
	group := k.Group(t, "bq-redrive")
	poison := map[string]bool{}
	var dead []*message.Message
	for i, reason := range []string{envelope.ReasonPoison, envelope.ReasonFailed, envelope.ReasonPoison, envelope.ReasonFailed} {
		e, err := envelope.New("urn:babel:orders:created", map[string]int{"order": i}, envelope.WithQueue(topic))
		if err != nil {
			t.Fatal(err)
		}
		e.Meta.Lang, e.Attempts = "java", 3
		e.DeadLetter = &envelope.DeadLetter{Reason: reason, OriginalQueue: topic, Attempts: 3, Lang: "java", FailedAt: 1}
		if reason == envelope.ReasonPoison {
			poison[e.Meta.ID] = true
		}
		body, _ := e.Marshal()
		msg := message.NewMessage(e.Meta.ID, body)
		msg.Metadata.Set("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
		dead = append(dead, msg)
	}
	if err := k.Publisher(t).Publish(dlq, dead...); err != nil {
		t.Fatal(err)
	}
	brokers := strings.Join(k.Brokers, ",")
	redriveArgs := []string{"redrive", "--broker", "kafka", "--kafka-brokers", brokers, "--group", group, "--from", dlq, "--reason", "poison", "--idle", "1s", "--quiet"}

	code, stdout, stderr := runCLI(t, append(redriveArgs, "--dry-run")...)
	if code != 0 || !strings.Contains(stdout, "4 read, 2 would move, 2 would stay") {
		t.Fatalf("dry run: exit %d\n%s\n%s", code, stdout, stderr)
	}
	if n := k.Backlog(t, group, dlq); n != 4 {
		t.Fatalf("after the dry run group %s has %d dead letters uncommitted, want 4: the dry run committed offsets", group, n)
	}

	code, stdout, stderr = runCLI(t, redriveArgs...)
	if code != 0 || !strings.Contains(stdout, "4 read, 2 moved, 2 kept") {
		t.Fatalf("exit %d\n%s\n%s", code, stdout, stderr)
	}
	moved := k.Browse(t, "bq-test-reader", topic)
	if len(moved) != 2 {
		t.Fatalf("%d messages on %s, want the 2 poison dead letters", len(moved), topic)
	}
	for _, m := range moved {
		e, err := envelope.Parse(m.Payload)
		if err != nil || !poison[e.Meta.ID] || e.DeadLetter != nil || e.Attempts != 0 ||
			m.Metadata.Get(kafkamarshal.HeaderAttempts) != "0" || m.UUID != e.Meta.ID || m.Metadata.Get("traceparent") == "" {
			t.Fatalf("redriven %s %v: %v", m.Payload, m.Metadata, err)
		}
	}
	left := k.Browse(t, group, dlq)
	if len(left) != 2 {
		t.Fatalf("%d dead letters left for group %s, want the 2 failed ones put back", len(left), group)
	}
	for _, m := range left {
		if e, err := envelope.Parse(m.Payload); err != nil || poison[e.Meta.ID] || e.DeadLetter == nil {
			t.Fatalf("left on the dead-letter topic: %s (%v)", m.Payload, err)
		}
	}

	code, stdout, stderr = runCLI(t, redriveArgs...)
	if code != 0 || !strings.Contains(stdout, "2 read, 0 moved, 2 kept") {
		t.Fatalf("second run: exit %d\n%s\n%s", code, stdout, stderr)
	}
}

// TestRedriveKafkaMissingTopic: a --from topic that does not exist is an
// error, and neither the run nor the dry run creates it, on a Kafka that
// creates topics on first use.
func TestRedriveKafkaMissingTopic(t *testing.T) {
	t.Parallel()
	k := kafkatest.Start(t)
	dlq := "bq-test-missing-" + testenv.RandomHex(4) + ".dlq"
	k.DeleteTopicAtEnd(t, dlq) // only if the test failed
	for _, extra := range [][]string{nil, {"--dry-run"}} {
		args := append([]string{"redrive", "--broker", "kafka", "--kafka-brokers", strings.Join(k.Brokers, ","), "--from", dlq, "--idle", "300ms", "--quiet"}, extra...)
		code, stdout, stderr := runCLI(t, args...)
		if code != 1 || !strings.Contains(stderr, "does not exist") {
			t.Errorf("%v: exit %d, want 1 with \"does not exist\"\n%s\n%s", extra, code, stdout, stderr)
		}
	}
	admin, err := sarama.NewClusterAdmin(k.Brokers, kafkatest.Config())
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	topics, err := admin.ListTopics()
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := topics[dlq]; ok {
		t.Fatalf("redrive created the topic %s", dlq)
	}
}
