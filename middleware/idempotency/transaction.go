package idempotency

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/babelqueue/watermill-idempotency/internal/sqlstate"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// WithTransaction turns on the transactional mode (the consumer inbox and,
// with WithOutbox, the outbox): every identified delivery runs in a
// transaction on db that also writes the message's record, so the handler's
// writes and the record commit or roll back together, and the window between
// an effect and its record is closed for effects that live in that database.
// The store must be a stores.TxStore (postgresstore is) and use the same
// database. A message without identity that runs (fail open) runs in such a
// transaction too, with no record: the handler always finds its
// transaction, and its outbox.
//
// For each delivery: begin; record the message (a concurrent transaction
// holding the same message makes this wait: if it commits, this delivery is a
// duplicate, rolled back, skipped and acked; if it rolls back, this one goes
// on); run the handler with the transaction in its context
// (stores.TxFromContext, postgresstore.TxFromContext); write the messages it
// returned to the outbox in the same transaction (WithOutbox); commit; only
// then return, so the router acks the delivery after the commit. A handler
// error or panic rolls back: neither the effect, the record nor a produced
// message exists, and the error propagates. A failed commit propagates too
// (the router nacks, the broker redelivers): one that failed because the
// database went away (a lost connection, the server shutting down) or the
// delivery's context was cancelled meanwhile matches
// ErrStore, transient like a failed BEGIN, so the dead-letter middleware
// leaves it to the broker; a deferred constraint the handler's writes
// violate fails the delivery as a handler error would. Serialization failures and
// deadlocks (SQLSTATE 40001, 40P01) are retried with a fresh transaction,
// the handler included (WithTxRetries); under WithSubscriberTx the
// subscriber's transaction is rolled back and the message read again in a
// fresh one (see there).
//
// A handler that returns messages needs WithOutbox: without it the delivery
// fails with ErrNoOutbox and nothing is committed, since publishing them on
// the network cannot be part of the transaction.
//
// A store that is a TxBeginner (postgresstore is) begins the transactions
// the middleware opens itself together with the record, in the cheaper way
// it knows (postgresstore: a plain INSERT, an upsert only for a key that
// has a row); any other stores.TxStore records with RememberTx. On
// database/sql BEGIN is a round trip of its own and the record another: a
// delivery costs one round trip more than the handler's own transaction
// (WithPgxTransaction sends the record with BEGIN and saves it). With
// postgresstore a duplicate costs a statement that fails with a unique
// violation, which PostgreSQL writes to its log as an ERROR (with the
// statement, under the default log_min_error_statement): a line per
// duplicate, not a fault; then a rollback and the record read in a fresh
// transaction, which is rolled back too.
//
// It cannot be combined with WithClaim, WithoutClaim or WithParkWait: the
// record's row lock already keeps concurrent duplicates apart.
func WithTransaction(db *sql.DB) Option {
	return func(c *config) { c.txDB = db }
}

// TxBeginner is a stores.TxStore that can begin a transaction already
// holding a message's record, more cheaply than BEGIN followed by
// RememberTx (postgresstore can: a plain INSERT instead of an upsert).
// WithTransaction uses it for the transactions it opens itself; under
// WithSubscriberTx the subscriber's transaction is begun already, and
// RememberTx records the message in it.
type TxBeginner interface {
	stores.TxStore
	// BeginTx begins a transaction on db with opts and records key in it
	// with fingerprint (0: none) and value (nil: none). It reports
	// whether the transaction recorded the key (true) or found it
	// remembered (false: a duplicate, with the record found), as
	// RememberTx does, and returns the open transaction in both cases; on
	// error none is left open.
	BeginTx(ctx context.Context, db *sql.DB, opts *sql.TxOptions, key string, fingerprint uint64, value []byte) (tx *sql.Tx, recorded bool, found stores.Record, err error)
}

// WithSubscriberTx makes the transactional mode reuse the transaction a
// subscriber consumes the message in, found by txOf, instead of opening one:
// then consuming the message, the effect, the record and the outbox rows
// commit atomically when the subscriber commits. For watermill-sql's
// subscriber pass watermillsql.Tx (package
// middleware/idempotency/watermillsql); watermill-sql commits after the
// router's ack, and a failed commit leaves the message unconsumed, so it
// comes back. When txOf finds no transaction the middleware opens its own.
//
// A delivery can be handled more than once in one subscriber transaction
// (Retry retries it, watermill-sql resends a nacked message in the same
// transaction, a dead-letter middleware acks a failure), so each attempt
// runs inside a savepoint: a failure or panic rolls back to it, taking that
// attempt's writes, record and outbox rows with it. A retry then runs
// cleanly, and a dead-lettered message leaves no record behind, so its
// redrive runs.
//
// The subscriber commits a whole batch of messages at once, so an attempt
// checks its deferred constraints (DEFERRABLE INITIALLY DEFERRED) before its
// savepoint is released: a write that violates one fails that attempt, as
// the handler's own error would (retried, then dead-lettered), instead of
// every commit of the batch for ever. The check leaves the transaction's
// constraint modes as they were; COMMIT checks everything again (a
// constraint trigger runs twice, what it wrote in the check undone).
//
// A serialization failure or a deadlock (SQLSTATE 40001, 40P01) cannot pass
// in the transaction that met it (watermill-sql's is REPEATABLE READ: every
// retry sees the same snapshot). The attempt then rolls the subscriber's
// transaction back and fails with ErrStore (transient: never
// dead-lettered). A delivery whose subscriber transaction is over succeeds
// without running the handler, so that the subscriber acks it, its commit
// fails, and the message is read again in a fresh transaction (a nack would
// make watermill-sql resend it in the same transaction). txOf's subscriber
// must leave a message whose transaction did not commit unconsumed, as
// watermill-sql does.
func WithSubscriberTx(txOf func(ctx context.Context) (*sql.Tx, bool)) Option {
	return func(c *config) { c.subscriberTx = txOf }
}

// WithTxRetries sets how many times a transaction that failed with a
// serialization failure or a deadlock is retried (default 3).
func WithTxRetries(n int) Option {
	return func(c *config) { c.txRetries, c.txRetriesSet = n, true }
}

// WithTxOptions sets the options of the transactions the middleware opens
// (default: the database's, usually READ COMMITTED).
func WithTxOptions(opts *sql.TxOptions) Option {
	return func(c *config) { c.txOptions = opts }
}

// WithOutbox makes the transactional mode write the messages a handler
// produces to an outbox in the delivery's transaction, instead of handing
// them to the router to publish: they commit with the effect and the record,
// or not at all. publisherFor returns a publisher bound to tx; a relay
// publishes the committed rows to the broker afterwards, outside the
// transaction. watermillsql.Outbox provides both halves on watermill-sql and
// Watermill's components/forwarder:
//
//	outbox, err := watermillsql.NewOutbox(ctx, db, watermillsql.OutboxConfig{Topic: "orders_outbox"})
//	router.AddMiddleware(idempotency.Middleware(store,
//		idempotency.WithTransaction(db), idempotency.WithOutbox(outbox.Publisher)))
//	relay, err := outbox.NewForwarder(brokerPublisher) // run it beside the router
//
// The handler's returned messages go to the topic the router would have
// published them to (message.PublishTopicFromCtx: the handler's publish
// topic); the middleware returns none to the router. A handler may also
// publish to other topics itself through OutboxFromContext. Produced messages
// are relayed at least once: give them identities derived from the consumed
// message (envelope.NewChild) so their consumers skip a second copy.
func WithOutbox(publisherFor func(tx *sql.Tx) (message.Publisher, error)) Option {
	return func(c *config) { c.outbox = publisherFor }
}

// OutboxFromContext returns the outbox publisher of the delivery's
// transaction under WithOutbox: what a handler publishes with it commits with
// the handler's writes and is relayed after the commit.
func OutboxFromContext(ctx context.Context) (message.Publisher, bool) {
	p, ok := ctx.Value(outboxKey{}).(message.Publisher)
	return p, ok
}

type outboxKey struct{}

// Errors of the transactional mode.
var (
	// ErrNoOutbox is matched when a handler returns messages in the
	// transactional mode without WithOutbox: they cannot commit with the
	// effect, so the delivery fails and nothing is committed.
	ErrNoOutbox = errors.New("handler returned messages in transactional mode without an outbox (WithOutbox)")

	// ErrNoPublishTopic is matched when a handler returns messages under
	// WithOutbox but the router gave it no publish topic to send them to
	// (a consumer handler, or a direct call).
	ErrNoPublishTopic = errors.New("handler returned messages but has no publish topic")
)

// savepoint names the savepoint each attempt in a subscriber's transaction
// runs in. PostgreSQL and MySQL let a name be reused: ROLLBACK TO and RELEASE
// act on the latest savepoint of that name.
const savepoint = "bq_idempotency_attempt"

// checkAndRelease ends a successful attempt in a subscriber's transaction,
// in one round trip: it checks the deferred constraints (DEFERRABLE
// INITIALLY DEFERRED foreign keys, unique and exclusion constraints,
// constraint triggers) now, in a savepoint of its own, then releases the
// attempt's savepoint. A violation fails SET CONSTRAINTS, and the statements
// after it do not run: the attempt is then rolled back to its savepoint and
// fails as the handler's own failure would. ROLLBACK TO restores the
// constraint modes SET CONSTRAINTS changed, and marks the checks it ran as
// pending again: the transaction goes on as before, and COMMIT checks
// everything once more.
const checkAndRelease = "SAVEPOINT bq_idempotency_check; SET CONSTRAINTS ALL IMMEDIATE; " +
	"ROLLBACK TO SAVEPOINT bq_idempotency_check; RELEASE SAVEPOINT bq_idempotency_check; RELEASE SAVEPOINT " + savepoint

// inTransaction is the transactional mode (WithTransaction): record the
// message, run the handler and write what it produced in one transaction,
// and commit before returning.
func (g *Guard) inTransaction(d delivery, h message.HandlerFunc) ([]*message.Message, error) {
	if g.cfg.subscriberTx != nil {
		if tx, ok := g.cfg.subscriberTx(d.ctx); ok {
			// The subscriber commits on ack and rolls back when it gives
			// the message up; the attempt is isolated in a savepoint.
			return nil, g.txBudget(d, func(d delivery) error { return g.inSavepoint(d, h, tx) })
		}
	}
	return nil, g.txBudget(d, func(d delivery) error {
		return g.retryingConflicts(d, func() error { return g.ownTx(d, h) })
	})
}

// inPgxTransaction is the transactional mode on a pgx pool
// (WithPgxTransaction): as inTransaction, in transactions of its own.
func (g *Guard) inPgxTransaction(d delivery, h message.HandlerFunc) ([]*message.Message, error) {
	return nil, g.txBudget(d, func(d delivery) error {
		return g.retryingConflicts(d, func() error { return g.ownPgxTx(d, h) })
	})
}

// retryingConflicts runs attempt, a transaction of the middleware's own,
// again while it fails with a serialization failure or a deadlock, up to
// WithTxRetries times.
func (g *Guard) retryingConflicts(d delivery, attempt func() error) error {
	for n := 1; ; n++ {
		err := attempt()
		if !isConflict(err) {
			return err
		}
		if n > g.cfg.txRetries {
			if errors.Is(err, ErrStore) {
				return err
			}
			// Still conflicting: nothing committed, and a redelivery in a
			// fresh transaction may well pass. Transient, never a dead
			// letter.
			return g.storeError(d, fmt.Sprintf("commit (%d conflicting transactions)", n), err)
		}
		g.cfg.logger.Debug("Transaction conflicted with another; retrying with a fresh one", g.fields(d.ev).Add(
			watermill.LogFields{"attempt": n, "error": err.Error()}))
	}
}

// ownTx runs one attempt in a transaction of the middleware's own and
// commits it before returning, so the router acks only a committed delivery.
func (g *Guard) ownTx(d delivery, h message.HandlerFunc) error {
	var tx *sql.Tx
	var err error
	recorded := false
	if g.txBeginner != nil && !d.unrecorded {
		// BEGIN and the record together, the store's cheaper way.
		start := g.obs.startStore(d.ctx)
		var found stores.Record
		tx, recorded, found, err = g.txBeginner.BeginTx(d.ctx, g.cfg.txDB, g.cfg.txOptions, d.key, d.fp, nil)
		g.obs.endStore(d.ctx, start, d.ev.Handler, "record")
		if err != nil {
			return g.storeError(d, "record", err)
		}
		if !recorded {
			_ = tx.Rollback()
			return g.notRecorded(d, found)
		}
		if err := g.txDue(d, found); err != nil {
			_ = tx.Rollback()
			return err
		}
	} else if tx, err = g.cfg.txDB.BeginTx(d.ctx, g.cfg.txOptions); err != nil {
		return g.storeError(d, "begin transaction for", err)
	}
	committed := false
	defer func() {
		if !committed { // an error, a duplicate or a panic
			_ = tx.Rollback()
		}
	}()
	duplicate, err := g.inTx(d, h, tx, recorded)
	if err != nil || duplicate {
		return err
	}
	committed = true
	if err := tx.Commit(); err != nil {
		if lostStore(err) || d.ctx.Err() != nil {
			// The database went away at COMMIT, or the delivery was
			// cancelled (shutdown) and database/sql rolled the transaction
			// back: nothing happened, as when BEGIN fails; or COMMIT's
			// reply was lost, and the redelivery finds the record if it
			// committed. It is transient.
			return g.storeError(d, "commit", err)
		}
		return fmt.Errorf("idempotency: commit message %q: %w", d.ev.MessageID, err)
	}
	return nil
}

// lostStore reports a failure of the connection to the database rather
// than of the transaction's content: a connection exception (SQLSTATE class
// 08), the server shutting down or not accepting connections (57P01–57P03),
// a serialization failure or deadlock (40001, 40P01), or a network-level
// error with no SQLSTATE, pgx's closed connection among them (a COMMIT
// whose reply was lost with its connection: it may have committed, and
// the redelivery finds out; it was dead-lettered as the handler's
// failure), but not a connection pgx had closed before the statement was
// sent (pgconn.SafeToRetry): a statement of the handler's ended it, its
// error swallowed, and nothing committed; every redelivery did the same,
// redelivered for ever. A deferred constraint violated by the handler's
// writes (class 23, or an exception raised by a trigger) is not one: that
// delivery fails as the handler's.
func lostStore(err error) bool {
	if code, ok := sqlstate.Of(err); ok {
		switch {
		case strings.HasPrefix(code, "08"), code == "57P01", code == "57P02", code == "57P03",
			code == "40001", code == "40P01":
			return true
		}
		return false
	}
	var netErr net.Error
	return errors.Is(err, driver.ErrBadConn) || errors.Is(err, sql.ErrConnDone) || (errors.Is(err, pgconn.ErrConnClosed) && !pgconn.SafeToRetry(err)) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, context.DeadlineExceeded) || errors.As(err, &netErr)
}

// inSavepoint runs one attempt in the subscriber's transaction tx, inside a
// savepoint that a failure or a panic rolls back to.
func (g *Guard) inSavepoint(d delivery, h message.HandlerFunc, tx *sql.Tx) error {
	if _, err := tx.ExecContext(d.ctx, "SAVEPOINT "+savepoint); err != nil {
		if errors.Is(err, sql.ErrTxDone) {
			return g.passOver(d)
		}
		return g.storeError(d, "open a savepoint for", err)
	}
	done := false
	defer func() {
		if !done { // a panic
			_ = g.rollbackToSavepoint(d, tx)
		}
	}()
	_, err := g.inTx(d, h, tx, false)
	done = true
	if isConflict(err) {
		return g.abandonTx(d, tx, err)
	}
	if err != nil {
		if rbErr := g.rollbackToSavepoint(d, tx); rbErr != nil {
			return errors.Join(err, rbErr)
		}
		return err
	}
	if _, err := tx.ExecContext(d.ctx, checkAndRelease); err != nil {
		if isConflict(err) {
			return g.abandonTx(d, tx, err)
		}
		// The attempt's writes violate a deferred constraint, or a
		// statement of the attempt failed and the handler went on (the
		// transaction is aborted), or the connection is gone. Undo the
		// attempt: when that works the transaction is sound again and the
		// attempt failed as the handler's own failure would; otherwise the
		// store is lost.
		if rbErr := g.rollbackToSavepoint(d, tx); rbErr != nil {
			return g.storeError(d, "release the savepoint of", errors.Join(err, rbErr))
		}
		return fmt.Errorf("idempotency: message %q: the attempt cannot commit (its writes violate a deferred constraint, or a statement in its transaction failed though the handler returned no error); rolled back: %w",
			d.ev.MessageID, err)
	}
	return nil
}

// abandonTx rolls the subscriber's transaction back after a serialization
// failure or a deadlock (SQLSTATE 40001, 40P01) in an attempt: it cannot
// succeed in that transaction's snapshot, and a retry in it would fail the
// same way until the message was dead-lettered. The error is transient
// (ErrStore): not dead-lettered. Every later attempt in the rolled-back
// transaction passes over (passOver), so that the subscriber's commit fails
// and the message is read again in a fresh transaction.
func (g *Guard) abandonTx(d delivery, tx *sql.Tx, err error) error {
	if rbErr := tx.Rollback(); rbErr != nil && !errors.Is(rbErr, sql.ErrTxDone) {
		err = errors.Join(err, rbErr)
	}
	if errors.Is(err, ErrStore) { // the record's statement met it: reported already
		return err
	}
	return g.storeError(d, "run (its transaction conflicted with another and was rolled back, to be read again in a fresh one)", err)
}

// passOver answers a delivery whose subscriber's transaction is over
// (rolled back by abandonTx, or with the subscriber's context): nothing can
// commit in it, so the handler does not run, and the delivery succeeds,
// so that the subscriber acks it and commits, which fails and leaves the
// message unconsumed: it is read again in a fresh transaction. Failing it
// instead would nack it, and watermill-sql resends a nacked message in the
// same transaction, for ever.
func (g *Guard) passOver(d delivery) error {
	g.cfg.logger.Info("The subscriber's transaction is over (rolled back); the delivery is acked without running, for the subscriber to read it again in a fresh transaction",
		g.fields(d.ev))
	return nil
}

// rollbackToSavepoint undoes the attempt's writes, record and outbox rows,
// and releases the savepoint. It outlives the message context: an attempt
// cut short by shutdown must still be undone.
func (g *Guard) rollbackToSavepoint(d delivery, tx *sql.Tx) error {
	ctx, cancel := g.storeContext(context.WithoutCancel(d.ctx))
	defer cancel()
	for _, stmt := range []string{"ROLLBACK TO SAVEPOINT " + savepoint, "RELEASE SAVEPOINT " + savepoint} {
		if _, err := tx.ExecContext(ctx, stmt); err != nil {
			return fmt.Errorf("idempotency: roll back the failed attempt of message %q: %w", d.ev.MessageID, err)
		}
	}
	return nil
}

// inTx records the message in tx (unless recorded says it is already),
// runs the handler with tx (and the outbox) in its context and writes the
// messages it returned to the outbox. duplicate reports a message the
// handler must not run for (nothing to commit).
func (g *Guard) inTx(d delivery, h message.HandlerFunc, tx *sql.Tx, recorded bool) (duplicate bool, err error) {
	if !d.unrecorded && !recorded {
		start := g.obs.startStore(d.ctx)
		fresh, found, err := g.txStore.RememberTx(d.ctx, tx, d.key, d.fp, nil)
		g.obs.endStore(d.ctx, start, d.ev.Handler, "record")
		if err != nil {
			return false, g.storeError(d, "record", err)
		}
		if !fresh {
			return true, g.notRecorded(d, found)
		}
		if err := g.txDue(d, found); err != nil {
			return true, err
		}
	}
	ctx := stores.WithTx(g.withDelivery(d), tx)
	var outbox message.Publisher
	if g.cfg.outbox != nil {
		if outbox, err = g.cfg.outbox(tx); err != nil {
			return false, g.storeError(d, "open the outbox for", err)
		}
		ctx = context.WithValue(ctx, outboxKey{}, outbox)
	}
	d.msg.SetContext(ctx)
	defer d.msg.SetContext(d.ctx)
	produced, err := g.runTx(d, h)
	if err == nil && len(produced) > 0 {
		err = g.toOutbox(d, outbox, produced)
	}
	if !d.unrecorded { // a message without identity was reported as fail_open
		g.observe(d.ctx, d.msg, d.event(OutcomeRun, err))
	}
	return false, err
}

// notRecorded answers a delivery whose record a transaction found instead
// of writing: a delivery of the claim mode running it under a live claim (a
// rolling deploy) is in flight, to come back later; anything else is a
// duplicate, skipped.
func (g *Guard) notRecorded(d delivery, found stores.Record) error {
	switch {
	case found.State == stores.StateInFlight:
		err := fmt.Errorf("idempotency: message %q: %w", d.ev.MessageID, ErrInFlight)
		return g.observe(d.ctx, d.msg, d.event(OutcomePark, err))
	case found.Ended():
		// The transaction may hold the row: reopening waits until it is
		// over (txBudget).
		if err := g.conflict(d, found.Fingerprint); err != nil {
			return err
		}
		if redriven(d, found) {
			return &reopenError{found: found}
		}
		g.observe(d.ctx, d.msg, d.event(OutcomeEnded, nil))
		return nil
	}
	return g.skip(d, found)
}

// toOutbox writes the messages the handler returned to the outbox, for the
// topic the router would have published them to.
func (g *Guard) toOutbox(d delivery, outbox message.Publisher, produced []*message.Message) error {
	if outbox == nil {
		return fmt.Errorf("idempotency: message %q: %w", d.ev.MessageID, ErrNoOutbox)
	}
	topic := message.PublishTopicFromCtx(d.ctx)
	if topic == "" {
		return fmt.Errorf("idempotency: message %q: %w", d.ev.MessageID, ErrNoPublishTopic)
	}
	for _, m := range produced {
		m.SetContext(d.ctx)
	}
	if err := outbox.Publish(topic, produced...); err != nil {
		return fmt.Errorf("idempotency: message %q: write %d produced messages to the outbox: %w", d.ev.MessageID, len(produced), err)
	}
	return nil
}

// isConflict reports a serialization failure or deadlock, the errors a fresh
// transaction may not meet. Drivers expose the SQLSTATE through a
// SQLState method (pgx's *pgconn.PgError, lib/pq's *pq.Error).
func isConflict(err error) bool {
	return sqlstate.Is(err, sqlstate.SerializationFailure) || sqlstate.Is(err, sqlstate.DeadlockDetected)
}
