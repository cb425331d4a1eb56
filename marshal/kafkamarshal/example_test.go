package kafkamarshal_test

import (
	"fmt"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/marshal/kafkamarshal"
)

// A record carries the envelope as its value and the bq- headers as
// strings; its timestamp is meta.created_at.
func ExampleMarshaler_Marshal() {
	e, _ := envelope.New("urn:babel:orders:created", map[string]int{"order": 1042},
		envelope.WithID("f1e2d3c4-b5a6-4789-90ab-cdef01234567"),
		envelope.WithTraceID("7b3f9c2a-e41d-4f88-9b2a-1c0d5e6f7a8b"),
		envelope.WithCreatedAt(time.UnixMilli(1749132727000)))
	body, _ := e.Marshal()
	rec, _ := kafkamarshal.Marshaler{}.Marshal("orders", message.NewMessage(e.Meta.ID, body))
	for _, h := range rec.Headers {
		fmt.Printf("%s: %s\n", h.Key, h.Value)
	}
	fmt.Println("timestamp:", rec.Timestamp.UnixMilli())
	// Output:
	// bq-job: urn:babel:orders:created
	// bq-trace-id: 7b3f9c2a-e41d-4f88-9b2a-1c0d5e6f7a8b
	// bq-message-id: f1e2d3c4-b5a6-4789-90ab-cdef01234567
	// bq-schema-version: 1
	// bq-source-lang: go
	// bq-attempts: 0
	// timestamp: 1749132727000
}

// On consume, the bq-attempts header is the retry counter: the payload the
// handler sees says so, even where the body said otherwise.
func ExampleMarshaler_Unmarshal() {
	body := []byte(`{"job":"urn:babel:orders:created","trace_id":"t-1","data":{},"meta":{"id":"m-1","lang":"java","schema_version":1},"attempts":0}`)
	msg, _ := kafkamarshal.Marshaler{}.Unmarshal(&sarama.ConsumerMessage{Value: body, Headers: []*sarama.RecordHeader{
		{Key: []byte("bq-message-id"), Value: []byte("m-1")}, {Key: []byte("bq-attempts"), Value: []byte("2")},
	}})
	e, _ := envelope.Parse(msg.Payload)
	fmt.Println(msg.UUID, "attempts:", e.Attempts)
	// Output:
	// m-1 attempts: 2
}
