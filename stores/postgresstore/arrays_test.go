package postgresstore_test

import (
	"context"
	"slices"
	"testing"
	"time"

	_ "github.com/lib/pq" // registers "postgres", a second database/sql driver

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/storetest"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestArrayLiteralsRoundTrip: the array literals the grouped statements
// send come back from the server element for element, whatever a claim
// token holds.
func TestArrayLiteralsRoundTrip(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	tokens := []string{"", "plain", `a "quoted" one`, `back\slash`, "comma,brace{}", "NULL", "null", " spaced ", "ünïcode ✓", `\"`, "{}", "x\ny"}
	rows, err := db.QueryContext(ctx, `SELECT unnest($1::text::text[])`, postgresstore.TextArray(tokens))
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var got []string
	for rows.Next() {
		var s *string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		if s == nil {
			t.Fatal("an element came back NULL")
		}
		got = append(got, *s)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, tokens) {
		t.Errorf("text array: got %q, want %q", got, tokens)
	}

	var sum, nulls int64
	if err := db.QueryRowContext(ctx, `SELECT coalesce(sum(v), 0), count(*) FILTER (WHERE v IS NULL) FROM unnest($1::text::bigint[]) AS v`,
		postgresstore.Int64Array([]int64{-9223372036854775808, 9223372036854775807, 0, 5}, func(v int64) bool { return v == 0 })).Scan(&sum, &nulls); err != nil {
		t.Fatal(err)
	}
	if sum != 4 || nulls != 1 {
		t.Errorf("bigint array: sum %d with %d NULL, want 4 with 1", sum, nulls)
	}
}

// TestContractOnLibPQ runs the store contract through lib/pq, the other
// common database/sql driver: the grouped statements take their arrays as
// string parameters, which every driver passes.
func TestContractOnLibPQ(t *testing.T) {
	if testing.Short() {
		t.Skip("the contract again through lib/pq: TestLibPQBurst covers the driver in -short")
	}
	db := testenv.PostgresWithDriver(t, "postgres")
	db.SetMaxOpenConns(70)
	db.SetMaxIdleConns(70)
	storetest.Run(t,
		func(t *testing.T) stores.Store { return newStore(t, db) },
		storetest.WithTTLStore(func(t *testing.T, ttl time.Duration) stores.Store {
			return newStore(t, db, postgresstore.WithTTL(ttl))
		}),
		storetest.WithTxDB(db))
}
