package postgresstore

import (
	"bytes"
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/babelqueue/watermill-idempotency/internal/ctxerr"
	"github.com/babelqueue/watermill-idempotency/internal/sqlstate"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// Errors of the transaction claims (WithTransactionClaims).
var (
	// ErrClaimLost is matched by the error of a Remember whose claim's
	// transaction ended before the record committed: its connection
	// dropped, its session was terminated (pg_terminate_backend, a server
	// restart, idle_in_transaction_session_timeout once its lease passed
	// unrenewed) or its commit failed. Nothing of the claim is left: another
	// delivery may have taken the key meanwhile.
	//
	// A Remember whose commit went unanswered (its deadline passed, or the
	// connection was cut after the statement went out) fails with an
	// error that does not match it: the record may have committed.
	ErrClaimLost = errors.New("postgresstore: the claim's transaction ended before its record committed")
	// ErrPoolExhausted is matched by the error of a Claim that found no
	// connection to hold its transaction on: taking one would leave the
	// pool (sql.DB.SetMaxOpenConns) without a free connection, whoever
	// holds the others (this Store's claims, another Store's on the same
	// *sql.DB, the handlers' statements), or no connection came free
	// before the call's deadline. Raise the pool's limit above the number
	// of concurrent deliveries of every Store that shares it.
	ErrPoolExhausted = errors.New("postgresstore: no connection free in the pool for a claim's transaction")
)

// WithTransactionClaims makes every claim a transaction of its own, held
// open on a connection of the pool while its holder works: Claim begins the
// transaction and inserts the record's row, uncommitted; Remember commits
// it (the commit is the record: one commit per message instead of the
// claim's and the record's); Release rolls it back. See "Claims held in a
// transaction" in the package documentation for what it changes. Each
// claim holds a connection of db's pool while its handler runs; Stores of
// several handlers may share one *sql.DB: a claim is refused
// (ErrPoolExhausted) rather than take the pool's last free connection,
// whichever Store's claims hold the others.
func WithTransactionClaims() Option { return func(s *Store) { s.txClaims = true } }

// WithClaimWait bounds how long a Claim under WithTransactionClaims waits
// for another delivery's claim on the same key (default DefaultClaimWait),
// shortened to leave room before the caller's deadline. A claim that ends
// meanwhile (committed: the key is remembered; rolled back: the claim is
// taken) is reported at once; one still open after the wait is reported in
// flight. Zero waits as little as PostgreSQL can (1 ms).
func WithClaimWait(d time.Duration) Option {
	return func(s *Store) { s.claimWait, s.claimWaitSet = d, true }
}

// DefaultClaimWait is how long a Claim under WithTransactionClaims waits on
// another delivery's open claim before it reports it in flight, unless
// WithClaimWait says otherwise. The middleware waits for an in-flight
// message again (idempotency.WithParkWait) before it parks it, so this
// only needs to be short enough for several looks within that wait.
const DefaultClaimWait = 250 * time.Millisecond

// maxIdleTimeout is the longest idle_in_transaction_session_timeout
// PostgreSQL takes (INT_MAX milliseconds, 24.8 days): the longest lease of
// a transaction claim.
const maxIdleTimeout = time.Duration(1<<31-1) * time.Millisecond

// txHeld is the transaction claims a Store holds, by row key. Each claim
// holds its connection, taken from the pool, until it ends.
type txHeld struct {
	mu        sync.Mutex
	claims    map[string]*txClaim // taken, or being taken
	taking    atomic.Int64        // claims held, and being taken: the connections they hold or wait for
	acquiring atomic.Int64        // claims between their look at the pool and the connection they took

	// BEGIN and the INSERT, around the row key and the lock wait (claimQuery)
	claimPrefix, claimMiddle, claimSuffix string
	recordPrefix                          string // the UPDATE of the record's expiry, fingerprint and value
	rememberSQL                           string // Remember of a holder that holds no claim here (rememberUnheld)
	deleteLapsedSQL                       string // removes a row whose expiry passed, before claiming its key
	lockFailingSQL                        string // locks a failing record (or a lapsed claim carrying a count) for a claim
	table                                 string // quoted
}

// txClaim is one transaction claim: an open transaction on conn holding
// the uncommitted row of key for its holder. Other deliveries of the key in
// this process wait for it here (done), holding no connection.
type txClaim struct {
	key, token string
	since      time.Time     // when the claim was asked for
	ready      chan struct{} // closed once taken (conn set) or not
	done       chan struct{} // closed once it ended, or was not taken

	mu         sync.Mutex // held while a statement runs on conn
	conn       *sql.Conn  // nil until taken
	ended      bool       // committed, rolled back, lost, or not taken
	deadline   time.Time  // the lease's end, unless renewed
	lapse      *time.Timer
	remembered *stores.Record // set before done closes when the key is known remembered
	// The count of failures the claim carries (a failing record it took
	// over, or its holder's Fail), as a failing record; nil: none. After
	// its holder's Fail the count is committed in the row, as a claim of
	// the leased mode of its holder (leased), which the transaction holds
	// locked: the count outlives the transaction, and a release commits
	// the failing record rather than rolling back.
	failure *stores.Record
	leased  bool
}

// carried is the record a claim of c's holder finds: its count, if any
// (c.mu held).
func (c *txClaim) carried() stores.Record {
	if c.failure == nil {
		return stores.Record{}
	}
	r := *c.failure
	if r.Failure.End != nil {
		end := *r.Failure.End
		r.Failure.End = &end
	}
	return r
}

// held reports whether c is taken and has not ended (c.mu held).
func (c *txClaim) held() bool { return c.conn != nil && !c.ended }

// initTxClaims prepares the statements of the transaction claims on table t
// (quoted), whose records expire by expires (SQL).
func (s *Store) initTxClaims(t, expires string) error {
	if s.claimWait < 0 {
		return fmt.Errorf("%w: negative claim wait %v", ErrInvalidOption, s.claimWait)
	}
	if !s.txClaims {
		if s.claimWaitSet {
			return fmt.Errorf("%w: WithClaimWait without WithTransactionClaims", ErrInvalidOption)
		}
		return nil
	}
	if !s.claimWaitSet {
		s.claimWait = DefaultClaimWait
	}
	h := &txHeld{claims: map[string]*txClaim{}, table: t}
	// The row is the record from the start (no claim token: nobody but its
	// own transaction can see it before it commits). The settings are set
	// by the INSERT itself, local to the transaction, before its conflict
	// check can wait on another claim's row lock.
	async := ""
	if s.asyncCommit {
		async = ` AND set_config('synchronous_commit', 'off', true) IS NOT NULL`
	}
	h.claimPrefix = "BEGIN;\nINSERT INTO " + t + " (key, expires_at) SELECT '"
	h.claimMiddle = "'::uuid, " + expires + " WHERE set_config('lock_timeout', '"
	h.claimSuffix = "ms', true) IS NOT NULL" + async + " ON CONFLICT (key) DO NOTHING"
	h.deleteLapsedSQL = `DELETE FROM ` + t + ` WHERE key = $1 AND expires_at IS NOT NULL AND expires_at <= ` + nowMS + `
		AND NOT ` + counted("")
	h.lockFailingSQL = `SELECT coalesce(fingerprint, 0), failure FROM ` + t + ` WHERE key = $1 AND ` + takeable("") + ` FOR UPDATE`
	h.recordPrefix = "UPDATE " + t + " SET claim = NULL, failure = NULL, expires_at = " + expires + ", fingerprint = "
	h.rememberSQL = `INSERT INTO ` + t + ` AS r (key, expires_at, fingerprint, value) SELECT $1::uuid, ` + expires + `, $2::bigint, $3::bytea
		WHERE set_config('lock_timeout', $4, true) IS NOT NULL
		ON CONFLICT (key) DO UPDATE SET expires_at = EXCLUDED.expires_at, claim = NULL, fingerprint = EXCLUDED.fingerprint, value = EXCLUDED.value, failure = NULL
		WHERE r.claim IS NULL OR r.claim = '' OR r.claim = $5 OR r.expires_at <= ` + nowMS
	s.held = h
	return nil
}

// claimQuery is the Claim's one round trip: BEGIN, and the INSERT of the
// record's row with the transaction's settings. Its values are literals (a
// query of several statements takes no parameters): the key is uuid text
// made by RowKey, the others integers.
func (h *txHeld) claimQuery(rowKey string, wait, lease time.Duration) string {
	var b strings.Builder
	b.Grow(len(h.claimPrefix) + len(h.claimMiddle) + len(h.claimSuffix) + 96)
	b.WriteString(h.claimPrefix)
	b.WriteString(rowKey)
	b.WriteString(h.claimMiddle)
	b.WriteString(strconv.FormatInt(wait.Milliseconds(), 10))
	b.WriteString("ms', true) IS NOT NULL AND set_config('idle_in_transaction_session_timeout', '")
	b.WriteString(strconv.FormatInt(lease.Milliseconds(), 10))
	b.WriteString(h.claimSuffix)
	return b.String()
}

// txLease is lease as a transaction claim keeps it: at least 1 ms, at most
// maxIdleTimeout.
func txLease(lease time.Duration) time.Duration {
	return min(max(lease, time.Millisecond), maxIdleTimeout)
}

// holding returns the claim this Store holds, or is taking, on rowKey, or
// nil.
func (h *txHeld) holding(rowKey string) *txClaim {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.claims[rowKey]
}

// drop forgets c, if it is still the claim on its key, and the connection
// it counted.
func (h *txHeld) drop(c *txClaim) {
	h.mu.Lock()
	if h.claims[c.key] == c {
		delete(h.claims, c.key)
	}
	h.mu.Unlock()
	h.taking.Add(-1)
}

// claimTx is Claim under WithTransactionClaims. A claim this process holds,
// or is taking, on the key is waited for in the process (up to the claim
// wait): deliveries of one message that meet here hold one connection, not
// one each.
func (s *Store) claimTx(ctx context.Context, key string, lease time.Duration) (bool, stores.Record, error) {
	h := s.held
	rowKey, token := RowKey(key), s.holder(ctx)
	if err := ctx.Err(); err != nil {
		return false, stores.Record{}, fmt.Errorf("postgresstore: claim: %w", err)
	}
	lease = txLease(lease)
	ctx, cancel := s.context(ctx)
	defer cancel()
	waitUntil := time.Now().Add(s.lockWait(ctx))
	retook := false
	for {
		h.mu.Lock()
		c := h.claims[rowKey]
		if c == nil {
			c = &txClaim{key: rowKey, token: token, since: time.Now(), ready: make(chan struct{}), done: make(chan struct{})}
			h.claims[rowKey] = c
			h.mu.Unlock()
			claimed, found, lapsed, err := s.beginClaim(ctx, c, lease, time.Until(waitUntil))
			if lapsed && !retook {
				// A lapsed claim of the leased mode, or an expired record:
				// delete it (committed at once, so no transaction holds the
				// old row for long), then claim the key afresh. Of racing
				// claimers one inserts; the others wait on its row.
				retook = true
				if _, err := s.db.ExecContext(ctx, h.deleteLapsedSQL, rowKey); err != nil {
					return false, stores.Record{}, fail(ctx, "claim", err)
				}
				continue
			}
			return claimed, found, err
		}
		h.mu.Unlock()
		if c.token == token { // the holder's own claim (its call sent again)
			select {
			case <-c.ready:
			case <-ctx.Done():
				return false, stores.Record{}, fmt.Errorf("postgresstore: claim: %w", ctx.Err())
			}
			c.mu.Lock()
			held, carried := c.held(), c.carried()
			c.mu.Unlock()
			if held {
				return true, carried, nil
			}
			<-c.done
			continue
		}
		// Another delivery in this process has the key, or is taking it.
		wait := time.NewTimer(time.Until(waitUntil))
		select {
		case <-c.done:
			wait.Stop()
			if r := c.remembered; r != nil {
				found := *r
				found.Value = bytes.Clone(r.Value)
				return false, found, nil
			}
			continue // not taken, rolled back or lost: try again
		case <-wait.C:
			return false, stores.Record{State: stores.StateInFlight}, nil
		case <-ctx.Done():
			wait.Stop()
			return false, stores.Record{}, fmt.Errorf("postgresstore: claim: %w", ctx.Err())
		}
	}
}

// beginClaim takes a connection, begins c's transaction and inserts the
// row, waiting at most wait on another transaction's row. Claimed, the
// transaction stays open and c is held; otherwise it is rolled back, c
// ended, and found tells what stood in the way (lapsed: a row whose expiry
// passed, to be removed before claiming again).
func (s *Store) beginClaim(ctx context.Context, c *txClaim, lease, wait time.Duration) (claimed bool, found stores.Record, lapsed bool, err error) {
	h := s.held
	defer close(c.ready)
	notTaken := func(remembered *stores.Record) {
		c.mu.Lock()
		c.ended, c.remembered = true, remembered
		c.mu.Unlock()
		h.drop(c)
		close(c.done)
	}
	// The pool decides, not this Store's own count: the claims of other
	// Stores on the same *sql.DB, and the handlers' statements, hold its
	// connections too. A claim never takes the pool's last free
	// connection: refused at once when taking one would leave none, and
	// checked again once taken, since concurrent claims (here or in
	// another Store) may have taken the others meanwhile; the connection
	// then goes back, and of claims racing for the last connections some
	// may be refused where one would have fitted, never one too many.
	// Claims of this Store about to take a connection count as taken, so
	// that a burst of them never takes more than the pool leaves.
	h.taking.Add(1)
	ahead := h.acquiring.Add(1) - 1
	if st := s.db.Stats(); st.MaxOpenConnections > 0 && st.InUse+int(ahead) >= st.MaxOpenConnections-1 {
		h.acquiring.Add(-1)
		notTaken(nil)
		return false, stores.Record{}, false, s.poolExhausted(st, "taking one would leave none")
	}
	conn, err := s.db.Conn(ctx)
	h.acquiring.Add(-1)
	if err != nil {
		notTaken(nil)
		if st := s.db.Stats(); ctx.Err() != nil && st.MaxOpenConnections > 0 && st.InUse >= st.MaxOpenConnections {
			return false, stores.Record{}, false, fmt.Errorf("%w: %w", s.poolExhausted(st, "waited for one until the deadline"), err)
		}
		return false, stores.Record{}, false, fail(ctx, "claim", err)
	}
	if st := s.db.Stats(); st.MaxOpenConnections > 0 && st.InUse >= st.MaxOpenConnections {
		_ = conn.Close() // back to the pool, idle
		notTaken(nil)
		return false, stores.Record{}, false, s.poolExhausted(st, "the last was taken meanwhile")
	}
	res, err := conn.ExecContext(ctx, h.claimQuery(c.key, max(wait, time.Millisecond), lease))
	var n int64
	if err == nil {
		n, err = res.RowsAffected()
	}
	switch {
	case err == nil && n == 1:
		c.mu.Lock()
		c.conn, c.deadline = conn, c.since.Add(lease)
		c.lapse = time.AfterFunc(lease, func() { s.lapseTx(c) })
		c.mu.Unlock()
		return true, stores.Record{}, false, nil
	case sqlstate.Is(err, lockNotAvailable):
		// Another delivery's open claim: in flight.
		_ = s.endTx(ctx, conn, "ROLLBACK")
		notTaken(nil)
		return false, stores.Record{State: stores.StateInFlight}, false, nil
	case err != nil:
		discard(conn)
		notTaken(nil)
		return false, stores.Record{}, false, fail(ctx, "claim", err)
	}
	// A committed row: a remembered record, an expired one, a failing or
	// ended record, or a claim of the leased mode (another Store without
	// WithTransactionClaims, or a holder's claim carrying a count).
	var r claimRow
	err = r.scan(conn.QueryRowContext(ctx, s.claimRowSQL, c.key, c.token).Scan)
	var what int
	if err == nil {
		what, found, err = r.verdict()
	}
	switch {
	case err == nil && what == rowTakeable && (!r.lapsed || r.failure != nil):
		// A failing record, or a lapsed claim carrying a count: the claim's
		// transaction locks the row and carries the count.
		return s.lockFailing(ctx, c, conn, lease, notTaken)
	}
	_ = s.endTx(ctx, conn, "ROLLBACK")
	switch {
	case errors.Is(err, sql.ErrNoRows):
		notTaken(nil)
		return false, stores.Record{}, true, nil // gone since: claim it again
	case err != nil:
		notTaken(nil)
		return false, stores.Record{}, false, fail(ctx, "claim", err)
	case what == rowTakeable: // expired
		notTaken(nil)
		return false, stores.Record{}, true, nil
	case what == rowMine: // the holder's own claim of the leased mode
		notTaken(nil)
		return true, found, false, nil
	}
	if found.Remembered() {
		kept := found
		kept.Value = bytes.Clone(found.Value)
		notTaken(&kept)
	} else {
		notTaken(nil)
	}
	return false, found, false, nil
}

// lockFailing takes c over a failing record, or a lapsed claim carrying a
// count of failures: its transaction, open on conn, locks the committed
// row (waiting at most the claim wait, set by the claim's INSERT) and
// carries the count, which a rollback leaves in place.
func (s *Store) lockFailing(ctx context.Context, c *txClaim, conn *sql.Conn, lease time.Duration, notTaken func(*stores.Record)) (bool, stores.Record, bool, error) {
	var fp int64
	var failure []byte
	err := conn.QueryRowContext(ctx, s.held.lockFailingSQL, c.key).Scan(&fp, &failure)
	var found stores.Record
	if err == nil {
		found, err = failedRecord(failure, fp)
	}
	switch {
	case sqlstate.Is(err, lockNotAvailable): // another delivery's open claim
		_ = s.endTx(ctx, conn, "ROLLBACK")
		notTaken(nil)
		return false, stores.Record{State: stores.StateInFlight}, false, nil
	case errors.Is(err, sql.ErrNoRows): // changed since it was read: look again
		_ = s.endTx(ctx, conn, "ROLLBACK")
		notTaken(nil)
		return false, stores.Record{}, false, nil
	case err != nil:
		discard(conn)
		notTaken(nil)
		return false, stores.Record{}, false, fail(ctx, "claim", err)
	}
	c.mu.Lock()
	c.conn, c.deadline, c.failure = conn, c.since.Add(lease), &found
	c.lapse = time.AfterFunc(lease, func() { s.lapseTx(c) })
	carried := c.carried()
	c.mu.Unlock()
	return true, carried, false, nil
}

// poolExhausted is the error of a claim refused for want of a connection
// (why), with the pool's state st.
func (s *Store) poolExhausted(st sql.DBStats, why string) error {
	return fmt.Errorf("%w: %s (%d of the pool's %d connections in use, %d by claims of this store; one is kept for the handlers and the other statements)",
		ErrPoolExhausted, why, st.InUse, st.MaxOpenConnections, s.held.taking.Load())
}

// lockNotAvailable is the SQLSTATE of a statement that waited on a lock for
// lock_timeout.
const lockNotAvailable = "55P03"

// lockWait is how long a claim may wait on another claim's row: the claim
// wait, shortened to a tenth of what is left before ctx's deadline less
// nothing (the statement must end by then), and at least 1 ms (zero would
// be no limit at all).
func (s *Store) lockWait(ctx context.Context) time.Duration {
	wait := s.claimWait
	if d, ok := ctx.Deadline(); ok {
		wait = min(wait, time.Until(d)*3/4)
	}
	return max(wait, time.Millisecond)
}

// endTx ends the transaction on conn with end (COMMIT or ROLLBACK, and
// whatever must go before) and gives conn back to the pool; a conn whose
// transaction did not end as asked is closed instead, never handed back
// with a transaction open. The statement runs detached from ctx's
// cancellation, bounded by the query timeout, so that a caller that gave
// up still leaves its connection idle; but endTx returns by ctx's end,
// with ctx's error, while the statement goes on.
func (s *Store) endTx(ctx context.Context, conn *sql.Conn, end string) error {
	run := func() error {
		ctx, cancel := boundedContext(context.WithoutCancel(ctx), s.queryTimeout)
		defer cancel()
		if _, err := conn.ExecContext(ctx, end); err != nil {
			discard(conn)
			return err
		}
		return conn.Close()
	}
	if ctx.Done() == nil {
		return run()
	}
	ended := make(chan error, 1)
	go func() { ended <- run() }()
	select {
	case err := <-ended:
		return err
	case <-ctx.Done():
		select {
		case err := <-ended: // ended in the same moment
			return err
		default:
			return ctx.Err()
		}
	}
}

// discard closes conn for good instead of giving it back to the pool: the
// server ends its session, and rolls back the transaction open on it.
func discard(conn *sql.Conn) {
	_ = conn.Raw(func(any) error { return driver.ErrBadConn })
	_ = conn.Close()
}

// finish ends c, a claim that was taken (c.mu held by the caller): its
// timer stopped, its key no longer held, and its waiters told; remembered,
// when it committed, is the record they find.
func (s *Store) finish(c *txClaim, remembered *stores.Record) {
	c.ended, c.remembered = true, remembered
	c.lapse.Stop()
	s.held.drop(c)
	close(c.done)
}

// lapseTx ends c if its lease passed unrenewed: its connection is closed,
// which rolls the transaction back (PostgreSQL has ended the session
// already, or does so now). A claim busy with a statement is left to it.
func (s *Store) lapseTx(c *txClaim) {
	if !c.mu.TryLock() {
		return
	}
	defer c.mu.Unlock()
	if !c.held() {
		return
	}
	if wait := time.Until(c.deadline); wait > 0 { // renewed meanwhile
		c.lapse.Reset(wait)
		return
	}
	discard(c.conn)
	s.finish(c, nil)
}

// rememberTx is Remember of a key this Store holds a transaction claim on:
// by the claim's holder, it commits the claim, with the record's
// fingerprint and value; by another, it writes nothing (ErrClaimTaken).
// done is false when there is no such claim (Remember then records the key
// as usual).
func (s *Store) rememberTx(ctx context.Context, key string, fingerprint uint64, value []byte) (done bool, err error) {
	rowKey := RowKey(key)
	c := s.held.holding(rowKey)
	if c == nil {
		return false, nil
	}
	if err := ctx.Err(); err != nil {
		return true, fmt.Errorf("postgresstore: remember: %w", err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.held() {
		return false, nil
	}
	if c.token != s.holder(ctx) {
		return true, fmt.Errorf("postgresstore: remember: %w", stores.ErrClaimTaken)
	}
	var b strings.Builder
	b.Grow(len(s.held.recordPrefix) + 96 + 2*len(value))
	b.WriteString(s.held.recordPrefix)
	writeLiterals(&b, fingerprint, ", value = ", value)
	b.WriteString(" WHERE key = '")
	b.WriteString(rowKey)
	b.WriteString("';\nCOMMIT")
	ctx, cancel := s.context(ctx)
	defer cancel()
	if _, err = c.conn.ExecContext(ctx, b.String()); err != nil {
		s.finish(c, nil)
		discard(c.conn)
		return true, s.commitError(ctx, c, "remember", err)
	}
	s.finish(c, &stores.Record{State: stores.StateRemembered, Fingerprint: fingerprint, Value: bytes.Clone(value)})
	_ = c.conn.Close()
	return true, nil
}

// releaseTx is Release of a key this Store holds a transaction claim on for
// the caller: it rolls the claim back. done is false when the caller holds
// no such claim (Release then acts as usual).
func (s *Store) releaseTx(ctx context.Context, key string) (done bool, err error) {
	c := s.held.holding(RowKey(key))
	if c == nil || c.token != s.holder(ctx) {
		return false, nil
	}
	if err := ctx.Err(); err != nil {
		return true, fmt.Errorf("postgresstore: release: %w", err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.held() {
		return false, nil
	}
	s.finish(c, nil)
	// A claim whose transaction is gone is released all the same; a
	// caller whose context ended before the transaction did is told so
	// (the end goes on without it).
	if err := s.endTx(ctx, c.conn, s.releaseEnd(c)); err != nil && ctx.Err() != nil {
		return true, fail(ctx, "release", err)
	}
	return true, nil
}

// releaseEnd is how a release ends c's transaction (c.mu held): a rollback,
// or, when a claim carrying its holder's count is committed under it, the
// failing record committed in its place (the count outlives the claim).
func (s *Store) releaseEnd(c *txClaim) string {
	if !c.leased {
		return "ROLLBACK"
	}
	return "UPDATE " + s.held.table + " SET claim = '', expires_at = (failure->>'expires')::bigint WHERE key = '" + c.key + "' AND failure IS NOT NULL;\nCOMMIT"
}

// failTx is Fail of a key this Store holds a transaction claim on. By
// another holder it writes nothing (ErrClaimTaken). By the claim's holder,
// with an end, the claim's transaction commits the ended record in the
// claim's place. Without one, the count must outlive the transaction while
// the claim stays held: the transaction commits the row as a claim of its
// holder of the leased mode carrying the count, for the rest of the lease,
// and a transaction of the claim's locks it again at once (one round trip
// each). Another worker that meets the row meanwhile finds it in flight,
// and waits on it once it is locked; should the holder die, its claim lapses
// with its lease and leaves the count behind. done is false when this Store
// holds no claim on key (Fail then writes as usual).
func (s *Store) failTx(ctx context.Context, key string, fingerprint uint64, f stores.Failure) (done bool, err error) {
	c := s.held.holding(RowKey(key))
	if c == nil {
		return false, nil
	}
	if err := ctx.Err(); err != nil {
		return true, fmt.Errorf("postgresstore: fail: %w", err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.held() {
		return false, nil
	}
	token := s.holder(ctx)
	if c.token != token {
		return true, fmt.Errorf("postgresstore: fail: %w", stores.ErrClaimTaken)
	}
	ctx, cancel := s.context(ctx)
	defer cancel()
	var b strings.Builder
	b.WriteString("UPDATE " + s.held.table + " SET claim = ")
	if f.End != nil {
		b.WriteString("'', expires_at = " + s.expiresSQL)
	} else {
		remaining := max(time.Until(c.deadline), time.Millisecond)
		b.WriteString(quoteLiteral(token) + ", expires_at = " + nowMS + " + " + strconv.FormatInt(remaining.Milliseconds(), 10))
	}
	b.WriteString(", fingerprint = " + nullLiteral(fingerprint) + ", value = NULL, failure = " + failureLiteral(f, s.expiresSQL))
	b.WriteString(" WHERE key = '" + c.key + "';\nCOMMIT")
	if _, err := c.conn.ExecContext(ctx, b.String()); err != nil {
		s.finish(c, nil)
		discard(c.conn)
		return true, s.commitError(ctx, c, "fail", err)
	}
	if f.End != nil {
		s.finish(c, nil)
		_ = c.conn.Close()
		return true, nil
	}
	c.leased = true
	c.failure = &stores.Record{State: stores.StateFailing, Fingerprint: fingerprint, Failure: f}
	// Lock the row again, under the transaction's settings.
	remaining := max(time.Until(c.deadline), time.Millisecond)
	relock := "BEGIN;\nSELECT set_config('lock_timeout', '" + strconv.FormatInt(s.lockWait(ctx).Milliseconds(), 10) + "ms', true), " +
		"set_config('idle_in_transaction_session_timeout', '" + strconv.FormatInt(remaining.Milliseconds(), 10) + "ms', true);\n" +
		"SELECT 1 FROM " + s.held.table + " WHERE key = '" + c.key + "' AND claim = " + quoteLiteral(token) + " FOR UPDATE"
	res, err := c.conn.ExecContext(ctx, relock)
	var n int64
	if err == nil {
		n, err = res.RowsAffected()
	}
	if err != nil || n != 1 {
		// The count is written; the claim is not held any more (its
		// holder learns it from Extend). The committed claim lapses with
		// its lease and leaves the count behind.
		s.finish(c, nil)
		if err != nil {
			discard(c.conn)
		} else {
			_ = s.endTx(ctx, c.conn, "ROLLBACK")
			err = errors.New("the row was taken meanwhile")
		}
		s.warnLost(c, err)
	}
	return true, nil
}

// extendTx renews the caller's transaction claim on key for lease from
// now, and reports whether the claim is still held: one statement on its
// connection, which sets the transaction's idle timeout to lease (and so
// restarts it) and fails if the transaction or its session ended. done is
// false when the caller holds no transaction claim on key.
func (s *Store) extendTx(ctx context.Context, key string, lease time.Duration) (done, held bool, err error) {
	c := s.held.holding(RowKey(key))
	if c == nil || c.token != s.holder(ctx) {
		return false, false, nil
	}
	if err := ctx.Err(); err != nil {
		return true, false, fmt.Errorf("postgresstore: extend: %w", err)
	}
	lease = txLease(lease)
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.held() {
		return true, false, nil
	}
	at := time.Now()
	ctx, cancel := s.context(ctx)
	defer cancel()
	_, err = c.conn.ExecContext(ctx, "SELECT set_config('idle_in_transaction_session_timeout', '"+strconv.FormatInt(lease.Milliseconds(), 10)+"ms', true)")
	if err != nil {
		// Whatever went wrong, the transaction cannot be trusted any more:
		// end it, so that the claim is free for another holder, and tell.
		s.finish(c, nil)
		discard(c.conn)
		s.warnLost(c, err)
		return true, false, nil
	}
	c.deadline = at.Add(lease)
	c.lapse.Reset(lease)
	return true, true, nil
}

// heldInFlight reports whether this Store holds an open transaction claim
// on key, and the record Lookup returns for it: in flight, with the count
// of failures it carries (another worker's open claim is uncommitted,
// invisible to a Lookup there).
func (s *Store) heldInFlight(key string) (stores.Record, bool) {
	if s.held == nil {
		return stores.Record{}, false
	}
	c := s.held.holding(RowKey(key))
	if c == nil {
		return stores.Record{}, false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.held() {
		return stores.Record{}, false
	}
	r := c.carried()
	r.State, r.ExpiresAt = stores.StateInFlight, time.Time{}
	return r, true
}

// commitError is the error of op, the statement that writes c's record
// and commits c's transaction, which failed with err. When the server
// refused it (an error with a SQLSTATE) or it was never sent (the
// connection found broken first), the transaction ended without
// committing: ErrClaimLost. When no answer came (the call's deadline or
// the query timeout passed, or the connection was cut after the statement
// went out), the commit may have happened: the error says so, and does
// not match ErrClaimLost; the message's redelivery finds the record if it
// did, and runs the message if it did not.
func (s *Store) commitError(ctx context.Context, c *txClaim, op string, err error) error {
	if _, refused := sqlstate.Of(err); refused || errors.Is(err, driver.ErrBadConn) || pgconn.SafeToRetry(err) {
		s.warnLost(c, err)
		return fmt.Errorf("%w: %w", ErrClaimLost, fail(ctx, op, err))
	}
	if s.logger != nil {
		s.logger.Warn("postgresstore: no answer to the commit of a claim's transaction; its record may have committed, which the message's redelivery will find",
			"table", s.table, "key", c.key, "held_for", time.Since(c.since).Round(time.Millisecond), "error", err)
	}
	return fmt.Errorf("postgresstore: %s: no answer to the commit of the claim's transaction, which may have committed: %w", op, ctxerr.Match(ctx, err))
}

// warnLost logs the loss of c's transaction.
func (s *Store) warnLost(c *txClaim, err error) {
	if s.logger != nil {
		s.logger.Warn("postgresstore: a claim's transaction ended before its record committed; another delivery may run the message",
			"table", s.table, "key", c.key, "held_for", time.Since(c.since).Round(time.Millisecond), "error", err)
	}
}

// rememberUnheld is Remember, under WithTransactionClaims, for a delivery
// (its context names a holder) that holds no transaction claim on key in
// this Store: its claim was lost, or is a claim of the leased mode. It
// writes the record as Remember does, alone rather than grouped, and waits
// at most the claim wait on another delivery's open claim of the key, so
// that neither it nor a group of others behind it waits for that delivery's
// handler: it then writes nothing (ErrClaimTaken), as over another
// holder's claim of the leased mode.
func (s *Store) rememberUnheld(ctx context.Context, key string, fingerprint uint64, value []byte) error {
	ctx, cancel := s.context(ctx)
	defer cancel()
	wait := strconv.FormatInt(s.lockWait(ctx).Milliseconds(), 10) + "ms"
	var n int64
	res, err := s.db.ExecContext(ctx, s.held.rememberSQL, RowKey(key), nullFingerprint(fingerprint), nullBytes(value), wait, s.holder(ctx))
	if err == nil {
		n, err = res.RowsAffected()
	}
	switch {
	case sqlstate.Is(err, lockNotAvailable):
		return fmt.Errorf("postgresstore: remember: another delivery holds the key in an open claim: %w (%w)", stores.ErrClaimTaken, err)
	case err != nil:
		return fail(ctx, "remember", err)
	case n == 0:
		return fmt.Errorf("postgresstore: remember: %w", stores.ErrClaimTaken)
	}
	return nil
}

// yieldHeld makes way for a record written in a transaction of the
// caller's (RememberTx, BeginTx, BeginPgx) on a key this Store holds a
// transaction claim on, which that transaction would otherwise wait for: the
// caller's own claim is rolled back first (the record in the caller's
// transaction takes its place, as it replaces a claim of the leased mode),
// and another holder's is reported in flight (inFlight true), without
// waiting for its handler.
func (s *Store) yieldHeld(ctx context.Context, key string) (inFlight bool) {
	if s.held == nil {
		return false
	}
	c := s.held.holding(RowKey(key))
	if c == nil {
		return false
	}
	if c.token != s.holder(ctx) {
		return true
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.held() {
		s.finish(c, nil)
		_ = s.endTx(ctx, c.conn, "ROLLBACK")
	}
	return false
}

// ReleaseAll frees every claim this Store holds, as Release by each holder
// would. Call it when a worker stops, once its router has: the messages it
// still held can run elsewhere at once (their claims do not wait out their
// lease).
//
// With WithTransactionClaims it rolls back every claim's transaction and
// gives its connection back to the pool, so that no session is left idle
// in a transaction. It returns by ctx's end, with its error, when the ends
// have not come by then: they go on, each bounded by the query timeout,
// every claim's started all the same (a claim busy with a statement of its
// holder's is left to it). With session claims (the default with the pgx
// driver) it closes the claims' session, as Close does: the server frees its locks
// as it ends the session, a moment after the call returns, and the Store
// opens a new session at its next claim. With claims of rows (another
// driver, WithRowClaims, WithPartitions) it does nothing (they lapse with
// their lease).
func (s *Store) ReleaseAll(ctx context.Context) error {
	if s.session != nil {
		s.releaseAllSession()
		return nil
	}
	if s.held == nil {
		return nil
	}
	s.held.mu.Lock()
	all := make([]*txClaim, 0, len(s.held.claims))
	for _, c := range s.held.claims {
		all = append(all, c)
	}
	s.held.mu.Unlock()
	// Once ctx has ended, every claim's end still starts (endTx returns at
	// once and the end goes on, bounded by the query timeout), so that
	// none is left held for its lease; a claim busy with a statement of
	// its holder's is left to it.
	var first error
	for _, c := range all {
		if ctx.Err() != nil {
			if !c.mu.TryLock() {
				if first == nil {
					first = fmt.Errorf("postgresstore: release all: %w", ctx.Err())
				}
				continue
			}
		} else {
			c.mu.Lock()
		}
		var err error
		if c.held() {
			s.finish(c, nil)
			err = s.endTx(ctx, c.conn, s.releaseEnd(c))
		}
		c.mu.Unlock()
		if err != nil && ctx.Err() != nil && first == nil {
			first = fail(ctx, "release all", err)
		}
	}
	return first
}
