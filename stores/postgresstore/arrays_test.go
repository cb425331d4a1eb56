package postgresstore_test

import (
	"context"
	"encoding/json"
	"math"
	"slices"
	"testing"

	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
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
