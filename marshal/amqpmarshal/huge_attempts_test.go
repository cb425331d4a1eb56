package amqpmarshal_test

import (
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/marshal/amqpmarshal"
)

// TestHugeAttemptsAreNotTruncated: the x-attempts header mirrors the
// body's attempts as an AMQP integer. A count beyond 32 bits must keep its
// value (a wider integer), not wrap to another number or a negative one
// that disagrees with the body.
func TestHugeAttemptsAreNotTruncated(t *testing.T) {
	for _, attempts := range []int64{1 << 31, 1<<32 + 3, 1<<63 - 1} {
		body := fmt.Sprintf(`{"job":"urn:babel:orders:created","trace_id":"t-1","data":{},"meta":{"id":"m-1","schema_version":1},"attempts":%d}`, attempts)
		pub, err := amqpmarshal.Marshaler{}.Marshal(message.NewMessage("u", []byte(body)))
		if err != nil {
			t.Fatal(err)
		}
		var got int64
		switch v := pub.Headers[amqpmarshal.HeaderAttempts].(type) {
		case int32:
			got = int64(v)
		case int64:
			got = v
		default:
			t.Fatalf("attempts %d: x-attempts is %T", attempts, v)
		}
		if got != attempts {
			t.Errorf("attempts %d: x-attempts = %d", attempts, got)
		}
	}
}
