package postgresstore_test

import (
	"bytes"
	"context"
	"sync"
	"testing"

	"github.com/babelqueue/watermill-idempotency/internal/testenv"
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
