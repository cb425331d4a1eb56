// Package kafkamarshal speaks the BabelQueue Kafka binding for
// watermill-kafka v3, so that a Watermill router consumes the records the
// BabelQueue SDKs produce and produces records they consume.
//
//	sub, _ := kafka.NewSubscriber(kafka.SubscriberConfig{
//		Brokers: brokers, ConsumerGroup: "orders-workers", Unmarshaler: kafkamarshal.Marshaler{},
//	}, logger)
//	pub, _ := kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers, Marshaler: kafkamarshal.Marshaler{}}, logger)
//
// A record's value is the envelope, byte for byte. Its headers, all UTF-8
// strings, project the envelope: bq-job (the URN), bq-trace-id,
// bq-message-id, bq-schema-version, bq-source-lang and bq-attempts; the
// message's out-of-band metadata (a W3C traceparent, …) rides beside them and
// never overrides them. The record timestamp is meta.created_at (Kafka keeps
// it from protocol version 0.10.0; set the publisher's sarama Version).
// Kafka 4 no longer speaks the protocol of watermill-kafka's default
// Version (1.0): give both sides a sarama config with sarama.V2_1_0_0 or
// later, as Example_router does.
//
// A consumer group rebalance (a member joins, leaves or dies) hands a
// partition over from its committed offset, and watermill-kafka commits
// nothing a consumer acks once its session ended: the new owner gets those
// records again, and the kit's middleware skips the ones that were handled.
//
// Kafka has no delivery count, so on consume the bq-attempts header is the
// retry counter when it is present and a whole number, even when it is lower
// than the body's attempts; otherwise the body's attempts stands. When the
// two disagree, the message's payload is the envelope re-encoded with the
// header's count (unknown fields kept); otherwise it is the record's value,
// unchanged. The Watermill UUID is bq-message-id, else the UUID header of
// watermill-kafka's own marshaler, else the body's meta.id, else a fresh
// UUID. Unmarshal never fails: a record that is not an envelope reaches the
// handler, and the kit's dead-letter middleware, as it is.
package kafkamarshal

import (
	"fmt"
	"strconv"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/babelqueue/watermill-idempotency/envelope"
)

// The binding's record headers.
const (
	HeaderJob           = envelope.MetadataJob       // job, the URN
	HeaderTraceID       = envelope.MetadataTraceID   // trace_id
	HeaderMessageID     = envelope.MetadataMessageID // meta.id
	HeaderSchemaVersion = "bq-schema-version"        // meta.schema_version, in decimal
	HeaderSourceLang    = "bq-source-lang"           // meta.lang
	HeaderAttempts      = "bq-attempts"              // attempts, in decimal; authoritative on consume
)

// Marshaler converts between Watermill messages and BabelQueue Kafka
// records. It implements watermill-kafka's MarshalerUnmarshaler; the zero
// value is ready to use.
type Marshaler struct {
	// PartitionKey, when set, returns the record key of a message (for
	// example its trace_id, to keep a causal chain on one partition). By
	// default records have no key.
	PartitionKey func(topic string, msg *message.Message) (string, error)
}

var _ kafka.MarshalerUnmarshaler = Marshaler{}

// Marshal builds the record for msg. When the payload is a valid envelope
// the bq- headers and the timestamp are projected from it and msg's
// metadata rides beside them (the projection wins a clash); any other
// payload gets msg's metadata and the Watermill UUID header. The value is
// the payload, unchanged.
func (m Marshaler) Marshal(topic string, msg *message.Message) (*sarama.ProducerMessage, error) {
	rec := &sarama.ProducerMessage{Topic: topic, Value: sarama.ByteEncoder(msg.Payload)}
	e, err := envelope.Parse(msg.Payload)
	isEnvelope := err == nil
	var projected map[string]string
	if isEnvelope {
		projected = map[string]string{
			HeaderJob: e.Job, HeaderTraceID: e.TraceID, HeaderMessageID: e.Meta.ID,
			HeaderSchemaVersion: strconv.Itoa(e.Meta.SchemaVersion), HeaderSourceLang: e.Meta.Lang,
			HeaderAttempts: strconv.Itoa(e.Attempts),
		}
		if e.Meta.CreatedAt > 0 {
			rec.Timestamp = time.UnixMilli(e.Meta.CreatedAt)
		}
	} else {
		projected = map[string]string{kafka.UUIDHeaderKey: msg.UUID}
	}
	rec.Headers = make([]sarama.RecordHeader, 0, len(msg.Metadata)+len(projected))
	for _, k := range []string{HeaderJob, HeaderTraceID, HeaderMessageID, HeaderSchemaVersion, HeaderSourceLang, HeaderAttempts, kafka.UUIDHeaderKey} {
		if v, ok := projected[k]; ok && v != "" {
			rec.Headers = append(rec.Headers, sarama.RecordHeader{Key: []byte(k), Value: []byte(v)})
		}
	}
	for k, v := range msg.Metadata {
		if _, clash := projected[k]; clash || k == "" || k == kafka.UUIDHeaderKey {
			continue
		}
		rec.Headers = append(rec.Headers, sarama.RecordHeader{Key: []byte(k), Value: []byte(v)})
	}
	if m.PartitionKey != nil {
		key, err := m.PartitionKey(topic, msg)
		if err != nil {
			return nil, fmt.Errorf("kafkamarshal: partition key of %s: %w", msg.UUID, err)
		}
		rec.Key = sarama.StringEncoder(key)
	}
	return rec, nil
}

// Unmarshal builds the Watermill message for a record: every header as
// metadata (the Watermill UUID header excepted), attempts reconciled with
// bq-attempts as the package documentation says. It never fails.
func (m Marshaler) Unmarshal(rec *sarama.ConsumerMessage) (*message.Message, error) {
	md := make(message.Metadata, len(rec.Headers))
	var watermillUUID string
	for _, h := range rec.Headers {
		if h == nil {
			continue
		}
		if string(h.Key) == kafka.UUIDHeaderKey {
			watermillUUID = string(h.Value)
			continue
		}
		md[string(h.Key)] = string(h.Value)
	}
	payload := Reconcile(rec.Value, md)
	id := md[HeaderMessageID]
	if id == "" {
		id = watermillUUID
	}
	if id == "" {
		if ident, err := envelope.ReadIdentity(payload); err == nil {
			id = ident.ID
		}
	}
	if id == "" {
		id = uuid.NewString()
	}
	msg := message.NewMessage(id, payload)
	msg.Metadata = md
	return msg, nil
}

// Reconcile returns the envelope body with its attempts set to the
// bq-attempts value of headers, which is authoritative when present and a
// whole number ≥ 0 (even when lower than the body's). It returns body
// itself when the header is absent or unusable, the counts agree, or body is
// not an envelope.
func Reconcile(body []byte, headers map[string]string) []byte {
	raw, ok := headers[HeaderAttempts]
	if !ok {
		return body
	}
	n, err := strconv.Atoi(raw)
	if err != nil || n < 0 {
		return body
	}
	e, err := envelope.Parse(body)
	if err != nil || e.Attempts == n {
		return body
	}
	e.Attempts = n
	out, err := e.Marshal()
	if err != nil {
		return body
	}
	return out
}
