package idempotency_test

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
)

// A handler produces a child of the message it handles: the same parent
// always gives the same child id, and the parent's traceparent follows.
func ExampleNewChildMessage() {
	parentEnv, _ := envelope.New("urn:babel:orders:created", map[string]int{"order": 1042},
		envelope.WithID("f1e2d3c4-b5a6-4789-90ab-cdef01234567"), envelope.WithTraceID("7b3f9c2a-e41d-4f88-9b2a-1c0d5e6f7a8b"))
	body, _ := parentEnv.Marshal()
	parent := message.NewMessage(parentEnv.Meta.ID, body)
	parent.Metadata.Set("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
	parent.Metadata.Set("x-attempts", "3") // a transport header of the parent's hop: not inherited

	child, _ := idempotency.NewChildMessage(parent, "invoice", "urn:babel:invoices:requested", map[string]int{"order": 1042})
	fmt.Println("uuid:", child.UUID)
	fmt.Println("trace_id:", child.Metadata.Get(envelope.MetadataTraceID))
	fmt.Println("traceparent:", child.Metadata.Get("traceparent"))
	fmt.Printf("x-attempts: %q\n", child.Metadata.Get("x-attempts"))
	// Output:
	// uuid: 623b74c7-fc0f-566a-ab82-dbd2f62d8aa3
	// trace_id: 7b3f9c2a-e41d-4f88-9b2a-1c0d5e6f7a8b
	// traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01
	// x-attempts: ""
}
