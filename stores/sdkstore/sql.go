package sdkstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/babelqueue/watermill-idempotency/internal/ctxerr"
	"github.com/babelqueue/watermill-idempotency/internal/sqlmigrate"
	"github.com/babelqueue/watermill-idempotency/internal/sqlstate"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// Default tables of the SDK SQL stores.
const (
	DefaultPHPTable = "bq_idempotency"         // PHP PdoStore
	DefaultGoTable  = "babelqueue_idempotency" // Go SDK idempotency-postgres
)

// PHPMaxIDChars is the longest message id the PHP PdoStore's message_id
// column (VARCHAR(255)) holds.
const PHPMaxIDChars = 255

// Dialect is the database a PHP PdoStore table lives in.
type Dialect int

// The databases the PHP PdoStore layout is supported on.
const (
	PostgreSQL Dialect = iota + 1 // PostgreSQL, through pgx's database/sql driver
	MariaDB                       // MariaDB 10.3 or later, through go-sql-driver/mysql
)

// String returns "PostgreSQL" or "MariaDB".
func (d Dialect) String() string {
	switch d {
	case PostgreSQL:
		return "PostgreSQL"
	case MariaDB:
		return "MariaDB"
	}
	return fmt.Sprintf("Dialect(%d)", int(d))
}

// PHPPDOStore reads and writes the records of the PHP SDK's PdoStore: one
// row per meta.id with state 'claimed' (and expires_at, Unix seconds) or
// 'seen' (expires_at NULL). See the package documentation.
type PHPPDOStore struct {
	notSupported
	db      *sql.DB
	cfg     config
	dialect Dialect
	table   string

	rememberSQL, forgetSQL, claimSQL, takeoverSQL, releaseSQL, claimRowSQL, inspectSQL, extendSQL, stateSQL string

	// instance is the claim holder of calls whose context names none.
	instance string

	// gens maps a holder token and key to the expires_at its claim wrote.
	// The layout has no column for the holder, and among the kit's
	// claims a claim's expires_at tells it from the claims before it (a
	// takeover always writes a later one), so the holder recognises its
	// claim by that value: Release drops the row only while it still
	// carries it, and a Claim finding it there finds its own claim.
	mu   sync.Mutex
	gens map[string]claimGen
	now  func() time.Time // the worker's clock (a test sets its own)
}

// claimGen is a claim the instance took: the expiry it wrote (Unix seconds
// by the database clock) and, read on this process's monotonic clock, when
// that expiry has surely passed. The latter decides when the instance may
// forget the claim: the database's expiry is never compared with the
// worker's wall clock, which may be off by any amount.
type claimGen struct {
	expires int64
	until   time.Time
}

var _ stores.Store = (*PHPPDOStore)(nil)

// NewPHPPDO returns a store on db sharing the PHP SDK PdoStore's table, in
// PostgreSQL or MariaDB. Options: WithTable, WithScopedKeys,
// WithQueryTimeout. It does not touch the database: call Migrate first (on
// PostgreSQL the PHP side may create the table instead; on MariaDB Migrate
// is what checks a table the PHP side made). db stays the caller's. On
// MariaDB, leave go-sql-driver/mysql's clientFoundRows off (the default).
func NewPHPPDO(db *sql.DB, dialect Dialect, opts ...Option) (*PHPPDOStore, error) {
	cfg := newConfig(opts)
	if cfg.table == "" {
		cfg.table = DefaultPHPTable
	}
	if err := sqlCommon(db, &cfg, false); err != nil {
		return nil, err
	}
	if cfg.ttlSet {
		return nil, fmt.Errorf("%w: the PHP PdoStore layout keeps remembered messages until they are deleted; WithTTL does not apply", ErrInvalidOption)
	}
	s := &PHPPDOStore{db: db, cfg: cfg, dialect: dialect, instance: stores.NewClaimToken(), gens: map[string]claimGen{}, now: time.Now}
	t := cfg.table
	switch dialect {
	case PostgreSQL:
		if err := checkFolded("table", t); err != nil {
			return nil, err
		}
		t = quotePG(t)
		now := "floor(extract(epoch from clock_timestamp()))::bigint"
		// Remember replaces a 'seen' row, the caller's own claim (the
		// expiry it wrote, $2) or a lapsed one; another live claim (the
		// PHP SDK's, or another holder's) is left alone: no row affected.
		s.rememberSQL = `INSERT INTO ` + t + ` AS r (message_id, state, expires_at) VALUES ($1, 'seen', NULL)
ON CONFLICT (message_id) DO UPDATE SET state = 'seen', expires_at = NULL
WHERE r.state <> 'claimed' OR r.expires_at IS NULL OR r.expires_at < ` + now + ` OR r.expires_at = $2`
		s.extendSQL = `UPDATE ` + t + ` SET expires_at = ` + now + ` + $3
WHERE message_id = $1 AND state = 'claimed' AND expires_at = $2 AND expires_at >= ` + now + `
RETURNING expires_at`
		s.forgetSQL = `DELETE FROM ` + t + ` WHERE message_id = $1`
		s.claimSQL = `INSERT INTO ` + t + ` AS r (message_id, state, expires_at) VALUES ($1, 'claimed', ` + now + ` + $2)
ON CONFLICT (message_id) DO UPDATE SET expires_at = EXCLUDED.expires_at
WHERE r.state = 'claimed' AND r.expires_at < ` + now + `
RETURNING expires_at`
		s.releaseSQL = `DELETE FROM ` + t + ` WHERE message_id = $1 AND state = 'claimed' AND expires_at = $2`
		s.claimRowSQL = `SELECT EXISTS (SELECT 1 FROM ` + t + ` WHERE message_id = $1 AND state = 'claimed' AND expires_at = $2 AND expires_at >= ` + now + `)`
		s.inspectSQL = `SELECT state, expires_at, ` + now + ` FROM ` + t + ` WHERE message_id = $1`
	case MariaDB:
		t = quoteMaria(t)
		// As on PostgreSQL; MariaDB assigns left to right, so the state
		// follows the new expiry (NULL once replaced). A row left as it
		// was (refused, or 'seen' already) affects none.
		s.rememberSQL = `INSERT INTO ` + t + ` (message_id, state, expires_at) VALUES (?, 'seen', NULL)
ON DUPLICATE KEY UPDATE
    expires_at = IF(state <> 'claimed' OR expires_at IS NULL OR expires_at < UNIX_TIMESTAMP() OR expires_at <=> ?, NULL, expires_at),
    state = IF(expires_at IS NULL, 'seen', state)`
		s.stateSQL = `SELECT state FROM ` + t + ` WHERE message_id = ?`
		s.extendSQL = `UPDATE ` + t + ` SET expires_at = ? WHERE message_id = ? AND state = 'claimed' AND expires_at = ? AND expires_at >= ?`
		s.forgetSQL = `DELETE FROM ` + t + ` WHERE message_id = ?`
		s.claimSQL = `INSERT INTO ` + t + ` (message_id, state, expires_at) VALUES (?, 'claimed', ?)`
		s.takeoverSQL = `UPDATE ` + t + ` SET expires_at = ? WHERE message_id = ? AND state = 'claimed' AND expires_at < ?`
		s.releaseSQL = `DELETE FROM ` + t + ` WHERE message_id = ? AND state = 'claimed' AND expires_at = ?`
		s.claimRowSQL = `SELECT EXISTS (SELECT 1 FROM ` + t + ` WHERE message_id = ? AND state = 'claimed' AND expires_at = ? AND expires_at >= UNIX_TIMESTAMP())`
		s.inspectSQL = `SELECT state, expires_at, UNIX_TIMESTAMP() FROM ` + t + ` WHERE message_id = ?`
	default:
		return nil, fmt.Errorf("%w: dialect %v: want PostgreSQL or MariaDB", ErrInvalidOption, dialect)
	}
	s.table = t
	return s, nil
}

func sqlCommon(db *sql.DB, cfg *config, claims bool) error {
	if db == nil {
		return fmt.Errorf("%w: nil *sql.DB", ErrInvalidOption)
	}
	if cfg.prefix != "" || cfg.claimPrefix != "" {
		return fmt.Errorf("%w: a key prefix does not apply to an SQL layout", ErrInvalidOption)
	}
	if !claims && cfg.claimTable != "" {
		return fmt.Errorf("%w: WithClaimTable applies to the Go SDK layout only", ErrInvalidOption)
	}
	if err := checkTable(cfg.table); err != nil {
		return err
	}
	if cfg.queryTimeout < 0 {
		return fmt.Errorf("%w: negative query timeout %v", ErrInvalidOption, cfg.queryTimeout)
	}
	return cfg.checkTTL()
}

// checkFolded refuses a PostgreSQL table name with capitals. The BabelQueue
// SDKs write the name unquoted, and PostgreSQL folds an unquoted name to
// lower case: "Orders_Idem" would be the table orders_idem to them, while the
// kit, which quotes the name, would use another table, "Orders_Idem", and a
// message handled on both sides would run twice. The error names the table
// the SDKs use.
func checkFolded(what, name string) error {
	if folded := strings.ToLower(name); folded != name {
		return fmt.Errorf("%w: %s %q: PostgreSQL folds the name to lower case where it is not quoted, as the BabelQueue SDKs write it, so their table is %s: give that name",
			ErrInvalidOption, what, name, folded)
	}
	return nil
}

func quotePG(name string) string {
	parts := strings.Split(name, ".")
	for i, p := range parts {
		parts[i] = `"` + p + `"`
	}
	return strings.Join(parts, ".")
}

func quoteMaria(name string) string {
	parts := strings.Split(name, ".")
	for i, p := range parts {
		parts[i] = "`" + p + "`"
	}
	return strings.Join(parts, ".")
}

// Migrate creates the table with the PdoStore's columns if it does not
// exist. On MariaDB the message_id column compares byte for byte
// (utf8mb4_nopad_bin); Migrate checks that an existing table does too and
// returns an error matching ErrKeyCollation, ending with the ALTER TABLE
// that fixes it, when it does not: a table the PHP SDK made with
// PdoStore::ddl() takes the database's default collation, which on MariaDB
// usually ignores case (utf8mb4_general_ci). So on MariaDB call Migrate
// even when the PHP side made the table. Replicas may call it at once: the
// migrations of one table run one at a time (an advisory lock on
// PostgreSQL, GET_LOCK on MariaDB), and a wait ends with ctx.
func (s *PHPPDOStore) Migrate(ctx context.Context) error {
	ctx, cancel := s.cfg.bound(ctx)
	defer cancel()
	if s.dialect == PostgreSQL {
		err := sqlmigrate.Postgres(ctx, s.db, s.table, `CREATE TABLE IF NOT EXISTS `+s.table+` (
    message_id VARCHAR(255) PRIMARY KEY,
    state      VARCHAR(16)  NOT NULL,
    expires_at BIGINT       NULL
)`)
		if err != nil {
			return fmt.Errorf("sdkstore: create %s: %w", s.table, ctxerr.Match(ctx, err))
		}
		return nil
	}
	return sqlmigrate.MariaDB(ctx, s.db, s.table, s.migrateMariaDB)
}

// migrateMariaDB creates the table on conn, which holds the migration lock,
// and checks the collation of its key.
func (s *PHPPDOStore) migrateMariaDB(ctx context.Context, conn *sql.Conn) error {
	if _, err := conn.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+s.table+` (
    message_id VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL PRIMARY KEY,
    state      VARCHAR(16)  NOT NULL,
    expires_at BIGINT       NULL
)`); err != nil {
		return fmt.Errorf("sdkstore: create %s: %w", s.table, ctxerr.Match(ctx, err))
	}
	schema, table := "", s.cfg.table
	if i := strings.IndexByte(table, '.'); i >= 0 {
		schema, table = table[:i], table[i+1:]
	}
	var collation sql.NullString
	err := conn.QueryRowContext(ctx, `SELECT COLLATION_NAME FROM information_schema.COLUMNS
WHERE TABLE_SCHEMA = COALESCE(NULLIF(?, ''), DATABASE()) AND TABLE_NAME = ? AND COLUMN_NAME = 'message_id'`, schema, table).Scan(&collation)
	if err != nil {
		return fmt.Errorf("sdkstore: read the collation of %s.message_id: %w", s.table, ctxerr.Match(ctx, err))
	}
	if c := collation.String; collation.Valid && !strings.HasSuffix(c, "_nopad_bin") && !strings.HasSuffix(c, "_0900_bin") {
		return fmt.Errorf("%w: %s.message_id uses %s (a table made by the PHP SDK's PdoStore::ddl() takes the database's default), "+
			"so ids differing only in case or trailing spaces would share one record; run ALTER TABLE %s MODIFY message_id VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL",
			ErrKeyCollation, s.table, c, s.table)
	}
	return nil
}

// inspect reports key's row: state 'seen' is remembered, with no expiry; a
// 'claimed' row is in flight while its expires_at has not passed by the
// database clock, and a lapsed claim (one any claimer may take over) is
// unknown, as is an absent row. A claim's expires_at counts whole seconds
// and the claim holds through that second, so ExpiresAt is the second after
// it: the first instant a claimer can take the row over. A row in any other
// state is reported in flight (with its expires_at when it has one):
// neither side reads it as done, nor can claim it.
func (s *PHPPDOStore) inspect(ctx context.Context, key string) (stores.Record, error) {
	if err := s.cfg.checkKey(key); err != nil {
		return stores.Record{}, err
	}
	ctx, cancel := s.cfg.bound(ctx)
	defer cancel()
	var (
		state   string
		expires sql.NullInt64
		now     int64
	)
	err := s.db.QueryRowContext(ctx, s.inspectSQL, columnKey(key, PHPMaxIDChars)).Scan(&state, &expires, &now)
	if errors.Is(err, sql.ErrNoRows) {
		return stores.Record{}, nil
	}
	if err != nil {
		return stores.Record{}, fmt.Errorf("sdkstore: inspect in %s: %w", s.table, ctxerr.Match(ctx, err))
	}
	switch {
	case state == "seen":
		return stores.Record{State: stores.StateRemembered}, nil
	case state == "claimed" && expires.Valid && expires.Int64 < now:
		return stores.Record{}, nil // a lapsed claim: nothing runs under it
	}
	r := stores.Record{State: stores.StateInFlight}
	if expires.Valid {
		r.ExpiresAt = time.Unix(expires.Int64, 0).Add(time.Second)
	}
	return r, nil
}

// remember sets key's row to state 'seen' with no expiry, unless it holds
// another live claim (the PHP SDK's, or another holder's): that is left
// alone (stores.ErrClaimTaken).
func (s *PHPPDOStore) remember(ctx context.Context, key string) error {
	if err := s.cfg.checkKey(key); err != nil {
		return err
	}
	ctx, cancel := s.cfg.bound(ctx)
	defer cancel()
	id := columnKey(key, PHPMaxIDChars)
	var gen sql.NullInt64
	gen.Int64, gen.Valid = s.gen(holderToken(ctx, s.instance), key)
	res, err := s.db.ExecContext(ctx, s.rememberSQL, id, gen)
	if err != nil {
		return fmt.Errorf("sdkstore: remember in %s: %w", s.table, ctxerr.Match(ctx, err))
	}
	n, err := res.RowsAffected()
	if err != nil {
		return fmt.Errorf("sdkstore: remember in %s: %w", s.table, ctxerr.Match(ctx, err))
	}
	if n == 0 && s.dialect == MariaDB { // left as it was: 'seen' already, or refused
		var state string
		if err := s.db.QueryRowContext(ctx, s.stateSQL, id).Scan(&state); err != nil {
			return fmt.Errorf("sdkstore: remember in %s: %w", s.table, ctxerr.Match(ctx, err))
		}
		if state == "seen" {
			n = 1
		}
	}
	if n == 0 {
		return fmt.Errorf("sdkstore: remember in %s: %w", s.table, stores.ErrClaimTaken)
	}
	s.dropGen(ctx, key)
	return nil
}

// Extend extends the caller's live claim on key to lease from now (whole
// seconds, rounded up, by the database clock); held is false when key
// holds no live claim of this holder. A holder's claim is recognised by
// the expiry it last wrote, which this store instance remembers (see
// Release).
func (s *PHPPDOStore) Extend(ctx context.Context, key string, lease time.Duration) (bool, error) {
	if err := s.cfg.checkKey(key); err != nil {
		return false, err
	}
	if lease < time.Millisecond {
		return false, fmt.Errorf("sdkstore: lease %v: want at least 1ms", lease)
	}
	ctx, cancel := s.cfg.bound(ctx)
	defer cancel()
	holder := holderToken(ctx, s.instance)
	gen, ok := s.gen(holder, key)
	if !ok {
		return false, ctx.Err()
	}
	id, secs := columnKey(key, PHPMaxIDChars), leaseSeconds(lease)
	var expires int64
	if s.dialect == PostgreSQL {
		err := s.db.QueryRowContext(ctx, s.extendSQL, id, gen, secs).Scan(&expires)
		if errors.Is(err, sql.ErrNoRows) {
			return false, nil
		}
		if err != nil {
			return false, fmt.Errorf("sdkstore: extend the claim in %s: %w", s.table, ctxerr.Match(ctx, err))
		}
	} else {
		var now int64
		if err := s.db.QueryRowContext(ctx, `SELECT UNIX_TIMESTAMP()`).Scan(&now); err != nil {
			return false, fmt.Errorf("sdkstore: read the database clock: %w", ctxerr.Match(ctx, err))
		}
		expires = now + secs
		res, err := s.db.ExecContext(ctx, s.extendSQL, expires, id, gen, now)
		if err != nil {
			return false, fmt.Errorf("sdkstore: extend the claim in %s: %w", s.table, ctxerr.Match(ctx, err))
		}
		n, err := res.RowsAffected()
		if err != nil {
			return false, fmt.Errorf("sdkstore: extend the claim in %s: %w", s.table, ctxerr.Match(ctx, err))
		}
		if n != 1 {
			// MariaDB counts a row left unchanged (extended within the
			// second its claim already ends in) as not affected.
			if expires != gen {
				return false, nil
			}
			return s.ownClaim(ctx, id, holder, key)
		}
	}
	s.keepGen(holder, key, expires, secs)
	return true, nil
}

// Forget deletes key's row, claimed or seen.
func (s *PHPPDOStore) Forget(ctx context.Context, key string) error {
	if err := s.cfg.checkKey(key); err != nil {
		return err
	}
	ctx, cancel := s.cfg.bound(ctx)
	defer cancel()
	if _, err := s.db.ExecContext(ctx, s.forgetSQL, columnKey(key, PHPMaxIDChars)); err != nil {
		return fmt.Errorf("sdkstore: forget in %s: %w", s.table, ctxerr.Match(ctx, err))
	}
	s.dropGen(ctx, key)
	return nil
}

// leaseSeconds rounds a lease up to whole seconds, the layout's unit. It
// does not overflow for the longest leases: they never wrap into the past.
func leaseSeconds(lease time.Duration) int64 {
	return int64(lease/time.Second) + int64(min(lease%time.Second, 1))
}

// claim inserts key's row as 'claimed' until now + lease (whole seconds,
// rounded up, by the database clock), or takes over a 'claimed' row whose
// expiry has passed. A claim lasts between lease and lease + 1s. A live
// claim this store instance took for the same holder (the delivery's
// token, or the instance's when ctx names none) is the holder's own: Claim
// reports true and keeps its expiry.
func (s *PHPPDOStore) claim(ctx context.Context, key string, lease time.Duration) (bool, error) {
	if err := s.cfg.checkKey(key); err != nil {
		return false, err
	}
	if lease < time.Millisecond {
		return false, fmt.Errorf("sdkstore: lease %v: want at least 1ms", lease)
	}
	ctx, cancel := s.cfg.bound(ctx)
	defer cancel()
	id, secs, holder := columnKey(key, PHPMaxIDChars), leaseSeconds(lease), holderToken(ctx, s.instance)
	var expires int64
	if s.dialect == PostgreSQL {
		err := s.db.QueryRowContext(ctx, s.claimSQL, id, secs).Scan(&expires)
		if errors.Is(err, sql.ErrNoRows) {
			return s.ownClaim(ctx, id, holder, key)
		}
		if err != nil {
			return false, fmt.Errorf("sdkstore: claim in %s: %w", s.table, ctxerr.Match(ctx, err))
		}
	} else {
		var now int64
		if err := s.db.QueryRowContext(ctx, `SELECT UNIX_TIMESTAMP()`).Scan(&now); err != nil {
			return false, fmt.Errorf("sdkstore: read the database clock: %w", ctxerr.Match(ctx, err))
		}
		expires = now + secs
		_, err := s.db.ExecContext(ctx, s.claimSQL, id, expires)
		var me *mysql.MySQLError
		switch {
		case errors.As(err, &me) && me.Number == 1062: // duplicate key: take over a lapsed claim
			res, err := s.db.ExecContext(ctx, s.takeoverSQL, expires, id, now)
			if err != nil {
				return false, fmt.Errorf("sdkstore: take over a claim in %s: %w", s.table, ctxerr.Match(ctx, err))
			}
			n, err := res.RowsAffected()
			if err != nil {
				return false, fmt.Errorf("sdkstore: take over a claim in %s: %w", s.table, ctxerr.Match(ctx, err))
			}
			if n != 1 {
				return s.ownClaim(ctx, id, holder, key)
			}
		case err != nil:
			return false, fmt.Errorf("sdkstore: claim in %s: %w", s.table, ctxerr.Match(ctx, err))
		}
	}
	s.keepGen(holder, key, expires, secs)
	return true, nil
}

// ownClaim reports whether the claim that kept a Claim out is the holder's
// own live claim: the row is still 'claimed' with the expiry the holder's
// claim wrote, and that expiry has not passed.
func (s *PHPPDOStore) ownClaim(ctx context.Context, id, holder, key string) (bool, error) {
	gen, ok := s.gen(holder, key)
	if !ok {
		return false, nil
	}
	var mine bool
	if err := s.db.QueryRowContext(ctx, s.claimRowSQL, id, gen).Scan(&mine); err != nil {
		return false, fmt.Errorf("sdkstore: read the claim in %s: %w", s.table, ctxerr.Match(ctx, err))
	}
	return mine, nil
}

// Release deletes the caller's 'claimed' row (the store instance's own
// claim when ctx names no holder); never a 'seen' one. A holder's claim is
// recognised by the expiry it wrote, which this store instance remembers:
// a Release from another instance, or of a claim taken over since, changes
// nothing (the claim lapses after its lease).
func (s *PHPPDOStore) Release(ctx context.Context, key string) error {
	if err := s.cfg.checkKey(key); err != nil {
		return err
	}
	ctx, cancel := s.cfg.bound(ctx)
	defer cancel()
	gen, ok := s.takeGen(holderToken(ctx, s.instance), key)
	if !ok {
		return ctx.Err()
	}
	if _, err := s.db.ExecContext(ctx, s.releaseSQL, columnKey(key, PHPMaxIDChars), gen); err != nil {
		return fmt.Errorf("sdkstore: release in %s: %w", s.table, ctxerr.Match(ctx, err))
	}
	return nil
}

func genKey(holder, key string) string { return holder + "\x00" + key }

// keepGen remembers the expiry a claim of secs seconds wrote, just now.
func (s *PHPPDOStore) keepGen(holder, key string, expires, secs int64) {
	// The database counted the claim from no earlier than the call's
	// start, and it holds through the second it ends in: measured from
	// now, it has surely passed after secs seconds and one more.
	now := s.now()
	until := now.Add(time.Duration(secs+1) * time.Second)
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.gens) >= 4096 {
		// Forget the claims whose lease has passed: a Release of one of
		// those may leave it to lapse, which it already has. Both times
		// carry the monotonic clock: a step of the wall clock changes
		// nothing.
		for k, g := range s.gens {
			if now.After(g.until) {
				delete(s.gens, k)
			}
		}
	}
	s.gens[genKey(holder, key)] = claimGen{expires: expires, until: until}
}

func (s *PHPPDOStore) gen(holder, key string) (int64, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	g, ok := s.gens[genKey(holder, key)]
	return g.expires, ok
}

func (s *PHPPDOStore) takeGen(holder, key string) (int64, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	k := genKey(holder, key)
	g, ok := s.gens[k]
	delete(s.gens, k)
	return g.expires, ok
}

func (s *PHPPDOStore) dropGen(ctx context.Context, key string) {
	s.takeGen(holderToken(ctx, s.instance), key)
}

// GoPostgresStore reads and writes the records of the Go SDK's
// idempotency-postgres: a row per meta.id, done while its expires_at is NULL
// or in the future. The kit's own in-flight claims live in a second table,
// which the Go SDK never reads. See the package documentation.
type GoPostgresStore struct {
	notSupported
	db          *sql.DB
	cfg         config
	table       string
	claimTable  string
	seenSQL     string
	rememberSQL string
	forgetSQL   string
	claimSQL    string
	releaseSQL  string
	inspectSQL  string
	extendSQL   string
	// The same without the claim table, for a database where the kit's
	// Migrate never ran (a Go SDK fleet the operator inspects).
	forgetRecordSQL, inspectRecordSQL string
	defaultClaims                     bool   // the claim table is the default one (no WithClaimTable)
	instance                          string // the claim holder of calls whose context names none
}

var _ stores.Store = (*GoPostgresStore)(nil)

// NewGoPostgres returns a store on db (PostgreSQL) sharing the Go SDK
// idempotency-postgres table. Options: WithTable, WithClaimTable, WithTTL
// (give the SDK's), WithScopedKeys, WithQueryTimeout. It does not touch the
// database: call Migrate first. db stays the caller's.
func NewGoPostgres(db *sql.DB, opts ...Option) (*GoPostgresStore, error) {
	cfg := newConfig(opts)
	if cfg.table == "" {
		cfg.table = DefaultGoTable
	}
	defaultClaims := cfg.claimTable == ""
	if defaultClaims {
		cfg.claimTable = cfg.table + "_claims"
	}
	if err := sqlCommon(db, &cfg, true); err != nil {
		return nil, err
	}
	if err := checkTable(cfg.claimTable); err != nil {
		return nil, err
	}
	if cfg.claimTable == cfg.table {
		return nil, fmt.Errorf("%w: the claim table must not be the record table", ErrInvalidOption)
	}
	if err := checkFolded("table", cfg.table); err != nil {
		return nil, err
	}
	if err := checkFolded("claim table", cfg.claimTable); err != nil {
		return nil, err
	}
	t, c := quotePG(cfg.table), quotePG(cfg.claimTable)
	return &GoPostgresStore{
		db: db, cfg: cfg, table: t, claimTable: c, instance: stores.NewClaimToken(), defaultClaims: defaultClaims,
		seenSQL: `SELECT EXISTS (SELECT 1 FROM ` + t + ` WHERE message_id = $1 AND (expires_at IS NULL OR expires_at > clock_timestamp()))`,
		// The record and the end of the claim commit together; a claimer
		// waiting on the claim row then finds the record. Another
		// holder's live claim ($3 is the caller's) is locked and left
		// alone, and no record is written: the statement returns false.
		rememberSQL: `WITH k AS (
    SELECT 1 FROM ` + c + ` WHERE message_id = $1 AND holder <> $3 AND expires_at > clock_timestamp() FOR UPDATE
), r AS (
    INSERT INTO ` + t + ` (message_id, created_at, expires_at)
    SELECT $1, clock_timestamp(), clock_timestamp() + $2::bigint * interval '1 microsecond' WHERE NOT EXISTS (SELECT 1 FROM k)
    ON CONFLICT (message_id) DO UPDATE SET created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at
), d AS (
    DELETE FROM ` + c + ` WHERE message_id = $1 AND NOT EXISTS (SELECT 1 FROM k)
)
SELECT NOT EXISTS (SELECT 1 FROM k)`,
		extendSQL: `UPDATE ` + c + ` SET expires_at = clock_timestamp() + $3::bigint * interval '1 microsecond'
WHERE message_id = $1 AND holder = $2 AND expires_at > clock_timestamp()`,
		forgetSQL: `WITH r AS (DELETE FROM ` + t + ` WHERE message_id = $1)
DELETE FROM ` + c + ` WHERE message_id = $1`,
		claimSQL: `INSERT INTO ` + c + ` AS k (message_id, holder, expires_at)
VALUES ($1, $2, clock_timestamp() + $3::bigint * interval '1 microsecond')
ON CONFLICT (message_id) DO UPDATE SET holder = EXCLUDED.holder,
    expires_at = CASE WHEN k.expires_at > clock_timestamp() THEN k.expires_at ELSE EXCLUDED.expires_at END
WHERE k.expires_at <= clock_timestamp() OR k.holder = EXCLUDED.holder
RETURNING 1`,
		releaseSQL: `DELETE FROM ` + c + ` WHERE message_id = $1 AND holder = $2`,
		// The live record and the live claim, in one statement (one
		// snapshot: a Remember, which writes the one and drops the other
		// together, is seen before or after, never half way).
		inspectSQL: `SELECT r.message_id IS NOT NULL, r.expires_at, k.expires_at
FROM (SELECT $1::text AS id) q
LEFT JOIN ` + t + ` r ON r.message_id = q.id AND (r.expires_at IS NULL OR r.expires_at > clock_timestamp())
LEFT JOIN ` + c + ` k ON k.message_id = q.id AND k.expires_at > clock_timestamp()`,
		forgetRecordSQL: `DELETE FROM ` + t + ` WHERE message_id = $1`,
		inspectRecordSQL: `SELECT r.message_id IS NOT NULL, r.expires_at, NULL::timestamptz
FROM (SELECT $1::text AS id) q
LEFT JOIN ` + t + ` r ON r.message_id = q.id AND (r.expires_at IS NULL OR r.expires_at > clock_timestamp())`,
	}, nil
}

// Migrate creates the record table with the Go SDK's columns and the kit's
// claim table, if they do not exist, in one transaction; replicas may call
// it at once (migrations of one table run one at a time, under an advisory
// lock, and a wait ends with ctx).
func (s *GoPostgresStore) Migrate(ctx context.Context) error {
	ctx, cancel := s.cfg.bound(ctx)
	defer cancel()
	if err := sqlmigrate.Postgres(ctx, s.db, s.table,
		`CREATE TABLE IF NOT EXISTS `+s.table+` (
    message_id TEXT        PRIMARY KEY,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    expires_at TIMESTAMPTZ NULL
)`,
		`CREATE TABLE IF NOT EXISTS `+s.claimTable+` (
    message_id TEXT        PRIMARY KEY,
    holder     TEXT        NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL
)`); err != nil {
		return fmt.Errorf("sdkstore: migrate: %w", ctxerr.Match(ctx, err))
	}
	return nil
}

// seen reports whether key has a row whose expires_at is NULL or in the
// future, whoever wrote it.
func (s *GoPostgresStore) seen(ctx context.Context, key string) (bool, error) {
	if err := s.cfg.checkKey(key); err != nil {
		return false, err
	}
	ctx, cancel := s.cfg.bound(ctx)
	defer cancel()
	var seen bool
	if err := s.db.QueryRowContext(ctx, s.seenSQL, columnKey(key, 0)).Scan(&seen); err != nil {
		return false, fmt.Errorf("sdkstore: seen in %s: %w", s.table, ctxerr.Match(ctx, err))
	}
	return seen, nil
}

// inspect reports key's record: a row whose expires_at is NULL or in the
// future (whoever wrote it) is remembered, expiring at expires_at; otherwise
// a live claim of the kit in the claim table is in flight until its lease
// ends; otherwise key is unknown (no row, or an expired one).
func (s *GoPostgresStore) inspect(ctx context.Context, key string) (stores.Record, error) {
	if err := s.cfg.checkKey(key); err != nil {
		return stores.Record{}, err
	}
	ctx, cancel := s.cfg.bound(ctx)
	defer cancel()
	var (
		remembered      bool
		record, claimed sql.NullTime
	)
	err := s.db.QueryRowContext(ctx, s.inspectSQL, columnKey(key, 0)).Scan(&remembered, &record, &claimed)
	if s.defaultClaims && undefinedTable(err) { // no claim table: nothing can be in flight
		err = s.db.QueryRowContext(ctx, s.inspectRecordSQL, columnKey(key, 0)).Scan(&remembered, &record, &claimed)
	}
	if err != nil {
		return stores.Record{}, fmt.Errorf("sdkstore: inspect in %s: %w", s.table, ctxerr.Match(ctx, err))
	}
	switch {
	case remembered:
		return stores.Record{State: stores.StateRemembered, ExpiresAt: record.Time}, nil
	case claimed.Valid:
		return stores.Record{State: stores.StateInFlight, ExpiresAt: claimed.Time}, nil
	}
	return stores.Record{}, nil
}

func (s *GoPostgresStore) ttlMicros() any {
	if s.cfg.ttl == 0 {
		return nil
	}
	return s.cfg.ttl.Microseconds()
}

// remember writes key's row (expiring after the TTL, or never) and drops the
// claim on it (the caller's, or a lapsed one), in one statement; another
// holder's live claim is left alone and no row written
// (stores.ErrClaimTaken).
func (s *GoPostgresStore) remember(ctx context.Context, key string) error {
	if err := s.cfg.checkKey(key); err != nil {
		return err
	}
	ctx, cancel := s.cfg.bound(ctx)
	defer cancel()
	var written bool
	if err := s.db.QueryRowContext(ctx, s.rememberSQL, columnKey(key, 0), s.ttlMicros(), holderToken(ctx, s.instance)).Scan(&written); err != nil {
		return fmt.Errorf("sdkstore: remember in %s: %w", s.table, ctxerr.Match(ctx, err))
	}
	if !written {
		return fmt.Errorf("sdkstore: remember in %s: %w", s.table, stores.ErrClaimTaken)
	}
	return nil
}

// Extend extends the caller's live claim on key in the claim table to
// lease from now; held is false when key holds no live claim of this
// holder (a remembered key has none).
func (s *GoPostgresStore) Extend(ctx context.Context, key string, lease time.Duration) (bool, error) {
	if err := s.cfg.checkKey(key); err != nil {
		return false, err
	}
	if lease < time.Millisecond {
		return false, fmt.Errorf("sdkstore: lease %v: want at least 1ms", lease)
	}
	ctx, cancel := s.cfg.bound(ctx)
	defer cancel()
	res, err := s.db.ExecContext(ctx, s.extendSQL, columnKey(key, 0), holderToken(ctx, s.instance), lease.Microseconds())
	if err != nil {
		return false, fmt.Errorf("sdkstore: extend the claim in %s: %w", s.claimTable, ctxerr.Match(ctx, err))
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fmt.Errorf("sdkstore: extend the claim in %s: %w", s.claimTable, ctxerr.Match(ctx, err))
	}
	return n == 1, nil
}

// Forget deletes key's row and any claim on it.
func (s *GoPostgresStore) Forget(ctx context.Context, key string) error {
	if err := s.cfg.checkKey(key); err != nil {
		return err
	}
	ctx, cancel := s.cfg.bound(ctx)
	defer cancel()
	_, err := s.db.ExecContext(ctx, s.forgetSQL, columnKey(key, 0))
	if s.defaultClaims && undefinedTable(err) { // no claim table: only the record to drop
		_, err = s.db.ExecContext(ctx, s.forgetRecordSQL, columnKey(key, 0))
	}
	if err != nil {
		return fmt.Errorf("sdkstore: forget in %s: %w", s.table, ctxerr.Match(ctx, err))
	}
	return nil
}

// undefinedTable reports PostgreSQL's undefined_table, on any driver.
func undefinedTable(err error) bool { return sqlstate.Is(err, sqlstate.UndefinedTable) }

// claim takes the kit's claim on key in the claim table for the caller's
// holder (the delivery's token, or the store instance's when ctx names
// none), takes over one whose lease has passed, or finds the holder's own
// live claim (its claim sent again after the reply was lost) and keeps its
// lease. It then looks for a live record: if there is one, it drops the
// claim and reports false. Two statements, in this order: a
// claimer that waited on a claim row until its Remember committed finds the
// record.
func (s *GoPostgresStore) claim(ctx context.Context, key string, lease time.Duration) (bool, error) {
	if err := s.cfg.checkKey(key); err != nil {
		return false, err
	}
	if lease < time.Millisecond {
		return false, fmt.Errorf("sdkstore: lease %v: want at least 1ms", lease)
	}
	ctx, cancel := s.cfg.bound(ctx)
	defer cancel()
	id := columnKey(key, 0)
	var one int
	err := s.db.QueryRowContext(ctx, s.claimSQL, id, holderToken(ctx, s.instance), lease.Microseconds()).Scan(&one)
	if errors.Is(err, sql.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("sdkstore: claim in %s: %w", s.claimTable, ctxerr.Match(ctx, err))
	}
	seen, err := s.seen(ctx, key)
	if err == nil && !seen {
		return true, nil
	}
	if rerr := s.Release(ctx, key); rerr != nil && err == nil {
		err = rerr
	}
	return false, err
}

// Release drops the caller's claim on key (the store instance's own when
// ctx names no holder); never another holder's. It never touches the
// record.
func (s *GoPostgresStore) Release(ctx context.Context, key string) error {
	if err := s.cfg.checkKey(key); err != nil {
		return err
	}
	ctx, cancel := s.cfg.bound(ctx)
	defer cancel()
	if _, err := s.db.ExecContext(ctx, s.releaseSQL, columnKey(key, 0), holderToken(ctx, s.instance)); err != nil {
		return fmt.Errorf("sdkstore: release in %s: %w", s.claimTable, ctxerr.Match(ctx, err))
	}
	return nil
}

// DeleteExpired deletes up to limit claims whose expiry has passed (the
// claims of deliveries that died) and returns how many it deleted. Remembered
// messages are never deleted: the layout keeps them until they are
// forgotten. Call it in a loop until it returns less than limit.
func (s *PHPPDOStore) DeleteExpired(ctx context.Context, limit int) (int64, error) {
	if limit < 1 {
		return 0, fmt.Errorf("%w: limit %d: want at least 1", ErrInvalidOption, limit)
	}
	ctx, cancel := s.cfg.bound(ctx)
	defer cancel()
	query := `DELETE FROM ` + s.table + ` WHERE state = 'claimed' AND expires_at < UNIX_TIMESTAMP() LIMIT ?`
	if s.dialect == PostgreSQL {
		query = `DELETE FROM ` + s.table + ` WHERE message_id IN (
    SELECT message_id FROM ` + s.table + `
    WHERE state = 'claimed' AND expires_at < floor(extract(epoch from clock_timestamp()))::bigint
    LIMIT $1 FOR UPDATE SKIP LOCKED)`
	}
	res, err := s.db.ExecContext(ctx, query, limit)
	if err != nil {
		return 0, fmt.Errorf("sdkstore: delete expired claims from %s: %w", s.table, ctxerr.Match(ctx, err))
	}
	return res.RowsAffected()
}

// DeleteExpired deletes up to limit expired records, and up to limit lapsed
// claims, and returns how many rows it deleted. The Go SDK's own cleanup
// does the same for its records; run this one when no Go SDK consumer is
// left to. Call it in a loop until it returns less than limit.
func (s *GoPostgresStore) DeleteExpired(ctx context.Context, limit int) (int64, error) {
	if limit < 1 {
		return 0, fmt.Errorf("%w: limit %d: want at least 1", ErrInvalidOption, limit)
	}
	ctx, cancel := s.cfg.bound(ctx)
	defer cancel()
	var total int64
	for _, t := range []string{s.table, s.claimTable} {
		res, err := s.db.ExecContext(ctx, `DELETE FROM `+t+` WHERE message_id IN (
    SELECT message_id FROM `+t+` WHERE expires_at <= clock_timestamp()
    LIMIT $1 FOR UPDATE SKIP LOCKED)`, limit)
		if err != nil {
			return total, fmt.Errorf("sdkstore: delete expired rows from %s: %w", t, ctxerr.Match(ctx, err))
		}
		n, err := res.RowsAffected()
		if err != nil {
			return total, err
		}
		total += n
	}
	return total, nil
}
