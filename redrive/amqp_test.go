package redrive_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/redrive"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestRedriveOverAMQPReadsMessagesWithoutUUIDs: dead letters published to
// RabbitMQ by another runtime carry no Watermill UUID; a run over
// watermill-amqp still reads all of them and moves the selected ones.
func TestRedriveOverAMQPReadsMessagesWithoutUUIDs(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL(t)
	conn := testenv.AMQP(t)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	topic := "bq-test-amqp-" + testenv.RandomHex(4)
	dlq := topic + ".dlq"
	t.Cleanup(func() {
		for _, q := range []string{topic, dlq} {
			_, _ = ch.QueueDelete(q, false, false, false)
		}
		_ = ch.Close()
	})
	for _, q := range []string{topic, dlq} {
		if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	now := time.Now().UnixMilli()
	for i := range 4 {
		reason := envelope.ReasonFailed
		if i%2 == 1 {
			reason = envelope.ReasonPoison
		}
		e, _ := envelope.New("urn:babel:orders:created", map[string]any{"n": i})
		e.DeadLetter = &envelope.DeadLetter{Reason: reason, OriginalQueue: topic, FailedAt: now, Attempts: 3, Lang: "python"}
		body, _ := e.Marshal()
		err := ch.PublishWithContext(context.Background(), "", dlq, false, false, amqp.Publishing{
			ContentType: "application/json", DeliveryMode: amqp.Persistent, MessageId: e.Meta.ID, Body: body,
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	cfg := wamqp.NewDurableQueueConfig(url)
	sub, err := wamqp.NewSubscriber(cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	pub, err := wamqp.NewPublisher(cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	report, err := redrive.Run(context.Background(), sub, pub, dlq, redrive.WithReasons(envelope.ReasonPoison), redrive.WithIdleTimeout(time.Second))
	time.Sleep(100 * time.Millisecond) // let the last ack reach the broker
	_ = sub.Close()
	if err != nil || len(report.Entries) != 4 || report.Moved != 2 {
		t.Fatalf("read %d of 4, moved %d (err %v); want 4 read and the 2 poison ones moved", len(report.Entries), report.Moved, err)
	}
	for q, want := range map[string]int{topic: 2, dlq: 2} {
		info, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
		if err != nil || info.Messages != want {
			t.Fatalf("%s holds %d messages (err %v), want %d", q, info.Messages, err, want)
		}
	}
}
