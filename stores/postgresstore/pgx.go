package postgresstore

import (
	"context"
	"encoding/hex"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/babelqueue/watermill-idempotency/internal/sqlstate"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// SQLSTATEs the pgx path branches on.
const (
	uniqueViolation            = "23505" // an insert met an existing key
	notNullViolation           = "23502" // the record's key was NULL: a session claim holds the key
	invalidStatementName       = "26000" // EXECUTE of a statement the session does not have
	duplicatePreparedStatement = "42P05" // a statement of that name exists already in the session
)

// BeginPgx begins a transaction on conn (pgx used natively, without
// database/sql) and records key in it with fingerprint (0: none) and value
// (nil: none), in one round trip: BEGIN and the record's INSERT go out
// together. It reports, as [Store.RememberTx] does, whether this transaction
// recorded the key (true) or found it remembered already (false: a
// duplicate, with the record found). While another transaction holds an
// uncommitted record of the same key it waits: if that one commits, the
// result is false; if it rolls back, this transaction records the key.
//
// On success tx is open on conn whatever the result: commit it after the
// handler's writes (recorded), or roll it back (a duplicate). On error no
// transaction is left open on conn. opts are the transaction's options
// (opts.BeginQuery, when set, replaces the BEGIN).
//
// A message never seen costs that one round trip: the INSERT is prepared on
// conn once (under a name starting bq_idempotency_record_) and run by an
// EXECUTE whose values are literals, since a multi-statement query cannot
// take parameters (the key as uuid text, the fingerprint as an integer, the
// value hex-encoded: none from outside the store). An existing row (a duplicate,
// an expired record, a claim of the claim mode) fails the insert with a
// unique violation (which the server logs as an error, with the statement
// under the default log_min_error_statement); the transaction is then
// rolled back and begun again in
// one round trip, and the key recorded as RememberTx does it (taking over an
// expired record or a lapsed claim; a live claim of the claim mode is
// reported in flight), a few round trips more on that rare path.
func (s *Store) BeginPgx(ctx context.Context, conn *pgx.Conn, opts pgx.TxOptions, key string, fingerprint uint64, value []byte) (tx pgx.Tx, recorded bool, found stores.Record, err error) {
	if len(value) > MaxValue {
		return nil, false, stores.Record{}, fmt.Errorf("postgresstore: begin with the record: a value of %d bytes: %w (at most %d)", len(value), stores.ErrValueTooLarge, MaxValue)
	}
	if s.yieldHeld(ctx, key) {
		if tx, err = conn.BeginTx(ctx, opts); err != nil {
			return nil, false, stores.Record{}, fail(ctx, "begin with the record", err)
		}
		return tx, false, stores.Record{State: stores.StateInFlight}, nil
	}
	ctx, cancel := s.context(ctx)
	defer cancel()
	rowKey := RowKey(key)
	if s.parts != nil { // RememberTx's locked write
		if tx, err = conn.BeginTx(ctx, opts); err != nil {
			return nil, false, stores.Record{}, fail(ctx, "begin with the record", err)
		}
		if recorded, found, err = s.rememberPgx(ctx, tx, rowKey, fingerprint, value); err != nil {
			_ = tx.Rollback(ctx)
			return nil, false, stores.Record{}, err
		}
		return tx, recorded, found, nil
	}
	begin := beginSQL(opts)
	tx, err = s.beginRecorded(ctx, conn, begin, opts.CommitQuery, rowKey, fingerprint, value)
	if err == nil {
		s.recordedOwn(rowKey, s.holder(ctx))
		return tx, true, stores.Record{}, nil
	}
	if code := sqlState(err); code != uniqueViolation && code != notNullViolation {
		s.rollbackConn(ctx, conn)
		return nil, false, stores.Record{}, fail(ctx, "begin with the record", err)
	}
	// The key has a row, or a session claim holds it: roll the failed
	// transaction back and begin a
	// fresh one in the same round trip, then record as RememberTx does.
	if tx, err = conn.BeginTx(ctx, pgx.TxOptions{BeginQuery: "ROLLBACK; " + begin, CommitQuery: opts.CommitQuery}); err != nil {
		s.rollbackConn(ctx, conn)
		return nil, false, stores.Record{}, fail(ctx, "begin with the record", err)
	}
	recorded, found, err = s.rememberPgx(ctx, tx, rowKey, fingerprint, value)
	if err != nil {
		_ = tx.Rollback(ctx)
		return nil, false, stores.Record{}, err
	}
	return tx, recorded, found, nil
}

// beginRecorded sends begin and the record's INSERT in one round trip. The
// INSERT is the statement the store prepares on conn once (conn.Prepare,
// which pgx keeps per connection), run by an EXECUTE with the values as
// literals: planned once per connection rather than on every message. A
// connection whose server-side statements were dropped behind pgx's back
// (DISCARD ALL, DEALLOCATE ALL) has it prepared again. The store falls back
// to the plain INSERT with literals, parsed and planned each time, for
// good: where EXECUTE cannot reach a prepared statement at all (PgBouncer
// renames them), where the session already holds the statement pgx never
// prepared (a pooler shares server connections between clients), and where
// statements are lost again and again (a pool resetting its connections
// with DISCARD ALL on every release), since each loss costs a failed
// EXECUTE and four round trips more.
//
// The INSERT goes on a line of its own: a -- comment ending begin (a
// BeginQuery of the caller's) ends with it instead of swallowing the record.
func (s *Store) beginRecorded(ctx context.Context, conn *pgx.Conn, begin, commit, rowKey string, fingerprint uint64, value []byte) (pgx.Tx, error) {
	if !s.noExecute.Load() {
		executes := s.executes.Add(1)
		for attempt := 0; attempt < 2 && !s.noExecute.Load(); attempt++ {
			if _, err := conn.Prepare(ctx, s.recordStmt, s.recordSQL); err != nil {
				if sqlState(err) != duplicatePreparedStatement {
					return nil, err
				}
				// Another client's statement on a server connection a
				// pooler shares: this session's statements are not its
				// own.
				s.noExecute.Store(true)
				break
			}
			tx, err := conn.BeginTx(ctx, pgx.TxOptions{BeginQuery: recordQuery(begin, s.executePrefix, rowKey, s.rowLock(rowKey), true, fingerprint, value), CommitQuery: commit})
			if sqlState(err) != invalidStatementName {
				return tx, err
			}
			// The server no longer has the statement pgx thinks it
			// prepared: forget it on both sides and prepare it again,
			// unless statements are lost too often to be worth it.
			s.rollbackConn(ctx, conn)
			if err := conn.Deallocate(ctx, s.recordStmt); err != nil {
				return nil, err
			}
			if lost := s.lostStatements.Add(1); attempt == 1 || (lost >= lostStatementsMin && lost*lostStatementsRatio >= executes) {
				s.noExecute.Store(true)
			}
		}
	}
	return conn.BeginTx(ctx, pgx.TxOptions{BeginQuery: recordQuery(begin, s.insertPrefix, rowKey, s.rowLock(rowKey), false, fingerprint, value), CommitQuery: commit})
}

// The store gives its prepared statement up once it was lost (26000) at
// least lostStatementsMin times, on at least one in lostStatementsRatio of
// the messages that ran it.
const (
	lostStatementsMin   = 4
	lostStatementsRatio = 16
)

// sqlState is the SQLSTATE of err, or "".
func sqlState(err error) string {
	code, _ := sqlstate.Of(err)
	return code
}

// rememberPgx is RememberTx's statements in a pgx transaction.
func (s *Store) rememberPgx(ctx context.Context, tx pgx.Tx, rowKey string, fingerprint uint64, value []byte) (bool, stores.Record, error) {
	exec := func(ctx context.Context, query string, args ...any) (int64, error) {
		tag, err := tx.Exec(ctx, query, args...)
		return tag.RowsAffected(), err
	}
	query := func(ctx context.Context, query string, args ...any) func(...any) error {
		return tx.QueryRow(ctx, query, args...).Scan
	}
	return s.rememberIn(ctx, exec, query, rowKey, fingerprint, value)
}

// recordQuery is begin, then on a line of its own the record: prefix (the
// EXECUTE of the prepared INSERT when execute, or the plain INSERT up to
// its key) followed by the values as literals: rowKey is uuid text made by
// RowKey, the others integers and hex. The plain INSERT's key is NULL when
// the key's lock (lock, taken shared) is held by a session claim, as the
// prepared one's.
func recordQuery(begin, prefix, rowKey string, lock int64, execute bool, fingerprint uint64, value []byte) string {
	var b strings.Builder
	b.Grow(len(begin) + len(prefix) + 160 + 2*len(value))
	b.WriteString(begin)
	b.WriteString("\n; ")
	b.WriteString(prefix)
	quoted := "'" + rowKey + "'"
	lockText := strconv.FormatInt(lock, 10)
	if execute {
		b.WriteString(quoted)
	} else {
		b.WriteString(lockedKey(lockText, quoted+"::uuid"))
	}
	b.WriteString(", ")
	writeLiterals(&b, fingerprint, ", ", value)
	if execute {
		b.WriteString(", ")
		b.WriteString(lockText)
	}
	b.WriteByte(')')
	return b.String()
}

// lockedKey is the SQL of a record's key, key, when the transaction takes
// the key's advisory lock, lock, shared, and NULL when a session claim
// holds it exclusively (the INSERT then fails on the NULL key).
func lockedKey(lock, key string) string {
	return `CASE WHEN pg_try_advisory_xact_lock_shared(` + lock + `) THEN ` + key + ` END`
}

// writeLiterals writes fingerprint (NULL for 0), sep, and value (NULL for
// nil, else hex-decoded) to b as SQL literals.
func writeLiterals(b *strings.Builder, fingerprint uint64, sep string, value []byte) {
	if fingerprint == 0 {
		b.WriteString("NULL")
	} else {
		b.WriteString(strconv.FormatInt(int64(fingerprint), 10))
	}
	b.WriteString(sep)
	if value == nil {
		b.WriteString("NULL")
	} else {
		b.WriteString("decode('")
		b.WriteString(hex.EncodeToString(value))
		b.WriteString("', 'hex')")
	}
}

// beginSQL is the BEGIN of opts, as pgx would send it.
func beginSQL(opts pgx.TxOptions) string {
	if opts.BeginQuery != "" {
		return opts.BeginQuery
	}
	b := "BEGIN"
	if opts.IsoLevel != "" {
		b += " ISOLATION LEVEL " + string(opts.IsoLevel)
	}
	if opts.AccessMode != "" {
		b += " " + string(opts.AccessMode)
	}
	if opts.DeferrableMode != "" {
		b += " " + string(opts.DeferrableMode)
	}
	return b
}

// rollbackConn ends a transaction a failed statement left open on conn
// (bounded by the query timeout, even for a caller gone), so the connection
// goes back to its pool idle.
func (s *Store) rollbackConn(ctx context.Context, conn *pgx.Conn) {
	if conn.IsClosed() || conn.PgConn().TxStatus() == 'I' {
		return
	}
	ctx, cancel := boundedContext(context.WithoutCancel(ctx), s.queryTimeout)
	defer cancel()
	_, _ = conn.Exec(ctx, "ROLLBACK")
}

// fnv64 is the FNV-1a hash of s: prepared statements of stores that differ
// in table or TTL get names of their own.
func fnv64(s string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(s))
	return h.Sum64()
}
