package redrive_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/redrive"
)

// Once the payment gateway is fixed, the messages it failed go back to
// their queue: dead_letter block stripped, attempts reset, meta.id kept (so
// the idempotency guard still skips any that did take effect). The message
// dead-lettered for another reason stays on the dead-letter topic.
func ExampleRun() {
	pubSub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer pubSub.Close()
	deadLetter := func(orderID int, reason string) {
		id := fmt.Sprintf("charge-%d", orderID)
		e, _ := envelope.New("urn:babel:payments:charge", map[string]any{"order_id": orderID},
			envelope.WithID(id), envelope.WithQueue("orders"), envelope.WithTraceID("trace-"+id),
			envelope.WithCreatedAt(time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)))
		e.Attempts = 3
		e.DeadLetter = &envelope.DeadLetter{Reason: reason, OriginalQueue: "orders", Attempts: 3, Lang: "go"}
		payload, _ := e.Marshal()
		if err := pubSub.Publish("orders.dlq", message.NewMessage(watermill.NewUUID(), payload)); err != nil {
			panic(err)
		}
	}
	deadLetter(1042, envelope.ReasonFailed)
	deadLetter(1043, envelope.ReasonUnknownURN)
	deadLetter(1044, envelope.ReasonFailed)

	// The run reads orders.dlq from pubSub and publishes on out: GoChannel
	// replays its messages in no set order, so a message put back on the
	// topic the run reads could come round before the others were read.
	// Against a broker, pass the same pub/sub's subscriber and publisher.
	out := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer out.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	report, err := redrive.Run(ctx, pubSub, out, "orders.dlq",
		redrive.WithReasons(envelope.ReasonFailed),
		redrive.WithIdleTimeout(200*time.Millisecond))
	if err != nil {
		panic(err)
	}
	fmt.Println("moved:", report.Moved, "put back:", report.PutBack)
	entries := report.Entries // in the order the messages were handled
	slices.SortFunc(entries, func(a, b redrive.Entry) int { return strings.Compare(a.ID, b.ID) })
	for _, e := range entries {
		fmt.Println(e.ID, e.Reason, "moved:", e.Moved)
	}

	orders, err := out.Subscribe(ctx, "orders")
	if err != nil {
		panic(err)
	}
	var redriven []string
	for range report.Moved {
		msg := <-orders
		msg.Ack()
		redriven = append(redriven, string(msg.Payload))
	}
	slices.Sort(redriven)
	for _, payload := range redriven {
		fmt.Println(payload)
	}
	// Output:
	// moved: 2 put back: 1
	// charge-1042 failed moved: true
	// charge-1043 unknown_urn moved: false
	// charge-1044 failed moved: true
	// {"job":"urn:babel:payments:charge","trace_id":"trace-charge-1042","data":{"order_id":1042},"meta":{"id":"charge-1042","queue":"orders","lang":"go","schema_version":1,"created_at":1767323045000},"attempts":0}
	// {"job":"urn:babel:payments:charge","trace_id":"trace-charge-1044","data":{"order_id":1044},"meta":{"id":"charge-1044","queue":"orders","lang":"go","schema_version":1,"created_at":1767323045000},"attempts":0}
}
