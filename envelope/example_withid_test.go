package envelope_test

import (
	"errors"
	"fmt"

	"github.com/babelqueue/watermill-idempotency/envelope"
)

// An empty business key is an error rather than a random meta.id, which
// would make every retry of the message a new message.
func ExampleWithID() {
	orderKey := "" // a bug upstream: the key came out empty
	_, err := envelope.New("urn:babel:orders:placed", map[string]any{"order_id": 1042}, envelope.WithID(orderKey))
	fmt.Println(errors.Is(err, envelope.ErrInvalid))

	e, _ := envelope.New("urn:babel:orders:placed", map[string]any{"order_id": 1042}, envelope.WithID("order-1042-placed"))
	fmt.Println(e.Meta.ID)
	// Output:
	// true
	// order-1042-placed
}
