package postgresstore

import "time"

// Statements returns the SQL the store issues, by name, so the benchmarks can
// issue the very same statements bare beside the middleware.
func (s *Store) Statements() map[string]string {
	return map[string]string{
		"lookup":        s.lookupSQL,
		"remember":      s.rememberSQL,
		"remember-many": s.rememberManySQL,
		"claim":         s.claimSQL,
		"claim-row":     s.claimRowSQL,
	}
}

// StatementCount is how many statements the store has run (the pool watch's
// count), so tests can tell that concurrent calls shared statements.
func (s *Store) StatementCount() uint64 { return s.churn.statements.Load() }

// TextArray and Int64Array are the array literals of the grouped statements.
var (
	TextArray  = textArray
	Int64Array = int64Array
)

// SetDropMargin sets how long every record of a partition must have been
// expired before DeleteExpired drops it (a minute otherwise), so that
// tests need not wait a minute.
func (s *Store) SetDropMargin(d time.Duration) { s.parts.dropMargin = d }
