package postgresstore_test

import (
	"bytes"
	"context"
	"sync"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestHostileGroupedLookupsOwnTheirValues: concurrent Lookups of one key
// share a grouped statement, but each caller gets a value of its own, as
// from memstore: a caller that changes its copy (decrypting it in place,
// say) never changes another caller's. Before, every caller of a group got
// the one slice the row was scanned into.
func TestHostileGroupedLookupsOwnTheirValues(t *testing.T) {
	db := testenv.Postgres(t)
	db.SetMaxOpenConns(8)
	s := newStore(t, db)
	ctx := context.Background()
	want := []byte("the saved answer")
	if err := s.Remember(ctx, "valued", 0xfeed, want); err != nil {
		t.Fatal(err)
	}
	const callers = 32
	for round := range 50 {
		values := make([][]byte, callers)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range callers {
			wg.Go(func() {
				<-start
				r, err := s.Lookup(ctx, "valued")
				if err != nil {
					t.Error(err)
					return
				}
				values[i] = r.Value
			})
		}
		close(start)
		wg.Wait()
		if t.Failed() {
			return
		}
		for i, v := range values {
			if !bytes.Equal(v, want) {
				t.Fatalf("round %d: caller %d got %q, want %q", round, i, v, want)
			}
		}
		values[0][0] = 'T' // the first caller changes its copy
		for i, v := range values[1:] {
			if v[0] == 'T' {
				t.Fatalf("round %d: caller %d's value changed when caller 0 changed its own (%q): grouped callers share one slice", round, i+1, v)
			}
		}
	}
}

// TestHostileRememberTxLeavesALiveClaimAlone: RememberTx does not take over
// a live claim (a delivery running the message under Claim): it reports
// the key in flight and writes nothing, and takes the claim over once it
// lapsed. Before, it took the live claim over (recorded true): the
// transactional delivery ran while the claimed one ran too.
func TestHostileRememberTxLeavesALiveClaimAlone(t *testing.T) {
	db := testenv.Postgres(t)
	s := newStore(t, db)
	ctx := context.Background()
	claimer := stores.WithClaimToken(ctx, "a claim-mode delivery")
	if ok, _, err := s.Claim(claimer, "k", 300*time.Millisecond); err != nil || !ok {
		t.Fatal(ok, err)
	}
	rememberTx := func() (bool, stores.Record) {
		t.Helper()
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		recorded, found, err := s.RememberTx(ctx, tx, "k", 0xfeed, nil)
		if err != nil {
			_ = tx.Rollback()
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		return recorded, found
	}
	if recorded, found := rememberTx(); recorded || found.State != stores.StateInFlight {
		t.Fatalf("RememberTx over a live claim = %v, found %v; want false, in flight", recorded, found.State)
	}
	if r, err := s.Lookup(ctx, "k"); err != nil || r.State != stores.StateInFlight {
		t.Fatalf("after RememberTx over a live claim the key is %v (%v), want the claim kept", r.State, err)
	}
	time.Sleep(400 * time.Millisecond)
	if recorded, _ := rememberTx(); !recorded {
		t.Fatal("RememberTx over a lapsed claim did not record the key")
	}
}
