package amqpmarshal_test

import (
	"fmt"
	"sort"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/marshal/amqpmarshal"
)

func printTable(t amqp.Table) {
	keys := make([]string, 0, len(t))
	for k := range t {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Printf("  %s: %v (%T)\n", k, t[k], t[k])
	}
}

// A message published through the marshaler carries the properties and
// native-typed headers BabelQueue consumers in every language read.
func ExampleMarshaler_Marshal() {
	e, _ := envelope.New("urn:babel:orders:created", map[string]int{"order": 1042},
		envelope.WithID("f1e2d3c4-b5a6-4789-90ab-cdef01234567"),
		envelope.WithTraceID("7b3f9c2a-e41d-4f88-9b2a-1c0d5e6f7a8b"),
		envelope.WithQueue("orders"), envelope.WithCreatedAt(time.UnixMilli(1749132727000)))
	body, _ := e.Marshal()
	msg := message.NewMessage(e.Meta.ID, body)
	msg.Metadata.Set("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")

	p, _ := amqpmarshal.Marshaler{}.Marshal(msg)
	fmt.Println("type:", p.Type)
	fmt.Println("correlation_id:", p.CorrelationId)
	fmt.Println("message_id:", p.MessageId)
	fmt.Println("app_id:", p.AppId, "content_type:", p.ContentType, "persistent:", p.DeliveryMode == amqp.Persistent)
	fmt.Println("headers:")
	printTable(p.Headers)
	fmt.Println("body unchanged:", string(p.Body) == string(body))
	// Output:
	// type: urn:babel:orders:created
	// correlation_id: 7b3f9c2a-e41d-4f88-9b2a-1c0d5e6f7a8b
	// message_id: f1e2d3c4-b5a6-4789-90ab-cdef01234567
	// app_id: babelqueue content_type: application/json persistent: true
	// headers:
	//   traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01 (string)
	//   x-attempts: 0 (int32)
	//   x-schema-version: 1 (int32)
	//   x-source-lang: go (string)
	// body unchanged: true
}

// A delivery published by a BabelQueue SDK (integer headers, identity in the
// properties) becomes a Watermill message whose UUID is meta.id.
func ExampleMarshaler_Unmarshal() {
	d := amqp.Delivery{
		MessageId: "f1e2d3c4-b5a6-4789-90ab-cdef01234567", Type: "urn:babel:orders:created",
		CorrelationId: "7b3f9c2a-e41d-4f88-9b2a-1c0d5e6f7a8b",
		Headers: amqp.Table{"x-attempts": int32(2), "x-schema-version": int32(1), "x-source-lang": "php",
			"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
		Body: []byte(`{"job":"urn:babel:orders:created","trace_id":"7b3f9c2a-e41d-4f88-9b2a-1c0d5e6f7a8b","data":{},"meta":{"id":"f1e2d3c4-b5a6-4789-90ab-cdef01234567","queue":"orders","lang":"php","schema_version":1,"created_at":1749132727000},"attempts":2}`),
	}
	msg, _ := amqpmarshal.Marshaler{}.Unmarshal(d)
	fmt.Println("uuid:", msg.UUID)
	keys := make([]string, 0, len(msg.Metadata))
	for k := range msg.Metadata {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Printf("%s: %s\n", k, msg.Metadata[k])
	}
	// Output:
	// uuid: f1e2d3c4-b5a6-4789-90ab-cdef01234567
	// bq-job: urn:babel:orders:created
	// bq-message-id: f1e2d3c4-b5a6-4789-90ab-cdef01234567
	// bq-trace-id: 7b3f9c2a-e41d-4f88-9b2a-1c0d5e6f7a8b
	// traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01
	// x-attempts: 2
	// x-schema-version: 1
	// x-source-lang: php
}

// NewConfig is the SDKs' topology: the topic is a durable queue on the
// default exchange, and the routing key is the queue's name.
func ExampleNewConfig() {
	c := amqpmarshal.NewConfig("amqp://guest:guest@localhost:5672/")
	fmt.Printf("queue %q durable=%v, exchange %q, routing key %q, confirms=%v\n",
		c.Queue.GenerateName("orders"), c.Queue.Durable, c.Exchange.GenerateName("orders"),
		c.Publish.GenerateRoutingKey("orders"), c.Publish.ConfirmDelivery)
	// Output:
	// queue "orders" durable=true, exchange "", routing key "orders", confirms=true
}
