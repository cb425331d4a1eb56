package memstore_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/stores/storetest"
)

func TestContract(t *testing.T) {
	storetest.Run(t,
		func(t *testing.T) stores.Store { return memstore.New() },
		storetest.WithTTLStore(func(t *testing.T, ttl time.Duration) stores.Store {
			return memstore.New(memstore.WithTTL(ttl))
		}))
}

// TestMemoryStaysBoundedByTTL writes far more keys than fit in one TTL and
// checks that expired records are reclaimed by later writes, without any
// background goroutine.
func TestMemoryStaysBoundedByTTL(t *testing.T) {
	const ttl = 20 * time.Millisecond
	s := memstore.New(memstore.WithTTL(ttl))
	ctx := context.Background()
	deadline := time.Now().Add(300 * time.Millisecond)
	written, peak := 0, 0
	for time.Now().Before(deadline) {
		for range 100 {
			if err := s.Remember(ctx, fmt.Sprintf("k-%d", written), 0, nil); err != nil {
				t.Fatal(err)
			}
			written++
		}
		peak = max(peak, s.Len())
		time.Sleep(time.Millisecond)
	}
	// Expired claims are reclaimed the same way.
	for i := range 1000 {
		if _, _, err := s.Claim(ctx, fmt.Sprintf("c-%d", i), time.Millisecond); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(2 * ttl)
	if err := s.Remember(ctx, "last", 0, nil); err != nil {
		t.Fatal(err)
	}
	if s.Len() != 1 {
		t.Fatalf("after every other record expired the store holds %d records, want 1", s.Len())
	}
	if peak >= written/2 {
		t.Fatalf("peak of %d records for %d written over %d TTLs: expired records are not reclaimed", peak, written, 300*time.Millisecond/ttl)
	}
}

func TestClaimRejectsNonPositiveLease(t *testing.T) {
	if _, _, err := memstore.New().Claim(context.Background(), "k", 0); err == nil {
		t.Fatal("Claim with a zero lease returned no error")
	}
}

func TestNewPanicsOnNegativeTTL(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Fatal("New(WithTTL(-1)) did not panic")
		}
	}()
	memstore.New(memstore.WithTTL(-time.Second))
}

func Example() {
	ctx := context.Background()
	store := memstore.New(memstore.WithTTL(72 * time.Hour))

	seen, _ := stores.Seen(ctx, store, "order-1042")
	fmt.Println("seen before:", seen)
	_ = store.Remember(ctx, "order-1042", 0, nil)
	seen, _ = stores.Seen(ctx, store, "order-1042")
	fmt.Println("seen after:", seen)
	// Output:
	// seen before: false
	// seen after: true
}
