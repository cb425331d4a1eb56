package effects_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/babelqueue/watermill-idempotency/effects"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// A charge whose reply is lost: the first attempt leaves it unknown, the
// retry waits until the request sent can no longer be on its way (the
// lease), then asks the provider's status lookup and gets the charge,
// without charging again.
func Example() {
	fx, err := effects.New(memstore.NewEffects(),
		effects.WithCallTimeout(50*time.Millisecond), effects.WithLease(100*time.Millisecond))
	if err != nil {
		panic(err)
	}
	defer fx.Close()

	ledger := map[string]string{} // the provider's charges, by idempotency key
	charge := fx.Effect("charge", effects.WithResolver(func(ctx context.Context, key string) (effects.Outcome, error) {
		if id, ok := ledger[key]; ok {
			return effects.Succeeded([]byte(id)), nil
		}
		return effects.NotFound(), nil
	}))
	call := func(lose bool) effects.Call {
		return func(ctx context.Context, key string) (effects.Outcome, error) {
			if _, ok := ledger[key]; !ok {
				ledger[key] = fmt.Sprintf("ch_%d", len(ledger)+1)
			}
			if lose {
				return effects.Outcome{}, errors.New("read tcp: i/o timeout") // charged; the reply lost
			}
			return effects.Succeeded([]byte(ledger[key])), nil
		}
	}

	// The middleware puts the message's identity in the handler's context.
	ctx := idempotency.ContextWithDelivery(context.Background(), idempotency.Delivery{
		Key: idempotency.Key("billing", "order-1042"), Scope: "billing", ID: "order-1042"})
	_, err = charge.Do(ctx, map[string]int{"amount_cents": 1299}, call(true))
	fmt.Println("first attempt unknown:", errors.Is(err, effects.ErrUnknownOutcome))
	id, err := charge.Do(ctx, map[string]int{"amount_cents": 1299}, call(false))
	fmt.Println("retry:", string(id), err, "- charges:", len(ledger))
	// Output:
	// first attempt unknown: true
	// retry: ch_1 <nil> - charges: 1
}
