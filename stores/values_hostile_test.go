package stores_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestHostileValuesThatLookLikeOtherRecords: a kept value that spells
// another record of the store's own format (redisstore's "1", a claim's
// "c…", a "v<fp>:" prefix, a bare number) or holds NUL bytes, colons or a
// mebibyte of random bytes comes back byte for byte, with its
// fingerprint, from Lookup and from the Claim it stands in the way of, on
// every store that keeps values.
func TestHostileValuesThatLookLikeOtherRecords(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	redisClient := testenv.Redis(t)
	table := "idem_values_" + testenv.RandomHex(4)
	pg, err := postgresstore.New(db, postgresstore.WithTable(table))
	if err != nil {
		t.Fatal(err)
	}
	if err := pg.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = db.Exec(`DROP TABLE ` + table) })
	pgUngrouped, err := postgresstore.New(db, postgresstore.WithTable(table), postgresstore.WithoutGrouping())
	if err != nil {
		t.Fatal(err)
	}
	random := make([]byte, redisstore.MaxValue)
	_, _ = rand.Read(random)
	values := map[string][]byte{
		"one": []byte("1"), "claim": []byte("c"), "claim-token": []byte("cAAAAAAAAAAAAAAAA"),
		"value-format": []byte("v1234:x"), "number": []byte("42"), "nul": {0, 0, ':', 0},
		"colons": []byte(":::"), "random-mebibyte": random,
	}
	prefix := "bq-values-" + testenv.RandomHex(4) + ":"
	for name, s := range map[string]stores.Store{
		"memstore": memstore.New(), "redisstore": redisstore.New(redisClient, redisstore.WithPrefix(prefix)),
		"postgresstore": pg, "postgresstore-ungrouped": pgUngrouped,
	} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			for vname, v := range values {
				key := name + "/" + vname
				if err := s.Remember(ctx, key, 0xfeed, v); err != nil {
					t.Fatalf("%s: Remember: %v", vname, err)
				}
				t.Cleanup(func() { _ = s.Forget(context.Background(), key) })
				r, err := s.Lookup(ctx, key)
				if err != nil || !r.Remembered() || !bytes.Equal(r.Value, v) || r.Fingerprint != 0xfeed { // a value keeps all 64 bits
					t.Fatalf("%s: Lookup = %v, %d bytes, fingerprint %d, %v; want remembered, %d bytes, %d",
						vname, r.State, len(r.Value), r.Fingerprint, err, len(v), 0xfeed)
				}
				claimed, found, err := s.Claim(stores.WithClaimToken(ctx, "AAAAAAAAAAAAAAAA"), key, time.Minute)
				if err != nil || claimed || !found.Remembered() || !bytes.Equal(found.Value, v) {
					t.Fatalf("%s: Claim = %v, found %v with %d bytes, %v; want refused by the record, its value", vname, claimed, found.State, len(found.Value), err)
				}
			}
		})
	}
}
