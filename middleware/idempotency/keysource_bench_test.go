package idempotency_test

import (
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// BenchmarkKeySource measures the decision for a first-seen plain message
// keyed on its UUID, beside the same payload keyed on its envelope meta.id:
// what reading the key from the message and fingerprinting the whole
// payload cost instead of reading meta.id and fingerprinting job and data.
func BenchmarkKeySource(b *testing.B) {
	env := testenv.NewEnvelope(b)
	for _, c := range []struct {
		name string
		opts []idempotency.Option
	}{
		{"envelope-meta-id", nil},
		{"uuid", []idempotency.Option{idempotency.WithKeySource(idempotency.KeyFromUUID())}},
		{"metadata", []idempotency.Option{idempotency.WithKeySource(idempotency.KeyFromMetadata("Idempotency-Key"))}},
	} {
		b.Run(c.name, func(b *testing.B) {
			h := idempotency.Middleware(memstore.New(memstore.WithTTL(time.Hour)), c.opts...)(noop)
			msg := message.NewMessage("", env.Payload)
			b.ReportAllocs()
			var n uint64
			for b.Loop() {
				n++
				env.SetID(n)
				key := strconv.FormatUint(n, 10)
				msg.UUID = key
				msg.Metadata.Set("Idempotency-Key", key)
				if _, err := h(msg); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
