package idempotency_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// TestDeliveryInTheHandlersContext: in every mode the handler finds the
// message's identity and scoped key in its context, and the message's own
// context is back once the middleware returns; a message handled without
// identity carries none.
func TestDeliveryInTheHandlersContext(t *testing.T) {
	t.Parallel()
	l := newLedgerDB(t)
	modes := map[string][]idempotency.Option{
		"claim":       {idempotency.WithScope("billing")},
		"seen-set":    {idempotency.WithScope("billing"), idempotency.WithoutClaim()},
		"transaction": {idempotency.WithScope("billing"), idempotency.WithTransaction(l.db)},
	}
	for name, opts := range modes {
		t.Run(name, func(t *testing.T) {
			var store stores.Store = memstore.New()
			if name == "transaction" {
				store = l.store
			}
			id := "delivery-" + name + "-" + t.Name()
			msg := msgOf(envelopeWithID(t, id))
			own := msg.Context()
			var got idempotency.Delivery
			var ok bool
			h := idempotency.Middleware(store, opts...)(func(m *message.Message) ([]*message.Message, error) {
				got, ok = idempotency.DeliveryFromContext(m.Context())
				return nil, nil
			})
			if _, err := h(msg); err != nil {
				t.Fatal(err)
			}
			if !ok || got.ID != id || got.Scope != "billing" || got.Key != idempotency.Key("billing", id) || got.Message != msg {
				t.Fatalf("DeliveryFromContext = %+v, %v; want id %q, scope billing, its key, the message", got, ok, id)
			}
			if msg.Context() != own {
				t.Fatal("the message's own context was not put back")
			}
		})
	}
	t.Run("no identity", func(t *testing.T) {
		ok := true
		h := idempotency.Middleware(memstore.New())(func(m *message.Message) ([]*message.Message, error) {
			_, ok = idempotency.DeliveryFromContext(m.Context())
			return nil, nil
		})
		if _, err := h(msgOf([]byte("not an envelope"))); err != nil || ok {
			t.Fatalf("a message without identity: %v, delivery found %v", err, ok)
		}
	})
	d := idempotency.Delivery{Key: "k", ID: "i"}
	if got, ok := idempotency.DeliveryFromContext(idempotency.ContextWithDelivery(context.Background(), d)); !ok || got != d {
		t.Fatalf("ContextWithDelivery round trip = %+v, %v", got, ok)
	}
}
