package testenv

import (
	"context"
	"database/sql"
	"testing"
)

// Querier runs a query: a *sql.DB, a *sql.Conn or a *sql.Tx.
type Querier interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// Column runs query on q, whose rows have one column, and returns that
// column's values in the rows' order (nil for no row); it fails t on any
// error, the rows' own included.
func Column[T any](ctx context.Context, t testing.TB, q Querier, query string, args ...any) []T {
	t.Helper()
	rows, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []T
	for rows.Next() {
		var v T
		if err := rows.Scan(&v); err != nil {
			t.Fatal(err)
		}
		out = append(out, v)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}
