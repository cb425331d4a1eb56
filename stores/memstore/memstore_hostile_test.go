package memstore_test

import (
	"context"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// TestHostileClaimsEndedLeaveNoMemoryBehind: claims that ended (released
// after a failure, or replaced by a record that was forgotten) hold no
// memory, whatever their lease and whatever claim of a longer lease came
// before them. Before, every claim stayed in the store's expiry queue,
// with its key, until its lease passed, and behind a claim of a longer
// lease until that one's passed too: 200,000 claims released within a
// second, behind one claim of a day, kept about 20 MB for a day.
func TestHostileClaimsEndedLeaveNoMemoryBehind(t *testing.T) {
	s := memstore.New(memstore.WithTTL(time.Minute))
	ctx := context.Background()
	slow := stores.WithClaimToken(ctx, "a-batch-job")
	if ok, _, err := s.Claim(slow, "nightly-batch", 24*time.Hour); err != nil || !ok {
		t.Fatal(ok, err)
	}
	heap := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	before := heap()
	const claims = 200_000
	for i := range claims {
		key := fmt.Sprintf("orders-handler\x1fpayment-%012d-0123456789abcdef", i)
		dctx := stores.WithClaimToken(ctx, fmt.Sprint(i))
		if ok, _, err := s.Claim(dctx, key, 30*time.Second); err != nil || !ok {
			t.Fatal(ok, err)
		}
		if i%2 == 0 {
			if err := s.Release(dctx, key); err != nil { // the handler failed
				t.Fatal(err)
			}
			continue
		}
		if err := s.Remember(dctx, key, 0, nil); err != nil {
			t.Fatal(err)
		}
		if err := s.Forget(ctx, key); err != nil { // an operator forgets it
			t.Fatal(err)
		}
	}
	after := heap()
	runtime.KeepAlive(s)
	if s.Len() != 1 {
		t.Fatalf("Len = %d, want 1 (the batch job's claim)", s.Len())
	}
	if grew := int64(after) - int64(before); grew > 4<<20 {
		t.Fatalf("the heap grew %.1f MB for %d claims that all ended (one live claim left), want under 4 MB",
			float64(grew)/(1<<20), claims)
	}
}
