package sdkstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/sdkstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestPHPPDOWorkerClockAheadKeepsItsClaims: the PHP PdoStore layout has no
// holder column, so an instance remembers the expiry each of its claims
// wrote (by the database clock). A worker whose own clock runs an hour
// ahead (a resumed VM, an NTP step) must not take its live claims for
// lapsed when it trims that memory: it would no longer find them, its
// renewal would report the claim lost and cancel a handler that still
// holds it, and its release would leave the claim to lapse.
func TestPHPPDOWorkerClockAheadKeepsItsClaims(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	s := ok(t)(sdkstore.NewPHPPDO(db, sdkstore.PostgreSQL, sdkstore.WithTable(sqlTable(t, db, "bq_idempotency")))).(*sdkstore.PHPPDOStore)
	migrate(t, s)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sdkstore.SetWallClock(s, func() time.Time { return time.Now().Add(time.Hour) })
	holder := stores.WithClaimToken(ctx, "delivery-1")
	key := "clock-" + testenv.RandomHex(4)
	if claimed, _, err := s.Claim(holder, key, 30*time.Second); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	sdkstore.FillClaimMemory(s, 4096)
	// One more claim makes the instance trim its memory.
	if claimed, _, err := s.Claim(stores.WithClaimToken(ctx, "delivery-2"), key+"-b", 30*time.Second); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	if held, err := s.Extend(holder, key, 30*time.Second); err != nil || !held {
		t.Fatalf("Extend of a claim live for 30 s by the database clock, on a worker whose clock is an hour ahead = %v, %v; want held", held, err)
	}
	// Three hours on by the same clock, every claim remembered has passed:
	// the next claim trims them.
	sdkstore.SetWallClock(s, func() time.Time { return time.Now().Add(3 * time.Hour) })
	if claimed, _, err := s.Claim(stores.WithClaimToken(ctx, "delivery-3"), key+"-c", 30*time.Second); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	if n := sdkstore.ClaimMemory(s); n != 1 {
		t.Fatalf("%d claims remembered after the trim, want 1 (the claim just taken)", n)
	}
}
