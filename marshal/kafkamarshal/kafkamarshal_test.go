package kafkamarshal_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/marshal/kafkamarshal"
	"github.com/babelqueue/watermill-idempotency/testkit/conformance"
)

type manifest struct {
	Kafka struct {
		PropertyProjection struct {
			EnvelopeFile string            `json:"envelope_file"`
			Headers      map[string]string `json:"headers"`
		} `json:"property_projection"`
		AttemptsReconciliation struct {
			Cases []struct {
				Name           string `json:"name"`
				BodyAttempts   int    `json:"body_attempts"`
				HeaderAttempts *int   `json:"header_attempts"`
				Expected       int    `json:"expected_attempts"`
			} `json:"cases"`
		} `json:"attempts_reconciliation"`
	} `json:"kafka"`
}

func load(t *testing.T) manifest {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(conformance.Dir(), "manifest.json"))
	if err != nil {
		t.Fatal(err)
	}
	var m manifest
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	if len(m.Kafka.PropertyProjection.Headers) == 0 || len(m.Kafka.AttemptsReconciliation.Cases) == 0 {
		t.Fatal("the manifest has no kafka.property_projection or kafka.attempts_reconciliation block")
	}
	return m
}

func headers(rec *sarama.ProducerMessage) map[string]string {
	out := map[string]string{}
	for _, h := range rec.Headers {
		out[string(h.Key)] = string(h.Value)
	}
	return out
}

// consumed turns a produced record into the record a consumer reads.
func consumed(t *testing.T, rec *sarama.ProducerMessage) *sarama.ConsumerMessage {
	t.Helper()
	value, err := rec.Value.Encode()
	if err != nil {
		t.Fatal(err)
	}
	c := &sarama.ConsumerMessage{Topic: rec.Topic, Value: value, Timestamp: rec.Timestamp}
	for _, h := range rec.Headers {
		c.Headers = append(c.Headers, &sarama.RecordHeader{Key: h.Key, Value: h.Value})
	}
	return c
}

func TestConformancePropertyProjection(t *testing.T) {
	p := load(t).Kafka.PropertyProjection
	body := conformance.Fixture(t, strings.TrimPrefix(p.EnvelopeFile, "fixtures/"))
	msg := message.NewMessage("watermill-uuid", body)
	msg.Metadata.Set("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
	msg.Metadata.Set(kafkamarshal.HeaderAttempts, "9") // a stale count never wins over the body
	rec, err := kafkamarshal.Marshaler{}.Marshal("orders", msg)
	if err != nil {
		t.Fatal(err)
	}
	got := headers(rec)
	for k, want := range p.Headers {
		if got[k] != want {
			t.Errorf("header %s = %q, want %q", k, got[k], want)
		}
	}
	if got["traceparent"] != msg.Metadata.Get("traceparent") || len(got) != len(p.Headers)+1 {
		t.Errorf("headers %v", got)
	}
	value, _ := rec.Value.Encode()
	if string(value) != string(body) || rec.Topic != "orders" || rec.Key != nil {
		t.Errorf("record %s %s %v", rec.Topic, value, rec.Key)
	}
	e, _ := envelope.Parse(body)
	if !rec.Timestamp.Equal(time.UnixMilli(e.Meta.CreatedAt)) {
		t.Errorf("timestamp %v, want meta.created_at %d", rec.Timestamp, e.Meta.CreatedAt)
	}
	back, err := kafkamarshal.Marshaler{}.Unmarshal(consumed(t, rec))
	if err != nil {
		t.Fatal(err)
	}
	if back.UUID != e.Meta.ID || string(back.Payload) != string(body) || back.Metadata.Get("traceparent") != msg.Metadata.Get("traceparent") {
		t.Errorf("consumed %s %s %v", back.UUID, back.Payload, back.Metadata)
	}
}

func TestConformanceAttemptsReconciliation(t *testing.T) {
	for _, c := range load(t).Kafka.AttemptsReconciliation.Cases {
		t.Run(c.Name, func(t *testing.T) {
			e, _ := envelope.New("urn:babel:orders:created", map[string]int{"order": 1})
			e.Attempts = c.BodyAttempts
			body, _ := e.Marshal()
			rec := &sarama.ConsumerMessage{Value: body}
			if c.HeaderAttempts != nil {
				rec.Headers = []*sarama.RecordHeader{{Key: []byte(kafkamarshal.HeaderAttempts), Value: []byte(strconv.Itoa(*c.HeaderAttempts))}}
			}
			msg, err := kafkamarshal.Marshaler{}.Unmarshal(rec)
			if err != nil {
				t.Fatal(err)
			}
			got, err := envelope.Parse(msg.Payload)
			if err != nil {
				t.Fatal(err)
			}
			if got.Attempts != c.Expected {
				t.Fatalf("attempts %d, want %d", got.Attempts, c.Expected)
			}
			if c.Expected == c.BodyAttempts && string(msg.Payload) != string(body) {
				t.Fatalf("payload re-encoded although the counts agree:\n%s\n%s", msg.Payload, body)
			}
			if msg.UUID != e.Meta.ID {
				t.Fatalf("uuid %q, want meta.id %q", msg.UUID, e.Meta.ID)
			}
		})
	}
}

func TestUnusableAttemptsHeaderIgnored(t *testing.T) {
	e, _ := envelope.New("urn:babel:orders:created", nil)
	e.Attempts = 2
	body, _ := e.Marshal()
	for _, v := range []string{"", "x", "-1", "1.5"} {
		msg, _ := kafkamarshal.Marshaler{}.Unmarshal(&sarama.ConsumerMessage{Value: body,
			Headers: []*sarama.RecordHeader{{Key: []byte(kafkamarshal.HeaderAttempts), Value: []byte(v)}}})
		if string(msg.Payload) != string(body) {
			t.Errorf("bq-attempts %q changed the body to %s", v, msg.Payload)
		}
	}
}

func TestNotAnEnvelope(t *testing.T) {
	msg := message.NewMessage("plain-uuid", []byte("plain payload"))
	msg.Metadata.Set("tenant", "eu")
	rec, err := kafkamarshal.Marshaler{PartitionKey: func(string, *message.Message) (string, error) { return "k", nil }}.Marshal("t", msg)
	if err != nil {
		t.Fatal(err)
	}
	if h := headers(rec); h[kafka.UUIDHeaderKey] != "plain-uuid" || h["tenant"] != "eu" || h[kafkamarshal.HeaderJob] != "" {
		t.Fatalf("headers %v", h)
	}
	if k, _ := rec.Key.Encode(); string(k) != "k" {
		t.Fatalf("key %q", k)
	}
	back, err := kafkamarshal.Marshaler{}.Unmarshal(consumed(t, rec))
	if err != nil || back.UUID != "plain-uuid" || string(back.Payload) != "plain payload" || back.Metadata.Get(kafka.UUIDHeaderKey) != "" {
		t.Fatalf("consumed %v %s %v: %v", back.UUID, back.Payload, back.Metadata, err)
	}
	if fresh, _ := (kafkamarshal.Marshaler{}).Unmarshal(&sarama.ConsumerMessage{Value: []byte("x")}); fresh.UUID == "" {
		t.Fatal("no UUID for a record without one")
	}
}
