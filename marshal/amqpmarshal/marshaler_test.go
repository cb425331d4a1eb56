package amqpmarshal_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/marshal/amqpmarshal"
	"github.com/babelqueue/watermill-idempotency/testkit/conformance"
)

// projection is the rabbitmq.property_projection block of the vendored
// conformance manifest.
type projection struct {
	EnvelopeFile string            `json:"envelope_file"`
	Properties   map[string]string `json:"properties"`
	Headers      map[string]any    `json:"headers"`
}

func loadProjection(t *testing.T) projection {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(conformance.Dir(), "manifest.json"))
	if err != nil {
		t.Fatal(err)
	}
	var m struct {
		RabbitMQ struct {
			PropertyProjection projection `json:"property_projection"`
		} `json:"rabbitmq"`
	}
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	p := m.RabbitMQ.PropertyProjection
	if p.EnvelopeFile == "" || len(p.Properties) == 0 || len(p.Headers) == 0 {
		t.Fatal("the manifest has no rabbitmq.property_projection block")
	}
	return p
}

// TestConformancePropertyProjection publishes the manifest's envelope and
// checks every property and native-typed header it lists, and that the body
// is byte-identical.
func TestConformancePropertyProjection(t *testing.T) {
	p := loadProjection(t)
	body := conformance.Fixture(t, strings.TrimPrefix(p.EnvelopeFile, "fixtures/"))
	msg := message.NewMessage("watermill-uuid", body)
	msg.Metadata.Set("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
	pub, err := amqpmarshal.Marshaler{}.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{
		"type": pub.Type, "correlation_id": pub.CorrelationId, "message_id": pub.MessageId,
		"app_id": pub.AppId, "content_type": pub.ContentType,
	}
	for name, want := range p.Properties {
		if got[name] != want {
			t.Errorf("property %s = %q, want %q", name, got[name], want)
		}
	}
	for name, want := range p.Headers {
		v, ok := pub.Headers[name]
		switch want := want.(type) {
		case float64: // a JSON number: the header must be an AMQP integer
			n, isInt := v.(int32)
			if !ok || !isInt || float64(n) != want {
				t.Errorf("header %s = %#v, want the integer %v", name, v, want)
			}
		case string:
			if v != want {
				t.Errorf("header %s = %#v, want %q", name, v, want)
			}
		default:
			t.Fatalf("manifest header %s has an unexpected type %T", name, want)
		}
	}
	if string(pub.Body) != string(body) {
		t.Errorf("body changed:\n got %s\nwant %s", pub.Body, body)
	}
	if pub.DeliveryMode != amqp.Persistent {
		t.Errorf("delivery mode %d, want persistent", pub.DeliveryMode)
	}
	if pub.Headers["traceparent"] != msg.Metadata.Get("traceparent") {
		t.Errorf("traceparent header %v", pub.Headers["traceparent"])
	}
	if err := pub.Headers.Validate(); err != nil {
		t.Errorf("headers are not a valid AMQP table: %v", err)
	}
}

// TestContractHeadersWinAClash: metadata named like a contract header (say
// a stale x-attempts kept from an earlier hop) never overrides the value
// projected from the body.
func TestContractHeadersWinAClash(t *testing.T) {
	e, err := envelope.New("urn:babel:orders:created", map[string]int{"order": 1})
	if err != nil {
		t.Fatal(err)
	}
	e.Attempts = 2
	body, _ := e.Marshal()
	msg := message.NewMessage(e.Meta.ID, body)
	msg.Metadata.Set(amqpmarshal.HeaderAttempts, "7")
	msg.Metadata.Set(amqpmarshal.HeaderSchemaVersion, "9")
	msg.Metadata.Set(amqpmarshal.HeaderSourceLang, "php")
	msg.Metadata.Set(envelope.MetadataMessageID, "stale-id")
	pub, _ := amqpmarshal.Marshaler{}.Marshal(msg)
	if pub.Headers[amqpmarshal.HeaderAttempts] != int32(2) || pub.Headers[amqpmarshal.HeaderSchemaVersion] != int32(1) ||
		pub.Headers[amqpmarshal.HeaderSourceLang] != "go" {
		t.Fatalf("headers %v", pub.Headers)
	}
	if _, ok := pub.Headers[envelope.MetadataMessageID]; ok || pub.MessageId != e.Meta.ID {
		t.Fatalf("message_id %q, headers %v", pub.MessageId, pub.Headers)
	}
}

// sdkDelivery is a delivery as the BabelQueue SDKs put it on the wire:
// native integer headers, a traceparent, the identity in the properties.
func sdkDelivery(t *testing.T) (amqp.Delivery, envelope.Envelope) {
	t.Helper()
	e, err := envelope.New("urn:babel:orders:created", map[string]any{"order": 1042}, envelope.WithQueue("orders"))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := e.Marshal()
	return amqp.Delivery{
		Body: body, Type: e.Job, CorrelationId: e.TraceID, MessageId: e.Meta.ID,
		AppId: amqpmarshal.AppID, ContentType: amqpmarshal.ContentType, DeliveryMode: amqp.Persistent,
		Headers: amqp.Table{
			"x-attempts": int32(0), "x-schema-version": int64(1), "x-source-lang": "python",
			"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
			"x-flag":      true, "x-ratio": 0.5, "x-void": nil, "x-bytes": []byte("raw"),
		},
	}, e
}

func TestUnmarshalSDKMessage(t *testing.T) {
	d, e := sdkDelivery(t)
	if _, err := (wamqp.DefaultMarshaler{}).Unmarshal(d); err == nil {
		t.Fatal("watermill-amqp's stock marshaler accepts native integer headers now; the package doc is out of date")
	}
	msg, err := amqpmarshal.Marshaler{}.Unmarshal(d)
	if err != nil {
		t.Fatal(err)
	}
	if msg.UUID != e.Meta.ID || string(msg.Payload) != string(d.Body) {
		t.Fatalf("uuid %q payload %s", msg.UUID, msg.Payload)
	}
	want := map[string]string{
		envelope.MetadataMessageID: e.Meta.ID, envelope.MetadataTraceID: e.TraceID, envelope.MetadataJob: e.Job,
		"x-attempts": "0", "x-schema-version": "1", "x-source-lang": "python",
		"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		"x-flag":      "true", "x-ratio": "0.5", "x-bytes": "raw",
	}
	for k, v := range want {
		if got := msg.Metadata.Get(k); got != v {
			t.Errorf("metadata %s = %q, want %q", k, got, v)
		}
	}
	if _, ok := msg.Metadata["x-void"]; ok || len(msg.Metadata) != len(want) {
		t.Errorf("metadata %v", msg.Metadata)
	}
}

// TestUnmarshalNeverFails: whatever the body and the headers, the delivery
// becomes a message with a non-empty UUID.
func TestUnmarshalNeverFails(t *testing.T) {
	for name, d := range map[string]amqp.Delivery{
		"empty":          {},
		"not JSON":       {Body: []byte("\x00\xffnot json"), Headers: amqp.Table{"x-attempts": int64(3), "x-nested": amqp.Table{"a": int16(1)}, "x-array": []any{int8(1), "b"}, "x-dec": amqp.Decimal{Scale: 2, Value: 1234}, "x-time": time.Unix(0, 0)}},
		"body identity":  {Body: []byte(`{"job":"urn:x","trace_id":"t","data":{},"meta":{"id":"from-body","schema_version":1}}`)},
		"watermill uuid": {Body: []byte("x"), Headers: amqp.Table{wamqp.DefaultMessageUUIDHeaderKey: "wm-uuid"}},
	} {
		msg, err := amqpmarshal.Marshaler{}.Unmarshal(d)
		if err != nil || msg.UUID == "" {
			t.Fatalf("%s: uuid %q, err %v", name, msg.UUID, err)
		}
		switch name {
		case "body identity":
			if msg.UUID != "from-body" {
				t.Errorf("%s: uuid %q", name, msg.UUID)
			}
		case "watermill uuid":
			if msg.UUID != "wm-uuid" || msg.Metadata.Get(wamqp.DefaultMessageUUIDHeaderKey) != "" {
				t.Errorf("%s: uuid %q metadata %v", name, msg.UUID, msg.Metadata)
			}
		case "not JSON":
			if msg.Metadata.Get("x-attempts") != "3" || msg.Metadata.Get("x-time") != "1970-01-01T00:00:00Z" {
				t.Errorf("%s: metadata %v", name, msg.Metadata)
			}
		}
	}
}

// TestRoundTrip: a message published and consumed through the marshaler
// keeps its UUID, payload and metadata, envelope or not.
func TestRoundTrip(t *testing.T) {
	e, _ := envelope.New("urn:babel:orders:created", nil)
	body, _ := e.Marshal()
	for _, msg := range []*message.Message{message.NewMessage(e.Meta.ID, body), message.NewMessage("plain-uuid", []byte("plain payload"))} {
		msg.Metadata.Set("traceparent", "00-abc-def-01")
		msg.Metadata.Set("tenant", "eu")
		pub, _ := amqpmarshal.Marshaler{}.Marshal(msg)
		got, _ := amqpmarshal.Marshaler{}.Unmarshal(amqp.Delivery{
			Body: pub.Body, Headers: pub.Headers, MessageId: pub.MessageId, Type: pub.Type, CorrelationId: pub.CorrelationId,
		})
		if got.UUID != msg.UUID || string(got.Payload) != string(msg.Payload) ||
			got.Metadata.Get("traceparent") != "00-abc-def-01" || got.Metadata.Get("tenant") != "eu" {
			t.Fatalf("sent %s %s %v, got %s %s %v", msg.UUID, msg.Payload, msg.Metadata, got.UUID, got.Payload, got.Metadata)
		}
	}
}
