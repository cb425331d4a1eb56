package postgresstore

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/babelqueue/watermill-idempotency/internal/failrec"
	"github.com/babelqueue/watermill-idempotency/internal/sqlstate"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// A failing or ended record (stores.Store.Fail) is a row whose failure
// column holds what the failures were, as JSON:
//
//	{"attempts": 3, "first": 1733400000000, "not_before": 1733400004000,
//	 "expires": 1734004800000,
//	 "end": {"reason": "failed", "at": 1733400009000, "topic": "orders.dlq", "marker": ""}}
//
// Times are Unix milliseconds (0 or absent: none); expires is when the
// count lapses (null: kept until forgotten); end is there once the message
// ended. The column is NULL in every other row, so a record that never
// failed costs nothing more (a bit of the row's null bitmap).
//
// The row's claim column tells the rest. Empty (''), the row is the
// failing or ended record itself (its expires_at the count's expiry): a
// holder's token is never empty, and NULL means remembered, to this
// release and to earlier ones alike (an earlier worker, which knows no
// failures, sees a failing record as in flight and leaves it alone, rather
// than as remembered). A holder's token: the row is the claim of the
// delivery that runs the message again, carrying the count, and once its
// lease passes the row is the failing record again, until the count's own
// expiry. A remembered record never has a count, whatever its failure
// column says (an earlier worker's Remember leaves the column as it was).

// failureJSON is the failure column.
type failureJSON struct {
	Attempts  int      `json:"attempts"`
	First     int64    `json:"first,omitempty"`
	NotBefore int64    `json:"not_before,omitempty"`
	Expires   *int64   `json:"expires,omitempty"` // written by the statement, from the database clock
	End       *endJSON `json:"end,omitempty"`
}

type endJSON struct {
	Reason string `json:"reason"`
	At     int64  `json:"at,omitempty"`
	Topic  string `json:"topic"`
	Marker string `json:"marker"`
}

// encodeFailure is f as the failure column, without its expiry.
func encodeFailure(f stores.Failure) string {
	j := failureJSON{Attempts: f.Attempts, First: failrec.UnixMilli(f.FirstFailure), NotBefore: failrec.UnixMilli(f.NotBefore)}
	if e := f.End; e != nil {
		j.End = &endJSON{Reason: e.Reason, At: failrec.UnixMilli(e.At), Topic: e.Topic, Marker: e.Marker}
	}
	b, _ := json.Marshal(j) // ints and strings only: never fails
	return string(b)
}

// decodeFailure reads the failure column: the failure, and when the count
// lapses (zero: never).
func decodeFailure(b []byte) (stores.Failure, time.Time, error) {
	var j failureJSON
	if err := json.Unmarshal(b, &j); err != nil {
		return stores.Failure{}, time.Time{}, fmt.Errorf("postgresstore: a failure column that is not the store's JSON (%.80q): %w", b, err)
	}
	f := stores.Failure{Attempts: j.Attempts, FirstFailure: failrec.FromUnixMilli(j.First), NotBefore: failrec.FromUnixMilli(j.NotBefore)}
	if e := j.End; e != nil {
		f.End = &stores.End{Reason: e.Reason, At: failrec.FromUnixMilli(e.At), Topic: e.Topic, Marker: e.Marker}
	}
	var expires time.Time
	if j.Expires != nil {
		expires = time.UnixMilli(*j.Expires)
	}
	return f, expires, nil
}

// failedRecord is the failing or ended record of the failure column b with
// fingerprint fp.
func failedRecord(b []byte, fp int64) (stores.Record, error) {
	f, expires, err := decodeFailure(b)
	if err != nil {
		return stores.Record{}, err
	}
	r := stores.Record{State: stores.StateFailing, Fingerprint: uint64(fp), Failure: f, ExpiresAt: expires}
	if f.End != nil {
		r.State = stores.StateEnded
	}
	return r, nil
}

// SQL fragments on a row (a: "" or an alias with its dot). liveFailure:
// the failure column has not lapsed (the column not NULL); counted: the row
// carries a live count (a failing or ended record, or a holder's claim
// carrying one); takeable: a failing record, or a lapsed claim carrying a
// count, that a claim or a record takes over; heldByOther: a live claim of
// a holder other than token (SQL).
func liveFailure(a string) string {
	return `coalesce((` + a + `failure->>'expires')::bigint > ` + nowMS + `, true)`
}

func counted(a string) string {
	return `(` + a + `claim IS NOT NULL AND ` + a + `failure IS NOT NULL AND ` + liveFailure(a) + `)`
}

func takeable(a string) string {
	return `(` + counted(a) + ` AND ` + a + `failure->'end' IS NULL AND (` + a + `claim = '' OR ` + a + `expires_at <= ` + nowMS + `))`
}

func heldByOther(a, token string) string {
	return `coalesce(` + a + `claim NOT IN ('', ` + token + `) AND ` + a + `expires_at > ` + nowMS + `, false)`
}

// failureSQL are the statements of failing and ended records, on table t
// (quoted), whose records expire by expires (SQL).
type failureSQL struct {
	fail, failUnheld, failRow, reopen, rememberFailing string
	// the partitioned layout's locked Fail (format, see initPartitions)
	failFmt string
}

// initFailures prepares the statements of Fail and Reopen, and of
// RememberTx over a failing record.
func (s *Store) initFailures(t, expires string) {
	q := &s.failure
	// The failure as written: the caller's JSON and the count's expiry,
	// from the database clock.
	column := `$3::text::jsonb || jsonb_build_object('expires', ` + expires + `)`
	// Fail without an end keeps the caller's live claim, which carries the
	// count; with one, or over anything else that is neither a live
	// record nor another holder's live claim, the row becomes the failing
	// or ended record.
	keep := `(r.claim = $4 AND r.expires_at > ` + nowMS + ` AND EXCLUDED.failure->'end' IS NULL)`
	update := `ON CONFLICT (key) DO UPDATE SET claim = CASE WHEN ` + keep + ` THEN r.claim ELSE '' END,
			expires_at = CASE WHEN ` + keep + ` THEN r.expires_at ELSE EXCLUDED.expires_at END,
			fingerprint = EXCLUDED.fingerprint, value = NULL, failure = EXCLUDED.failure
		WHERE NOT (r.claim IS NULL AND (r.expires_at IS NULL OR r.expires_at > ` + nowMS + `))
			AND NOT ` + heldByOther("r.", "$4")
	// Like a record, it is written only while no session claim of another
	// worker of the table holds the key, unless the caller's own claim row
	// is live.
	q.fail = `INSERT INTO ` + t + ` AS r (key, expires_at, claim, fingerprint, failure) SELECT $1::uuid, ` + expires + `, '', $2::bigint, ` + column + `
		WHERE ` + unclaimedOrOwn(t, lockOfKeySQL("$1::uuid", t), "$1::uuid", "$4::text") + `
		` + update
	// Under WithTransactionClaims, without a claim here: another worker's
	// open claim is waited for at most the claim wait ($5).
	q.failUnheld = `INSERT INTO ` + t + ` AS r (key, expires_at, claim, fingerprint, failure) SELECT $1::uuid, ` + expires + `, '', $2::bigint, ` + column + `
		WHERE set_config('lock_timeout', $5, true) IS NOT NULL
		` + update
	// What kept Fail from writing: another holder's live claim (a row, or
	// a session claim holding the key's lock), or a live record.
	q.failRow = `SELECT coalesce(` + heldByOther("r.", "$2") + `, false) OR NOT pg_try_advisory_xact_lock_shared(` + lockOfKeySQL("u.k", t) + `),
		coalesce(r.claim IS NULL AND (r.expires_at IS NULL OR r.expires_at > ` + nowMS + `), false)
		FROM (SELECT $1::uuid AS k) AS u LEFT JOIN ` + t + ` AS r ON r.key = u.k`
	q.reopen = `DELETE FROM ` + t + ` WHERE key = $1 AND claim = '' AND failure->'end'->>'marker' = $2
		AND (expires_at IS NULL OR expires_at > ` + nowMS + `)`
	// RememberTx's second statement, when its upsert left the row alone: the
	// row as it was (old), and, when it is a failing record (or a lapsed
	// claim, or the caller's own, carrying a count), the record written
	// over it in the caller's transaction (up), so that the caller learns
	// the count in the same round trip. The update re-checks the row under
	// its lock, and the count it replaces must be the one read.
	q.rememberFailing = `WITH old AS (SELECT key, claim, fingerprint, value, failure, expires_at FROM ` + t + ` WHERE key = $1),
		up AS (UPDATE ` + t + ` AS r SET expires_at = ` + expires + `, claim = NULL, fingerprint = $2, value = $3, failure = NULL
			FROM old WHERE old.failure IS NOT NULL AND r.key = old.key AND r.failure = old.failure
				AND ` + counted("r.") + ` AND r.failure->'end' IS NULL AND (r.claim = '' OR r.claim = $4 OR r.expires_at <= ` + nowMS + `)
			RETURNING 1)
		SELECT ` + heldByOther("old.", "$4") + `, coalesce(old.fingerprint, 0), old.value,
			CASE WHEN ` + counted("old.") + ` THEN old.failure END,
			EXISTS (SELECT 1 FROM up)
		FROM old`
}

// failureLiteral is the failure column's value for f as SQL, with the
// count's expiry expires (SQL).
func failureLiteral(f stores.Failure, expires string) string {
	return `(` + quoteLiteral(encodeFailure(f)) + `::jsonb || jsonb_build_object('expires', ` + expires + `))`
}

// Fail records that key's runs failed (and, with f.End, that it ended);
// see stores.Store. One INSERT … ON CONFLICT DO UPDATE, which keeps the
// caller's live claim (carrying the count from then on) unless f ends the
// message, and leaves a live record and another holder's live claim alone:
// a SELECT then tells which (ErrClaimTaken for the claim, nil for the
// record).
func (s *Store) Fail(ctx context.Context, key string, fingerprint uint64, f stores.Failure) error {
	if s.session != nil {
		return s.failSession(ctx, key, fingerprint, f)
	}
	if s.held != nil {
		if done, err := s.failTx(ctx, key, fingerprint, f); done {
			return err
		}
	}
	ctx, cancel := s.context(ctx)
	defer cancel()
	rowKey, token := RowKey(key), s.holder(ctx)
	for attempt := 0; ; attempt++ {
		var written bool
		var err error
		switch {
		case s.parts != nil:
			written, err = s.execLocked(ctx, s.lockedWrite(s.failure.failFmt, rowKey, token,
				nullLiteral(fingerprint), failureLiteral(f, s.expiresSQL), strconv.FormatBool(f.End == nil)))
		case s.held != nil:
			wait := strconv.FormatInt(s.lockWait(ctx).Milliseconds(), 10) + "ms"
			written, err = s.wrote(ctx, s.failure.failUnheld, rowKey, nullFingerprint(fingerprint), encodeFailure(f), token, wait)
			if sqlstate.Is(err, lockNotAvailable) {
				return fmt.Errorf("postgresstore: fail: another delivery holds the key in an open claim: %w (%w)", stores.ErrClaimTaken, err)
			}
		default:
			written, err = s.wrote(ctx, s.failure.fail, rowKey, nullFingerprint(fingerprint), encodeFailure(f), token)
		}
		if err != nil {
			return fail(ctx, "fail", err)
		}
		if written {
			return nil
		}
		if again, err := s.whyNotFailed(ctx, rowKey, token, attempt); !again {
			return err
		}
		// The row changed since (released, lapsed, forgotten): again.
	}
}

// whyNotFailed tells why Fail's statement wrote nothing on rowKey's row:
// another holder's live claim (ErrClaimTaken), a live record (nil: the
// effect happened, and that is what the key keeps), or neither any more
// (again: the row changed since, released, lapsed or forgotten; an error
// once that happened three times).
func (s *Store) whyNotFailed(ctx context.Context, rowKey, token string, attempt int) (again bool, err error) {
	var taken, remembered bool
	err = s.db.QueryRowContext(ctx, s.failure.failRow, rowKey, token).Scan(&taken, &remembered)
	switch {
	case err != nil && !errors.Is(err, sql.ErrNoRows):
		return false, fail(ctx, "fail", err)
	case taken:
		return false, fmt.Errorf("postgresstore: fail: %w", stores.ErrClaimTaken)
	case remembered:
		return false, nil
	case attempt == 2:
		return false, fmt.Errorf("postgresstore: fail: the key's row kept changing under the statement")
	}
	return true, nil
}

// wrote runs a statement and reports whether it wrote a row; its error is
// the driver's.
func (s *Store) wrote(ctx context.Context, query string, args ...any) (bool, error) {
	res, err := s.db.ExecContext(ctx, query, args...)
	if err != nil {
		return false, err
	}
	n, err := res.RowsAffected()
	return n > 0, err
}

// nullLiteral is fingerprint as an SQL literal, NULL for 0.
func nullLiteral(fingerprint uint64) string {
	if fingerprint == 0 {
		return "NULL"
	}
	return strconv.FormatInt(int64(fingerprint), 10)
}

// Reopen drops key's ended record when its marker is marker; see
// stores.Store. One DELETE on the primary key.
func (s *Store) Reopen(ctx context.Context, key string, marker string) (bool, error) {
	ctx, cancel := s.context(ctx)
	defer cancel()
	res, err := s.db.ExecContext(ctx, s.failure.reopen, RowKey(key), marker)
	if err != nil {
		return false, fail(ctx, "reopen", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fail(ctx, "reopen", err)
	}
	return n == 1, nil
}

// rowQuerier runs a query returning at most one row, in the caller's
// transaction (database/sql or pgx).
type rowQuerier func(ctx context.Context, query string, args ...any) func(dest ...any) error

// rememberFound is RememberTx's answer when its upsert left the row alone:
// the caller's transaction records the key over a failing record (true,
// with the failing record found), or finds a duplicate, a live claim of
// another holder (in flight) or an end. noRow reports that no row matched
// the scan (the row went since the upsert).
func (s *Store) rememberFound(ctx context.Context, query rowQuerier, rowKey string, fingerprint uint64, value []byte, token string) (recorded bool, found stores.Record, again bool, err error) {
	var inFlight, updated bool
	var fp int64
	var kept, failure []byte
	err = query(ctx, s.failure.rememberFailing, rowKey, nullFingerprint(fingerprint), nullBytes(value), token)(&inFlight, &fp, &kept, &failure, &updated)
	switch {
	case isNoRows(err):
		return false, stores.Record{}, true, nil
	case err != nil:
		return false, stores.Record{}, false, err
	case failure == nil && inFlight:
		return false, stores.Record{State: stores.StateInFlight}, false, nil
	case failure == nil:
		return false, stores.Record{State: stores.StateRemembered, Fingerprint: uint64(fp), Value: kept}, false, nil
	}
	found, err = failedRecord(failure, fp)
	switch {
	case err != nil:
		return false, stores.Record{}, false, err
	case updated:
		return true, found, false, nil
	case inFlight:
		found.State, found.ExpiresAt = stores.StateInFlight, time.Time{}
		return false, found, false, nil
	case found.State == stores.StateEnded:
		return false, found, false, nil
	}
	return false, stores.Record{}, true, nil // the count changed under the statement
}

// isNoRows reports an empty result, from database/sql or pgx.
func isNoRows(err error) bool { return errors.Is(err, sql.ErrNoRows) || errors.Is(err, pgx.ErrNoRows) }
