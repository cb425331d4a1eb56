package testenv

import (
	"context"
	"database/sql"
	"testing"
)

// CountsByKey runs query on db, whose rows are a key (text) and a count,
// and returns the counts by key; it fails t on any error.
func CountsByKey(t testing.TB, db *sql.DB, query string, args ...any) map[string]int {
	t.Helper()
	rows, err := db.QueryContext(context.Background(), query, args...)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	counts := map[string]int{}
	for rows.Next() {
		var key string
		var n int
		if err := rows.Scan(&key, &n); err != nil {
			t.Fatal(err)
		}
		counts[key] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return counts
}
