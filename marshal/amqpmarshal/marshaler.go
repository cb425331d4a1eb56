package amqpmarshal

import (
	"fmt"
	"math"
	"strconv"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/babelqueue/watermill-idempotency/envelope"
)

// Values of the binding's properties and the names of its contract headers.
const (
	// AppID is the app_id property of every message the binding publishes.
	AppID = "babelqueue"
	// ContentType is the content_type property of every message.
	ContentType = "application/json"
	// HeaderAttempts carries the envelope's attempts, an AMQP integer.
	HeaderAttempts = "x-attempts"
	// HeaderSchemaVersion carries meta.schema_version, an AMQP integer.
	HeaderSchemaVersion = "x-schema-version"
	// HeaderSourceLang carries meta.lang.
	HeaderSourceLang = "x-source-lang"
)

// Marshaler converts between Watermill messages and the BabelQueue RabbitMQ
// binding. It implements watermill-amqp's Marshaler; the zero value is ready
// to use. See the package documentation for the mapping.
type Marshaler struct {
	// NotPersistentDeliveryMode publishes with transient delivery instead of
	// persistent. The SDKs publish persistent messages.
	NotPersistentDeliveryMode bool
}

var _ wamqp.Marshaler = Marshaler{}

// Marshal builds the AMQP publishing for msg. When msg's payload is a valid
// envelope, the properties and contract headers are projected from it and
// msg's metadata rides as string headers beside them (the contract headers
// win a clash; the bq-message-id, bq-trace-id and bq-job metadata are not
// written, the properties carry them). Any other payload is published with
// message_id = msg.UUID and the metadata as headers. The body is the payload,
// unchanged. It never fails.
func (m Marshaler) Marshal(msg *message.Message) (amqp.Publishing, error) {
	p := amqp.Publishing{
		ContentType: ContentType,
		AppId:       AppID,
		Body:        msg.Payload,
		MessageId:   msg.UUID,
	}
	if !m.NotPersistentDeliveryMode {
		p.DeliveryMode = amqp.Persistent
	}
	e, err := envelope.Parse(msg.Payload)
	isEnvelope := err == nil
	headers := make(amqp.Table, len(msg.Metadata)+3)
	for k, v := range msg.Metadata {
		if k == "" || (isEnvelope && (k == envelope.MetadataMessageID || k == envelope.MetadataTraceID || k == envelope.MetadataJob)) {
			continue
		}
		headers[k] = v
	}
	if isEnvelope {
		p.Type = e.Job
		p.CorrelationId = e.TraceID
		p.MessageId = e.Meta.ID
		if e.Meta.CreatedAt > 0 {
			p.Timestamp = time.UnixMilli(e.Meta.CreatedAt).UTC()
		}
		headers[HeaderAttempts] = amqpInt(int64(e.Attempts))
		headers[HeaderSchemaVersion] = amqpInt(int64(e.Meta.SchemaVersion))
		if e.Meta.Lang != "" {
			headers[HeaderSourceLang] = e.Meta.Lang
		} else {
			delete(headers, HeaderSourceLang)
		}
	}
	if len(headers) > 0 {
		p.Headers = headers
	}
	return p, nil
}

// Unmarshal builds the Watermill message for a delivery. The payload is the
// body, unchanged. The UUID is message_id, else the header watermill-amqp's
// own marshaler writes, else the body's meta.id, else a fresh UUID. Every
// header becomes metadata, whatever its AMQP type (see [HeaderString]); the
// message_id, correlation_id and type properties become the bq-message-id,
// bq-trace-id and bq-job metadata. It never fails, so that no delivery is
// requeued before a handler has seen it.
func (m Marshaler) Unmarshal(d amqp.Delivery) (*message.Message, error) {
	id := d.MessageId
	if id == "" {
		id, _ = d.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
	}
	if id == "" {
		if ident, err := envelope.ReadIdentity(d.Body); err == nil {
			id = ident.ID
		}
	}
	if id == "" {
		id = uuid.NewString()
	}
	msg := message.NewMessage(id, d.Body)
	msg.Metadata = make(message.Metadata, len(d.Headers)+3)
	for k, v := range d.Headers {
		if k == wamqp.DefaultMessageUUIDHeaderKey {
			continue
		}
		if s, ok := HeaderString(v); ok {
			msg.Metadata[k] = s
		}
	}
	if d.MessageId != "" {
		msg.Metadata[envelope.MetadataMessageID] = d.MessageId
	}
	if d.CorrelationId != "" {
		msg.Metadata[envelope.MetadataTraceID] = d.CorrelationId
	}
	if d.Type != "" {
		msg.Metadata[envelope.MetadataJob] = d.Type
	}
	return msg, nil
}

// HeaderString returns the metadata string for an AMQP header value: a
// string as it is, a byte array as text, an integer in decimal, a float in
// its shortest form, a boolean as "true" or "false", a timestamp in RFC 3339,
// anything else (decimals, arrays, nested tables) as Go prints it. ok is
// false for a void (nil) value, which is left out.
func HeaderString(v any) (s string, ok bool) {
	switch v := v.(type) {
	case nil:
		return "", false
	case string:
		return v, true
	case []byte:
		return string(v), true
	case int8:
		return strconv.FormatInt(int64(v), 10), true
	case int16:
		return strconv.FormatInt(int64(v), 10), true
	case int32:
		return strconv.FormatInt(int64(v), 10), true
	case int64:
		return strconv.FormatInt(v, 10), true
	case int:
		return strconv.Itoa(v), true
	case uint8:
		return strconv.FormatUint(uint64(v), 10), true
	case uint16:
		return strconv.FormatUint(uint64(v), 10), true
	case uint32:
		return strconv.FormatUint(uint64(v), 10), true
	case float32:
		return strconv.FormatFloat(float64(v), 'g', -1, 32), true
	case float64:
		return strconv.FormatFloat(v, 'g', -1, 64), true
	case bool:
		return strconv.FormatBool(v), true
	case time.Time:
		return v.UTC().Format(time.RFC3339), true
	}
	return fmt.Sprint(v), true
}

// amqpInt is n as the narrowest AMQP integer that holds it: a 32-bit one,
// as the SDKs send, or a 64-bit one rather than a wrapped value that would
// disagree with the body.
func amqpInt(n int64) any {
	if n >= math.MinInt32 && n <= math.MaxInt32 {
		return int32(n)
	}
	return n
}
