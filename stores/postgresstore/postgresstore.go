// Package postgresstore keeps idempotency records in a PostgreSQL table,
// shared by every worker of a fleet. It implements [stores.Store] (claims,
// a TTL, fingerprints, values and failures) and, for the middleware's transactional
// mode, [stores.TxStore], over database/sql with any PostgreSQL driver; it is tested with pgx v5's stdlib driver and with
// lib/pq, on PostgreSQL 15.
//
// With pgx's driver a claim is an advisory lock held on a connection the
// Store keeps for its claims, and writes nothing (see "Session claims");
// call [Store.Close] when the worker stops. With another driver, behind a
// pooler in transaction mode ([WithRowClaims]), with [WithTransactionClaims]
// or [WithPartitions], a claim is a row of the table.
//
// # The table
//
// [Store.Migrate] creates it (safe on every boot); schema.sql holds the same
// DDL for those who run their own migrations:
//
//	CREATE TABLE IF NOT EXISTS watermill_idempotency (
//	    key         uuid   PRIMARY KEY, -- the first 128 bits of SHA-256 of the scoped key
//	    expires_at  bigint,             -- Unix milliseconds; NULL: kept until forgotten
//	    claim       text,               -- the in-flight claim holder; NULL once remembered
//	    fingerprint bigint,             -- of the remembered message's content; NULL: none
//	    value       bytea,              -- a value kept with the record (a saved answer); NULL: none
//	    failure     jsonb               -- how often the message failed, and how it ended; NULL: never failed
//	);
//
// A row holds what a decision needs and nothing more: a fixed 16-byte key
// whatever the handler name and meta.id, an expiry, a claim token only while
// a delivery is in flight, and the fingerprint that catches a reused meta.id
// (and, rarely, a value: an HTTP answer saved for a retry, up to
// MaxValue). Migrate adds a column the table lacks (fingerprint, value,
// failure) in place: a column without a default rewrites nothing, and
// the lock it takes lasts a moment. There is no index on expires_at; expired
// rows count as absent, and [Store.DeleteExpired] removes them by walking the
// table in bounded block ranges. A row costs 99.9 to 101.4 bytes with its
// primary key index, measured from 1 to 10 million rows (docs/benchmarks.md,
// "Record size").
//
// # Failing and ended records
//
// A message whose runs failed ([Store.Fail], the middleware's retry
// budget) keeps its count in the failure column, as JSON read by any
// PostgreSQL client:
//
//	{"attempts": 3, "first": 1733400000000, "not_before": 1733400004000, "expires": 1734004800000,
//	 "end": {"reason": "failed", "at": 1733400009000, "topic": "orders.dlq", "marker": ""}}
//
// (Unix milliseconds; expires is when the count lapses, a retention after
// the last failure, null without a TTL; end once the message ended, its
// dead letter acked). With claim NULL the row is the failing or ended
// record; with a claim it is the claim of the delivery that runs the
// message again, carrying the count: once that claim's lease passes
// unrenewed, the row is the failing record again until the count's own
// expiry (DeleteExpired keeps it meanwhile), so a holder that dies leaves
// the count behind. The column is NULL in every row of a message that never
// failed: the statements of the first-seen path are those of a store
// without failures, and the row costs no byte more (its null bitmap already
// has room for the column).
//
// # Statements
//
// Lookup is one SELECT on the primary key, Remember one INSERT … ON
// CONFLICT DO UPDATE (which leaves another holder's live claim alone),
// Extend one UPDATE of the caller's live claim (claims of rows; session
// claims are below), Release one statement
// (a DELETE, or, for a claim carrying a count of failures, an UPDATE that
// leaves the failing record), Forget and Reopen one DELETE, Fail one
// INSERT … ON CONFLICT DO UPDATE (which keeps the caller's live claim and
// leaves a live record and another holder's live claim alone; only then a
// SELECT tells which). RememberTx is one
// INSERT … ON CONFLICT DO UPDATE in the caller's transaction (the insert is
// the lookup: a live record conflicts, and a duplicate costs one statement
// more, which reads its fingerprint and value, or finds an end, or takes a
// failing record over in the same transaction and returns its count). [Store.BeginPgx], for pgx used natively, sends
// the transaction's BEGIN and a plain INSERT in one round trip (a unique
// violation is the existing row). Claim is one INSERT … ON CONFLICT
// DO NOTHING for a message never seen (the common case); on conflict a
// SELECT on the primary key tells a remembered record from one in flight,
// and only a row whose expiry has passed, or a failing record, is taken
// over, by an UPDATE that re-checks it under the row lock and returns the
// count it keeps (so exactly one of any number of racing claimers wins,
// and a duplicate of a live record or an end locks and writes nothing). Times come from the database
// clock, so workers' clocks need not agree. A claim's holder is the
// delivery's token (stores.WithClaimToken), or a random token of the Store
// instance for calls that name none; a claim by the holder of a live claim
// finds it taken by itself. Retentions and leases are kept in milliseconds in
// a bigint: any time.Duration fits.
//
// # Grouped statements
//
// Under load, the Lookup, Remember, Claim and Extend calls of concurrent deliveries
// share statements: while one statement of a kind runs, the calls that
// arrive queue, and the next statement carries them all (SELECT … WHERE key
// = ANY($1), INSERT … SELECT FROM unnest($1, $2) …), so a hundred
// deliveries cost a few statements and a few commits instead of a hundred
// of each. A call that finds nothing in flight yields once, so that calls
// runnable at the same moment can join it, and then runs, alone if none
// came: at low load nothing waits. Every call still returns by its own context's
// deadline, and gets its own answer. A call that gives up (its context
// done) may still take effect: the statement carrying it runs on, so a
// Remember that returned a deadline error can have written its record. A
// claim taken for a caller that gave up is released: every statement that
// can take a claim (the insert, grouped or not, and the takeover of a lapsed
// claim or a failing record) runs detached from its caller's cancellation,
// bounded by the query timeout, and undoes the claim once it ended for a
// caller gone meanwhile (a failing record's count stays). (Cut short by a
// caller's deadline while it waited on a row lock, the statement would be
// dropped by the driver, which closes the connection and sends the server
// no request to cancel it under pgx's defaults, and the server would still
// take the claim once the lock went, committing it as the statement ends.)
// Only a statement that the query timeout itself cuts short can still take
// a claim on the server that way; it lapses with its lease. A transaction
// claim (WithTransactionClaims) cut short leaves nothing: its row is never
// committed, and the server rolls it back with the session the driver
// closed. WithoutGrouping turns
// grouping off; WithAsynchronousCommit goes further for the records (see its
// doc).
//
// # Claims held in a transaction
//
// With [WithTransactionClaims] a claim is a transaction of its own, held
// open on a connection of the pool while the handler runs: Claim begins it
// and inserts the record's row, uncommitted, in one round trip (BEGIN and
// the INSERT together); Remember commits it, with the record's expiry,
// fingerprint and value, in one round trip (an UPDATE and the COMMIT
// together): the commit is the record, one commit per message instead of
// the claim's and the record's. Release rolls it back. Nothing of a claim
// is ever committed, so nothing of it outlives its holder:
//
//   - A holder that dies (a crash, SIGKILL, a dropped connection) frees its
//     claim at once: PostgreSQL aborts the transaction when the backend sees
//     the connection close. There is no lease to wait out.
//   - A holder that hangs while connected, or whose host vanished without
//     closing its connection, is bounded by the lease: the claim's
//     transaction sets idle_in_transaction_session_timeout to it, and the
//     server ends the session once no statement came for that long (a
//     renewal of the claim sends one). The Store also closes the
//     connection of a claim whose lease passed unrenewed. A lease beyond
//     24.8 days (the longest timeout PostgreSQL takes) lasts 24.8 days.
//   - A copy of the message in another worker waits on the claim's row
//     (lock_timeout, [WithClaimWait], 250 ms by default and shortened to fit
//     the call's deadline): it finds the record the moment the claim commits
//     (skipped, or a conflict by its fingerprint), takes the claim the moment
//     it rolls back, and is reported in flight if the claim is still open
//     after the wait (the middleware then waits again, up to its park wait,
//     and parks it). A copy in the same process waits on the claim itself,
//     holding no connection.
//   - A holder that lost its claim (its session terminated, its lease
//     passed) learns it: its Remember fails with an error matching
//     [ErrClaimLost] and the loss is logged. Remember called again by that
//     holder writes the record as usual, unless another delivery holds the
//     key: it then waits for it at most the claim wait and writes nothing.
//     A Remember whose commit goes unanswered (its deadline passes, the
//     connection is cut after the statement went out) cannot know whether
//     the record committed: its error says so and does not match
//     [ErrClaimLost]; the message's redelivery finds the record, or runs.
//   - A claim of a failing record locks the committed row in its
//     transaction and carries its count; a rollback leaves the row as it
//     was. The holder's Fail must outlive the transaction yet keep the
//     claim: the transaction commits the row as a claim of the holder
//     carrying the new count, for the rest of its lease, and a new
//     transaction of the claim locks it again at once (two round trips).
//     Another worker meanwhile finds it in flight, then waits on the lock;
//     a holder that dies leaves the count once that claim's lease passed.
//     Release then commits the failing record instead of rolling back, and
//     a Fail with an end commits the ended record in the claim's place.
//
// What changes for the other calls: another worker's open claim is an
// uncommitted row, invisible to Lookup there (unknown, not in flight; the
// Store's own claims are in flight), and to Forget, which cannot remove it:
// forgetting a message while it runs leaves its record to be committed, so
// forget it once it finished. A record written in a transaction of the
// caller's (RememberTx, BeginTx, BeginPgx) by the holder of the key's
// claim in this Store takes the claim's place (the claim is rolled back
// first); another holder's claim here is reported in flight. Claims are not
// grouped: each message costs its own two round trips and its own commit.
//
// Each message in flight holds a connection from the pool for its whole
// run, besides those the Store's other statements and the handlers use: size
// the pool as below (twice the concurrency, of every router whose Stores
// share it). A claim that would take the pool's last free connection is
// refused at once with an error matching [ErrPoolExhausted], as is one that
// finds no connection free before its deadline, rather than wait on
// handlers that may need one themselves. The pool's own count decides
// (db.Stats: its connections in use against db.SetMaxOpenConns), whoever
// holds them: this Store's claims, those of other Stores on the same
// *sql.DB, the handlers' statements; so one connection is always left for
// a handler. Of claims racing for the last connections some may be
// refused where one would have fitted (a transient error: the message
// comes back), never one too many. Call
// [Store.ReleaseAll] when a worker stops, after its router, so that the
// claims it still holds are rolled back at once. A pooler in front of
// PostgreSQL must pool by session or by transaction (PgBouncer's transaction
// pooling keeps a server connection for the claim's whole transaction), not
// by statement.
//
// The handler's own writes to the same database still belong in the
// middleware's transactional mode (idempotency.WithTransaction), where the
// handler's transaction carries the record: a claim held in a transaction
// of its own commits apart from them.
//
// # Session claims
//
// In short: on pgx a claim writes nothing; the Store keeps one connection
// of its own beside db's pool; call [Store.Close] when the worker stops,
// after its router; behind PgBouncer use session pooling, or [WithRowClaims].
//
// With the pgx driver, unless [WithRowClaims], [WithTransactionClaims] or
// [WithPartitions] says otherwise, a claim is a session-level advisory
// lock (pg_try_advisory_lock) taken on one connection the Store opens for
// its claims (its session), apart from db's pool and configured as a
// connection of that pool. [WithSessionClaims] insists on them: New then
// fails with [ErrNotPgx] on another driver, and with [ErrInvalidOption]
// beside WithTransactionClaims or WithPartitions. A claim writes nothing:
// no row, no WAL, no dead tuple for vacuum. The record is then the only row written per message, on the
// session, grouped as usual, and only while the session holds the key's
// lock: the statement takes the lock again for its own transaction, drops
// the session's, and so keeps the key until the record commits. The record
// of a key that had no row when it was claimed is a plain INSERT, without
// the upsert's conflict check: every writer of the store takes the key's
// lock first, so no row can be there. A row written meanwhile by a program
// that takes no lock (a tool writing the table by hand) fails that INSERT
// before the round trip changed anything, and the round trip goes again
// with the upsert (PostgreSQL's log then shows the unique violation as an
// ERROR line). A claimer
// that takes a lock reads the key's row in a second statement of the same
// round trip, so it sees every record committed before the lock was
// free. The session carries one round trip at a time, with every claim and
// record due meanwhile; while 16 or more claims are held on it, a round
// trip waits up to 500µs for more to join it first ([WithGroupPause]),
// which spares a busy worker about a fifth of its round trips and commits.
//
//   - A holder that dies (a crash, SIGKILL) frees its claims at once: the
//     server ends the session when its connection closes (measured: the
//     message was claimed elsewhere 22 ms after a SIGKILL). The message
//     runs again when the broker hands it out (on Redis Streams after its
//     idle time, 5 s in the production wiring), and, as with any claim, an
//     effect the dead holder made but did not record runs again: keep
//     effects in the same database in the transactional mode.
//   - A holder that stops talking to the server (SIGSTOP, a long pause, a
//     network cut) loses its session on the server's side after the claim
//     lease: while it holds claims, the session's idle_session_timeout is
//     the lease (PostgreSQL 14 and later; before, only the TCP keepalives
//     the session also sets: 5 s idle, then 3 probes 2 s apart), and its
//     client_connection_check_interval a second. Every renewal of a claim
//     asks the server, with one statement shared by every renewal due at
//     that moment (a Guard renews its claims together): a thousand claims
//     in flight cost about one round trip a second with a 5 s lease. A
//     session the server ended (terminated, cut off) has lost its locks,
//     maybe to another worker at once: the holder's next renewal says so.
//   - A claim its holder stops renewing lapses after its lease as with
//     rows: one timer per Store gives back the locks of such claims.
//   - A holder whose session was lost learns it from its next renewal, and
//     its Remember writes the record only when nobody holds the key:
//     otherwise it fails with an error matching [stores.ErrClaimTaken]. A
//     Remember cut by the loss of the session writes nothing. In its own
//     Store the lost claim still keeps the key from other holders for the
//     rest of its lease (as last renewed), so that a duplicate delivered
//     to the same worker during a database restart waits for the holder's
//     record, retried, rather than run the message again. A worker of
//     another process can take the key as soon as the server has freed
//     the lock, and runs the message again if the holder's effect was not
//     yet recorded: the transactional mode closes that window.
//   - Keys share the 64-bit space of advisory locks with the Store's other
//     tables (the table is mixed into each key) and with every other user
//     of advisory locks in the database. Two keys whose locks collide
//     (about one chance in 2^64 per pair held at once) run one after the
//     other: the second is in flight until the first ends, and the
//     middleware parks it; it never runs beside the first.
//   - A claim, this Store's or another worker's, is in flight to Lookup:
//     the grouped read of the keys' rows tries each key's lock, shared, in
//     the same statement, which fails while a claim holds it.
//   - A Remember that holds no claim here (the seen-set mode, or after a
//     Release) is written by the pool's grouped statement, which takes
//     the key's lock, shared: a key a session claim holds is refused with
//     [stores.ErrClaimTaken], and a claim taken meanwhile waits for the
//     record's commit, then finds it. Only the records of claims go over
//     the session, and those of claims that just ended here (lapsed,
//     released) while their lock is being given back: the session still
//     holds it, and nobody else does.
//   - Forget cannot free a claim another session holds.
//   - A record written in a transaction of the caller's (RememberTx,
//     BeginTx, BeginPgx) takes the key's lock, shared, for that
//     transaction: a session claim of the key makes it report in flight,
//     and no claim is taken until it commits or rolls back.
//
// A pooler in front of PostgreSQL must give the session a server
// connection of its own: PgBouncer in session mode works; in transaction
// or statement mode the locks would stay on a server connection other
// clients use, and the Store refuses with [ErrSessionPooled] (it checks
// when it opens the session, which Migrate does at start-up, and on every
// claim); [WithRowClaims] is then the way. The session costs one
// connection per Store, outside db's pool, opened at its first call (or by
// Migrate) and kept while claims come: while it holds claims its idle
// timeout is their lease; once it holds none, a minute, after which the
// server ends it and the next claim opens another. [Store.Close] (or
// [Store.ReleaseAll]) ends it at once, freeing every claim it holds. The
// session sets its own plan_cache_mode to force_generic_plan (PostgreSQL
// 12 and later): its statements, over arrays of a few keys, are planned
// once rather than at every run; nothing else sees the setting.
// Claims of rows and session claims exclude each other on one table: a
// claim of a row takes the key's advisory lock, shared, for its statement
// (it is not taken while a session claim holds the key), and a session
// claim finds a live claim row when it reads the key's row. Workers of
// either kind, on any driver, can so share a table (development builds
// whose claims of rows took no lock do not see the locks: stop them before
// starting this version). A worker with claims of rows sees a session
// claim only through its own Claim, though: while another worker's session
// claim holds a key, its Lookup says unknown, and its Remember without a
// claim (the seen-set mode) writes the record. Claims held in transactions
// (WithTransactionClaims) take no such lock: do not mix them with session
// claims.
//
// # Partitions
//
// [WithPartitions] (which needs a TTL) keeps the records in a table
// partitioned by time instead, so that expiry drops whole partitions, each
// in a moment, instead of deleting rows one by one with the bloat and
// vacuum work that leaves on the table the deliveries write:
//
//	CREATE TABLE watermill_idempotency (
//	    key uuid NOT NULL, expires_at bigint NOT NULL, claim text, fingerprint bigint, value bytea, failure jsonb,
//	    bucket bigint NOT NULL DEFAULT (<now in ms> / <period> * <period>),
//	    PRIMARY KEY (key, bucket)
//	) PARTITION BY RANGE (bucket);
//
// A row goes to the partition of the period in which it was created (the
// database clock) and never moves: a claim is remembered, renewed or
// released in the partition where it was taken, and a record rewritten
// stays where it is. Migrate creates the table and the partitions from the
// previous period to three ahead (each named after the table, "_p" and its
// first millisecond); DeleteExpired (and RunCleanup) creates those ahead as time goes
// on, then drops each partition whose period ended a TTL ago and whose
// every record has been expired for at least a minute: a record rewritten,
// a claim renewed or a count of failures written long after its creation
// keeps its partition until it expired. A write never gives an expired row a later expiry (the row is
// deleted and the key written anew, in the current partition), so a
// partition found wholly expired stays so. It is detached with DETACH
// PARTITION … CONCURRENTLY, read once more, and dropped: the table stays
// readable and writable throughout, where a plain DROP TABLE of a partition
// would wait for every open transaction on the table and hold every
// statement of the store behind it meanwhile (docs/benchmarks.md). One
// replica drops at a time (a session advisory lock; the others skip), and
// partitions are created under the table's migration lock (Migrate is the
// way to create the table: it also records the period in the table's
// comment, which Migrate checks). A write that
// finds no partition for the current period (DeleteExpired not run for
// three periods) creates it and is sent again.
//
// PostgreSQL enforces a primary key on a partitioned table only with the
// partition key in it, so (key, bucket) keeps a key unique within a
// partition, not across them: two claims of one key on either side of a
// period's boundary would both insert, in different partitions. Every
// statement that may create a row therefore takes a transaction-scoped
// advisory lock on the key's first 64 bits first, and checks for the key
// in a statement of its own, in one round trip (a query of three
// statements: the lock, the removal of the key's expired row, the write).
// Under READ COMMITTED each statement takes its own snapshot, so the check
// sees every write of the key committed before the lock was granted, and
// of two writers the second finds the first's row. Claim, Remember, Fail,
// RememberTx, BeginTx and BeginPgx do so (RememberTx holds the lock until
// the caller's transaction ends, as the unique index held the key before);
// Lookup, Extend, Release, Reopen and Forget find the row by key in
// whichever partition it is. A transaction above READ COMMITTED would take its
// snapshot before the lock is granted: the locked writes refuse it with an
// error.
//
// What it costs: a lookup by key reads the primary key of every partition
// (about retention / period + 5 of them: 11 or 12 for a week of daily
// partitions), a row is 22% bigger (the bucket, in the heap and the
// primary key), and Claim and Remember are sent on their own rather than
// grouped: a first-seen Claim took 1.7 to 4.5 times as long as on the plain
// table in the measure of docs/benchmarks.md, where dropping expired
// records removed 1.2 to 5.2 times as many rows a second (2.7 at 10
// million rows) as the plain table's
// DELETE, left no dead space behind, and a pass with nothing to remove
// cost a look at the catalog instead of a read of the whole table. It pays
// where deleting the expired rows is the burden (tens of millions a day);
// the plain table stays the default. WithTransactionClaims is
// refused with it: its uncommitted claims are invisible to the check made
// before a partition is dropped, and would need the key's lock held for the
// handler's whole run.
//
// # Sizing the connection pool
//
// database/sql keeps only 2 idle connections unless told otherwise: with
// more concurrent deliveries than that, most statements open a new
// PostgreSQL connection and the store slows down by an order of magnitude.
// Size the pool's idle connections to the concurrency of the routers that
// share it:
//
//	db.SetMaxOpenConns(2 * concurrency)
//	db.SetMaxIdleConns(2 * concurrency)
//
// Every statement is bounded by a query timeout (WithQueryTimeout, default 5s)
// when the caller's context has no earlier deadline, so that a hung server or
// a lock held by a stuck transaction cannot block a handler for good. The
// timer costs about 3–5% of a statement's time on loopback
// (docs/benchmarks.md); callers whose contexts carry deadlines of their own
// (idempotency.WithStoreTimeout) may turn it off with WithQueryTimeout(0).
package postgresstore

import (
	"context"
	"crypto/sha256"
	"database/sql"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/babelqueue/watermill-idempotency/internal/ctxerr"
	"github.com/babelqueue/watermill-idempotency/internal/sqlmigrate"
	"github.com/babelqueue/watermill-idempotency/internal/sqlstate"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// DefaultTable is the table the store uses unless WithTable says otherwise.
const DefaultTable = "watermill_idempotency"

//go:embed schema.sql
var schemaSQL string

// ErrInvalidOption is matched by the error New returns for a bad option.
var ErrInvalidOption = errors.New("postgresstore: invalid option")

// nowMS is the database clock in Unix milliseconds.
const nowMS = "(extract(epoch from statement_timestamp()) * 1000)::bigint"

// clockMS is the server's clock in milliseconds when the expression runs,
// rather than when its statement began (nowMS): a statement that waited
// on a row lock judges a claim by the moment it reaches it.
const clockMS = "(extract(epoch from clock_timestamp()) * 1000)::bigint"

// txStartMS is the start of the current transaction in milliseconds: what
// the session's round trip judges a claim row's lapse by, so that it never
// takes a key whose claim row another statement judged live after the
// round trip took the key's lock.
const txStartMS = "(extract(epoch from transaction_timestamp()) * 1000)::bigint"

// Store is a PostgreSQL-backed store, safe for concurrent use.
type Store struct {
	db           *sql.DB
	table        string // as given
	ttl          time.Duration
	queryTimeout time.Duration
	cleanupPages int
	instance     string // the claim holder of calls whose context names none
	logger       *slog.Logger
	churn        poolWatch
	ungrouped    bool          // WithoutGrouping
	asyncCommit  bool          // WithAsynchronousCommit
	inFlight     int           // grouped statements of one kind running at once
	pause        time.Duration // WithGroupPause

	partitioned bool          // WithPartitions
	period      time.Duration // WithPartitions
	parts       *parts        // the partitioned layout; nil for the plain table

	txClaims, claimWaitSet bool          // WithTransactionClaims, WithClaimWait
	claimWait              time.Duration // WithClaimWait
	held                   *txHeld       // the transaction claims held; nil without WithTransactionClaims

	sessionClaims bool          // WithSessionClaims, or the default with the pgx driver
	rowClaims     bool          // WithRowClaims
	session       *sessionState // nil without session claims
	sessOps       *group        // the session's operations, carried together

	seens, remembers, claims, extends *group

	seenManySQL, rememberManySQL, claimManySQL, extendManySQL, extendSQL string
	seenLockedSQL                                                        string // with the keys' locks

	claimSQL, claimRowSQL, takeoverSQL, lookupSQL, rememberSQL, rememberTxSQL, forgetSQL, releaseSQL, cleanupSQL, pagesSQL string

	expiresSQL string     // a record's expiry, as SQL (NULL without a TTL)
	failure    failureSQL // the statements of failing and ended records

	recordSQL, recordStmt string // the record's INSERT (BeginTx; prepared by BeginPgx) and its statement's name
	lockSeed              uint64 // mixes the table into the keys' advisory locks (rowLock)
	// BeginPgx's record up to its values: the EXECUTE of the prepared
	// INSERT, and the plain INSERT it falls back to (the expiry first).
	executePrefix, insertPrefix string
	noExecute                   atomic.Bool   // BeginPgx gave the prepared statement up
	executes, lostStatements    atomic.Uint64 // BeginPgx's EXECUTEs, and those whose statement was gone
}

var _ stores.TxStore = (*Store)(nil)

// Option configures a Store.
type Option func(*Store)

// WithTable sets the table (default DefaultTable): a plain identifier of
// letters, digits and underscores, optionally qualified by a schema
// ("billing.idempotency"). The workers of one table must name it alike,
// since its name is mixed into the keys' locks: "idempotency" and
// "public.idempotency" are one table to them, but a table of another
// schema is named with its schema by every worker (not found through
// search_path by some).
func WithTable(name string) Option { return func(s *Store) { s.table = name } }

// WithTTL makes remembered records expire after ttl: they count as absent
// from then on and DeleteExpired removes them. Zero (the default) keeps them
// until forgotten. Any ttl is kept as given.
func WithTTL(ttl time.Duration) Option { return func(s *Store) { s.ttl = ttl } }

// WithQueryTimeout bounds every statement (default 5s) when the caller's
// context has no earlier deadline. Zero disables it for the statements a
// call sends on its own; a grouped statement, which carries several callers
// and none of their contexts, is then bounded by 30s.
func WithQueryTimeout(d time.Duration) Option { return func(s *Store) { s.queryTimeout = d } }

// WithoutGrouping sends every call's statement on its own instead of
// grouping the statements of concurrent calls (see the package doc).
func WithoutGrouping() Option { return func(s *Store) { s.ungrouped = true } }

// WithGroupPause sets how long the session's next round trip may wait for
// more calls to join it (default 500µs; 0 turns the wait off). The session
// claims (the default on pgx) carry the claims and records of concurrent
// deliveries together, one round trip and at most one commit at a time.
// While at least 16 claims are held or being taken on the session, that is
// while that many handlers are running and their records are due, a round
// trip that could start waits up to d first: the calls due meanwhile share
// it rather than lead the next one, and the store spends fewer round trips
// and commits, and less database and client CPU, per delivery
// (docs/benchmarks.md). A delivery then waits up to d twice (its claim, its
// record). Fewer deliveries at once never wait: there the wait would cost
// more latency than it saves work. A call whose context is done ends the
// wait it leads, and a renewal (Extend) is never held back: it ends the
// wait of the round trip that will carry it, so that a lease shorter than
// d is renewed in time. At most 50ms. The statements of the other kinds of
// claims are not held back.
func WithGroupPause(d time.Duration) Option { return func(s *Store) { s.pause = d } }

// defaultGroupPause and maxGroupPause bound WithGroupPause; pauseSiblings
// is how many claims on the session make it busy enough to wait.
const (
	defaultGroupPause = 500 * time.Microsecond
	maxGroupPause     = 50 * time.Millisecond
	pauseSiblings     = 16
)

// sessionPause is the session group's pause: the store's while at least
// pauseSiblings claims are held or being taken on the session (handlers
// running, whose records are due soon), none otherwise.
func (s *Store) sessionPause() time.Duration {
	ss := s.session
	ss.mu.Lock()
	busy := len(ss.claims) >= pauseSiblings
	ss.mu.Unlock()
	if !busy {
		return 0
	}
	return s.pause
}

// WithStatementsInFlight sets how many grouped statements of one kind
// (Lookup, Remember, Claim) may run at once (default 1); calls arriving while that
// many run queue and share the next one. 1 groups the most: the fewest
// statements and commits, and the least database and client CPU per
// delivery, which is what end-to-end throughput depends on
// (docs/benchmarks.md). More lets a few concurrent calls run in parallel
// with less waiting, when the database has cores to spare.
func WithStatementsInFlight(n int) Option { return func(s *Store) { s.inFlight = n } }

// WithAsynchronousCommit makes Remember commit
// without waiting for the record to reach the disk (synchronous_commit = off
// for the record's own transaction only, set by the record's statement
// itself: still one round trip). The delivery is acked sooner and
// the database flushes less often, at a price: a crash of the database
// server (not of a worker) may lose the records of the last moments
// (at most three times wal_writer_delay, 600 ms by default), and their
// messages would run again if redelivered; the same narrow window as a record
// that could not be written. The transactional mode (RememberTx) is not
// affected: its record commits with the handler's transaction. Off by
// default.
func WithAsynchronousCommit() Option { return func(s *Store) { s.asyncCommit = true } }

// WithCleanupBatch sets how many table blocks (8 KiB pages, about 150 rows
// each) one DeleteExpired statement covers (default 1024).
func WithCleanupBatch(pages int) Option { return func(s *Store) { s.cleanupPages = pages } }

// WithLogger sets where the Store warns of a connection pool that keeps
// reconnecting (see New); default slog.Default(), nil for silence.
func WithLogger(logger *slog.Logger) Option { return func(s *Store) { s.logger = logger } }

var identifier = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

// New returns a Store on db, which stays the caller's to configure and
// close. It does not touch the database; call Migrate (or run schema.sql)
// before use. It returns an error matching ErrInvalidOption for a bad table
// name or duration.
//
// Size db's idle connections to the number of concurrent deliveries:
//
//	db.SetMaxOpenConns(2 * consumers)
//	db.SetMaxIdleConns(2 * consumers)
//
// database/sql keeps only 2 idle connections by default, so with more
// concurrent deliveries most statements open a new PostgreSQL connection
// (milliseconds each, and a backend process forked) and throughput falls
// by an order of magnitude. The Store watches for it: when the pool keeps
// closing idle connections it will have to open again
// (sql.DBStats.MaxIdleClosed grows by one for every 16 statements or
// more), it logs a warning, at most once a minute (WithLogger).
func New(db *sql.DB, opts ...Option) (*Store, error) {
	s := &Store{db: db, table: DefaultTable, queryTimeout: 5 * time.Second, cleanupPages: 1024,
		instance: stores.NewClaimToken(), logger: slog.Default(), inFlight: 1, pause: defaultGroupPause}
	for _, opt := range opts {
		opt(s)
	}
	if db == nil {
		return nil, fmt.Errorf("%w: nil *sql.DB", ErrInvalidOption)
	}
	quoted, err := quoteTable(s.table)
	if err != nil {
		return nil, err
	}
	if s.ttl < 0 || (s.ttl > 0 && s.ttl < time.Millisecond) {
		return nil, fmt.Errorf("%w: TTL %v: want 0 (forever) or at least 1ms", ErrInvalidOption, s.ttl)
	}
	if s.queryTimeout < 0 {
		return nil, fmt.Errorf("%w: negative query timeout %v", ErrInvalidOption, s.queryTimeout)
	}
	if s.inFlight < 1 {
		return nil, fmt.Errorf("%w: %d statements in flight: want at least 1", ErrInvalidOption, s.inFlight)
	}
	if s.pause < 0 || s.pause > maxGroupPause {
		return nil, fmt.Errorf("%w: group pause %v: want 0 (none) to %v", ErrInvalidOption, s.pause, maxGroupPause)
	}
	if s.cleanupPages < 1 {
		return nil, fmt.Errorf("%w: cleanup batch of %d pages: want at least 1", ErrInvalidOption, s.cleanupPages)
	}
	expires := "NULL"
	if s.ttl > 0 {
		expires = fmt.Sprintf("%s + %d", nowMS, s.ttl.Milliseconds())
	}
	t := quoted
	s.expiresSQL = expires
	// A row is live until its expiry, or, when it carries a count of
	// failures (a lapsed claim of a message that failed), until the
	// count's: the row is then the failing record.
	live := `(expires_at IS NULL OR expires_at > ` + nowMS + ` OR ` + counted("") + `)`
	// What a read returns of a row: whether it is a live claim, its
	// fingerprint, expiry and value, and its count while it lasts.
	read := `coalesce(claim <> '', false) AND expires_at > ` + nowMS + `, coalesce(fingerprint, 0), expires_at, value,
		CASE WHEN ` + counted("") + ` THEN failure END`
	s.lookupSQL = `SELECT ` + read + ` FROM ` + t + ` WHERE key = $1 AND ` + live
	// Remember replaces a record, the caller's own claim ($4) or a lapsed
	// one, never another holder's live claim: the row is then left alone
	// (no row affected).
	replaceable := `(r.claim IS NULL OR r.claim = '' OR r.claim = $4 OR r.expires_at <= ` + nowMS + `)`
	// WithAsynchronousCommit: the statement itself turns synchronous_commit
	// off for its own implicit transaction (set_config's is_local), so the
	// record needs no transaction of its own and stays one round trip.
	asyncCommit := ""
	if s.asyncCommit {
		asyncCommit = ` AND set_config('synchronous_commit', 'off', true) IS NOT NULL`
	}
	s.rememberSQL = `INSERT INTO ` + t + ` AS r (key, expires_at, fingerprint, value) SELECT $1::uuid, ` + expires + `, $2::bigint, $3::bytea
		WHERE ` + unclaimedOrOwn(t, "$5::int8", "$1::uuid", "$4::text") + asyncCommit + `
		ON CONFLICT (key) DO UPDATE SET expires_at = EXCLUDED.expires_at, claim = NULL, fingerprint = EXCLUDED.fingerprint, value = EXCLUDED.value, failure = NULL
		WHERE ` + replaceable
	// Inside the handler's transaction: insert, or take over an expired
	// record or a lapsed claim. A live record, or a live claim (a delivery
	// running in the claim mode), conflicts and is left alone; so is a row
	// carrying a live count of failures, which the next statement takes
	// over (failure.rememberFailing), returning the count.
	//
	// It also takes the key's advisory lock, shared ($5, rowLock), for the
	// transaction: a key a session claim holds is not recorded (nothing is
	// inserted, and the next statement says in flight), and no session
	// claim is taken until the transaction ends.
	s.lockSeed = tableSeed(t)
	s.rememberTxSQL = `INSERT INTO ` + t + ` AS r (key, expires_at, fingerprint, value) SELECT $1::uuid, ` + expires + `, $2::int8, $3::bytea
		WHERE pg_try_advisory_xact_lock_shared($5::int8)
		ON CONFLICT (key) DO UPDATE SET expires_at = EXCLUDED.expires_at, claim = NULL, fingerprint = EXCLUDED.fingerprint, value = EXCLUDED.value, failure = NULL
		WHERE NOT ` + counted("r.") + ` AND ((r.expires_at IS NOT NULL AND r.expires_at <= ` + nowMS + `) OR r.claim = $4)`
	// The plain INSERT of BeginTx and BeginPgx takes the key's lock, shared,
	// as RememberTx's does; where a session claim holds it the key is NULL,
	// which fails the INSERT (not_null_violation) as an existing row fails
	// it (unique_violation): both take RememberTx's path.
	s.recordSQL = `INSERT INTO ` + t + ` (key, expires_at, fingerprint, value) VALUES (` + lockedKey("$4::int8", "$1::uuid") + `, ` + expires + `, $2, $3)`
	s.recordStmt = fmt.Sprintf("bq_idempotency_record_%016x", fnv64(s.recordSQL))
	s.executePrefix = `EXECUTE ` + s.recordStmt + `(`
	s.insertPrefix = `INSERT INTO ` + t + ` (expires_at, key, fingerprint, value) VALUES (` + expires + `, `
	s.forgetSQL = `DELETE FROM ` + t + ` WHERE key = $1`
	// Claim: a plain insert, which settles the common case (a message never
	// seen) in the cheapest statement there is; on conflict it locks and
	// writes nothing. The conflicting row is then read (claimRowSQL): a live
	// record, claim or end explains the failed claim, and only a row whose
	// expiry has passed, or a failing record, is taken over, by an UPDATE
	// that re-checks it under the row lock, so of any number of racing
	// claimers exactly one wins. A live count of failures is kept with the
	// claim, and returned.
	//
	// A claim of a row also takes the key's advisory lock, shared, for its
	// statement: a key a session claim holds (WithSessionClaims, in another
	// worker of the table) is not claimed, and a session claim waits for
	// the row's claim to commit, then finds it. A fleet can so mix both
	// kinds while it switches from one to the other.
	s.claimSQL = `INSERT INTO ` + t + ` (key, expires_at, claim) SELECT $1::uuid, ` + nowMS + ` + $2::bigint, $3::text
		WHERE pg_try_advisory_xact_lock_shared(` + lockOfKeySQL("$1", t) + `) ON CONFLICT (key) DO NOTHING`
	s.claimRowSQL = `SELECT claim IS NULL, coalesce(claim = '', false), coalesce(fingerprint, 0), expires_at IS NOT NULL AND expires_at <= ` + nowMS + `,
		claim IS NOT DISTINCT FROM $2, expires_at, value, CASE WHEN ` + counted("") + ` THEN failure END FROM ` + t + ` WHERE key = $1`
	keepCount := `(` + counted("") + ` AND failure->'end' IS NULL)`
	s.takeoverSQL = `UPDATE ` + t + ` SET expires_at = ` + nowMS + ` + $2, claim = $3,
			fingerprint = CASE WHEN ` + keepCount + ` THEN fingerprint END, value = NULL, failure = CASE WHEN ` + keepCount + ` THEN failure END
		WHERE key = $1 AND ((expires_at IS NOT NULL AND expires_at <= ` + nowMS + `) OR ` + takeable("") + `)
			AND pg_try_advisory_xact_lock_shared(` + lockOfKeySQL("key", t) + `)
		RETURNING coalesce(fingerprint, 0), failure`
	// Release drops the caller's claim; one carrying a count of failures
	// leaves the failing record behind, until the count's expiry.
	s.releaseSQL = `WITH d AS (DELETE FROM ` + t + ` WHERE key = $1 AND claim = $2 AND failure IS NULL RETURNING 1)
		UPDATE ` + t + ` SET claim = '', expires_at = (failure->>'expires')::bigint WHERE key = $1 AND claim = $2 AND failure IS NOT NULL`
	s.cleanupSQL = `DELETE FROM ` + t + ` WHERE ctid >= ('(' || $1::bigint || ',0)')::tid AND ctid < ('(' || $2::bigint || ',0)')::tid
		AND expires_at <= ` + nowMS + ` AND NOT ` + counted("")
	s.seenManySQL = `SELECT key::text, ` + read + ` FROM ` + t + ` WHERE key = ANY($1::text::uuid[]) AND ` + live
	// With session claims, the read also names the keys a claim holds ($2,
	// the keys' locks): a shared try of a lock, released as the statement
	// ends, fails only while a session holds it. One round trip, as
	// without them; the rows are read by the index as above (a join of
	// the keys with the table was planned as a scan of the whole table
	// while it was small, and kept so as it grew).
	s.seenLockedSQL = `SELECT key::text, false, ` + read + ` FROM ` + t + ` WHERE key = ANY($1::text::uuid[]) AND ` + live + `
		UNION ALL SELECT u.k::text, true, false, 0, NULL, NULL, NULL FROM unnest($1::text::uuid[], $2::text::int8[]) AS u(k, lk)
		WHERE NOT pg_try_advisory_xact_lock_shared(u.lk)`
	// The grouped Remember (keys distinct): a row's caller token is found
	// at the key's place in the arrays; the rows written are returned.
	manyConflict := `
		ON CONFLICT (key) DO UPDATE SET expires_at = EXCLUDED.expires_at, claim = NULL, fingerprint = EXCLUDED.fingerprint, value = NULL, failure = NULL
		WHERE (r.claim IS NULL OR r.claim = '' OR r.expires_at <= ` + nowMS + ` OR r.claim = ($3::text::text[])[array_position($1::text::uuid[], r.key)])
		RETURNING key::text`
	// It writes only keys no session holds ($4, the keys' locks, tried
	// shared for the statement), or whose live claim row is the caller's
	// own, as the plain Remember does.
	s.rememberManySQL = `INSERT INTO ` + t + ` AS r (key, expires_at, fingerprint) SELECT k, ` + expires + `, f
		FROM unnest($1::text::uuid[], $2::text::bigint[], $4::text::int8[], $3::text::text[]) AS u(k, f, lk, c)
		WHERE ` + unclaimedOrOwn(t, "lk", "k", "c") + asyncCommit + manyConflict
	s.extendSQL = `UPDATE ` + t + ` SET expires_at = ` + nowMS + ` + $2 WHERE key = $1 AND claim = $3 AND expires_at > ` + nowMS
	// The grouped Extend reaches the rows by the index (key = ANY): joined
	// with the keys alone, it kept the plan the server made while the table
	// was empty, a hash join over a scan of the whole table, as it grew.
	s.extendManySQL = `UPDATE ` + t + ` AS r SET expires_at = ` + nowMS + ` + u.l FROM unnest($1::text::uuid[], $2::text::bigint[], $3::text::text[]) AS u(k, l, c)
		WHERE r.key = ANY($1::text::uuid[]) AND r.key = u.k AND r.claim = u.c AND r.expires_at > ` + nowMS + ` RETURNING r.key::text, r.claim`
	s.claimManySQL = `INSERT INTO ` + t + ` (key, expires_at, claim) SELECT k, ` + nowMS + ` + l, c FROM unnest($1::text::uuid[], $2::text::bigint[], $3::text::text[]) AS u(k, l, c)
		WHERE pg_try_advisory_xact_lock_shared(` + lockOfKeySQL("k", t) + `)
		ON CONFLICT (key) DO NOTHING RETURNING key::text, claim`
	s.seens = &group{maxInFlight: s.inFlight, run: s.runLookup}
	s.remembers = &group{maxInFlight: s.inFlight, run: s.runRemember}
	s.extends = &group{maxInFlight: s.inFlight, run: s.runExtend}
	s.claims = &group{maxInFlight: s.inFlight, run: s.runClaim, undo: s.undoClaim}
	s.pagesSQL = `SELECT pg_relation_size('` + strings.ReplaceAll(t, `'`, `''`) + `') / current_setting('block_size')::bigint`
	s.initFailures(t, expires)
	if err := s.initPartitions(t, expires); err != nil {
		return nil, err
	}
	if err := s.initTxClaims(t, expires); err != nil {
		return nil, err
	}
	if err := s.chooseClaims(); err != nil {
		return nil, err
	}
	if err := s.initSessionClaims(t, expires); err != nil {
		return nil, err
	}
	if s.session != nil {
		// Every statement on the session runs detached from its callers'
		// cancellation: one cut while it runs would end the session.
		s.sessOps = &group{maxInFlight: 1, run: s.runSession, undo: s.undoSessionClaim, pause: s.sessionPause, hurry: make(chan struct{}, 1)}
	}
	return s, nil
}

// quoteTable validates a table name and returns it quoted for SQL.
func quoteTable(name string) (string, error) {
	parts := strings.Split(name, ".")
	if len(parts) > 2 {
		return "", fmt.Errorf("%w: table %q: want name or schema.name", ErrInvalidOption, name)
	}
	for i, p := range parts {
		if !identifier.MatchString(p) {
			return "", fmt.Errorf("%w: table %q: %q is not a plain identifier (letters, digits, underscores; at most 63)",
				ErrInvalidOption, name, p)
		}
		parts[i] = `"` + p + `"`
	}
	return strings.Join(parts, "."), nil
}

// tableSeed is what mixes the table quoted (quoteTable's) into its keys'
// advisory locks: a table of the public schema seeds them alike whether
// its name carries the schema or not, so that workers naming it either way
// meet on one key's lock.
func tableSeed(quoted string) uint64 {
	return fnv64(strings.TrimPrefix(quoted, `"public".`))
}

// Table returns the table name the store uses.
func (s *Store) Table() string { return s.table }

// Capabilities reports claims, the TTL, all 64 bits of fingerprints,
// values of up to MaxValue bytes and failures.
func (s *Store) Capabilities() stores.Capabilities {
	return stores.Capabilities{Claims: true, TTL: s.ttl, Fingerprint: stores.KeepAllBits, MaxValue: MaxValue, Failures: true}
}

// MaxValue is the longest value the store keeps with a record: 1 MiB.
const MaxValue = 1 << 20

// Migrate creates the table if it does not exist. It is safe to call on
// every start, from every replica at once: migrations of one table run one
// at a time (an advisory lock held by the migration's transaction), and a
// wait for another ends with ctx. With session claims (the default with the
// pgx driver) it also opens the Store's session, so a pooler in transaction
// or statement mode is found here: it fails with an error matching
// ErrSessionPooled (pass WithRowClaims there).
func (s *Store) Migrate(ctx context.Context) error {
	quoted, _ := quoteTable(s.table)
	ddl := strings.ReplaceAll(schemaSQL, DefaultTable, quoted)
	ctx, cancel := s.context(ctx)
	defer cancel()
	if s.parts != nil {
		if err := s.migratePartitioned(ctx, quoted); err != nil {
			return fmt.Errorf("postgresstore: migrate %s: %w", s.table, err)
		}
		return nil
	}
	var kind sql.NullString
	if err := s.db.QueryRowContext(ctx, `SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)`, quoted).Scan(&kind); err == nil && kind.String == "p" {
		return fmt.Errorf("postgresstore: migrate %s: %w: it is partitioned (WithPartitions)", s.table, ErrLayout)
	}
	if err := sqlmigrate.Postgres(ctx, s.db, quoted, ddl); err != nil {
		return fmt.Errorf("postgresstore: migrate %s: %w", s.table, err)
	}
	if s.session != nil {
		// Session claims: open the session now, so that a pooler in
		// transaction mode is refused at start-up (ErrSessionPooled), not
		// at the first message.
		if _, err := s.use(ctx, 0, func(context.Context, *pgx.Conn) error { return nil }); err != nil {
			return fmt.Errorf("postgresstore: migrate %s: the claims' session: %w", s.table, err)
		}
	}
	return nil
}

// RowKey returns the value of the key column for key, as uuid text: find a
// record with psql by it.
func RowKey(key string) string {
	sum := sha256.Sum256([]byte(key))
	var b [36]byte
	hex.Encode(b[0:8], sum[0:4])
	b[8] = '-'
	hex.Encode(b[9:13], sum[4:6])
	b[13] = '-'
	hex.Encode(b[14:18], sum[6:8])
	b[18] = '-'
	hex.Encode(b[19:23], sum[8:10])
	b[23] = '-'
	hex.Encode(b[24:36], sum[10:16])
	return string(b[:])
}

// Lookup returns the record held for key, with its expiry: one SELECT on
// the primary key (grouped with concurrent calls).
func (s *Store) Lookup(ctx context.Context, key string) (stores.Record, error) {
	if r, ok := s.heldInFlight(key); ok && ctx.Err() == nil {
		return r, nil
	}
	if s.session != nil {
		if err := s.session.pooledErr(); err != nil {
			return stores.Record{}, err
		}
	}
	if s.session != nil && s.ungrouped {
		r, err := s.lookupRow(ctx, key)
		if err != nil {
			return r, err
		}
		return s.lookupSession(ctx, key, r)
	}
	return s.lookupRow(ctx, key) // grouped, with session claims: with the key's lock (runLookupLocked)
}

// lookupRow reads the record of key's row.
func (s *Store) lookupRow(ctx context.Context, key string) (stores.Record, error) {
	if !s.ungrouped {
		o := newOp()
		o.key = RowKey(key)
		if err := s.seens.do(ctx, s.queryTimeout, o); err != nil {
			return stores.Record{}, err
		}
		return o.record, nil
	}
	ctx, cancel := s.context(ctx)
	defer cancel()
	if s.session == nil && s.parts == nil {
		o := newOp()
		o.key = RowKey(key)
		err := s.runLookupLocked(ctx, []*op{o})
		return o.record, err
	}
	r, err := scanRecord(s.db.QueryRowContext(ctx, s.lookupSQL, RowKey(key)).Scan)
	if err != nil {
		return stores.Record{}, fail(ctx, "lookup", err)
	}
	return r, nil
}

// scanRecord reads a row of lookupSQL (live claim, fingerprint, expiry,
// value, live count of failures); no row is StateUnknown.
func scanRecord(scan func(...any) error) (stores.Record, error) {
	var claimed bool
	var fp int64
	var expires sql.NullInt64
	var value, failure []byte
	err := scan(&claimed, &fp, &expires, &value, &failure)
	if errors.Is(err, sql.ErrNoRows) {
		return stores.Record{}, nil
	}
	if err != nil {
		return stores.Record{}, err
	}
	return record(claimed, fp, expires, value, failure)
}

// record describes a live row: a live claim (claimed), carrying the count
// failure, if any; else the failing or ended record failure, or a
// remembered record.
func record(claimed bool, fp int64, expires sql.NullInt64, value, failure []byte) (stores.Record, error) {
	r := stores.Record{State: stores.StateRemembered, Fingerprint: uint64(fp), Value: value}
	switch {
	case claimed && failure != nil:
		f, err := failedRecord(failure, fp)
		if err != nil {
			return stores.Record{}, err
		}
		r = stores.Record{State: stores.StateInFlight, Fingerprint: f.Fingerprint, Failure: f.Failure}
	case claimed:
		r = stores.Record{State: stores.StateInFlight}
	case failure != nil:
		return failedRecord(failure, fp)
	}
	if expires.Valid {
		r.ExpiresAt = time.UnixMilli(expires.Int64)
	}
	return r, nil
}

// Remember records key with the fingerprint and value of its message,
// replacing any claim on it: one INSERT … ON CONFLICT DO UPDATE (grouped
// with concurrent calls unless it carries a value).
func (s *Store) Remember(ctx context.Context, key string, fingerprint uint64, value []byte) error {
	if len(value) > MaxValue {
		return fmt.Errorf("postgresstore: remember: a value of %d bytes: %w (at most %d)", len(value), stores.ErrValueTooLarge, MaxValue)
	}
	if s.session != nil {
		rowKey, lock := s.session.lockKey(key)
		known, pooled := s.session.knows(lock)
		switch {
		case pooled != nil:
			return pooled
		case value != nil || s.ungrouped || known:
			return s.rememberSession(ctx, rowKey, lock, fingerprint, value)
		}
		return s.rememberGrouped(ctx, rowKey, fingerprint)
	}
	if s.held != nil {
		if done, err := s.rememberTx(ctx, key, fingerprint, value); done {
			return err
		}
		if stores.ClaimToken(ctx) != "" {
			return s.rememberUnheld(ctx, key, fingerprint, value)
		}
	}
	if !s.ungrouped && s.parts == nil && value == nil {
		return s.rememberGrouped(ctx, RowKey(key), fingerprint)
	}
	ctx, cancel := s.context(ctx)
	defer cancel()
	return s.rememberOne(ctx, RowKey(key), fingerprint, value, s.holder(ctx))
}

// rememberGrouped records the row key rowKey (no value) by the pool's
// grouped statement, with concurrent callers.
func (s *Store) rememberGrouped(ctx context.Context, rowKey string, fingerprint uint64) error {
	o := newOp()
	o.key, o.fingerprint, o.token = rowKey, int64(fingerprint), s.holder(ctx)
	return s.remembers.do(ctx, s.queryTimeout, o)
}

// rememberOne runs the plain Remember statement: one row, written unless
// another holder's live claim is on it (ErrClaimTaken).
func (s *Store) rememberOne(ctx context.Context, rowKey string, fingerprint uint64, value []byte, token string) error {
	var written bool
	var err error
	if s.parts != nil {
		written, err = s.execLocked(ctx, s.rememberLocked(false, rowKey, fingerprint, value, token))
	} else {
		written, err = s.exec(ctx, s.rememberSQL, rowKey, nullFingerprint(fingerprint), nullBytes(value), token, s.rowLock(rowKey))
	}
	switch {
	case err != nil:
		return fail(ctx, "remember", err)
	case !written:
		return fmt.Errorf("postgresstore: remember: %w", stores.ErrClaimTaken)
	}
	return nil
}

// Extend extends the caller's live claim on key (the Store's own when ctx
// names no holder) to lease from now: one UPDATE on the primary key
// (grouped with concurrent calls), which matches only a live claim of
// this holder.
func (s *Store) Extend(ctx context.Context, key string, lease time.Duration) (bool, error) {
	if lease < time.Millisecond {
		return false, fmt.Errorf("postgresstore: extend lease %v: want at least 1ms", lease)
	}
	if s.session != nil {
		return s.extendSession(ctx, key, lease)
	}
	if s.held != nil {
		if done, held, err := s.extendTx(ctx, key, lease); done {
			return held, err
		}
	}
	if !s.ungrouped {
		o := newOp()
		o.key, o.token, o.lease = RowKey(key), s.holder(ctx), lease.Milliseconds()
		if err := s.extends.do(ctx, s.queryTimeout, o); err != nil {
			return false, err
		}
		return o.claimed, nil
	}
	ctx, cancel := s.context(ctx)
	defer cancel()
	return s.execAs(ctx, "extend", s.extendSQL, RowKey(key), lease.Milliseconds(), s.holder(ctx))
}

// nullBytes is value as a statement's argument: NULL for nil (lib/pq
// sends a nil []byte as an empty bytea).
func nullBytes(value []byte) any {
	if value == nil {
		return nil
	}
	return value
}

func nullFingerprint(fp uint64) sql.NullInt64 {
	return sql.NullInt64{Int64: int64(fp), Valid: fp != 0}
}

// RememberTx records key with fingerprint and value inside tx, the transaction the
// handler writes its effect in, and reports whether it did (false: a
// duplicate, the record exists; one more statement reads it). A concurrent
// transaction holding an uncommitted record of the same key makes it wait
// until that one commits (false) or rolls back (true). The record commits
// or rolls back with tx.
func (s *Store) RememberTx(ctx context.Context, tx *sql.Tx, key string, fingerprint uint64, value []byte) (bool, stores.Record, error) {
	if len(value) > MaxValue {
		return false, stores.Record{}, fmt.Errorf("postgresstore: remember in transaction: a value of %d bytes: %w (at most %d)", len(value), stores.ErrValueTooLarge, MaxValue)
	}
	if s.yieldHeld(ctx, key) {
		return false, stores.Record{State: stores.StateInFlight}, nil
	}
	ctx, cancel := s.context(ctx)
	defer cancel()
	exec := func(ctx context.Context, query string, args ...any) (int64, error) {
		res, err := tx.ExecContext(ctx, query, args...)
		if err != nil {
			return 0, err
		}
		return res.RowsAffected()
	}
	query := func(ctx context.Context, query string, args ...any) func(...any) error {
		return tx.QueryRowContext(ctx, query, args...).Scan
	}
	return s.rememberIn(ctx, exec, query, RowKey(key), fingerprint, value)
}

// rememberIn is RememberTx in a transaction of either driver, which exec
// and query run statements in.
func (s *Store) rememberIn(ctx context.Context, exec func(ctx context.Context, query string, args ...any) (int64, error), query rowQuerier, rowKey string, fingerprint uint64, value []byte) (bool, stores.Record, error) {
	token := s.holder(ctx)
	if s.session != nil && s.yieldOwnClaim(ctx, rowKey, token) {
		return false, stores.Record{State: stores.StateInFlight}, nil
	}
	lock := s.rowLock(rowKey)
	waited := false
	for attempt := 0; ; attempt++ {
		var n int64
		var err error
		if s.parts != nil {
			n, err = exec(ctx, s.rememberLocked(true, rowKey, fingerprint, value, token))
			s.noPartition(ctx, err)
		} else {
			n, err = exec(ctx, s.rememberTxSQL, rowKey, nullFingerprint(fingerprint), nullBytes(value), token, lock)
		}
		if err != nil {
			return false, stores.Record{}, fail(ctx, "remember in transaction", err)
		}
		if n >= 1 {
			s.recordedOwn(rowKey, token)
			return true, stores.Record{}, nil
		}
		if s.parts == nil {
			// Nothing written: the key's lock first (the transaction has it
			// already, unless a session claim holds the key).
			var got bool
			if err := query(ctx, `SELECT pg_try_advisory_xact_lock_shared($1)`, lock)(&got); err != nil {
				return false, stores.Record{}, fail(ctx, "remember in transaction", err)
			}
			if !got {
				// The caller's own claim's lock, on a session lost as it
				// was given back, stays taken until the session's server
				// process has ended: the caller was told in flight for
				// its own key.
				if s.session != nil && !waited {
					if pid := s.lostOwnLock(rowKey, token); pid != 0 && s.awaitLocksGone(ctx, pid) {
						waited = true
						continue
					}
				}
				return false, stores.Record{State: stores.StateInFlight}, nil
			}
		}
		// The row was left alone: a duplicate, a live claim (a delivery
		// runs the message in the claim mode), an end, or a count of
		// failures to take over, in one more statement.
		recorded, found, again, err := s.rememberFound(ctx, query, rowKey, fingerprint, value, token)
		if err != nil {
			return false, stores.Record{}, fail(ctx, "remember in transaction", err)
		}
		if !again || attempt == 2 {
			if recorded {
				s.recordedOwn(rowKey, token)
			}
			return recorded, found, nil
		}
		// The row changed between the two statements: again.
	}
}

// BeginTx begins a transaction on db with opts and records key in it with
// fingerprint (0: none) and value (nil: none), as RememberTx does, but more
// cheaply for a key never seen: the record is a plain INSERT instead of
// RememberTx's INSERT … ON CONFLICT, in as many round trips (BEGIN, then
// the INSERT). Per delivery the transactional mode kept 82.1% of the
// handler alone's throughput with it against 80.9% with the upsert; the
// server's CPU for the two is within the noise (docs/benchmarks.md, "A
// handler that does real work"). It reports whether this transaction
// recorded the key (true) or found it remembered already (false: a
// duplicate, with the record found; a live claim of the claim mode is
// reported in flight). While another transaction holds an uncommitted
// record of the same key it waits: if that one commits, the result is
// false; if it rolls back, this transaction records the key.
//
// On success tx is open whatever the result: commit it after the handler's
// writes (recorded), or roll it back (a duplicate). On error no transaction
// is left open.
//
// An existing row (a duplicate, an expired record, a claim) fails the plain
// INSERT with a unique violation, which the server logs as an ERROR (with
// the statement, under the default log_min_error_statement): a line per
// duplicate. That transaction is rolled back and the key recorded by
// RememberTx in a fresh one (taking over an expired record or a lapsed
// claim): a ROLLBACK, a BEGIN and RememberTx's statements more on that path.
// The transactional mode of the idempotency middleware (WithTransaction)
// calls it for every transaction it begins itself; under WithSubscriberTx
// the subscriber's transaction is begun already and RememberTx records.
func (s *Store) BeginTx(ctx context.Context, db *sql.DB, opts *sql.TxOptions, key string, fingerprint uint64, value []byte) (tx *sql.Tx, recorded bool, found stores.Record, err error) {
	if len(value) > MaxValue {
		return nil, false, stores.Record{}, fmt.Errorf("postgresstore: begin with the record: a value of %d bytes: %w (at most %d)", len(value), stores.ErrValueTooLarge, MaxValue)
	}
	if s.yieldHeld(ctx, key) {
		if tx, err = db.BeginTx(ctx, opts); err != nil {
			return nil, false, stores.Record{}, fail(ctx, "begin with the record", err)
		}
		return tx, false, stores.Record{State: stores.StateInFlight}, nil
	}
	if tx, err = db.BeginTx(ctx, opts); err != nil {
		return nil, false, stores.Record{}, fail(ctx, "begin with the record", err)
	}
	if s.parts != nil { // RememberTx's locked write
		if recorded, found, err = s.RememberTx(ctx, tx, key, fingerprint, value); err != nil {
			_ = tx.Rollback()
			return nil, false, stores.Record{}, err
		}
		return tx, recorded, found, nil
	}
	qctx, cancel := s.context(ctx)
	rowKey := RowKey(key)
	_, err = tx.ExecContext(qctx, s.recordSQL, rowKey, nullFingerprint(fingerprint), value, s.rowLock(rowKey))
	cancel()
	if err == nil {
		s.recordedOwn(rowKey, s.holder(ctx))
		return tx, true, stores.Record{}, nil
	}
	_ = tx.Rollback()
	if !sqlstate.Is(err, uniqueViolation) && !sqlstate.Is(err, notNullViolation) {
		return nil, false, stores.Record{}, fail(ctx, "begin with the record", err)
	}
	// The key has a row, or a session claim holds it: record it as
	// RememberTx does, in a fresh transaction.
	if tx, err = db.BeginTx(ctx, opts); err != nil {
		return nil, false, stores.Record{}, fail(ctx, "begin with the record", err)
	}
	if recorded, found, err = s.RememberTx(ctx, tx, key, fingerprint, value); err != nil {
		_ = tx.Rollback()
		return nil, false, stores.Record{}, err
	}
	return tx, recorded, found, nil
}

// TxFromContext returns the transaction a handler must write its effect in
// under the idempotency middleware's transactional mode
// (idempotency.WithTransaction). It is stores.TxFromContext.
func TxFromContext(ctx context.Context) (*sql.Tx, bool) { return stores.TxFromContext(ctx) }

// Forget deletes the record of key, remembered or claimed.
func (s *Store) Forget(ctx context.Context, key string) error {
	ctx, cancel := s.context(ctx)
	defer cancel()
	if _, err := s.db.ExecContext(ctx, s.forgetSQL, RowKey(key)); err != nil {
		return fail(ctx, "forget", err)
	}
	return nil
}

// Claim takes the claim on key for lease, for the holder named by
// stores.ClaimToken(ctx) (the Store itself when ctx names none), or returns
// the record in its way: it inserts the row, or takes over a row whose
// claim lease or retention has passed. A live claim of the same holder
// reports true and keeps its lease. A message never seen costs one INSERT,
// a duplicate an INSERT and a SELECT on the primary key (and a lapsed claim
// or expired record one UPDATE more, to take it over).
func (s *Store) Claim(ctx context.Context, key string, lease time.Duration) (claimed bool, found stores.Record, err error) {
	if lease < time.Millisecond {
		return false, stores.Record{}, fmt.Errorf("postgresstore: claim lease %v: want at least 1ms", lease)
	}
	if s.held != nil {
		return s.claimTx(ctx, key, lease)
	}
	if s.session != nil {
		return s.claimSession(ctx, key, lease)
	}
	ctx, cancel := s.context(ctx)
	defer cancel()
	rowKey, token := RowKey(key), s.holder(ctx)
	if s.ungrouped || s.parts != nil {
		claimed, _, err = s.execClaim(ctx, false, rowKey, lease.Milliseconds(), token)
	} else {
		o := newOp()
		o.key, o.token, o.lease = rowKey, token, lease.Milliseconds()
		// o's results are final only when do succeeded: a caller that gave
		// up leaves them to the statement still carrying it.
		if err = s.claims.do(ctx, s.queryTimeout, o); err == nil {
			claimed = o.claimed
		}
	}
	if err != nil || claimed {
		return claimed, stores.Record{}, err
	}
	// The key is held: find out how. A row gone since the insert (released,
	// forgotten, cleaned up) is claimed again, once.
	for pass := 1; ; pass++ {
		var r claimRow
		err := r.scan(s.db.QueryRowContext(ctx, s.claimRowSQL, rowKey, token).Scan)
		switch {
		case errors.Is(err, sql.ErrNoRows) && pass == 1:
			claimed, _, err = s.execClaim(ctx, false, rowKey, lease.Milliseconds(), token)
			if err != nil || claimed {
				return claimed, stores.Record{}, err
			}
			continue
		case errors.Is(err, sql.ErrNoRows):
			// No row, and the insert refused again: a session claim of
			// another worker holds the key's lock (the insert takes it,
			// shared), or a row came and went twice; in flight either way.
			return false, stores.Record{State: stores.StateInFlight}, nil
		case err != nil:
			return false, stores.Record{}, fail(ctx, "claim", err)
		}
		switch what, found, err := r.verdict(); {
		case err != nil:
			return false, stores.Record{}, fail(ctx, "claim", err)
		case what == rowTakeable:
			// lost the takeover: in flight elsewhere
			return s.execClaim(ctx, true, rowKey, lease.Milliseconds(), token)
		case what == rowMine: // the holder's own live claim (its statement sent again)
			return true, found, nil
		default:
			return false, found, nil
		}
	}
}

// unclaimedOrOwn is the condition (SQL) under which a record, or an end,
// is written on table t (quoted) while no session claim (WithSessionClaims,
// in another worker of the table) holds its key: the key's advisory lock
// is tried shared for the statement, and a claim taken meanwhile waits for
// the write's commit, then finds it. A holder whose own claim row is live
// writes whatever the lock says: a session claimer holds the lock only for
// the round trip in which it finds that row and gives the lock back, and
// the holder's write must not be refused for it. Live is judged by the
// clock when the check runs (clockMS), after the session took the lock,
// and the session judges the lapse by its round trip's start (txStartMS),
// before it: a claim live here is live there, and the session gives the
// key back. (The row is read by the key alone, so that the plan keeps the
// index however small the table was when it was made.) lk, key and token
// are the statement's expressions of the key's lock, the key and the
// caller's token.
func unclaimedOrOwn(t, lk, key, token string) string {
	return `CASE WHEN pg_try_advisory_xact_lock_shared(` + lk + `) THEN true
		ELSE ` + token + ` <> '' AND coalesce((SELECT o.claim = ` + token + ` AND o.expires_at > ` + clockMS + ` FROM ` + t + ` AS o WHERE o.key = ` + key + `), false) END`
}

// claimRow is a row of claimRowSQL: what stood in a claim's way.
type claimRow struct {
	remembered, failing, lapsed, mine bool // failing: a failing or ended record
	fp                                int64
	expires                           sql.NullInt64
	value, failure                    []byte // failure: a live count of failures
}

func (r *claimRow) scan(scan func(...any) error) error { return scan(r.fields()...) }

// fields are the destinations of a row of claimRowSQL's columns, in order.
func (r *claimRow) fields() []any {
	return []any{&r.remembered, &r.failing, &r.fp, &r.lapsed, &r.mine, &r.expires, &r.value, &r.failure}
}

// What a claim makes of the row in its way.
const (
	rowHeld     = iota // a live record, end or claim of another holder: found
	rowTakeable        // a lapsed claim, an expired record or a failing record: taken over
	rowMine            // the holder's own live claim: claimed, found is its count
)

// verdict tells what a claim makes of r, and the record it finds there.
func (r *claimRow) verdict() (what int, found stores.Record, err error) {
	switch {
	case r.lapsed:
		return rowTakeable, stores.Record{}, nil // with its count, if it carries a live one
	case r.remembered:
		found, err = record(false, r.fp, r.expires, r.value, nil)
		return rowHeld, found, err
	case r.failure == nil && r.failing: // its count lapsed this very moment
		return rowTakeable, stores.Record{}, nil
	case r.failure == nil && r.mine:
		return rowMine, stores.Record{}, nil
	case r.failure == nil:
		return rowHeld, stores.Record{State: stores.StateInFlight}, nil
	}
	found, err = failedRecord(r.failure, r.fp)
	switch {
	case err != nil:
		return rowHeld, stores.Record{}, err
	case r.failing && found.State == stores.StateEnded:
		return rowHeld, found, nil
	case r.failing:
		return rowTakeable, found, nil
	case r.mine:
		return rowMine, found, nil
	}
	found.State, found.ExpiresAt = stores.StateInFlight, time.UnixMilli(r.expires.Int64)
	return rowHeld, found, nil
}

// holder returns the claim holder of ctx: its token, or the Store's own.
func (s *Store) holder(ctx context.Context) string {
	if token := stores.ClaimToken(ctx); token != "" {
		return token
	}
	return s.instance
}

// execClaim runs a statement that may take the claim on key for token
// (the insert, or with takeover the takeover of a row whose claim lapsed,
// whose record expired or that is a failing record) and reports whether
// it did, and the failing record the claim took over, if any. The statement runs detached from ctx's cancellation, bounded by the
// store's query timeout, as grouped claims do: cut short by the caller's
// deadline while it waited on a row lock, it would be dropped by the
// driver, whose request to cancel it the server may never get, and the
// server would still take the claim once the lock went, for a delivery
// that got an error: its redelivery (another holder) would be parked for
// the whole lease. A caller whose ctx is done first returns at once with
// ctx's error; the statement runs on, and a claim it then takes is
// released.
func (s *Store) execClaim(ctx context.Context, takeover bool, key string, lease int64, token string) (bool, stores.Record, error) {
	if err := ctx.Err(); err != nil {
		return false, stores.Record{}, fmt.Errorf("postgresstore: claim: %w", err)
	}
	timeout := s.queryTimeout
	if timeout <= 0 {
		timeout = defaultBatchTimeout
	}
	o := newOp()
	o.key, o.token = key, token
	go func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
		defer cancel()
		switch {
		case s.parts != nil:
			o.claimed, o.record, o.err = s.claimPartitioned(sctx, takeover, key, lease, token)
		case takeover:
			o.claimed, o.record, o.err = s.takeOver(sctx, key, lease, token)
		default:
			o.claimed, o.err = s.exec(sctx, s.claimSQL, key, lease, token)
		}
		if !o.state.CompareAndSwap(opPending, opSettled) && o.err == nil {
			s.undoClaim(o) // its caller gave up
		}
		close(o.done)
	}()
	select {
	case <-o.done:
	case <-ctx.Done():
		if err := o.giveUp(ctx); err != nil {
			return false, stores.Record{}, err
		}
	}
	return o.claimed, o.record, o.err
}

// takeOver runs takeoverSQL and reports whether it took the claim, and the
// count of failures it kept with it (a failing record found), if any.
func (s *Store) takeOver(ctx context.Context, key string, lease int64, token string) (bool, stores.Record, error) {
	var fp int64
	var failure []byte
	err := s.db.QueryRowContext(ctx, s.takeoverSQL, key, lease, token).Scan(&fp, &failure)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return false, stores.Record{}, nil
	case err != nil:
		return false, stores.Record{}, fail(ctx, "claim", err)
	case failure == nil:
		return true, stores.Record{}, nil
	}
	found, err := failedRecord(failure, fp)
	if err != nil {
		// The claim is taken all the same: release it rather than leave
		// it to its lease.
		s.releaseGivenUp(key, token)
		return false, stores.Record{}, fail(ctx, "claim", err)
	}
	return true, found, nil
}

// exec runs a claim statement and reports whether it wrote the row.
func (s *Store) exec(ctx context.Context, query string, args ...any) (bool, error) {
	return s.execAs(ctx, "claim", query, args...)
}

// execAs is exec of the operation op, which its errors name (an extend's
// said "extend: postgresstore: claim: …").
func (s *Store) execAs(ctx context.Context, op, query string, args ...any) (bool, error) {
	res, err := s.db.ExecContext(ctx, query, args...)
	if err != nil {
		return false, fail(ctx, op, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fail(ctx, op, err)
	}
	return n == 1, nil
}

// Release drops the caller's claim on key (the Store's own when ctx names
// no holder); see stores.Store.
func (s *Store) Release(ctx context.Context, key string) error {
	if s.session != nil {
		return s.releaseSession(ctx, key)
	}
	if s.held != nil {
		if done, err := s.releaseTx(ctx, key); done {
			return err
		}
	}
	ctx, cancel := s.context(ctx)
	defer cancel()
	if _, err := s.db.ExecContext(ctx, s.releaseSQL, RowKey(key), s.holder(ctx)); err != nil {
		return fail(ctx, "release", err)
	}
	return nil
}

// DeleteExpired removes the rows whose expiry has passed (expired records
// and lapsed claims, unless they carry a live count of failures) and
// returns how many it removed. It walks the table in
// ranges of WithCleanupBatch blocks, one short DELETE each, so it never holds
// long locks or builds one giant transaction, and it uses no index. It stops
// early, returning what it removed so far, when ctx is done.
//
// Schedule it as often as you like; once an hour suits most retentions.
// From the application:
//
//	go func() { _ = store.RunCleanup(ctx, time.Hour, func(err error) { log.Print(err) }) }()
//
// or from the database with pg_cron, running the same DELETE over the whole
// table at a quiet time:
//
//	SELECT cron.schedule('idempotency-cleanup', '17 * * * *',
//	  $$DELETE FROM watermill_idempotency WHERE expires_at <= (extract(epoch from now()) * 1000)::bigint
//	    AND (failure IS NULL OR (failure->>'expires')::bigint <= (extract(epoch from now()) * 1000)::bigint)$$);
//
// (the second line keeps a lapsed claim that carries a live count of
// failures: it is the message's failing record until the count lapses).
func (s *Store) DeleteExpired(ctx context.Context) (int64, error) {
	if s.parts != nil {
		return s.rollPartitions(ctx)
	}
	var pages int64
	pctx, cancel := s.context(ctx)
	err := s.db.QueryRowContext(pctx, s.pagesSQL).Scan(&pages)
	cancel()
	if err != nil {
		return 0, fmt.Errorf("postgresstore: delete expired: table size: %w", err)
	}
	var deleted int64
	for from := int64(0); from < pages; from += int64(s.cleanupPages) {
		bctx, cancel := s.context(ctx)
		res, err := s.db.ExecContext(bctx, s.cleanupSQL, from, from+int64(s.cleanupPages))
		cancel()
		if err != nil {
			return deleted, fmt.Errorf("postgresstore: delete expired: blocks %d-%d: %w", from, from+int64(s.cleanupPages), err)
		}
		n, _ := res.RowsAffected()
		deleted += n
	}
	return deleted, nil
}

// RunCleanup calls DeleteExpired now and then every interval until ctx is
// done, and returns ctx's error. A failed pass is returned through onError
// (when non-nil) and retried at the next interval. It starts no goroutine of
// its own: run it in one you own.
func (s *Store) RunCleanup(ctx context.Context, every time.Duration, onError func(error)) error {
	if every <= 0 {
		return fmt.Errorf("postgresstore: cleanup interval %v: want a positive duration", every)
	}
	ticker := time.NewTicker(every)
	defer ticker.Stop()
	for {
		if _, err := s.DeleteExpired(ctx); err != nil && onError != nil && ctx.Err() == nil {
			onError(err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-ticker.C:
		}
	}
}

// context bounds a statement by the query timeout, unless ctx already has an
// earlier deadline. It also counts the statement for the pool watch.
func (s *Store) context(ctx context.Context) (context.Context, context.CancelFunc) {
	s.tick()
	return boundedContext(ctx, s.queryTimeout)
}

// tick counts a statement for the pool watch, and looks at the pool every
// churnSample statements.
func (s *Store) tick() {
	if s.logger != nil && s.churn.statements.Add(1)%churnSample == 0 {
		s.watchPool()
	}
}

// churnSample is how many statements pass between two looks at the pool.
const churnSample = 1024

// poolWatch follows how many idle connections the pool closed for lack of
// room (sql.DBStats.MaxIdleClosed) against the statements the Store ran.
type poolWatch struct {
	statements atomic.Uint64
	mu         sync.Mutex
	idleClosed int64
	warned     time.Time
}

// watchPool warns, at most once a minute, when the pool closed an idle
// connection for at least one in 16 of the last churnSample statements:
// each close is a new connection later (milliseconds, against a fraction of
// one for a statement).
func (s *Store) watchPool() {
	w := &s.churn
	if !w.mu.TryLock() {
		return
	}
	defer w.mu.Unlock()
	stats := s.db.Stats()
	closed := stats.MaxIdleClosed - w.idleClosed
	w.idleClosed = stats.MaxIdleClosed
	if closed < churnSample/16 || time.Since(w.warned) < time.Minute {
		return
	}
	w.warned = time.Now()
	s.logger.Warn("postgresstore: the connection pool keeps reconnecting: raise db.SetMaxIdleConns to the number of concurrent deliveries",
		"table", s.table, "idle_closed", closed, "statements", churnSample,
		"max_idle_closed_total", stats.MaxIdleClosed, "open", stats.OpenConnections, "in_use", stats.InUse)
}

// fail wraps err, what op got from the database. When ctx is done, or past
// its deadline, the statement was cut short for it, and the error matches
// ctx's error whatever the driver reports (ctxerr.Match).
func fail(ctx context.Context, op string, err error) error {
	return fmt.Errorf("postgresstore: %s: %w", op, ctxerr.Match(ctx, err))
}
