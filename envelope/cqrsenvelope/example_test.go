package cqrsenvelope_test

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/envelope/cqrsenvelope"
)

// ShipOrder is a command of the example.
type ShipOrder struct {
	OrderID string `json:"order_id"`
}

// Marshal puts a command into an envelope any BabelQueue consumer reads.
func ExampleMarshaler_Marshal() {
	m := cqrsenvelope.Marshaler{
		URN:   func(any) string { return "urn:babel:orders:ship" },
		ID:    func(v any) string { return "ship-" + v.(*ShipOrder).OrderID },
		Queue: func(string) string { return "orders.commands" },
	}
	msg, err := m.Marshal(&ShipOrder{OrderID: "1042"})
	if err != nil {
		panic(err)
	}
	e, _ := envelope.Parse(msg.Payload)
	fmt.Println("job:", e.Job)
	fmt.Println("meta.id:", e.Meta.ID, "= UUID:", msg.UUID == e.Meta.ID)
	fmt.Println("data:", string(e.Data))
	fmt.Println("queue:", e.Meta.Queue, "lang:", e.Meta.Lang, "schema:", e.Meta.SchemaVersion)
	// Output:
	// job: urn:babel:orders:ship
	// meta.id: ship-1042 = UUID: true
	// data: {"order_id":"1042"}
	// queue: orders.commands lang: go schema: 1
}

// A command another SDK sent (here the "urn" alias and fields Go does not
// know) is routed by its URN and decoded into the Go command.
func ExampleMarshaler_Unmarshal() {
	m := cqrsenvelope.Marshaler{URN: func(any) string { return "urn:babel:orders:ship" }}
	fromPHP := message.NewMessage("u-1", []byte(`{"urn":"urn:babel:orders:ship","trace_id":"t-1",
		"data":{"order_id":"1042","carrier":"dhl"},
		"meta":{"id":"m-1","lang":"php","schema_version":1,"created_at":1764500000000},"attempts":0}`))

	fmt.Println("routes to the Go handler:", m.NameFromMessage(fromPHP) == m.Name(&ShipOrder{}))
	var cmd ShipOrder
	if err := m.Unmarshal(fromPHP, &cmd); err != nil {
		panic(err)
	}
	fmt.Printf("%+v\n", cmd)
	// Output:
	// routes to the Go handler: true
	// {OrderID:1042}
}

// A command sent while handling a message takes the handled message's
// trace_id and an id derived from its meta.id, the same on every retry.
func ExampleMarshaler_Continue() {
	m := cqrsenvelope.Marshaler{}
	handled, _ := envelope.New("urn:babel:orders:placed", map[string]any{"order_id": "1042"},
		envelope.WithID("order-1042-placed"), envelope.WithTraceID("trace-1"))
	payload, _ := handled.Marshal()
	// The context a CQRS handler gets.
	ctx := cqrs.CtxWithOriginalMessage(context.Background(), message.NewMessage("u-1", payload))

	var ids []string
	for range 2 { // the handler runs twice: a retry
		msg, _ := m.Marshal(&ShipOrder{OrderID: "1042"})
		msg.SetContext(ctx)
		if err := m.Continue(msg, &ShipOrder{OrderID: "1042"}); err != nil {
			panic(err)
		}
		e, _ := envelope.Parse(msg.Payload)
		ids = append(ids, e.Meta.ID)
		fmt.Println("trace_id:", e.TraceID)
	}
	fmt.Println("same meta.id on the retry:", ids[0] == ids[1])
	// Output:
	// trace_id: trace-1
	// trace_id: trace-1
	// same meta.id on the retry: true
}

// DefaultURN names a type by its package and name.
func ExampleDefaultURN() {
	fmt.Println(cqrsenvelope.DefaultURN(&ShipOrder{}))
	// Output:
	// urn:babel:cqrsenvelope_test:ship_order
}
