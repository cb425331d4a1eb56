package idempotency

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/stores"
)

// WithTransaction turns on the transactional mode (the consumer inbox): every
// identified delivery runs in a transaction on db that also writes the
// message's record, so the handler's writes and the record commit or roll back
// together, and the window between an effect and its record is closed for
// effects that live in that database. The store must implement
// stores.TxRememberer (postgresstore does) and use the same database.
//
// For each delivery: begin; record the message (a concurrent transaction
// holding the same message makes this wait: if it commits, this delivery is a
// duplicate, rolled back, skipped and acked; if it rolls back, this one goes
// on); run the handler with the transaction in its context
// (stores.TxFromContext, postgresstore.TxFromContext); commit. A handler error
// or panic rolls back: neither the effect nor the record exists, and the error
// propagates. A failed commit propagates too. Serialization failures and
// deadlocks (SQLSTATE 40001, 40P01) are retried with a fresh transaction, the
// handler included (WithTxRetries). When the handler returns messages for the
// router to publish, the commit waits until the router acked the delivery.
//
// It cannot be combined with WithClaim: the record's row lock already keeps
// concurrent duplicates apart.
func WithTransaction(db *sql.DB) Option {
	return func(c *config) { c.txDB = db }
}

// WithSubscriberTx makes the transactional mode reuse the transaction a
// subscriber consumes the message in, found by txOf, instead of opening one:
// then consuming the message, the effect and the record commit atomically
// when the router acks. For watermill-sql's subscriber pass
// watermillsql.Tx (package middleware/idempotency/watermillsql). When txOf
// finds no transaction the middleware opens its own.
func WithSubscriberTx(txOf func(ctx context.Context) (*sql.Tx, bool)) Option {
	return func(c *config) { c.subscriberTx = txOf }
}

// WithTxRetries sets how many times a transaction that failed with a
// serialization failure or a deadlock is retried (default 3).
func WithTxRetries(n int) Option {
	return func(c *config) { c.txRetries = n }
}

// WithTxOptions sets the options of the transactions the middleware opens
// (default: the database's, usually READ COMMITTED).
func WithTxOptions(opts *sql.TxOptions) Option {
	return func(c *config) { c.txOptions = opts }
}

// handleInTx is the transactional decision for an identified delivery.
func (g *Guard) handleInTx(d delivery, h message.HandlerFunc) ([]*message.Message, error) {
	if g.cfg.subscriberTx != nil {
		if tx, ok := g.cfg.subscriberTx(d.ctx); ok {
			// The subscriber commits on ack and rolls back on nack.
			produced, _, err := g.inTx(d, h, tx)
			return produced, err
		}
	}
	for attempt := 1; ; attempt++ {
		produced, err := g.ownTx(d, h)
		if !isConflict(err) || attempt > g.cfg.txRetries {
			return produced, err
		}
		g.cfg.logger.Info("Transaction conflicted with another; retrying with a fresh one", g.fields(d.ev).Add(
			watermill.LogFields{"attempt": attempt, "error": err.Error()}))
	}
}

// ownTx runs one attempt in a transaction of the middleware's own.
func (g *Guard) ownTx(d delivery, h message.HandlerFunc) ([]*message.Message, error) {
	// The transaction outlives the message context when the commit waits
	// for the router's ack (subscribers may cancel that context on ack).
	tx, err := g.cfg.txDB.BeginTx(context.WithoutCancel(d.ctx), g.cfg.txOptions)
	if err != nil {
		return nil, g.storeError(d, "begin transaction for", err)
	}
	committing := false
	defer func() {
		if !committing {
			_ = tx.Rollback()
		}
	}()
	produced, duplicate, err := g.inTx(d, h, tx)
	if err != nil || duplicate {
		return produced, err
	}
	committing = true
	if len(produced) > 0 {
		go g.commitTxAfterAck(d, tx)
		return produced, nil
	}
	if err := tx.Commit(); err != nil {
		return nil, fmt.Errorf("idempotency: commit message %q: %w", d.ev.MessageID, err)
	}
	return nil, nil
}

// inTx records the message in tx and runs the handler with tx in its
// context. duplicate reports a skipped duplicate (nothing to commit).
func (g *Guard) inTx(d delivery, h message.HandlerFunc, tx *sql.Tx) (produced []*message.Message, duplicate bool, err error) {
	var fresh bool
	var kept uint64
	start := g.metrics.startStore(d.ctx)
	if g.txFP != nil && d.fp != 0 {
		fresh, kept, err = g.txFP.RememberTxFingerprint(d.ctx, tx, d.key, d.fp)
	} else {
		fresh, err = g.txStore.RememberTx(d.ctx, tx, d.key)
	}
	g.metrics.endStore(d.ctx, start, d.ev.Handler, "record")
	if err != nil {
		return nil, false, g.storeError(d, "record", err)
	}
	if !fresh {
		if err := g.conflict(d, kept); err != nil {
			return nil, false, err
		}
		g.observe(d.ctx, d.msg, d.event(OutcomeSkip, nil))
		return nil, true, nil
	}
	d.msg.SetContext(stores.WithTx(d.ctx, tx))
	defer d.msg.SetContext(d.ctx)
	produced, err = h(d.msg)
	g.observe(d.ctx, d.msg, d.event(OutcomeRun, err))
	return produced, false, err
}

// commitTxAfterAck commits once the router acked the delivery (its produced
// messages were published) and rolls back on a nack or WithAckTimeout.
func (g *Guard) commitTxAfterAck(d delivery, tx *sql.Tx) {
	timer := time.NewTimer(g.cfg.ackTimeout)
	defer timer.Stop()
	select {
	case <-d.msg.Acked():
		if err := tx.Commit(); err != nil {
			err = fmt.Errorf("idempotency: commit message %q after its ack: its produced messages were published but its effect and record were not committed: %w",
				d.ev.MessageID, err)
			g.observe(d.ctx, d.msg, d.event(OutcomeRememberFailed, err))
		}
	case <-d.msg.Nacked():
		_ = tx.Rollback()
	case <-timer.C:
		_ = tx.Rollback()
		g.cfg.logger.Info("Delivery was neither acked nor nacked in time; transaction rolled back", g.fields(d.ev))
	}
}

// isConflict reports a serialization failure or deadlock, the errors a fresh
// transaction may not meet. Drivers expose the SQLSTATE through a
// SQLState method (pgx's *pgconn.PgError, lib/pq's *pq.Error).
func isConflict(err error) bool {
	var state interface{ SQLState() string }
	if !errors.As(err, &state) {
		return false
	}
	switch state.SQLState() {
	case "40001", "40P01": // serialization_failure, deadlock_detected
		return true
	}
	return false
}
