// Package sqlstate reads the SQLSTATE of a database error, whatever the
// database/sql driver: pgx's *pgconn.PgError and lib/pq's *pq.Error both
// report it through a SQLState method.
package sqlstate

import "errors"

// Of returns the SQLSTATE of the first error in err's chain that has one,
// and whether there was one.
func Of(err error) (string, bool) {
	var state interface{ SQLState() string }
	if !errors.As(err, &state) {
		return "", false
	}
	return state.SQLState(), true
}

// Is reports whether err carries the SQLSTATE code.
func Is(err error, code string) bool {
	got, ok := Of(err)
	return ok && got == code
}

// Codes PostgreSQL reports that the kit's packages act on.
const (
	SerializationFailure = "40001"
	DeadlockDetected     = "40P01"
	UndefinedTable       = "42P01"
)
