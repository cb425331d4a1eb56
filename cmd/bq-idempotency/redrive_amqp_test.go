package main

import (
	"context"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestRedriveAMQP redrives dead letters an SDK put on a RabbitMQ queue
// (native integer headers, no Watermill UUID header): every selected one is
// moved to its original queue with attempts reset, the others stay.
func TestRedriveAMQP(t *testing.T) {
	url := testenv.AMQPURL(t)
	t.Setenv("AMQP_URL", url)
	ch, err := testenv.AMQP(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	queue := "bq-test-orders-" + testenv.RandomHex(4)
	dlq := queue + ".dlq"
	t.Cleanup(func() {
		for _, q := range []string{queue, dlq} {
			if _, err := ch.QueueDelete(q, false, false, false); err != nil {
				t.Errorf("delete %s: %v", q, err)
			}
		}
	})
	for _, q := range []string{queue, dlq} {
		if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	poison := map[string]bool{}
	for i, reason := range []string{envelope.ReasonPoison, envelope.ReasonFailed, envelope.ReasonPoison, envelope.ReasonFailed} {
		e, err := envelope.New("urn:babel:orders:created", map[string]int{"order": i}, envelope.WithQueue(queue))
		if err != nil {
			t.Fatal(err)
		}
		e.Meta.Lang, e.Attempts = "python", 3
		e.DeadLetter = &envelope.DeadLetter{Reason: reason, OriginalQueue: queue, Attempts: 3, Lang: "python", FailedAt: 1}
		if reason == envelope.ReasonPoison {
			poison[e.Meta.ID] = true
		}
		body, _ := e.Marshal()
		err = ch.PublishWithContext(context.Background(), "", dlq, false, false, amqp.Publishing{
			ContentType: "application/json", DeliveryMode: amqp.Persistent, AppId: "babelqueue",
			Type: e.Job, CorrelationId: e.TraceID, MessageId: e.Meta.ID, Body: body,
			Headers: amqp.Table{"x-attempts": 3, "x-schema-version": 1, "x-source-lang": "python", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	code, stdout, stderr := runCLI(t, "redrive", "--broker", "amqp", "--from", dlq, "--reason", "poison", "--idle", "500ms", "--quiet")
	if code != 0 || !strings.Contains(stdout, "4 read, 2 moved, 2 kept") {
		t.Fatalf("exit %d\n%s\n%s", code, stdout, stderr)
	}
	for range 2 {
		d, ok, err := ch.Get(queue, true)
		if err != nil || !ok {
			t.Fatalf("redriven message: %v %v", ok, err)
		}
		e, err := envelope.Parse(d.Body)
		if err != nil || !poison[e.Meta.ID] || e.DeadLetter != nil || e.Attempts != 0 || d.Headers["x-attempts"] != int32(0) ||
			d.MessageId != e.Meta.ID || d.Headers["traceparent"] == nil {
			t.Fatalf("redriven %s %v: %v", d.Body, d.Headers, err)
		}
		delete(poison, e.Meta.ID)
	}
	if q, err := ch.QueueDeclarePassive(dlq, true, false, false, false, nil); err != nil || q.Messages != 2 {
		t.Fatalf("dead-letter queue: %d messages, %v", q.Messages, err)
	}
}

// TestRedriveAMQPMissingQueue: a --from queue that does not exist is an
// error, as on the other brokers, and redrive does not create it.
func TestRedriveAMQPMissingQueue(t *testing.T) {
	url := testenv.AMQPURL(t)
	t.Setenv("AMQP_URL", url)
	conn := testenv.AMQP(t)
	dlq := "bq-test-missing-" + testenv.RandomHex(4) + ".dlq"
	t.Cleanup(func() {
		ch, err := conn.Channel()
		if err != nil {
			t.Errorf("channel: %v", err)
			return
		}
		defer ch.Close()
		_, _ = ch.QueueDelete(dlq, false, false, false) // only if the test failed
	})
	code, stdout, stderr := runCLI(t, "redrive", "--broker", "amqp", "--from", dlq, "--idle", "300ms", "--quiet")
	if code != 1 || !strings.Contains(stderr, "does not exist") {
		t.Errorf("exit %d, want 1 with \"does not exist\"\n%s\n%s", code, stdout, stderr)
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if _, err := ch.QueueDeclarePassive(dlq, true, false, false, false, nil); err == nil {
		t.Errorf("redrive created the queue %s", dlq)
	}
}
