package idempotency_test

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func noop(*message.Message) ([]*message.Message, error) { return nil, nil }

// guard is one of the guards the in-memory benchmarks compare (see guards):
// the kit on memstore, plain and under WithClaim, and Watermill's
// Deduplicator. Each call of h builds a fresh one, with an empty store.
type guard struct {
	name string
	h    func() message.HandlerFunc
}

func guards() []guard {
	return []guard{
		{"kit-memstore-seenset", func() message.HandlerFunc {
			return idempotency.Middleware(memstore.New(memstore.WithTTL(time.Hour)), idempotency.WithoutClaim())(noop)
		}},
		{"kit-memstore-claim", func() message.HandlerFunc { // the default
			return idempotency.Middleware(memstore.New(memstore.WithTTL(time.Hour)))(noop)
		}},
		{"watermill-deduplicator", func() message.HandlerFunc { return (&middleware.Deduplicator{}).Middleware(noop) }},
	}
}

// plainDecode is what a consumer without this kit does at least once per
// message: decode the envelope with encoding/json.
type plainEnvelope struct {
	Job     string          `json:"job"`
	TraceID string          `json:"trace_id"`
	Data    json.RawMessage `json:"data"`
	Meta    struct {
		ID            string `json:"id"`
		Queue         string `json:"queue"`
		Lang          string `json:"lang"`
		SchemaVersion int    `json:"schema_version"`
		CreatedAt     int64  `json:"created_at"`
	} `json:"meta"`
	Attempts int `json:"attempts"`
}

// BenchmarkFirstSeen measures the whole decision for a message never seen
// before: bytes in, identity read, store checked and updated.
func BenchmarkFirstSeen(b *testing.B) {
	env := testenv.NewEnvelope(b)
	b.Logf("envelope: %d bytes", len(env.Payload))
	run := func(b *testing.B, h message.HandlerFunc) {
		msg := message.NewMessage("bench", env.Payload)
		b.ReportAllocs()
		var n uint64
		for b.Loop() {
			n++
			env.SetID(n)
			if _, err := h(msg); err != nil {
				b.Fatal(err)
			}
		}
	}
	for _, g := range guards() {
		b.Run(g.name, func(b *testing.B) { run(b, g.h()) })
	}
	b.Run("encoding-json-decode", func(b *testing.B) {
		b.ReportAllocs()
		var n uint64
		for b.Loop() {
			n++
			env.SetID(n)
			var e plainEnvelope
			if err := json.Unmarshal(env.Payload, &e); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkDuplicate measures a redelivery of a remembered message.
func BenchmarkDuplicate(b *testing.B) {
	payload := testenv.NewEnvelope(b).Payload
	run := func(b *testing.B, h message.HandlerFunc) {
		msg := message.NewMessage("bench", payload)
		if _, err := h(msg); err != nil {
			b.Fatal(err)
		}
		b.ReportAllocs()
		for b.Loop() {
			if _, err := h(msg); err != nil {
				b.Fatal(err)
			}
		}
	}
	for _, g := range guards() {
		b.Run(g.name, func(b *testing.B) { run(b, g.h()) })
	}
}

// BenchmarkWronglyDropped pushes 2,000,000 distinct messages through each
// guard and reports how many it dropped as duplicates although none is. The
// messages are realistic: same shape, each with a fresh random meta.id,
// trace_id and created_at, as a producer makes them. One iteration is the
// whole run; its time includes building the messages.
func BenchmarkWronglyDropped(b *testing.B) {
	const messages = 2_000_000
	run := func(b *testing.B, mw message.HandlerMiddleware) {
		for b.Loop() {
			ran := 0
			h := mw(func(*message.Message) ([]*message.Message, error) { ran++; return nil, nil })
			for range messages {
				e, err := envelope.New("urn:babel:orders:created", json.RawMessage(`{"order_id":1042,"customer_id":"c-8812",`+
					`"amount_cents":129900,"currency":"EUR","items":[{"qty":2,"sku":"SKU-1"},{"qty":1,"sku":"SKU-9"}]}`),
					envelope.WithQueue("orders"))
				if err != nil {
					b.Fatal(err)
				}
				payload, _ := e.Marshal()
				if _, err := h(message.NewMessage("bench", payload)); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(messages-ran), "dropped")
			b.ReportMetric(100*float64(messages-ran)/messages, "%dropped")
		}
	}
	b.Run("kit-memstore", func(b *testing.B) {
		run(b, idempotency.Middleware(memstore.New(memstore.WithTTL(time.Hour))))
	})
	b.Run("watermill-deduplicator", func(b *testing.B) {
		run(b, (&middleware.Deduplicator{}).Middleware)
	})
}

// TestAllocationsPerDelivery holds the hot paths to their allocation
// budget beyond the handler's own: at most 10 for a first delivery, which
// takes a claim and keeps it alive while the handler runs (the lease, its
// cancellable context, its timer and the renewal: 6), and 4 for a
// duplicate.
func TestAllocationsPerDelivery(t *testing.T) {
	env := testenv.NewEnvelope(t)
	h := idempotency.Middleware(memstore.New(memstore.WithTTL(time.Hour)))(noop)
	msg := message.NewMessage("bench", env.Payload)
	var n uint64
	first := testing.AllocsPerRun(1000, func() {
		n++
		env.SetID(n)
		_, _ = h(msg)
	})
	dup := testing.AllocsPerRun(1000, func() { _, _ = h(msg) })
	if first > 10 || dup > 4 {
		t.Fatalf("allocations per delivery: first-seen %.1f, duplicate %.1f; budget 10 and 4", first, dup)
	}
	t.Logf("allocations per delivery: first-seen %.1f, duplicate %.1f", first, dup)
}
