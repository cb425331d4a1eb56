package kafkamarshal_test

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/marshal/kafkamarshal"
	"github.com/babelqueue/watermill-idempotency/testkit/conformance"
	"github.com/babelqueue/watermill-idempotency/testkit/kafkatest"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// The manifest's kafka blocks again, through a Kafka protocol server
// (KAFKA_BROKERS, else an in-process kfake cluster): what watermill-kafka
// produces with the Marshaler is read back as a raw record, and raw records
// an SDK produces are consumed by a watermill-kafka subscriber.

// TestWireConformancePropertyProjection: the record a watermill-kafka
// publisher produces from the fixture carries the manifest's headers (and
// the message's own metadata), the envelope byte for byte as its value and
// meta.created_at as its timestamp, as stored by the broker.
func TestWireConformancePropertyProjection(t *testing.T) {
	t.Parallel()
	p := load(t).Kafka.PropertyProjection
	k := kafkatest.Start(t)
	topic := "bq-conformance-" + testenv.RandomHex(4)
	k.Topic(t, topic, 1)
	body := conformance.Fixture(t, strings.TrimPrefix(p.EnvelopeFile, "fixtures/"))
	msg := message.NewMessage("watermill-uuid", body)
	msg.Metadata.Set("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
	if err := k.Publisher(t).Publish(topic, msg); err != nil {
		t.Fatal(err)
	}
	rec := readRaw(t, k, topic)
	got := map[string]string{}
	for _, h := range rec.Headers {
		got[string(h.Key)] = string(h.Value)
	}
	for key, want := range p.Headers {
		if got[key] != want {
			t.Errorf("header %s = %q on the wire, want %q", key, got[key], want)
		}
	}
	if got["traceparent"] != msg.Metadata.Get("traceparent") || len(got) != len(p.Headers)+1 {
		t.Errorf("headers on the wire: %v", got)
	}
	e, _ := envelope.Parse(body)
	if string(rec.Value) != string(body) || !rec.Timestamp.Equal(time.UnixMilli(e.Meta.CreatedAt)) || rec.Key != nil {
		t.Errorf("record on the wire: value %s, timestamp %v (want meta.created_at %d), key %q", rec.Value, rec.Timestamp, e.Meta.CreatedAt, rec.Key)
	}
}

// readRaw reads the first record of partition 0 of topic with a plain
// sarama consumer.
func readRaw(t *testing.T, k *kafkatest.Cluster, topic string) *sarama.ConsumerMessage {
	t.Helper()
	consumer, err := sarama.NewConsumer(k.Brokers, kafkatest.Config())
	if err != nil {
		t.Fatal(err)
	}
	defer consumer.Close()
	pc, err := consumer.ConsumePartition(topic, 0, sarama.OffsetOldest)
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	select {
	case rec := <-pc.Messages():
		return rec
	case err := <-pc.Errors():
		t.Fatal(err)
	case <-time.After(20 * time.Second):
		t.Fatalf("no record on %s", topic)
	}
	return nil
}

// TestWireConformanceAttemptsReconciliation: records produced as an SDK
// does (the body's attempts, the bq-attempts header or none) reach a
// watermill-kafka subscriber with the manifest's attempts, and meta.id as
// the message UUID.
func TestWireConformanceAttemptsReconciliation(t *testing.T) {
	t.Parallel()
	cases := load(t).Kafka.AttemptsReconciliation.Cases
	k := kafkatest.Start(t)
	topic := "bq-conformance-" + testenv.RandomHex(4)
	k.Topic(t, topic, 1)
	producer, err := sarama.NewSyncProducer(k.Brokers, kafkatest.Config())
	if err != nil {
		t.Fatal(err)
	}
	defer producer.Close()
	want := map[string]int{}    // meta.id: the expected attempts
	name := map[string]string{} // meta.id: the case
	for _, c := range cases {
		e, _ := envelope.New("urn:babel:orders:created", map[string]int{"order": 1})
		e.Attempts = c.BodyAttempts
		body, _ := e.Marshal()
		rec := &sarama.ProducerMessage{Topic: topic, Value: sarama.ByteEncoder(body)}
		if c.HeaderAttempts != nil {
			rec.Headers = []sarama.RecordHeader{{Key: []byte(kafkamarshal.HeaderAttempts), Value: []byte(strconv.Itoa(*c.HeaderAttempts))}}
		}
		if _, _, err := producer.SendMessage(rec); err != nil {
			t.Fatal(err)
		}
		want[e.Meta.ID], name[e.Meta.ID] = c.Expected, c.Name
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	msgs, err := k.Subscriber(t, k.Group(t, "bq-conformance")).Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	for range cases {
		select {
		case msg := <-msgs:
			msg.Ack()
			e, err := envelope.Parse(msg.Payload)
			if err != nil {
				t.Fatalf("consumed %s: %v", msg.Payload, err)
			}
			expected, ok := want[msg.UUID]
			if !ok || e.Meta.ID != msg.UUID {
				t.Fatalf("consumed UUID %q, meta.id %q: the UUID is not meta.id", msg.UUID, e.Meta.ID)
			}
			if e.Attempts != expected {
				t.Errorf("%s: attempts %d after the round trip, want %d", name[msg.UUID], e.Attempts, expected)
			}
			delete(want, msg.UUID)
		case <-ctx.Done():
			t.Fatalf("cases not consumed: %v", want)
		}
	}
}
