package idempotency_test

import (
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// Messages that are not BabelQueue envelopes are keyed on a metadata field
// their producer sets; a message without it runs undeduplicated.
func ExampleWithKeySource() {
	guard := idempotency.Middleware(memstore.New(),
		idempotency.WithKeySource(idempotency.KeyFromMetadata("Idempotency-Key")))
	charge := guard(func(msg *message.Message) ([]*message.Message, error) {
		fmt.Printf("charging %s (key %q)\n", msg.Payload, msg.Metadata.Get("Idempotency-Key"))
		return nil, nil
	})

	for _, key := range []string{"pay-1", "pay-1", "pay-2", ""} {
		// Each publish is a new Watermill message with its own UUID.
		msg := message.NewMessage(watermill.NewUUID(), []byte(`{"amount_cents":1299}`))
		if key != "" {
			msg.Metadata.Set("Idempotency-Key", key)
		}
		if _, err := charge(msg); err != nil {
			fmt.Println("error:", err)
		}
	}
	// Output:
	// charging {"amount_cents":1299} (key "pay-1")
	// charging {"amount_cents":1299} (key "pay-2")
	// charging {"amount_cents":1299} (key "")
}

// Keyed on the Watermill UUID, a redelivered message is skipped, and the
// same UUID carrying other content is a conflict.
func ExampleKeyFromUUID() {
	guard := idempotency.Middleware(memstore.New(), idempotency.WithKeySource(idempotency.KeyFromUUID()))
	h := guard(func(msg *message.Message) ([]*message.Message, error) {
		fmt.Printf("handled %s\n", msg.Payload)
		return nil, nil
	})
	for _, payload := range []string{`{"n":1}`, `{ "n" : 1 }`, `{"n":2}`} {
		if _, err := h(message.NewMessage("c0ffee00-0000-4000-8000-000000000001", []byte(payload))); err != nil {
			fmt.Println("rejected as a conflict:", errors.Is(err, idempotency.ErrConflict))
		}
	}
	// Output:
	// handled {"n":1}
	// rejected as a conflict: true
}
