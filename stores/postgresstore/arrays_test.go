package postgresstore_test

import (
	"context"
	"encoding/json"
	"math"
	"slices"
	"testing"
	"time"

	_ "github.com/lib/pq" // registers "postgres", a second database/sql driver

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/storetest"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestArraysInTextForm: the session's statements send their arrays (row
// keys, fingerprints, locks, flags) as one string each, in PostgreSQL's
// text form of an array. The server must read back exactly the elements
// sent, whatever they hold: quotes, backslashes, commas, braces, spaces,
// NULL spelled out, the extremes of int64, no element at all.
func TestArraysInTextForm(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	ctx := context.Background()
	back := func(t *testing.T, sql string, sent any) []byte {
		t.Helper()
		var out []byte
		if err := db.QueryRowContext(ctx, sql, postgresstore.ArrayOf(sent)).Scan(&out); err != nil {
			t.Fatalf("%s with %q: %v", sql, postgresstore.ArrayOf(sent), err)
		}
		return out
	}
	for _, keys := range [][]string{
		{},
		{postgresstore.RowKey("order-1"), postgresstore.RowKey("order-2")},
		{`a"b`, `c\d`, `e,f`, `{g}`, ` h `, `NULL`, ``, `\"`, "line\nbreak", "ü"},
	} {
		var got []string
		if err := json.Unmarshal(back(t, `SELECT coalesce(array_to_json($1::text[]), '[]')::text`, keys), &got); err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, keys) {
			t.Errorf("the keys read back = %q; want %q", got, keys)
		}
	}
	// The row keys as the statements cast them.
	keys := []string{postgresstore.RowKey("order-1"), postgresstore.RowKey("order-2")}
	var got []string
	if err := json.Unmarshal(back(t, `SELECT array_to_json($1::text[]::uuid[])::text`, keys), &got); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, keys) {
		t.Errorf("the row keys read back as uuids = %q; want %q", got, keys)
	}
	ints := []int64{0, 1, -1, math.MaxInt64, math.MinInt64, 7331}
	var gotInts []int64
	if err := json.Unmarshal(back(t, `SELECT array_to_json($1::int8[])::text`, ints), &gotInts); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(gotInts, ints) {
		t.Errorf("the int64s read back = %v; want %v", gotInts, ints)
	}
	flags := []bool{true, false, false, true}
	var gotFlags []bool
	if err := json.Unmarshal(back(t, `SELECT array_to_json($1::bool[])::text`, flags), &gotFlags); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(gotFlags, flags) {
		t.Errorf("the flags read back = %v; want %v", gotFlags, flags)
	}
}

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
