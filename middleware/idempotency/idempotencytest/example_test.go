package idempotencytest_test

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency/idempotencytest"
)

// A payment delivered twice is charged once; a body that is not an
// envelope fails in the handler, is retried three times and dead-lettered.
// In a test, idempotencytest.New(t, handler) starts the harness and closes
// it when the test ends.
func Example() {
	charged := 0 // the handler runs one message at a time here: Deliver waits for each
	h, err := idempotencytest.Start(context.Background(), func(msg *message.Message) error {
		if _, err := envelope.Parse(msg.Payload); err != nil {
			return fmt.Errorf("unreadable payment: %w", err)
		}
		charged++
		return nil
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer h.Close()

	payment := idempotencytest.MustEnvelope("urn:babel:payments:requested",
		map[string]any{"order_id": "1042", "amount_cents": 1299}, envelope.WithID("payment-1042"))
	for _, r := range []idempotencytest.Result{
		h.Deliver(payment),
		h.Deliver(payment), // a redelivery
		h.Deliver([]byte("not an envelope")),
	} {
		fmt.Printf("%s: %d run(s)", r.Outcome, r.Runs)
		if r.DeadLetter != nil {
			fmt.Printf(", reason %s", r.DeadLetter.Metadata.Get(deadletter.MetadataReason))
		}
		fmt.Println()
	}
	fmt.Println("charged:", charged)
	// Output:
	// ran: 1 run(s)
	// skipped: 0 run(s)
	// dead_lettered: 4 run(s), reason poison
	// charged: 1
}
