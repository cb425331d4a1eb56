package postgresstore

import (
	"cmp"
	"context"
	"database/sql"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/babelqueue/watermill-idempotency/internal/sqlstate"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// ErrSessionPooled is matched by the error of every call of a Store with
// session claims (the default with the pgx driver) whose connection turned
// out to be shared by a pooler in transaction or statement mode
// (PgBouncer's pool_mode = transaction, for one): the advisory locks a
// claim is would stay on a server connection other clients then use, and
// outlive the Store. Give the Store a connection straight to PostgreSQL,
// or through a pooler in session mode, or keep the claims in rows
// (WithRowClaims).
var ErrSessionPooled = errors.New("postgresstore: session claims need a PostgreSQL session of their own, and a pooler shares this one between clients (transaction or statement pooling): connect the Store straight to PostgreSQL or through a pooler in session mode, or pass WithRowClaims()")

// ErrNotPgx is matched by the error of New with WithSessionClaims on a
// *sql.DB whose driver is not pgx's (github.com/jackc/pgx/v5/stdlib): the
// claims go out as pgx batches on the session's connection.
var ErrNotPgx = errors.New("postgresstore: session claims need the pgx driver (github.com/jackc/pgx/v5/stdlib)")

// WithSessionClaims insists on session claims, the default with the pgx
// driver: every claim a session-level advisory lock taken on one
// connection the Store keeps for its claims (its session), instead of a
// row. A claim then writes nothing (no row, no WAL), needs no renewal
// written anywhere, and is freed by PostgreSQL at once when its holder's
// process or connection dies (the message runs again when the broker
// hands it out: on Redis Streams, after its idle time). The record,
// written on the session while it holds the lock, is the only row written
// per message. See "Session claims" in the package documentation for what
// it changes.
//
// Without it, a Store whose driver is not pgx's, or that holds its claims
// in transactions (WithTransactionClaims) or partitions its table
// (WithPartitions), keeps its claims in rows. With it, New fails instead:
// with ErrNotPgx for another driver, with ErrInvalidOption for the two
// options it cannot be combined with.
func WithSessionClaims() Option { return func(s *Store) { s.sessionClaims = true } }

// WithRowClaims keeps every claim in a row of the table, as a Store on
// another driver than pgx's does: the claim's row is inserted with its
// lease, renewed by UPDATEs while the handler runs, and replaced by the
// record. It costs a row written per claim and a write per renewal, but no
// connection of its own: take it behind a pooler in transaction mode
// (PgBouncer's pool_mode = transaction), where session claims are refused
// with ErrSessionPooled. Claims of rows and session claims exclude each
// other on one table, so workers of either kind can run side by side.
func WithRowClaims() Option { return func(s *Store) { s.rowClaims = true } }

// chooseClaims settles the kind of the Store's claims: session claims
// when asked for, or by default on the pgx driver; rows otherwise.
func (s *Store) chooseClaims() error {
	switch {
	case s.rowClaims && s.sessionClaims:
		return fmt.Errorf("%w: WithRowClaims and WithSessionClaims are two kinds of claims: choose one", ErrInvalidOption)
	case s.rowClaims && s.txClaims:
		return fmt.Errorf("%w: WithRowClaims and WithTransactionClaims are two kinds of claims: choose one", ErrInvalidOption)
	case s.sessionClaims:
		if !isPgx(s.db) {
			return fmt.Errorf("%w: WithSessionClaims on a *sql.DB whose driver is a %T", ErrNotPgx, s.db.Driver())
		}
	case !s.rowClaims && !s.txClaims && !s.partitioned:
		s.sessionClaims = isPgx(s.db)
	}
	return nil
}

// SessionClaims reports whether the Store's claims are advisory locks of
// its session (the default on the pgx driver, or WithSessionClaims), as
// opposed to rows of the table (WithRowClaims, another driver) or
// transactions (WithTransactionClaims). A session claim has no expiry: it
// is held for as long as its holder's session lives.
func (s *Store) SessionClaims() bool { return s.session != nil }

// isPgx reports whether db's driver is pgx's.
func isPgx(db *sql.DB) bool {
	_, ok := db.Driver().(*stdlib.Driver)
	return ok
}

// Close ends the Store's session, when it holds its claims on one (the
// default with the pgx driver): the server frees the claims it still
// holds, and the connection, opened apart from db's pool, is closed. Call
// it when the worker stops, after its router; db stays the caller's to
// close. A Store used after Close opens a new session at its next claim
// (call Close again once those calls returned); the calls still carried
// for callers that gave up before it open none. It does nothing for claims
// of rows or claims held in transactions (see ReleaseAll for those).
func (s *Store) Close() error {
	if s.session != nil {
		s.releaseAllSession()
	}
	return nil
}

// sessionState is the connection a Store's session claims are held on, and
// the claims held there.
type sessionState struct {
	seed    uint64 // mixes the table into every lock's key
	collide int64  // tests: every key's lock, when not 0

	io      chan struct{} // one round trip at a time on conn: held by use while it runs, waited for up to the caller's deadline
	mu      sync.Mutex    // guards the fields below; released while a round trip is on the wire
	conn    *pgx.Conn     // the session's own connection, outside db's pool; nil until opened, and once lost
	pid     int32         // the server process of conn
	gen     uint64        // counts the sessions opened: a claim is held on the session of its generation only
	contact time.Time     // when the last statement that succeeded on conn was sent
	idle    time.Duration // the session's idle_session_timeout now: the claims' lease while it holds claims, sessionIdle (at least) once it held one and holds none; 0 before its first claim
	idleOK  bool          // the server has idle_session_timeout (PostgreSQL 14 and later)
	pooled  error         // once a pooler was found: every call fails with it
	closed  bool          // Close ran, and no session was opened since
	lease   time.Duration // the longest lease asked for: the idle timeout's base
	unheld  time.Duration // the idle timeout while no claim is held (at least): sessionIdle

	claims map[int64]*sessionClaim // by lock key: taken, or being taken
	// giving counts, by lock key, the locks whose claim ended here and
	// that are being given back on the session (unlock): until they are,
	// a Remember of the key goes over the session, which still holds it,
	// rather than be refused by the pool's statement for a lock nobody
	// else holds.
	giving map[int64]int
	lapse  *time.Timer // gives back the claims whose lease ran out unrenewed; nil when none is held
	next   time.Time   // when lapse fires

	claimReadSQL, rememberSQL, rememberFreshSQL, rememberValueSQL, failSQL string

	// freshConflicts counts the round trips whose plain inserts of fresh
	// claims' records met a row (unique_violation), and were sent again
	// with the upsert: a writer that ignores the keys' locks shares the
	// table (tests read it).
	freshConflicts int
}

// sessionClaim is a claim held on the session, or being taken.
type sessionClaim struct {
	token    string
	gen      uint64        // the session it is held on; 0 while being taken
	pid      int32         // that session's server process
	deadline time.Time     // when its lease runs out unless renewed (Extend)
	carried  stores.Record // the count of failures it carries; empty: none
	// yielded: its holder writes the record in a transaction of its own
	// (RememberTx, the Begin calls), which holds the key's lock, shared,
	// instead of the session: the lock was given back to let it, and the
	// claim stays its holder's (Extend says held) until it is released or
	// lapses. To every other call the key is as if not claimed here: the
	// server says whether the transaction still holds it.
	yielded bool
	// displaced, on a claim being taken: the yielded claim of another
	// holder it replaced here, put back when the key is not taken (its
	// transaction still holds the key), so that its holder's Extend and
	// Release still find it (Extend said it lost while its transaction
	// held the key, after a redelivery here asked for the key).
	displaced *sessionClaim
	// fresh: the claim's read found no row of the key, and nothing was
	// written for it on the session since; its record goes as a plain
	// insert (rememberFreshSQL), which spares the conflict check of an
	// upsert, and falls back to the upsert when another writer, one that
	// does not take the key's lock, put a row there meanwhile.
	fresh bool
}

// lockKey returns the row key of key and the 64-bit key of its advisory
// lock: the key's SHA-256 mixed with the table, so that one message id
// handled for two tables takes two locks.
func (ss *sessionState) lockKey(key string) (rowKey string, lock int64) {
	rowKey = RowKey(key)
	return rowKey, ss.lockOfRow(rowKey)
}

// lockOfRow is the advisory lock's key of the row key rowKey: its first 64
// bits (those of the key's SHA-256) mixed with the table.
func (ss *sessionState) lockOfRow(rowKey string) int64 {
	if ss.collide != 0 {
		return ss.collide
	}
	return seededLock(rowKey, ss.seed)
}

// seededLock is the advisory lock's key of the row key rowKey: its first
// 64 bits mixed with seed (the table's).
func seededLock(rowKey string, seed uint64) int64 {
	var b [8]byte
	_, _ = hex.Decode(b[0:4], []byte(rowKey[0:8]))
	_, _ = hex.Decode(b[4:6], []byte(rowKey[9:13]))
	_, _ = hex.Decode(b[6:8], []byte(rowKey[14:18]))
	return int64(binary.BigEndian.Uint64(b[:]) ^ seed)
}

// lockOfKeySQL is the advisory lock's key of the row key key (SQL, a uuid)
// on table t (quoted), as lockOfRow computes it: the key's first 64 bits
// mixed with the table.
func lockOfKeySQL(key, t string) string {
	return `(('x' || translate(left(` + key + `::text, 18), '-', ''))::bit(64)::bigint # ` + strconv.FormatInt(int64(tableSeed(t)), 10) + `)`
}

// initSessionClaims prepares the statements of the session claims on table t
// (quoted), whose records expire by expires (SQL).
func (s *Store) initSessionClaims(t, expires string) error {
	if !s.sessionClaims {
		return nil
	}
	switch {
	case s.txClaims:
		return fmt.Errorf("%w: WithSessionClaims and WithTransactionClaims are two kinds of claims: choose one", ErrInvalidOption)
	case s.partitioned:
		return fmt.Errorf("%w: WithSessionClaims cannot be combined with WithPartitions: the partitioned layout writes its record under a row lock across partitions, which the session does not fence", ErrInvalidOption)
	}
	ss := &sessionState{seed: tableSeed(t), claims: make(map[int64]*sessionClaim), giving: make(map[int64]int), unheld: sessionIdle, io: make(chan struct{}, 1)}
	// The rows in the way of a claim just taken, read in a statement of
	// their own after the locks were taken: it sees every record committed
	// by a holder that had the lock before. A row's lapse is judged by the
	// round trip's start (one implicit transaction), before the locks were
	// taken: a claim row that a worker with claims of rows judged live
	// while the lock was held here is live here too.
	ss.claimReadSQL = `SELECT key::text, claim IS NULL, coalesce(claim = '', false), coalesce(fingerprint, 0), expires_at IS NOT NULL AND expires_at <= ` + txStartMS + `,
		false, expires_at, value, CASE WHEN ` + counted("") + ` THEN failure END FROM ` + t + ` WHERE key = ANY($1::text[]::uuid[])`
	asyncCommit := ""
	if s.asyncCommit {
		asyncCommit = ` AND set_config('synchronous_commit', 'off', true) IS NOT NULL`
	}
	// Remember, grouped: each key is written only while this session holds
	// its lock, taken again for the statement's transaction (at once for a
	// lock the session holds; for a key whose claim was lost, only when
	// nobody holds it). The session's own lock is then dropped, but the
	// transaction's holds until the record commits: nobody takes the key
	// and misses the record. It writes no row over another holder's live
	// claim row either (a worker with claims of rows on the same table).
	locked := `l AS MATERIALIZED (SELECT k, f, lk, held, pg_try_advisory_xact_lock(lk) AS got
		FROM unnest($1::text[]::uuid[], $2::int8[], $3::int8[], $4::bool[]) AS u(k, f, lk, held))`
	unlock := `u AS (SELECT pg_advisory_unlock(lk) FROM l WHERE held AND got)`
	// Every grouped form reports the keys written and the locks given back.
	written := `SELECT array(SELECT key FROM w), (SELECT count(*) FROM u)`
	// Both upsert forms replace a record, a failing or ended one, or a
	// lapsed claim row.
	upsert := `ON CONFLICT (key) DO UPDATE SET expires_at = EXCLUDED.expires_at, claim = NULL, fingerprint = EXCLUDED.fingerprint, value = EXCLUDED.value, failure = NULL
			WHERE (r.claim IS NULL OR r.claim = '' OR r.expires_at <= ` + nowMS + `)
			RETURNING key::text),
		` + unlock + `
		` + written
	insertGot := `w AS (INSERT INTO ` + t + ` AS r (key, expires_at, fingerprint) SELECT k, ` + expires + `, nullif(f, 0) FROM l WHERE got` + asyncCommit
	ss.rememberSQL = `WITH ` + locked + `,
		` + insertGot + `
			` + upsert
	// Remember, grouped, of fresh claims held on the session (no row was
	// there when they were taken, and every writer of the kit takes a key's
	// lock before it writes the key's row): a plain insert, without the
	// upsert's conflict check, about a sixth of the statement's time. A
	// row put there meanwhile by a writer that ignores the locks fails it
	// (unique_violation), and with it the round trip's transaction, before
	// any lock of the session was given back: u gives them back only once
	// it has counted every row of w, whichever the server reads first. The
	// round trip is then sent again with the upsert.
	ss.rememberFreshSQL = `WITH l AS MATERIALIZED (SELECT k, f, lk, pg_try_advisory_xact_lock(lk) AS got
		FROM unnest($1::text[]::uuid[], $2::int8[], $3::int8[]) AS u(k, f, lk)),
		` + insertGot + `
			RETURNING key::text),
		u AS (SELECT pg_advisory_unlock(lk) FROM l WHERE got AND (SELECT count(*) FROM w) >= 0)
		` + written
	ss.rememberValueSQL = `WITH l AS MATERIALIZED (SELECT $1::text::uuid AS k, $4::bool AS held, $5::int8 AS lk, pg_try_advisory_xact_lock($5::int8) AS got),
		w AS (INSERT INTO ` + t + ` AS r (key, expires_at, fingerprint, value) SELECT k, ` + expires + `, $2::int8, $3::bytea FROM l WHERE got` + asyncCommit + `
			` + upsert
	// Fail, on the session: the failing or ended record written while the
	// lock is held (or free), as Fail writes it; the session's lock is
	// dropped with an end ($7), kept without one.
	column := `$3::text::jsonb || jsonb_build_object('expires', ` + expires + `)`
	ss.failSQL = `WITH l AS MATERIALIZED (SELECT pg_try_advisory_xact_lock($5::int8) AS got),
		w AS (INSERT INTO ` + t + ` AS r (key, expires_at, claim, fingerprint, failure) SELECT $1::text::uuid, ` + expires + `, '', $2::int8, ` + column + ` FROM l WHERE got
			ON CONFLICT (key) DO UPDATE SET claim = '', expires_at = EXCLUDED.expires_at, fingerprint = EXCLUDED.fingerprint, value = NULL, failure = EXCLUDED.failure
			WHERE NOT (r.claim IS NULL AND (r.expires_at IS NULL OR r.expires_at > ` + nowMS + `)) AND NOT ` + heldByOther("r.", "$4") + `
			RETURNING 1),
		u AS (SELECT pg_advisory_unlock($5) FROM l WHERE got AND $6::bool AND $7::bool)
		SELECT (SELECT got FROM l), EXISTS (SELECT 1 FROM w), (SELECT count(*) FROM u)`
	s.session = ss
	return nil
}

// errSessionLost is the cause of a call that found the session's
// connection gone: every claim held on it is lost.
var errSessionLost = errors.New("postgresstore: the claims' session ended")

// errClosedForNobody settles the calls of a round trip whose callers all
// gave up, carried after the Store was closed: no session is opened for
// them.
var errClosedForNobody = errors.New("postgresstore: the Store was closed, and every caller of the round trip gave up")

// use runs f on the session's connection, opening it first when there is
// none, and returns the generation f ran on. One round trip at a time runs
// on the connection (ss.io; a caller waits for its turn up to its
// context's deadline). f is called with ss.mu held (it may read and change
// ss.claims) and releases it while its statements are on the wire
// (ss.outside), so that a server slow to answer keeps nobody who only
// reads the claims. A connection that fails (the server ended the session, the
// network dropped, a statement ran past its deadline) is closed for good:
// every claim held on it is lost. lease is the longest lease of the claims
// f takes (0 for none).
func (s *Store) use(ctx context.Context, lease time.Duration, f func(ctx context.Context, c *pgx.Conn) error) (gen uint64, err error) {
	return s.useOn(ctx, lease, 0, nil, f)
}

// useOn is use, on the session of generation only when only is not 0: f
// then runs only while that session is open, and nothing is opened
// (giving a lock back is pointless on another session). When nobody
// reports, as the session would be opened, that every caller of the round
// trip gave up, nothing is opened after Close either: calls queued before
// Close, run by their carrier once their callers left, would open a
// session that nobody closes.
func (s *Store) useOn(ctx context.Context, lease time.Duration, only uint64, nobody func() bool, f func(ctx context.Context, c *pgx.Conn) error) (gen uint64, err error) {
	ss := s.session
	select {
	case ss.io <- struct{}{}:
		defer func() { <-ss.io }()
	case <-ctx.Done():
		return 0, fail(ctx, "session", ctx.Err())
	}
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.pooled != nil {
		return 0, ss.pooled
	}
	if only != 0 && (ss.gen != only || ss.conn == nil) {
		return 0, nil
	}
	ss.lease = max(ss.lease, lease)
	if ss.conn != nil && !ss.holdsAnyOnSession() && ss.idle > 0 && time.Since(ss.contact) > ss.idle/2 {
		// Nothing held, and the server may end the idle session any
		// moment: start afresh rather than race its timeout (the claims
		// being taken, this round trip's among them, are taken on the
		// new session).
		closeSession(ss.conn)
		ss.conn = nil
	}
	if only != 0 && ss.conn == nil {
		return 0, nil // the session of generation only ended, and its locks with it
	}
	if ss.conn == nil {
		forNobody := func() bool { return ss.closed && nobody != nil && nobody() }
		if forNobody() {
			return 0, errClosedForNobody
		}
		if err := s.openSession(ctx); err != nil {
			if errors.Is(err, ErrSessionPooled) {
				ss.pooled = err
			}
			return 0, err
		}
		if forNobody() { // Close ran while it dialled, and the callers left meanwhile
			closeSession(ss.conn)
			ss.conn = nil
			return 0, errClosedForNobody
		}
		ss.closed = false
	}
	at := time.Now()
	err = f(ctx, ss.conn)
	switch {
	case err == nil:
		ss.contact = at
		return ss.gen, nil
	case errors.Is(err, ErrSessionPooled):
		ss.pooled = err
		s.loseSession(err)
		return 0, err
	}
	// Any other failure ends the session too: a statement that failed may
	// have given a lock back or not (a batch's statements run in one
	// transaction, and a lock's release is not undone by its rollback), and
	// a session whose locks are unknown would leak them or free another
	// holder's. Ending it frees them all, and its holders learn it.
	s.loseSession(err)
	return 0, fmt.Errorf("%w: %w", errSessionLost, err)
}

// samePID fails with ErrSessionPooled when pid, the server process a
// statement ran on, is not the session's: a pooler handed the statement to
// another server connection (ss.mu held).
func (ss *sessionState) samePID(pid int32) error {
	if pid != ss.pid {
		return fmt.Errorf("%w: a statement ran in server process %d, the session is %d", ErrSessionPooled, pid, ss.pid)
	}
	return nil
}

// holdsAnyBut reports whether a claim is held or being taken on the
// session besides those the remembers ending end (ss.mu held).
func (ss *sessionState) holdsAnyBut(ending []*op) bool {
	for lock, c := range ss.claims {
		if c.yielded || (c.gen != 0 && c.gen != ss.gen) {
			continue
		}
		if !slices.ContainsFunc(ending, func(o *op) bool { return o.lock == lock && o.token == c.token }) {
			return true
		}
	}
	return false
}

// holdsAnyOnSession reports whether a claim is held on the session now
// open; the claims being taken are not (ss.mu held).
func (ss *sessionState) holdsAnyOnSession() bool {
	for _, c := range ss.claims {
		if c.gen != 0 && c.gen == ss.gen {
			return true
		}
	}
	return false
}

// sessionIdle is the idle_session_timeout of a session that holds no
// claim (at least; the claims' own when longer): the server ends a session
// unused that long, so that a Store nobody closed does not keep a
// connection for ever, and a Store unused for half of it opens a new
// session at its next claim rather than race the timeout.
const sessionIdle = time.Minute

// idleTimeout is the idle_session_timeout of a session whose claims have
// lease: a holder that stops talking to the server (paused, cut off) for
// that long loses its session, and with it its claims, on the server's
// side.
func idleTimeout(lease time.Duration) time.Duration {
	return min(max(lease, time.Second), maxIdleTimeout)
}

// openSession opens the session's connection, checks that it is a
// session of its own, and sets it up (ss.mu held, and released while it
// dials; ss.io held). The connection is the
// Store's own, opened with the configuration of a connection of db's pool
// (pgx's), so that the session takes nothing from the pool.
func (s *Store) openSession(ctx context.Context) error {
	ss := s.session
	var conn *pgx.Conn
	var pid int32
	var version int
	idle := max(idleTimeout(ss.lease), ss.unheld)
	if err := ss.outside(func() (err error) {
		conn, pid, version, err = s.dialSession(ctx, idle)
		return err
	}); err != nil {
		return err
	}
	if version < 140000 {
		idle = 0
	}
	ss.conn, ss.pid, ss.idle, ss.idleOK, ss.contact = conn, pid, idle, version >= 140000, time.Now()
	ss.gen++
	return nil
}

// outside runs f with ss.mu released (held by the caller, and held again
// when f returns): a round trip on the wire must not keep the callers who
// only read or change the claims waiting past their deadlines.
func (ss *sessionState) outside(f func() error) error {
	ss.mu.Unlock()
	defer ss.mu.Lock()
	return f()
}

// dialSession opens and sets up the session's connection: its server
// process and version. The session's idle timeout is idle from the start
// (PostgreSQL 14 and later): a session opened by a call that takes no
// claim (Migrate, a Remember or Fail without one) is ended by the server
// too once unused that long, rather than kept for ever by a Store nobody
// closes.
func (s *Store) dialSession(ctx context.Context, idle time.Duration) (conn *pgx.Conn, pid int32, version int, err error) {
	cfg, err := s.pgxConfig(ctx)
	if err != nil {
		return nil, 0, 0, err
	}
	conn, err = pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, 0, 0, fail(ctx, "open the claims' session", err)
	}
	// The server ends a session whose holder fell silent (a paused
	// process, a network cut) after the idle timeout, and checks for a
	// client that went away while a statement runs; TCP keepalives find a
	// vanished peer within seconds rather than hours. Statements see what
	// committed before they began (READ COMMITTED), whatever the
	// database's default.
	setup := `SELECT pg_backend_pid(), current_setting('server_version_num')::int,
		set_config('tcp_keepalives_idle', '5', false), set_config('tcp_keepalives_interval', '2', false), set_config('tcp_keepalives_count', '3', false),
		set_config('default_transaction_isolation', 'read committed', false)`
	if err := conn.QueryRow(ctx, setup).Scan(&pid, &version, nil, nil, nil, nil); err != nil {
		closeSession(conn)
		return nil, 0, 0, fail(ctx, "open the claims' session", err)
	}
	// The idle timeout is idle (sessionIdle, at least) from the start, set
	// to the claims' lease by the round trip that takes the session's first
	// claim, and back to sessionIdle by the one that ends its last: a
	// session that holds nothing stays open for the next claim, for a
	// while.
	//
	// The session's statements are planned once, generically (PostgreSQL
	// 12 and later): they read and write a few keys through arrays, and
	// the server would otherwise plan each of them again at every run (a
	// plan for the exact arrays looks cheaper than the generic one, which
	// assumes larger arrays), which measured a fifth of the server's CPU
	// per message.
	var sets []string
	if version >= 120000 {
		sets = append(sets, `set_config('plan_cache_mode', 'force_generic_plan', false)`)
	}
	if version >= 140000 {
		sets = append(sets, `set_config('client_connection_check_interval', '1000', false)`,
			`set_config('idle_session_timeout', '`+strconv.FormatInt(idle.Milliseconds(), 10)+`', false)`)
	}
	if len(sets) > 0 {
		if _, err := conn.Exec(ctx, `SELECT `+strings.Join(sets, ", ")); err != nil {
			closeSession(conn)
			return nil, 0, 0, fail(ctx, "open the claims' session", err)
		}
	}
	// A pooler in transaction mode hands the server connection the session
	// just used to the next transaction of any client: a statement of
	// another connection that lands on it is the proof.
	if err := checkNotShared(ctx, cfg, pid); err != nil {
		closeSession(conn)
		return nil, 0, 0, err
	}
	return conn, pid, version, nil
}

// pgxConfig returns the configuration of a connection of db's pool, for
// the session's own connection (ErrNotPgx when db's driver is not pgx's).
func (s *Store) pgxConfig(ctx context.Context) (*pgx.ConnConfig, error) {
	conn, err := s.db.Conn(ctx)
	if err != nil {
		return nil, fail(ctx, "open the claims' session", err)
	}
	defer func() { _ = conn.Close() }()
	var cfg *pgx.ConnConfig
	err = conn.Raw(func(dc any) error {
		c, ok := dc.(*stdlib.Conn)
		if !ok {
			return fmt.Errorf("%w (the driver's connection is a %T)", ErrNotPgx, dc)
		}
		cfg = c.Conn().Config().Copy()
		return nil
	})
	return cfg, err
}

// checkNotShared opens another connection like the session's and fails
// with ErrSessionPooled when its statement runs in the session's server
// process pid.
func checkNotShared(ctx context.Context, cfg *pgx.ConnConfig, pid int32) error {
	other, err := pgx.ConnectConfig(ctx, cfg.Copy())
	if err != nil {
		return fail(ctx, "open the claims' session", err)
	}
	defer closeSession(other)
	var got int32
	if err := other.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&got); err != nil {
		return fail(ctx, "open the claims' session", err)
	}
	if got == pid {
		return fmt.Errorf("%w: another client's statement ran in the session's server process %d", ErrSessionPooled, pid)
	}
	return nil
}

// closeSession closes a session's connection: the server ends the session
// and frees every lock it held.
func closeSession(conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = conn.Close(ctx)
}

// loseSession closes the session's connection for good (ss.mu held): the
// server ends the session, and frees every lock it held. The claims held
// on it are lost; their holders find out from Extend, and their Remember
// writes only if nobody took the key meanwhile.
func (s *Store) loseSession(cause error) {
	ss := s.session
	if ss.conn == nil {
		return
	}
	go closeSession(ss.conn) // within a second: the server frees the locks once the connection closes
	ss.conn = nil
	held := 0
	for _, c := range ss.claims {
		if c.gen != 0 {
			held++
		}
	}
	if held > 0 && s.logger != nil {
		s.logger.Warn("postgresstore: the session holding the claims was lost; their deliveries stop, and the messages can run elsewhere",
			"table", s.table, "claims", held, "error", cause)
	}
}

// holds reports whether the holder token holds the claim on lock, unlapsed,
// on the session now open (ss.mu held).
func (ss *sessionState) holds(lock int64, token string) bool {
	return ss.keeps(lock, token) && !ss.claims[lock].yielded
}

// keeps reports whether the holder token holds the claim on lock, unlapsed,
// on the session now open, or yielded it to a transaction of its own
// (ss.mu held).
func (ss *sessionState) keeps(lock int64, token string) bool {
	c := ss.claims[lock]
	return c != nil && c.token == token && c.gen != 0 && c.gen == ss.gen && ss.conn != nil && !time.Now().After(c.deadline)
}

// claimSession is Claim with session claims: the lock key is reserved in
// the Store (a claim of another holder here is in flight at once), then
// taken on the session with the rows in its way read after it, grouped
// with concurrent claims.
func (s *Store) claimSession(ctx context.Context, key string, lease time.Duration) (bool, stores.Record, error) {
	ss := s.session
	rowKey, lock := ss.lockKey(key)
	token := s.holder(ctx)
	ss.mu.Lock()
	c := ss.claims[lock]
	var displaced *sessionClaim
	switch {
	case c != nil && c.yielded:
		delete(ss.claims, lock) // its transaction holds the key, or held it: the server says which
		if c.token != token {
			displaced = c
		}
	case c != nil && c.gen != 0 && (c.gen != ss.gen || ss.conn == nil) && (c.token == token || time.Now().After(c.deadline)):
		// A claim of a session lost (its lock went with it), asked again by
		// its own holder or past its lease: taken anew. Another holder's,
		// within its lease, stays in flight below: its holder, in this
		// process, may still be running or recording the effect (its record
		// is written when nobody holds the key), as a claim row would keep
		// the key through the database's restart.
		delete(ss.claims, lock)
	case c != nil && c.gen != 0 && c.token == token && !time.Now().After(c.deadline):
		carried := c.carried
		ss.mu.Unlock()
		return true, carried, nil // its own claim, asked again
	case c != nil && c.gen != 0 && time.Now().After(c.deadline):
		// Another holder's claim here, whose lease ran out unrenewed: the
		// session holds the lock, and this holder takes the claim over.
		c.token, c.deadline, c.carried = token, time.Now().Add(lease), stores.Record{}
		ss.mu.Unlock()
		return s.takeOverHere(ctx, lock, rowKey, token, lease)
	case c != nil:
		ss.mu.Unlock()
		return false, stores.Record{State: stores.StateInFlight}, nil
	}
	ss.claims[lock] = &sessionClaim{token: token, displaced: displaced}
	ss.mu.Unlock()

	o := newOp()
	o.kind, o.key, o.token, o.lease, o.lock = opClaim, rowKey, token, lease.Milliseconds(), lock
	if err := s.sessOps.do(ctx, s.queryTimeout, o); err != nil {
		if o.unsent() {
			// Nothing will settle the reservation: left, it would report
			// the key in flight to every later claim here, for ever.
			s.dropReservation(lock, token)
		}
		return false, stores.Record{}, err
	}
	return o.claimed, o.record, nil
}

// dropReservation removes the reservation of the claim on lock that the
// holder token was taking, if it is still one.
func (s *Store) dropReservation(lock int64, token string) {
	ss := s.session
	ss.mu.Lock()
	defer ss.mu.Unlock()
	ss.dropReservationLocked(lock, token)
}

// dropReservationLocked is dropReservation with ss.mu held; a yielded
// claim the reservation displaced is put back.
func (ss *sessionState) dropReservationLocked(lock int64, token string) {
	if c := ss.claims[lock]; c != nil && c.token == token && c.gen == 0 {
		if c.displaced != nil {
			ss.claims[lock] = c.displaced
			return
		}
		delete(ss.claims, lock)
	}
}

// takeOverHere completes the takeover of a lapsed claim of this Store, its
// lock held on the session: the key's row is read as a claim reads it, and
// the session's idle timeout raised first when lease is longer than it.
func (s *Store) takeOverHere(ctx context.Context, lock int64, rowKey, token string, lease time.Duration) (bool, stores.Record, error) {
	ss := s.session
	var row claimRow
	var found bool
	err := s.detached(ctx, "claim", func(ctx context.Context) error {
		_, err := s.use(ctx, lease, func(ctx context.Context, c *pgx.Conn) error {
			if want := idleTimeout(ss.lease); ss.idleOK && ss.idle != want {
				if err := ss.outside(func() error {
					_, err := c.Exec(ctx, `SELECT set_config('idle_session_timeout', $1, false)`, strconv.FormatInt(want.Milliseconds(), 10))
					return err
				}); err != nil {
					return err
				}
				ss.idle = want
			}
			return ss.outside(func() error {
				r, err := c.Query(ctx, ss.claimReadSQL, []string{rowKey})
				if err != nil {
					return err
				}
				defer r.Close()
				for r.Next() {
					found = true
					if err := r.Scan(append([]any{nil}, row.fields()...)...); err != nil {
						return err
					}
				}
				return r.Err()
			})
		})
		return err
	})
	what, rec := s.verdictOf(row, found)
	if err == nil && what != rowHeld {
		ss.mu.Lock()
		if c := ss.claims[lock]; c != nil && c.token == token {
			c.carried = countOf(rec)
		}
		ss.mu.Unlock()
		return true, rec, nil
	}
	s.giveBack(ctx, lock, token)
	if err != nil {
		return false, stores.Record{}, err
	}
	return false, rec, nil
}

// giveBack ends the claim on lock of the holder token, if it holds it, and
// gives its lock back on the session it was taken on.
func (s *Store) giveBack(ctx context.Context, lock int64, token string) {
	ss := s.session
	ss.mu.Lock()
	c := ss.claims[lock]
	var gen uint64
	if c != nil && c.token == token {
		if !c.yielded { // a yielded claim's lock was given back already
			gen = c.gen
		}
		delete(ss.claims, lock)
		if gen != 0 {
			ss.givingLocked(lock)
		}
	}
	ss.mu.Unlock()
	if gen != 0 {
		s.unlock(ctx, []int64{lock}, gen)
	}
}

// verdictOf is what a claim that took the lock makes of the key's row
// (found: there is one): rowHeld when the row keeps the key (a live
// record, an end, another worker's claim row), with the record found.
func (s *Store) verdictOf(row claimRow, found bool) (int, stores.Record) {
	if !found {
		return rowTakeable, stores.Record{}
	}
	what, rec, err := row.verdict()
	if err != nil {
		return rowHeld, stores.Record{State: stores.StateInFlight}
	}
	if what == rowTakeable && rec.State == stores.StateUnknown && row.failure != nil {
		if r, err := failedRecord(row.failure, row.fp); err == nil && r.State == stores.StateFailing {
			rec = r // a lapsed claim carrying a count: the count goes on
		}
	}
	return what, rec
}

// countOf is the count of failures a claim that found rec carries.
func countOf(rec stores.Record) stores.Record {
	if rec.State == stores.StateFailing {
		return rec
	}
	return stores.Record{}
}

// scheduleLapseLocked sets the lapse timer to fire when the first lease among
// the claims held runs out (ss.mu held).
func (s *Store) scheduleLapseLocked() {
	ss := s.session
	var first time.Time
	for _, c := range ss.claims {
		if c.gen != 0 && (first.IsZero() || c.deadline.Before(first)) {
			first = c.deadline
		}
	}
	switch {
	case first.IsZero():
		if ss.lapse != nil {
			ss.lapse.Stop()
		}
		ss.next = time.Time{}
	case ss.lapse == nil:
		ss.lapse, ss.next = time.AfterFunc(time.Until(first), s.lapseClaims), first
	case ss.next.IsZero() || first.Before(ss.next) || time.Now().After(ss.next):
		ss.lapse.Reset(time.Until(first))
		ss.next = first
	}
}

// lapseClaims gives back the locks of the claims whose lease ran out
// unrenewed (their holders stopped renewing: gone as far as the store can
// tell), so that another worker can take them, and sets the timer for the
// next lease to run out. One timer serves every claim of the Store. A
// claim of an earlier session (lost: its lock went with it) whose lease ran
// out is forgotten too: kept, it would count as held for ever (a busy
// session pauses for company, WithGroupPause) and fire the timer again at
// once, for as long as its holder never came back.
func (s *Store) lapseClaims() {
	ss := s.session
	ss.mu.Lock()
	ss.next = time.Time{}
	now := time.Now()
	var locks []int64
	gen := ss.gen
	for lock, c := range ss.claims {
		if c.gen == 0 || !now.After(c.deadline) {
			continue // being taken, or within its lease
		}
		// Its lock goes back when this session holds it: a yielded claim's
		// went to its transaction, an earlier session's went with it.
		if c.gen == gen && !c.yielded {
			locks = append(locks, lock)
			ss.givingLocked(lock)
		}
		delete(ss.claims, lock)
	}
	s.scheduleLapseLocked()
	ss.mu.Unlock()
	if len(locks) > 0 {
		s.unlock(context.Background(), locks, gen)
	}
}

// inFlightOf is what a claim that found the key's lock taken reports: the
// key's record when its row, read after the lock was tried, is a live
// record or an end (final: whoever holds the lock only passes through, as
// a claimer that finds the record and gives the lock back); otherwise in
// flight, with the count of failures the key's row keeps, if any.
// No row (the zero claimRow) and a lapsed row are not final to verdict.
func inFlightOf(row claimRow) stores.Record {
	if what, rec, err := row.verdict(); err == nil && what == rowHeld && (rec.State == stores.StateRemembered || rec.State == stores.StateEnded) {
		return rec
	}
	if row.failure != nil {
		if r, err := failedRecord(row.failure, row.fp); err == nil && r.State != stores.StateEnded {
			r.State, r.ExpiresAt = stores.StateInFlight, time.Time{}
			return r
		}
	}
	return stores.Record{State: stores.StateInFlight}
}

// givingLocked marks the lock of a claim that ended here as being given back
// on the session (ss.mu held): the caller then calls unlock with it, which
// unmarks it.
func (ss *sessionState) givingLocked(lock int64) { ss.giving[lock]++ }

// given unmarks locks, given back by unlock (or gone with their session).
func (ss *sessionState) given(locks []int64) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	for _, lock := range locks {
		if ss.giving[lock]--; ss.giving[lock] <= 0 {
			delete(ss.giving, lock)
		}
	}
}

// unlock gives the session's locks back, when the session they were taken
// on (gen) is still open; a failure only leaves them until the session ends.
// Every lock of locks was marked by givingLocked.
func (s *Store) unlock(ctx context.Context, locks []int64, gen uint64) {
	defer s.session.given(locks)
	ctx, cancel := boundedContext(context.WithoutCancel(ctx), s.queryTimeout)
	defer cancel()
	_, err := s.useOn(ctx, 0, gen, nil, func(ctx context.Context, c *pgx.Conn) error {
		ss := s.session
		// The last claim given back (a duplicate found, a release): the
		// session's idle timeout goes back to the unheld one in the same
		// statement, as the round trip ending the last claim with its
		// record does.
		idle := ss.idle
		if unheld := max(idleTimeout(ss.lease), ss.unheld); ss.idleOK && idle != unheld && !ss.holdsAnyBut(nil) {
			idle = unheld
		}
		set := idle != ss.idle
		err := ss.outside(func() error {
			var err error
			if set {
				_, err = c.Exec(ctx, `SELECT count(pg_advisory_unlock(lk)), set_config('idle_session_timeout', $2, false) FROM unnest($1::int8[]) AS u(lk)`,
					locks, strconv.FormatInt(idle.Milliseconds(), 10))
			} else {
				_, err = c.Exec(ctx, `SELECT pg_advisory_unlock(lk) FROM unnest($1::int8[]) AS u(lk)`, locks)
			}
			return err
		})
		if err == nil {
			ss.idle = idle
		}
		return err
	})
	if err != nil && s.logger != nil {
		s.logger.Warn("postgresstore: could not give a claim's lock back; it goes with the session", "table", s.table, "error", err)
	}
}

// undoSessionClaim gives back a claim taken for a caller that gave up.
func (s *Store) undoSessionClaim(o *op) {
	if o.claimed {
		s.giveBack(context.Background(), o.lock, o.token)
	}
}

// extendSession is Extend with session claims: a claim lives as long as
// its session, so the claim is held while the session is: a session heard
// from within a third of lease needs no round trip; otherwise one
// statement, shared by every claim asking meanwhile, proves it alive. A
// claim yielded to its holder's transaction (RememberTx, the Begin calls)
// is renewed without one: the transaction holds its key, not the session.
func (s *Store) extendSession(ctx context.Context, key string, lease time.Duration) (bool, error) {
	if err := ctx.Err(); err != nil {
		// Nothing renewed: a keeper renewing with a done context would
		// otherwise push the claim's lease on for ever in this Store
		// (while other claims keep the session busy), the round trip that
		// proves the session alive never sent.
		return false, fmt.Errorf("postgresstore: extend: %w", err)
	}
	ss := s.session
	rowKey, lock := ss.lockKey(key)
	token := s.holder(ctx)
	ss.mu.Lock()
	c := ss.claims[lock]
	if c != nil && c.gen == 0 && c.displaced != nil {
		c = c.displaced // a redelivery here asks for the key meanwhile
	}
	if c != nil && c.yielded && c.token == token && c.gen != 0 && !time.Now().After(c.deadline) {
		// Its lock went to the holder's transaction, which holds the key
		// whatever becomes of the session: nothing on the session to
		// prove. (Asked, a session ended meanwhile, even as it gave the
		// lock back, said the claim lost while the transaction held the
		// key: the delivery was stopped for nothing.) Once the transaction
		// ended (rolled back, its connection killed), another worker may
		// hold the key: the server says whether one holds its lock
		// exclusively, which the transaction's shared lock kept from
		// anyone while it ran (Extend said held while another worker held
		// the claim). Renewed first: a pool its transactions hold answers
		// late, and the question is bounded by a second.
		c.deadline = time.Now().Add(lease)
		s.scheduleLapseLocked()
		ss.mu.Unlock()
		qctx, cancel := context.WithTimeout(ctx, time.Second)
		taken, err := s.claimedElsewhere(qctx, rowKey, lock)
		cancel()
		// Unanswered (the pool's connections cut as the session was),
		// the transaction is taken to hold it, as before the question.
		return err != nil || !taken, nil
	}
	held, gen := ss.keeps(lock, token), ss.gen
	if held { // keeps is false for a claim whose lease ran out: the lapse timer gives it back
		ss.claims[lock].deadline = time.Now().Add(lease)
		s.scheduleLapseLocked()
	}
	ss.mu.Unlock()
	if !held {
		return false, nil
	}
	// The server is asked every time: a session it ended (terminated, cut
	// off) has lost its locks, maybe to another worker already, and only a
	// statement on it finds that out. Renewals due together share the
	// round trip (the Guard's keeper sends them together), and the ping
	// raises the session's idle timeout to a lease longer than the claims
	// were taken with.
	o := newOp()
	// Urgent: a round trip paused for company (WithGroupPause) could hold
	// the renewal back past the lease it asks for.
	o.kind, o.lease, o.urgent = opPing, lease.Milliseconds(), true
	if err := s.sessOps.do(ctx, s.queryTimeout, o); err != nil {
		if errors.Is(err, errSessionLost) || errors.Is(err, ErrSessionPooled) {
			return false, nil
		}
		return false, err
	}
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.keeps(lock, token) && ss.gen == gen, nil
}

// knows reports whether a claim of the key whose lock is lock is held
// here, being taken, or was held on an earlier session and not yet
// settled: its record is written on the session, which holds (or held)
// the key's lock. Any other record (no claim here: a seen-set, a Remember
// after a Release) is written by the pool's grouped statement, which takes
// the key's lock, shared. It also returns the pooler's error, once one was
// found.
func (ss *sessionState) knows(lock int64) (bool, error) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	// A claim that ended here (a lapse, a release) whose lock is still
	// being given back on the session counts too: the pool's statement
	// would find the session's lock and refuse a record nobody else
	// holds the key against (a holder whose claim lapsed, remembering as
	// the lapse gives the lock back).
	return ss.claims[lock] != nil || ss.giving[lock] > 0, ss.pooled
}

// pooledErr is ErrSessionPooled's error once a pooler sharing the
// session's connection was found (every call then fails with it), nil
// before.
func (ss *sessionState) pooledErr() error {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.pooled
}

// rememberSession is Remember with session claims, over the session, of
// the row key rowKey, whose lock is lock.
func (s *Store) rememberSession(ctx context.Context, rowKey string, lock int64, fingerprint uint64, value []byte) error {
	o := newOp()
	o.key, o.lock = rowKey, lock
	o.kind, o.token, o.fingerprint, o.value = opRemember, s.holder(ctx), int64(fingerprint), value
	return s.sessOps.do(ctx, s.queryTimeout, o)
}

// releaseSession is Release with session claims: the holder's lock is
// given back; a claim carrying a count leaves its failing record, which
// is a row of its own.
func (s *Store) releaseSession(ctx context.Context, key string) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("postgresstore: release: %w", err)
	}
	ss := s.session
	_, lock := ss.lockKey(key)
	token := s.holder(ctx)
	ss.mu.Lock()
	c := ss.claims[lock]
	if c == nil || c.token != token || c.gen == 0 {
		ss.mu.Unlock()
		return nil
	}
	delete(ss.claims, lock)
	gen := c.gen
	if !c.yielded {
		ss.givingLocked(lock)
	}
	ss.mu.Unlock()
	if c.yielded {
		return nil // its lock went to its transaction
	}
	// The claim is gone here: its lock goes back whatever ctx does now (a
	// context done since the check above used to skip the unlock, and
	// leave the lock on the session, where nothing knew of it, for the
	// session's life: the key was in flight to every other worker).
	return s.runDetached(ctx, "release", func(ctx context.Context) error {
		s.unlock(ctx, []int64{lock}, gen)
		return nil
	})
}

// failSession is Fail with session claims: the failing or ended record is
// written on the session while it holds the key's lock (or while nobody
// does, for a holder without a claim here); an end gives the lock back.
func (s *Store) failSession(ctx context.Context, key string, fingerprint uint64, f stores.Failure) error {
	ss := s.session
	rowKey, lock := ss.lockKey(key)
	token := s.holder(ctx)
	end := f.End != nil
	return s.detached(ctx, "fail", func(ctx context.Context) error {
		for attempt := 0; ; attempt++ {
			var got, written, taken bool
			_, err := s.use(ctx, 0, func(ctx context.Context, c *pgx.Conn) error {
				cl := ss.claims[lock]
				held := ss.holds(lock, token)
				if cl != nil && !cl.yielded && !held && cl.token != token && (cl.gen == 0 || cl.gen == ss.gen) {
					taken = true // another holder's claim here
					return nil
				}
				err := ss.outside(func() error {
					return c.QueryRow(ctx, ss.failSQL, rowKey, nullFingerprint(fingerprint), encodeFailure(f), token, lock, held, end).Scan(&got, &written, nil)
				})
				switch {
				case err != nil || cl == nil || cl.token != token || ss.claims[lock] != cl: // (or it changed meanwhile)
				case end || !held:
					delete(ss.claims, lock)
				case written:
					cl.carried = stores.Record{State: stores.StateFailing, Fingerprint: fingerprint, Failure: f}
					cl.fresh = false // its failing record is a row now
				}
				return err
			})
			switch {
			case err != nil:
				return fail(ctx, "fail", err)
			case taken || !got:
				return fmt.Errorf("postgresstore: fail: %w", stores.ErrClaimTaken)
			case written:
				return nil
			}
			if again, err := s.whyNotFailed(ctx, rowKey, token, attempt); !again {
				return err
			}
		}
	})
}

// detached runs f bounded by the query timeout but not by ctx's
// cancellation (a statement cut on the session would end the session, and
// every claim on it), and returns its error, or ctx's when ctx is done
// first: f then runs on.
func (s *Store) detached(ctx context.Context, op string, f func(ctx context.Context) error) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("postgresstore: %s: %w", op, err)
	}
	return s.runDetached(ctx, op, f)
}

// runDetached is detached, f started even when ctx is done already (what
// its caller did before must be completed).
func (s *Store) runDetached(ctx context.Context, op string, f func(ctx context.Context) error) error {
	done := make(chan error, 1)
	go func() {
		dctx, cancel := boundedContext(context.WithoutCancel(ctx), s.queryTimeout)
		defer cancel()
		done <- f(dctx)
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("postgresstore: %s: %w", op, ctx.Err())
	}
}

// lookupSession completes a Lookup with session claims: a key whose row
// says nothing is in flight (unknown, or a failing record) is in flight
// when a claim of this Store or another session's lock holds it.
func (s *Store) lookupSession(ctx context.Context, key string, r stores.Record) (stores.Record, error) {
	ss := s.session
	if r.State != stores.StateUnknown && (r.State != stores.StateFailing) {
		return r, nil
	}
	_, lock := ss.lockKey(key)
	ss.mu.Lock()
	c := ss.claims[lock]
	here := c != nil && !c.yielded && c.gen != 0 && c.gen == ss.gen && ss.conn != nil
	ss.mu.Unlock()
	if !here {
		ctx, cancel := s.context(ctx)
		defer cancel()
		// A shared try of the key's lock, released as the statement ends,
		// fails only while a claim holds it: no scan of pg_locks.
		err := s.db.QueryRowContext(ctx, `SELECT NOT pg_try_advisory_xact_lock_shared($1)`, lock).Scan(&here)
		if err != nil {
			return stores.Record{}, fail(ctx, "lookup", err)
		}
	}
	if here {
		r.State, r.ExpiresAt = stores.StateInFlight, time.Time{}
	}
	return r, nil
}

// releaseAllSession ends the session: every claim held on it is freed at
// once (ReleaseAll).
func (s *Store) releaseAllSession() {
	ss := s.session
	ss.mu.Lock()
	defer ss.mu.Unlock()
	clear(ss.claims)
	s.scheduleLapseLocked()
	ss.closed = true
	if ss.conn == nil {
		return
	}
	select {
	case ss.io <- struct{}{}: // no round trip on the wire: a clean goodbye
		closeSession(ss.conn)
		<-ss.io
	default:
		// A round trip is on the wire, on a connection that is not safe
		// for concurrent use: its socket is closed under it, which fails
		// the round trip at once; the server ends the session all the same.
		_ = ss.conn.PgConn().Conn().Close()
	}
	ss.conn = nil
}

// yieldOwnClaim readies a record of rowKey in a transaction of the
// caller's (RememberTx and the Begin calls) with session claims: the
// caller's own claim of the key here is given back first (the record takes
// its place; so is a lapsed one), and another holder's claim here makes
// it report in flight without a statement. A claim another worker holds
// is found by the record's statement, which takes the key's lock, shared.
func (s *Store) yieldOwnClaim(ctx context.Context, rowKey, token string) (inFlight bool) {
	ss := s.session
	lock := ss.lockOfRow(rowKey)
	ss.mu.Lock()
	c := ss.claims[lock]
	var gen uint64
	switch {
	case c == nil || c.yielded || (c.gen != 0 && (c.gen != ss.gen || ss.conn == nil)):
	case c.token != token && (c.gen == 0 || !time.Now().After(c.deadline)):
		ss.mu.Unlock()
		return true
	case c.token == token && c.gen != 0:
		// The caller's own claim: its lock goes to the transaction, and
		// the claim stays the caller's while it runs (its renewals hold).
		gen = c.gen
		c.yielded = true
	default: // a lapsed claim, or one still being taken: given back
		gen = c.gen
		delete(ss.claims, lock)
		if gen != 0 {
			ss.givingLocked(lock)
		}
	}
	ss.mu.Unlock()
	if gen != 0 {
		s.unlockBy(ctx, []int64{lock}, gen)
	}
	return false
}

// recordedOwn marks the caller's own claim of rowKey here yielded once a
// record of the caller's transaction went in over it with session claims
// (RememberTx, the Begin calls): a claim lost with its session (its lock
// went with it) before it made way, the record holding the key in its
// place. Extend then says it held, as for a claim that made way on a live
// session; it said it lost while the caller's transaction held the key.
func (s *Store) recordedOwn(rowKey, token string) {
	if s.session == nil {
		return
	}
	ss := s.session
	lock := ss.lockOfRow(rowKey)
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if c := ss.claims[lock]; c != nil && c.token == token && c.gen != 0 && !time.Now().After(c.deadline) {
		c.yielded = true
	}
}

// lostOwnLock returns the server process of the session that held the
// holder token's own claim of rowKey here when that session was lost
// (its lock given back unanswered, the session ended or cut), 0
// otherwise: the claim's lock stays taken until that process has ended,
// a moment after its connection closed.
func (s *Store) lostOwnLock(rowKey, token string) int32 {
	ss := s.session
	lock := ss.lockOfRow(rowKey)
	ss.mu.Lock()
	defer ss.mu.Unlock()
	c := ss.claims[lock]
	if c == nil || c.token != token || c.gen == 0 || (c.gen == ss.gen && ss.conn != nil) {
		return 0
	}
	return c.pid
}

// claimedElsewhere reports whether a session holds the advisory lock of
// the row key rowKey (lock) exclusively while the key has no record: another holder's
// session claim of it. A record (the yielded claim's transaction
// committed) leaves the claim held, whatever the lock: a claim's taking
// holds it a moment to find the record, and the holder, done, would be
// told it lost for nothing.
func (s *Store) claimedElsewhere(ctx context.Context, rowKey string, lock int64) (bool, error) {
	ctx, cancel := s.context(ctx)
	defer cancel()
	quoted, _ := quoteTable(s.table)
	var taken bool
	if err := s.db.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND mode = 'ExclusiveLock' AND granted
		AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) AND objsubid = 1
		AND ((classid::int8 << 32) | objid::int8) = $1)
		AND NOT EXISTS (SELECT 1 FROM `+quoted+` WHERE key = $2 AND claim IS NULL AND failure IS NULL)`, lock, rowKey).Scan(&taken); err != nil {
		return false, fail(ctx, "extend", err)
	}
	return taken, nil
}

// awaitLocksGone waits until the server process pid holds no advisory
// lock any more (it has ended, or given them back), bounded by ctx and a
// second, and reports whether it saw so.
func (s *Store) awaitLocksGone(ctx context.Context, pid int32) bool {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	for {
		var held bool
		if err := s.db.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = $1 AND locktype = 'advisory')`, pid).Scan(&held); err != nil {
			return false
		}
		if !held {
			return true
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// unlockBy is unlock, returning by ctx's deadline while the lock's giving
// back goes on (bounded by the query timeout): a caller making way for its
// transaction's record leaves at its deadline, its next statement then
// failing with ctx's error. Without a deadline (a router's message
// context) it gives the lock back itself, bounded by the query timeout,
// sparing the transactional path a goroutine a delivery.
func (s *Store) unlockBy(ctx context.Context, locks []int64, gen uint64) {
	if _, ok := ctx.Deadline(); !ok {
		s.unlock(ctx, locks, gen)
		return
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.unlock(ctx, locks, gen)
	}()
	select {
	case <-done:
	case <-ctx.Done():
	}
}

// rowLock is the key of the advisory lock of the row key rowKey: the one
// session claims take, and the one every write of a record takes shared.
func (s *Store) rowLock(rowKey string) int64 {
	if s.session != nil {
		return s.session.lockOfRow(rowKey)
	}
	return seededLock(rowKey, s.lockSeed)
}

// rowLocks returns the advisory locks' keys of the row keys keys, in order.
func (s *Store) rowLocks(keys []string) []int64 {
	locks := make([]int64, len(keys))
	for i, k := range keys {
		locks[i] = s.rowLock(k)
	}
	return locks
}

// The kinds of the session's operations, carried together.
const (
	opClaim    = iota + 1 // take a claim's lock and read the key's row
	opRemember            // write a record and give the claim's lock back
	opPing                // prove the session alive
)

// runSession carries every operation queued for the session in one round
// trip (one pgx batch, one implicit transaction, one commit): the records
// first, then the claims' locks with the session's server process, then the
// rows of the claimed keys, read in a statement of their own after the
// locks were taken (so that it sees every record committed by a holder
// that had the lock before). A session found lost before the round trip
// (ended by the server while idle, or cut) is replaced, and the round trip
// made once more: the locks went with it.
func (s *Store) runSession(ctx context.Context, batch []*op) error {
	var claims, pings, remembers, plain, single []*op
	var lease int64
	for _, o := range batch {
		switch o.kind {
		case opClaim:
			claims = append(claims, o)
			lease = max(lease, o.lease)
		case opPing:
			pings = append(pings, o)
			lease = max(lease, o.lease)
		case opRemember:
			remembers = append(remembers, o)
		}
	}
	// The records by lock, those of one key in the order they came: the
	// first of a key goes in the grouped statement (sorted by lock), the
	// others, and those with a value, one statement each after it, as if
	// one ran after the other.
	slices.SortStableFunc(remembers, func(a, b *op) int { return cmp.Compare(a.lock, b.lock) })
	for i, o := range remembers {
		if o.value != nil || (i > 0 && remembers[i-1].lock == o.lock) {
			single = append(single, o)
		} else {
			plain = append(plain, o)
		}
	}
	r := &sessionRound{s: s, claims: claims, plain: plain, single: single, ping: len(pings) > 0}
	nobody := func() bool {
		return !slices.ContainsFunc(batch, func(o *op) bool { return o.state.Load() == opPending })
	}
	gen, err := s.useOn(ctx, time.Duration(lease)*time.Millisecond, 0, nobody, r.run)
	if errors.Is(err, errSessionLost) {
		gen, err = s.useOn(ctx, time.Duration(lease)*time.Millisecond, 0, nobody, r.run)
	}
	if err != nil {
		err = fail(ctx, "session", err)
	}
	for _, o := range pings {
		o.err = err
	}
	r.settleRemembers(err)
	giveBack := r.settleClaims(gen, err)
	if len(giveBack) > 0 {
		s.unlock(ctx, giveBack, gen)
	}
	return nil
}

// sessionRound is one round trip of runSession.
type sessionRound struct {
	s                     *Store
	claims, plain, single []*op
	ping                  bool

	// results of the last try
	sent    []*op // the remembers sent (the others were refused here)
	written map[string]bool
	got     []bool
	rows    map[string]claimRow

	upsertAll bool // every record as an upsert: a fresh one met a row
}

// run sends the round trip on c (ss.mu held, released while the round trip
// is on the wire: it reads and changes the
// claims of the session).
func (r *sessionRound) run(ctx context.Context, c *pgx.Conn) error {
	ss := r.s.session
	r.sent, r.written, r.got, r.rows = r.sent[:0], map[string]bool{}, nil, map[string]claimRow{}
	b := &pgx.Batch{}
	// The records. A claim of another holder here is refused without a
	// statement (the session's own lock would let the record through); one
	// of this holder lost with an earlier session writes only if nobody
	// holds the key.
	refused := func(o *op) bool {
		cl := ss.claims[o.lock]
		o.held = ss.holds(o.lock, o.token)
		if cl != nil && !cl.yielded && cl.token != o.token && (cl.gen == 0 || cl.gen == ss.gen) {
			o.err = fmt.Errorf("postgresstore: remember: %w", stores.ErrClaimTaken)
			return true
		}
		o.err = nil
		r.sent = append(r.sent, o)
		return false
	}
	// The records of fresh claims held here go first, as a plain insert
	// (the round trip sent again after one met a row goes without).
	var plain, fresh []*op
	for _, o := range r.plain {
		switch {
		case refused(o):
		case o.held && ss.claims[o.lock].fresh && !r.upsertAll:
			fresh = append(fresh, o)
		default:
			plain = append(plain, o)
		}
	}
	keysOut := func(row pgx.Row) error {
		var keys []string
		if err := row.Scan(&keys, nil); err != nil {
			return err
		}
		for _, k := range keys {
			r.written[k] = true
		}
		return nil
	}
	conflict := false
	if len(fresh) > 0 {
		b.Queue(ss.rememberFreshSQL,
			quotedArray(len(fresh), func(i int) string { return fresh[i].key }),
			intArray(len(fresh), func(i int) int64 { return fresh[i].fingerprint }),
			intArray(len(fresh), func(i int) int64 { return fresh[i].lock }),
		).QueryRow(func(row pgx.Row) error {
			err := keysOut(row)
			conflict = sqlstate.Is(err, uniqueViolation)
			return err
		})
	}
	if len(plain) > 0 {
		b.Queue(ss.rememberSQL,
			quotedArray(len(plain), func(i int) string { return plain[i].key }),
			intArray(len(plain), func(i int) int64 { return plain[i].fingerprint }),
			intArray(len(plain), func(i int) int64 { return plain[i].lock }),
			boolArray(len(plain), func(i int) bool { return plain[i].held }),
		).QueryRow(keysOut)
	}
	for _, o := range r.single {
		if !refused(o) {
			b.Queue(ss.rememberValueSQL, o.key, nullFingerprint(uint64(o.fingerprint)), nullBytes(o.value), o.held, o.lock).QueryRow(keysOut)
		}
	}
	// The idle timeout: set before the claims (or a renewal's ping) when
	// they are the first or longer than it allows for; cleared after the
	// records when they end the session's last claim (below).
	idle, want := ss.idle, idleTimeout(ss.lease)
	setIdle := func(d time.Duration) {
		idle = d
		b.Queue(`SELECT set_config('idle_session_timeout', $1, false)`, strconv.FormatInt(d.Milliseconds(), 10))
	}
	if ss.idleOK && (len(r.claims) > 0 || r.ping) && idle != want {
		setIdle(want)
	}
	// The claims' locks, and the session's server process (a pooler
	// handing statements to other server connections is found here).
	if len(r.claims) > 0 || r.ping {
		locks := intArray(len(r.claims), func(i int) int64 { return r.claims[i].lock })
		b.Queue(sessionLocksSQL, locks).
			QueryRow(func(row pgx.Row) error {
				var pid int32
				if err := row.Scan(&pid, &r.got); err != nil {
					return err
				}
				return ss.samePID(pid)
			})
	}
	if len(r.claims) > 0 {
		keys := quotedArray(len(r.claims), func(i int) string { return r.claims[i].key })
		b.Queue(ss.claimReadSQL, keys).Query(func(rows pgx.Rows) error {
			for rows.Next() {
				var key string
				var row claimRow
				if err := rows.Scan(append([]any{&key}, row.fields()...)...); err != nil {
					return err
				}
				r.rows[key] = row
			}
			return rows.Err()
		})
	}
	if unheld := max(want, ss.unheld); ss.idleOK && idle > 0 && idle != unheld && len(r.claims) == 0 && !ss.holdsAnyBut(r.sent) {
		setIdle(unheld)
	}
	if b.Len() == 0 {
		return nil
	}
	err := ss.outside(func() error { return c.SendBatch(ctx, b).Close() })
	if conflict {
		// A row was in the way of a fresh claim's record: the round trip's
		// transaction failed at its first statement, before any other ran
		// and before any lock went back. Those claims are fresh no more,
		// and the round trip goes again with the upsert.
		ss.freshConflicts++
		for _, o := range fresh {
			if cl := ss.claims[o.lock]; cl != nil && cl.token == o.token {
				cl.fresh = false
			}
		}
		r.upsertAll = true
		return r.run(ctx, c)
	}
	if err == nil {
		ss.idle = idle
	}
	// The claims of the session end with their records, written or
	// refused. A round trip that failed ended the session and wrote
	// nothing that the holder knows of: its claims stay, of a lost session,
	// so that the holder's record, retried, is still written when nobody
	// holds the key, and the Store keeps the key from its other holders
	// meanwhile (for the rest of the lease), as a claim row would through
	// the database's restart.
	if err == nil {
		for _, o := range r.sent {
			if cl := ss.claims[o.lock]; cl != nil && cl.token == o.token {
				delete(ss.claims, o.lock)
			}
		}
	}
	return err
}

// sessionLocksSQL takes the claims' locks ($1, in order) on the session,
// and reports its server process and which locks it got.
const sessionLocksSQL = `SELECT pg_backend_pid(), array(SELECT pg_try_advisory_lock(lk) FROM unnest($1::int8[]) WITH ORDINALITY AS u(lk, i) ORDER BY i)`

// quotedArray, intArray and boolArray return the text form of an array of
// n strings (each quoted), int64s or bools, the element at i given by at,
// for a parameter of an array type. The driver sends a string parameter as
// it is, in the text format, and the server parses it: one buffer a round
// trip, where a slice would be encoded element by element, each boxed on
// its way.
func quotedArray(n int, at func(i int) string) string {
	return arrayOf(n, len(`"00000000-0000-0000-0000-000000000000"`), func(b []byte, i int) []byte { return appendQuoted(b, at(i)) })
}

// intArray is quotedArray for int64s.
func intArray(n int, at func(i int) int64) string {
	return arrayOf(n, len("-9223372036854775808"), func(b []byte, i int) []byte { return strconv.AppendInt(b, at(i), 10) })
}

// boolArray is quotedArray for bools.
func boolArray(n int, at func(i int) bool) string {
	return arrayOf(n, len("false"), func(b []byte, i int) []byte { return strconv.AppendBool(b, at(i)) })
}

// arrayOf returns the text form of an array of n elements, each appended
// by elem and about width bytes long.
func arrayOf(n, width int, elem func(b []byte, i int) []byte) string {
	b := make([]byte, 0, 2+n*(width+1))
	b = append(b, '{')
	for i := range n {
		if i > 0 {
			b = append(b, ',')
		}
		b = elem(b, i)
	}
	return string(append(b, '}'))
}

// appendQuoted appends s to b as a quoted element of an array's text form.
func appendQuoted(b []byte, s string) []byte {
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		if c := s[i]; c == '"' || c == '\\' {
			b = append(b, '\\')
		}
		b = append(b, s[i])
	}
	return append(b, '"')
}

// settleRemembers gives each remember its result: refused here, err when
// the round trip failed, refused when its record was not written.
func (r *sessionRound) settleRemembers(err error) {
	for _, o := range append(r.plain, r.single...) {
		switch {
		case o.err != nil: // refused here (a record sent has none)
		case err != nil:
			o.err = err
		case !r.written[o.key]:
			o.err = fmt.Errorf("postgresstore: remember: %w", stores.ErrClaimTaken)
		}
	}
}

// settleClaims gives each claim its result, and returns the locks taken
// that must go back: those over a row that keeps the key (a live record, an
// end, another worker's claim row). A round trip that failed ended its
// session, and the locks it took went with it.
func (r *sessionRound) settleClaims(gen uint64, err error) (giveBack []int64) {
	ss := r.s.session
	ss.mu.Lock()
	defer ss.mu.Unlock()
	for i, o := range r.claims {
		c := ss.claims[o.lock]
		took := i < len(r.got) && r.got[i]
		if err != nil || !took {
			if err == nil {
				o.record = inFlightOf(r.rows[o.key])
			} else {
				o.err = err
			}
			ss.dropReservationLocked(o.lock, o.token)
			continue
		}
		if c == nil || c.token != o.token || c.gen != 0 {
			// The claim's reservation is gone (Close cleared it while the
			// lock was being taken): nothing here knows it is held, so
			// the lock goes back rather than stay on the session.
			giveBack = append(giveBack, o.lock)
			ss.givingLocked(o.lock)
			o.err = fmt.Errorf("postgresstore: claim: %w: the Store was closed while the claim was taken", errSessionLost)
			continue
		}
		row, found := r.rows[o.key]
		what, rec := r.s.verdictOf(row, found)
		if what == rowHeld {
			giveBack = append(giveBack, o.lock)
			ss.givingLocked(o.lock)
			o.record = rec
			delete(ss.claims, o.lock)
			continue
		}
		o.claimed, o.record = true, rec
		c.gen, c.deadline, c.carried, c.fresh = gen, time.Now().Add(time.Duration(o.lease)*time.Millisecond), countOf(rec), !found
		c.pid = ss.pid
		c.displaced = nil // its transaction ended: the key was free
	}
	r.s.scheduleLapseLocked()
	return giveBack
}
