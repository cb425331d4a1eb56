package postgresstore

import (
	"context"
	"database/sql"
	_ "embed"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/babelqueue/watermill-idempotency/internal/sqlmigrate"
	"github.com/babelqueue/watermill-idempotency/internal/sqlstate"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// DefaultEffectsTable is the table an Effects store uses unless
// WithEffectsTable says otherwise; its provider events go to the table of
// the same name followed by _events.
const DefaultEffectsTable = "watermill_idempotency_effects"

//go:embed effects.sql
var effectsSQL string

// Effects keeps the records of external effects ([stores.EffectStore]) in
// PostgreSQL, shared by every worker of a fleet. Build it with
// [NewEffects] and create its tables with [Effects.Migrate] (or
// effects.sql).
//
// One row per effect, keyed by its provider key, holds its intent, state,
// provider result, note, evidence, attempts, holder and lease; an index on
// (state, state_since) serves List and Stats. Every write is one statement
// on the store's own connections, never a caller's transaction: an intent
// commits before the call it announces. Times come from the database
// clock. Identities, results and notes are bytea, so any Go string is
// kept as given. Under a result lifetime (WithResultTTL) a succeeded
// effect's result_expires_at says when its result stops being read, and
// Purge or DeleteExpired clear it.
type Effects struct {
	db                   *sql.DB
	table, events, index string // quoted; index unqualified
	rindex               string // quoted, unqualified: the results to drop
	ttl                  time.Duration
	rttl                 time.Duration // the result lifetime; 0: the row's
	instance             string
	cols                 string
	beginSQL, moveSQL    string
	lookupSQL, eventSQL  string
	extendSQL            string
	listSQL, statsSQL    string
	forgetSQL            string
	cleanupSQLs          [2]string
	purgeSQLs            [2]string
	dropResultsSQL       string
}

var _ stores.EffectStore = (*Effects)(nil)

// EffectsOption configures an Effects store.
type EffectsOption func(*Effects)

// WithEffectsTable sets the table (default DefaultEffectsTable): a plain
// identifier, optionally qualified by a schema, of at most 56 characters
// (its events table adds _events).
func WithEffectsTable(name string) EffectsOption { return func(e *Effects) { e.table = name } }

// WithEffectsTTL makes final effects (succeeded, failed) and recorded
// provider events lapse ttl after they were written: they count as absent
// from then on, and DeleteExpired removes them. The default is
// stores.DefaultEffectsTTL (keep it at least as long as the replay
// horizon); zero keeps them until Purge or Forget removes them. Pending and
// unknown effects never lapse.
func WithEffectsTTL(ttl time.Duration) EffectsOption { return func(e *Effects) { e.ttl = ttl } }

// WithResultTTL keeps the provider's result of a succeeded effect for d
// after it succeeded, and the rest of its row for the effects TTL: past d
// every read treats the result as gone (Result nil, ResultDropped set, the
// effect still final), and Purge and DeleteExpired clear it in bulk (set
// the column to NULL, through a partial index of the results still held;
// PostgreSQL reuses the space once vacuumed). Zero (the default) keeps the
// result as long as the row. d may not be longer than the effects TTL
// (see stores.ValidResultTTL).
func WithResultTTL(d time.Duration) EffectsOption { return func(e *Effects) { e.rttl = d } }

// NewEffects returns an Effects store on db, which stays the caller's. It
// does not touch the database: call Migrate first. It returns an error
// matching ErrInvalidOption for a bad table name, TTL or result lifetime.
func NewEffects(db *sql.DB, opts ...EffectsOption) (*Effects, error) {
	e := &Effects{db: db, table: DefaultEffectsTable, ttl: stores.DefaultEffectsTTL, instance: stores.NewClaimToken()}
	for _, opt := range opts {
		opt(e)
	}
	if db == nil {
		return nil, fmt.Errorf("%w: nil *sql.DB", ErrInvalidOption)
	}
	if e.ttl < 0 || (e.ttl > 0 && e.ttl < time.Millisecond) {
		return nil, fmt.Errorf("%w: effects TTL %v: want 0 (forever) or at least 1ms", ErrInvalidOption, e.ttl)
	}
	if err := stores.ValidResultTTL(e.rttl, e.ttl); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidOption, err)
	}
	name := e.table
	if i := strings.LastIndexByte(name, '.'); i >= 0 {
		name = name[i+1:]
	}
	if len(name) > 56 {
		return nil, fmt.Errorf("%w: effects table %q: at most 56 characters", ErrInvalidOption, e.table)
	}
	raw := e.table
	var err error
	if e.table, err = quoteTable(raw); err != nil {
		return nil, err
	}
	e.events, _ = quoteTable(raw + "_events")
	e.index = `"` + name + `_state"`
	e.rindex = `"` + name + `_result"`
	e.prepare()
	return e, nil
}

func (e *Effects) prepare() {
	t := e.table
	ttl := min(e.ttl.Milliseconds(), maxLeaseMS)
	live := `(expires_at IS NULL OR expires_at > ` + nowMS + `)`
	// A result past its lifetime reads as gone, whether or not a purge
	// cleared it yet.
	e.cols = `key, name, scope, message_id, fingerprint, state,
		CASE WHEN result_expires_at IS NULL OR result_expires_at > ` + nowMS + ` THEN result END,
		note, evidence, attempts, holder, lease_until,
		created_at, state_since, updated_at, expires_at, result_expires_at, ` + nowMS
	e.beginSQL = `INSERT INTO ` + t + ` AS r (key, name, scope, message_id, fingerprint, state, attempts, holder, lease_until,
			created_at, state_since, updated_at)
		VALUES ($1, $2, $3, $4, $5, 'pending', 1, $6, ` + nowMS + ` + $7, ` + nowMS + `, ` + nowMS + `, ` + nowMS + `)
		ON CONFLICT (key) DO UPDATE SET name = EXCLUDED.name, scope = EXCLUDED.scope, message_id = EXCLUDED.message_id,
			fingerprint = EXCLUDED.fingerprint, state = 'pending', result = NULL, note = ''::bytea, evidence = '', attempts = 1,
			holder = EXCLUDED.holder, lease_until = EXCLUDED.lease_until, created_at = EXCLUDED.created_at,
			state_since = EXCLUDED.state_since, updated_at = EXCLUDED.updated_at, expires_at = NULL, result_expires_at = NULL
		WHERE r.expires_at IS NOT NULL AND r.expires_at <= ` + nowMS + `
		RETURNING ` + e.cols
	e.lookupSQL = `SELECT ` + e.cols + ` FROM ` + t + ` WHERE key = $1 AND ` + live
	// $1 key, $2 sources, $3 to, $4 result, $5 note, $6 evidence, $7 lease
	// ms, $8 holder, $9 only if idle, $10 an overrule.
	expires := `expires_at`
	if ttl > 0 {
		expires = fmt.Sprintf(`CASE WHEN $3::text IN ('succeeded', 'failed') THEN %s + %d ELSE expires_at END`, nowMS, ttl)
	}
	resultExpires := `result_expires_at`
	if rttl := min(e.rttl.Milliseconds(), maxLeaseMS); rttl > 0 {
		resultExpires = fmt.Sprintf(`CASE WHEN $3::text = 'succeeded' THEN %s + %d ELSE result_expires_at END`, nowMS, rttl)
	}
	e.moveSQL = `UPDATE ` + t + ` SET state = $3::text, updated_at = ` + nowMS + `, evidence = $6::text,
			state_since = CASE WHEN state <> $3::text THEN ` + nowMS + ` ELSE state_since END,
			note = CASE WHEN length($5::bytea) > 0 THEN $5::bytea ELSE note END,
			holder = CASE WHEN $3::text = 'pending' THEN $8::text ELSE '' END,
			lease_until = CASE WHEN $3::text = 'pending' THEN ` + nowMS + ` + $7::bigint WHEN $3::text = 'unknown' THEN lease_until ELSE 0 END,
			attempts = attempts + CASE WHEN $3::text = 'pending' THEN 1 ELSE 0 END,
			result = CASE WHEN $3::text = 'succeeded' THEN $4::bytea ELSE result END,
			result_expires_at = ` + resultExpires + `,
			expires_at = ` + expires + `
		WHERE key = $1 AND ` + live + ` AND state = ANY($2::text[])
			AND NOT (state = 'pending' AND $3::text IN ('pending', 'unknown') AND holder <> $8::text AND lease_until > ` + nowMS + `)
			AND NOT ($9::boolean AND state IN ('pending', 'unknown') AND lease_until > ` + nowMS + `)
			AND NOT ($10::boolean AND evidence <> '` + stores.EffectEvidenceOperator + `')
		RETURNING ` + e.cols
	// $1 key, $2 holder, $3 lease ms.
	e.extendSQL = `UPDATE ` + t + ` SET lease_until = ` + nowMS + ` + $3::bigint
		WHERE key = $1 AND state = 'pending' AND holder = $2::text AND ` + live + `
		RETURNING true`
	eventExpires := "NULL::bigint"
	if ttl > 0 {
		eventExpires = fmt.Sprintf("%s + %d", nowMS, ttl)
	}
	e.eventSQL = `INSERT INTO ` + e.events + ` AS v (event_id, key, received_at, expires_at) VALUES ($1, $2, ` + nowMS + `, ` + eventExpires + `)
		ON CONFLICT (event_id) DO UPDATE SET key = EXCLUDED.key, received_at = EXCLUDED.received_at, expires_at = EXCLUDED.expires_at
		WHERE v.expires_at IS NOT NULL AND v.expires_at <= ` + nowMS + `
		RETURNING true`
	e.listSQL = `SELECT ` + e.cols + ` FROM ` + t + ` WHERE ` + live + ` AND state = ANY($1::text[])
		AND ($2::bigint = 0 OR state_since < $2) ORDER BY state_since, key LIMIT $3`
	e.statsSQL = `SELECT state, count(*), min(state_since) FROM ` + t + ` WHERE ` + live + ` GROUP BY state`
	e.forgetSQL = `DELETE FROM ` + t + ` WHERE key = $1`
	e.purgeSQLs = [2]string{`DELETE FROM ` + t + ` WHERE state IN ('succeeded', 'failed') AND (state_since < $1 OR expires_at <= ` + nowMS + `)`,
		`DELETE FROM ` + e.events + ` WHERE received_at < $1 OR expires_at <= ` + nowMS}
	e.dropResultsSQL = `UPDATE ` + t + ` SET result = NULL WHERE result IS NOT NULL AND result_expires_at IS NOT NULL
		AND result_expires_at <= ` + nowMS
	e.cleanupSQLs = [2]string{`DELETE FROM ` + t + ` WHERE expires_at <= ` + nowMS, `DELETE FROM ` + e.events + ` WHERE expires_at <= ` + nowMS}
}

// maxLeaseMS bounds leases and retentions in milliseconds, far from
// bigint's end when added to the clock.
const maxLeaseMS = 1 << 60

// Migrate creates the store's tables and index if they do not exist (safe
// on every boot, from every replica at once: migrations of one table run
// one at a time, and a wait ends with ctx). effects.sql holds the
// same DDL for the default names.
func (e *Effects) Migrate(ctx context.Context) error {
	ddl := strings.NewReplacer(`"`+DefaultEffectsTable+`_events"`, e.events, `"`+DefaultEffectsTable+`_state"`, e.index,
		`"`+DefaultEffectsTable+`_result"`, e.rindex, `"`+DefaultEffectsTable+`"`, e.table).Replace(effectsSQL)
	if err := sqlmigrate.Postgres(ctx, e.db, e.table, ddl); err != nil {
		return fmt.Errorf("postgresstore: migrate effects %s: %w", e.table, err)
	}
	return nil
}

// Tables returns the quoted names of the effects table and its events
// table.
func (e *Effects) Tables() (effects, events string) { return e.table, e.events }

func (e *Effects) holder(ctx context.Context) string {
	if token := stores.ClaimToken(ctx); token != "" {
		return token
	}
	return e.instance
}

type rowScanner interface{ Scan(dest ...any) error }

// scanEffect reads a row of e.cols; sql.ErrNoRows is no effect.
func scanEffect(row rowScanner) (stores.Effect, error) {
	var (
		eff                                           stores.Effect
		key, name, scope, mid, note                   []byte
		fp                                            int64
		state                                         string
		lease, created, since, updated, now, attempts int64
		expires, resultExpires                        sql.NullInt64
	)
	dest := append([]any{}, &key, &name, &scope, &mid, &fp, &state, &eff.Result, &note, &eff.Evidence, &attempts, &eff.Holder,
		&lease, &created, &since, &updated, &expires, &resultExpires, &now)
	if err := row.Scan(dest...); err != nil {
		return eff, err
	}
	eff.Key, eff.Name, eff.Scope, eff.MessageID, eff.Note = string(key), string(name), string(scope), string(mid), string(note)
	eff.Fingerprint, eff.State, eff.Attempts = uint64(fp), stores.EffectState(state), int(attempts)
	eff.CreatedAt, eff.StateSince, eff.UpdatedAt = time.UnixMilli(created), time.UnixMilli(since), time.UnixMilli(updated)
	if expires.Valid {
		eff.ExpiresAt = time.UnixMilli(expires.Int64)
	}
	if resultExpires.Valid {
		eff.ResultExpiresAt = time.UnixMilli(resultExpires.Int64)
		if now >= resultExpires.Int64 {
			eff.Result, eff.ResultDropped = nil, true
		}
	}
	switch {
	case eff.State == stores.EffectPending:
		eff.LeaseUntil, eff.LeaseLapsed = time.UnixMilli(lease), now >= lease
	case eff.State == stores.EffectUnknown && lease > 0:
		eff.LeaseUntil, eff.Landing = time.UnixMilli(lease), now < lease
	}
	return eff, nil
}

// Begin records intent as a pending effect held by the caller, or returns
// the effect that exists.
func (e *Effects) Begin(ctx context.Context, intent stores.EffectIntent, lease time.Duration) (bool, stores.Effect, error) {
	for range 3 {
		eff, err := scanEffect(e.db.QueryRowContext(ctx, e.beginSQL, []byte(intent.Key), []byte(intent.Name), []byte(intent.Scope),
			[]byte(intent.MessageID), int64(intent.Fingerprint), e.holder(ctx), min(lease.Milliseconds(), maxLeaseMS)))
		switch {
		case err == nil:
			return true, eff, nil
		case !errors.Is(err, sql.ErrNoRows):
			return false, eff, fail(ctx, "begin effect", err)
		}
		found, err := e.Lookup(ctx, intent.Key)
		if err != nil || found.State != stores.EffectNone {
			return false, found, err
		}
		// Removed or lapsed between the two statements: insert again.
	}
	return false, stores.Effect{}, errors.New("postgresstore: begin effect: the record kept changing")
}

// Transition moves the effect key as t says, when allowed.
func (e *Effects) Transition(ctx context.Context, key string, t stores.EffectTransition) (bool, stores.Effect, error) {
	return e.transition(ctx, e.db, key, t)
}

type querier interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

func (e *Effects) transition(ctx context.Context, q querier, key string, t stores.EffectTransition) (bool, stores.Effect, error) {
	sources := t.Sources()
	if len(sources) == 0 {
		return false, stores.Effect{}, fmt.Errorf("postgresstore: %s to %s: %w", t.From, t.To, stores.ErrEffectTransition)
	}
	names := make([]string, len(sources))
	for i, s := range sources {
		names[i] = string(s)
	}
	result := t.Result
	if result == nil && t.To == stores.EffectSucceeded {
		result = []byte{}
	}
	eff, err := scanEffect(q.QueryRowContext(ctx, e.moveSQL, []byte(key), textArray(names), string(t.To), result, []byte(t.Note), t.Evidence,
		min(t.Lease.Milliseconds(), maxLeaseMS), e.holder(ctx), t.IfIdle, t.Overrule))
	switch {
	case err == nil:
		return true, eff, nil
	case !errors.Is(err, sql.ErrNoRows):
		return false, eff, fail(ctx, "effect transition", err)
	}
	eff, err = scanEffect(q.QueryRowContext(ctx, e.lookupSQL, []byte(key)))
	if errors.Is(err, sql.ErrNoRows) {
		return false, stores.Effect{}, nil
	}
	if err != nil {
		return false, eff, fail(ctx, "effect transition", err)
	}
	return false, eff, nil
}

// Extend renews the caller's lease of the pending effect key.
func (e *Effects) Extend(ctx context.Context, key string, lease time.Duration) (bool, error) {
	var held bool
	err := e.db.QueryRowContext(ctx, e.extendSQL, []byte(key), e.holder(ctx), min(lease.Milliseconds(), maxLeaseMS)).Scan(&held)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return false, nil
	case err != nil:
		return false, fail(ctx, "extend effect lease", err)
	}
	return held, nil
}

// Lookup returns the effect key.
func (e *Effects) Lookup(ctx context.Context, key string) (stores.Effect, error) {
	eff, err := scanEffect(e.db.QueryRowContext(ctx, e.lookupSQL, []byte(key)))
	if errors.Is(err, sql.ErrNoRows) {
		return stores.Effect{}, nil
	}
	if err != nil {
		return eff, fail(ctx, "look up effect", err)
	}
	return eff, nil
}

// ApplyEvent records eventID once and, the first time, applies t to key,
// in one transaction.
func (e *Effects) ApplyEvent(ctx context.Context, eventID, key string, t stores.EffectTransition) (stores.EventResult, error) {
	if len(t.Sources()) == 0 {
		return stores.EventResult{}, fmt.Errorf("postgresstore: %s to %s: %w", t.From, t.To, stores.ErrEffectTransition)
	}
	for attempt := 1; ; attempt++ {
		res, err := e.applyEvent(ctx, eventID, key, t)
		if err == nil || attempt >= 3 || !(sqlstate.Is(err, sqlstate.SerializationFailure) || sqlstate.Is(err, sqlstate.DeadlockDetected)) {
			return res, err
		}
	}
}

func (e *Effects) applyEvent(ctx context.Context, eventID, key string, t stores.EffectTransition) (stores.EventResult, error) {
	tx, err := e.db.BeginTx(ctx, nil)
	if err != nil {
		return stores.EventResult{}, fail(ctx, "apply effect event", err)
	}
	defer func() { _ = tx.Rollback() }()
	var first bool
	err = tx.QueryRowContext(ctx, e.eventSQL, []byte(eventID), []byte(key)).Scan(&first)
	if err != nil && !errors.Is(err, sql.ErrNoRows) {
		return stores.EventResult{}, fail(ctx, "apply effect event", err)
	}
	var res stores.EventResult
	if first {
		res.First = true
		if res.Moved, res.Now, err = e.transition(ctx, tx, key, t); err != nil {
			return stores.EventResult{}, err
		}
	} else {
		eff, err := scanEffect(tx.QueryRowContext(ctx, e.lookupSQL, []byte(key)))
		if err != nil && !errors.Is(err, sql.ErrNoRows) {
			return stores.EventResult{}, fail(ctx, "apply effect event", err)
		}
		res.Now = eff
		if errors.Is(err, sql.ErrNoRows) {
			res.Now = stores.Effect{}
		}
	}
	if err := tx.Commit(); err != nil {
		return stores.EventResult{}, fail(ctx, "apply effect event: commit", err)
	}
	return res, nil
}

// List returns the effects q selects, oldest first.
func (e *Effects) List(ctx context.Context, q stores.EffectQuery) ([]stores.Effect, error) {
	q = q.Normalized()
	names := make([]string, len(q.States))
	for i, s := range q.States {
		names[i] = string(s)
	}
	var before int64
	if !q.EnteredBefore.IsZero() {
		before = q.EnteredBefore.UnixMilli()
	}
	rows, err := e.db.QueryContext(ctx, e.listSQL, textArray(names), before, q.Limit)
	if err != nil {
		return nil, fail(ctx, "list effects", err)
	}
	defer rows.Close()
	var out []stores.Effect
	for rows.Next() {
		eff, err := scanEffect(rows)
		if err != nil {
			return nil, fail(ctx, "list effects", err)
		}
		out = append(out, eff)
	}
	if err := rows.Err(); err != nil {
		return nil, fail(ctx, "list effects", err)
	}
	return out, nil
}

// Stats counts the effects in each state and finds the oldest.
func (e *Effects) Stats(ctx context.Context) (map[stores.EffectState]stores.EffectStat, error) {
	rows, err := e.db.QueryContext(ctx, e.statsSQL)
	if err != nil {
		return nil, fail(ctx, "effect stats", err)
	}
	defer rows.Close()
	out := map[stores.EffectState]stores.EffectStat{}
	for rows.Next() {
		var state string
		var n, oldest int64
		if err := rows.Scan(&state, &n, &oldest); err != nil {
			return nil, fail(ctx, "effect stats", err)
		}
		out[stores.EffectState(state)] = stores.EffectStat{Count: n, Oldest: time.UnixMilli(oldest)}
	}
	if err := rows.Err(); err != nil {
		return nil, fail(ctx, "effect stats", err)
	}
	return out, nil
}

// Forget removes the effect key.
func (e *Effects) Forget(ctx context.Context, key string) error {
	if _, err := e.db.ExecContext(ctx, e.forgetSQL, []byte(key)); err != nil {
		return fail(ctx, "forget effect", err)
	}
	return nil
}

// DeleteExpired removes the final effects and the provider events whose
// retention (WithEffectsTTL) passed, and reports how many rows went; it
// also clears the results past their lifetime (WithResultTTL), which it
// does not count.
func (e *Effects) DeleteExpired(ctx context.Context) (int64, error) {
	if err := e.dropResults(ctx); err != nil {
		return 0, err
	}
	var total int64
	for _, stmt := range e.cleanupSQLs {
		res, err := e.db.ExecContext(ctx, stmt)
		if err != nil {
			return total, fail(ctx, "delete expired effects", err)
		}
		n, _ := res.RowsAffected()
		total += n
	}
	return total, nil
}

// Purge removes the final effects (succeeded, failed) that entered their
// state before before, and the provider events received before it, with
// those whose retention passed (as DeleteExpired), and reports how many
// rows went; it also clears the results past their lifetime
// (WithResultTTL), which it does not count. Pending and unknown effects
// stay, whatever their age.
func (e *Effects) Purge(ctx context.Context, before time.Time) (int64, error) {
	if err := e.dropResults(ctx); err != nil {
		return 0, err
	}
	var total int64
	for _, stmt := range e.purgeSQLs {
		res, err := e.db.ExecContext(ctx, stmt, before.UnixMilli())
		if err != nil {
			return total, fail(ctx, "purge effects", err)
		}
		n, _ := res.RowsAffected()
		total += n
	}
	return total, nil
}

// dropResults clears the results past their lifetime.
func (e *Effects) dropResults(ctx context.Context) error {
	if _, err := e.db.ExecContext(ctx, e.dropResultsSQL); err != nil {
		return fail(ctx, "drop expired effect results", err)
	}
	return nil
}
