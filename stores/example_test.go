package stores_test

import (
	"context"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// setStore is the smallest Store: a set of keys in memory. Prove a store of
// your own with storetest.Run before using it.
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

// Any type with Seen, Remember and Forget works with the middleware; the
// optional capabilities (Claimer, Expiring, Fingerprinter, ...) add what
// they promise when the store has them.
func Example() {
	var store stores.Store = &setStore{keys: map[string]bool{}}
	charge := idempotency.Middleware(store)(func(*message.Message) ([]*message.Message, error) {
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
	_, claims := store.(stores.Claimer)
	fmt.Println("claims:", claims)
	// Output:
	// charging card
	// claims: false
}
