package stores_test

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// setStore is the smallest store of the BabelQueue contract: a set of keys
// in memory. Prove a store of your own with storetest.Run before using it.
type setStore struct {
	mu   sync.Mutex
	keys map[string]bool
}

func (s *setStore) Seen(ctx context.Context, key string) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.keys[key], nil
}

func (s *setStore) Remember(ctx context.Context, key string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.keys[key] = true
	return nil
}

func (s *setStore) Forget(ctx context.Context, key string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.keys, key)
	return nil
}

// A store of your own with Seen, Remember and Forget (the BabelQueue
// contract) plugs in through FromSeenSet, as a post-success seen-set: the
// middleware runs it only when told so with WithoutClaim, since two
// concurrent deliveries of one message may then both run. The shipped
// stores implement the whole Store contract: claims, fingerprints, values.
func Example() {
	store := stores.FromSeenSet(&setStore{keys: map[string]bool{}}, 0)
	if _, err := idempotency.New(store); err != nil {
		fmt.Println("without WithoutClaim:", errors.Is(err, idempotency.ErrNoClaims))
	}
	charge := idempotency.Middleware(store, idempotency.WithoutClaim())(func(*message.Message) ([]*message.Message, error) {
		fmt.Println("charging card")
		return nil, nil
	})
	payment, _ := envelope.New("urn:babel:payments:requested", map[string]any{"amount_cents": 1299},
		envelope.WithID("payment-1042"))
	payload, _ := payment.Marshal()
	for range 2 { // the broker delivers it twice
		if _, err := charge(message.NewMessage(watermill.NewUUID(), payload)); err != nil {
			panic(err)
		}
	}
	fmt.Println("claims:", store.Capabilities().Claims)
	// Output:
	// without WithoutClaim: true
	// charging card
	// claims: false
}
