package postgresstore

import (
	"context"
	"time"
)

// Statements returns the SQL the store issues, by name, so the benchmarks can
// issue the very same statements bare beside the middleware.
func (s *Store) Statements() map[string]string {
	return map[string]string{
		"lookup":        s.lookupSQL,
		"remember":      s.rememberSQL,
		"remember-many": s.rememberManySQL,
		"claim":         s.claimSQL,
		"claim-row":     s.claimRowSQL,
		"seen-locked":   s.seenLockedSQL,
		"seen-many":     s.seenManySQL,
	}
}

// SessionRoundStatements returns the statements of a session's round trip
// (session claims), in the order it sends them: the records of fresh
// claims ($1 row keys, $2 fingerprints, $3 locks, each an array's text
// form), the claims' locks ($1 locks) and the claims' read ($1 row keys).
func (s *Store) SessionRoundStatements() (freshRecords, locks, claimRead string) {
	return s.session.rememberFreshSQL, sessionLocksSQL, s.session.claimReadSQL
}

// QuotedArray and IntArray are the array literals of the session's round
// trips.
var (
	QuotedArray = quotedArray
	IntArray    = intArray
)

// RowLock is the advisory lock the Store takes, or tries, for key: the one
// a session claim of key holds.
func (s *Store) RowLock(key string) int64 { return s.rowLock(RowKey(key)) }

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

// SessionPID returns the server process of the session holding s's claims
// (WithSessionClaims), 0 when none is open.
func (s *Store) SessionPID() int32 {
	s.session.mu.Lock()
	defer s.session.mu.Unlock()
	if s.session.conn == nil {
		return 0
	}
	return s.session.pid
}

// CollideLocks makes every key's advisory lock in s the lock lock, as two
// keys whose 64-bit lock keys collide.
func (s *Store) CollideLocks(lock int64) { s.session.seed = 0; s.session.collide = lock }

// SetSessionIdle sets how long s's session, holding no claim, stays open
// unused (a minute otherwise), so that tests need not wait a minute.
func (s *Store) SetSessionIdle(d time.Duration) {
	s.session.mu.Lock()
	defer s.session.mu.Unlock()
	s.session.unheld = d
}

// FreshConflicts returns how many of s's session round trips met a row in
// the way of a fresh claim's plain insert, and went again with the upsert.
func (s *Store) FreshConflicts() int {
	s.session.mu.Lock()
	defer s.session.mu.Unlock()
	return s.session.freshConflicts
}

// SessionStatements returns the SQL the store runs on its claims' session,
// by name (empty without session claims).
func (s *Store) SessionStatements() map[string]string {
	if s.session == nil {
		return nil
	}
	return map[string]string{
		"claim-read":     s.session.claimReadSQL,
		"remember":       s.session.rememberSQL,
		"remember-fresh": s.session.rememberFreshSQL,
		"remember-value": s.session.rememberValueSQL,
		"fail":           s.session.failSQL,
	}
}

// SessionPause is how long the session's next round trip would wait for
// more calls now (WithGroupPause).
func (s *Store) SessionPause() time.Duration { return s.sessionPause() }

// PausedGroupCall runs one call through a group whose pause is an hour,
// and returns its error: it returns by ctx's deadline only if the pause
// gives way to the caller's context.
func PausedGroupCall(ctx context.Context) error {
	g := &group{maxInFlight: 1, pause: func() time.Duration { return time.Hour },
		run: func(context.Context, []*op) error { return nil }}
	o := newOp()
	o.key = "00000000-0000-0000-0000-000000000000"
	return g.do(ctx, time.Minute, o)
}

// PauseSiblings is how many claims on the session make its round trips
// wait for more calls (WithGroupPause).
const PauseSiblings = pauseSiblings

// SetGroupPause sets s's pause past what WithGroupPause allows, so that a
// test can tell a call bounded by the pause from one bounded by its own
// deadline on a loaded machine. Call it while no call of s is running.
func (s *Store) SetGroupPause(d time.Duration) { s.pause = d }

// ArrayOf is the text form of an array of strings (quoted), of int64s or
// of bools, as the session's statements send them.
func ArrayOf(v any) string {
	switch v := v.(type) {
	case []string:
		return quotedArray(len(v), func(i int) string { return v[i] })
	case []int64:
		return intArray(len(v), func(i int) int64 { return v[i] })
	case []bool:
		return boolArray(len(v), func(i int) bool { return v[i] })
	}
	panic("ArrayOf: unsupported type")
}

// SessionQueued is how many calls wait in the queue of s's session for its
// next round trip.
func (s *Store) SessionQueued() int {
	s.sessOps.mu.Lock()
	defer s.sessOps.mu.Unlock()
	return len(s.sessOps.queue)
}

// RollLock is the advisory lock of the replica dropping the partitions of
// table (unquoted, as WithTable takes it).
func RollLock(table string) int64 {
	quoted, _ := quoteTable(table)
	return rollLock(quoted)
}
