package idempotency

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Delivery is the identity of the message a handler is running for, as the
// middleware decided it: what effects outside the store (package effects)
// derive their stable provider keys from.
type Delivery struct {
	// Key is the message's store key: Key(Scope, ID).
	Key string
	// Scope is the scope of the message's record: the handler name, or the
	// value of WithScope.
	Scope string
	// ID is the message's identity (meta.id, or the key source's key).
	ID string
	// Handler is the Watermill handler name ("" on a direct call).
	Handler string
	// Message is the message being handled.
	Message *message.Message
}

// deliveryContext carries a Delivery in one allocation.
type deliveryContext struct {
	context.Context
	d Delivery
}

type deliveryKey struct{}

func (c *deliveryContext) Value(key any) any {
	if key == (deliveryKey{}) {
		return &c.d
	}
	return c.Context.Value(key)
}

// DeliveryFromContext returns the identity of the message being handled.
// The middleware puts it in the handler's message context (msg.Context())
// in every mode, the transaction's included; it is absent for a message
// handled without deduplication (no identity: fail open).
func DeliveryFromContext(ctx context.Context) (Delivery, bool) {
	d, ok := ctx.Value(deliveryKey{}).(*Delivery)
	if !ok {
		return Delivery{}, false
	}
	return *d, true
}

// ContextWithDelivery returns a copy of ctx carrying d, as the middleware
// does for a handler. Use it to test a handler's effects without a router,
// or to run them from code that is not a Watermill handler (an HTTP
// handler keyed by an Idempotency-Key header, say).
func ContextWithDelivery(ctx context.Context, d Delivery) context.Context {
	return &deliveryContext{Context: ctx, d: d}
}

// withDelivery returns d's context carrying its identity.
func (g *Guard) withDelivery(d delivery) context.Context {
	return g.deliveryContext(&d, d.ctx)
}

// deliveryContext returns ctx carrying d's identity.
//
//go:noinline
func (g *Guard) deliveryContext(d *delivery, ctx context.Context) context.Context {
	scope := d.ev.Handler
	if g.cfg.fixedScope {
		scope = g.cfg.scope
	}
	return ContextWithDelivery(ctx, Delivery{Key: d.key, Scope: scope, ID: d.ev.MessageID, Handler: d.ev.Handler, Message: d.msg})
}

// runWithDelivery runs h with the delivery's identity in ctx (the
// message's context, or the claim's) as the message context, then puts
// the message's own context back.
func (g *Guard) runWithDelivery(d *delivery, ctx context.Context, h message.HandlerFunc) ([]*message.Message, error) {
	msg := d.msg
	own := msg.Context()
	msg.SetContext(g.deliveryContext(d, ctx))
	defer msg.SetContext(own)
	return h(msg)
}
