package postgresstore_test

import (
	"bytes"
	"testing"

	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestBeginKeepsTheLargestValue: a value of MaxValue bytes full of quotes,
// backslashes and NULs, under a key full of quotes, is recorded intact by
// every way of beginning, and found intact by a second copy.
func TestBeginKeepsTheLargestValue(t *testing.T) {
	t.Parallel()
	s := newStore(t, testenv.Postgres(t))
	value := bytes.Repeat([]byte("'\\\x00\"$$"), postgresstore.MaxValue/6+1)[:postgresstore.MaxValue]
	for name, begin := range beginners(t, s) {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			key := name + `'; DROP TABLE x; --\`
			b := mustBegin(t, begin, key, 3, value)
			if !b.recorded {
				t.Fatal("not recorded")
			}
			if err := b.commit(); err != nil {
				t.Fatal(err)
			}
			b = mustBegin(t, begin, key, 4, nil)
			if b.recorded || b.found.Fingerprint != 3 || !bytes.Equal(b.found.Value, value) {
				t.Fatalf("second copy: recorded %v, fingerprint %d, value intact %v", b.recorded, b.found.Fingerprint, bytes.Equal(b.found.Value, value))
			}
			if err := b.rollback(); err != nil {
				t.Fatal(err)
			}
		})
	}
}
