package idempotency

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/babelqueue/watermill-idempotency/stores"
)

// WithPgxTransaction is the transactional mode (see WithTransaction) on a
// pgx pool used natively, without database/sql: every identified delivery
// runs in a pgx transaction on pool that also holds the message's record,
// and the handler does its writes through PgxTxFromContext. The store must
// be a PgxTxStore (postgresstore is) on the same database.
//
// The record costs no round trip of its own: the transaction's BEGIN and
// the record's INSERT go out together, so a delivery costs the round trips
// of the handler's own transaction (BEGIN, its statements, COMMIT). The
// rest is as WithTransaction: a duplicate (the record committed by another
// transaction, or one that commits while this one waits for it) is rolled
// back, skipped and acked; a handler error or panic rolls back; the commit
// happens before the router acks; a failed BEGIN, a lost connection at
// COMMIT or a delivery cancelled meanwhile fails with ErrStore (transient);
// serialization failures and deadlocks are retried in a fresh transaction
// (WithTxRetries). WithPgxTxOptions sets the transactions' options. As
// there, a duplicate fails the record's INSERT with a unique violation,
// which PostgreSQL writes to its log as an ERROR: a line per duplicate, not
// a fault (postgresstore.Store.BeginPgx).
//
// It cannot be combined with WithTransaction, WithClaim, WithoutClaim,
// WithParkWait, WithSubscriberTx or WithOutbox (watermill-sql's outbox and subscriber are
// database/sql's): a handler that returns messages fails with ErrNoOutbox
// and nothing is committed.
func WithPgxTransaction(pool *pgxpool.Pool) Option {
	return func(c *config) { c.pgxPool = pool }
}

// WithPgxTxOptions sets the options of the transactions WithPgxTransaction
// opens (default: the database's, usually READ COMMITTED).
func WithPgxTxOptions(opts pgx.TxOptions) Option {
	return func(c *config) { c.pgxTxOptions, c.pgxTxOptionsSet = opts, true }
}

// PgxTxStore is a store that can begin a pgx transaction holding a
// message's record, for WithPgxTransaction.
type PgxTxStore interface {
	stores.Store
	// BeginPgx begins a transaction on conn with opts and records key in
	// it with fingerprint (0: none) and value (nil: none). It reports
	// whether the transaction recorded the key (true) or found it
	// remembered (false: a duplicate, with the record found), as
	// stores.TxStore.RememberTx does, and returns the open transaction in
	// both cases; on error none is left open on conn.
	BeginPgx(ctx context.Context, conn *pgx.Conn, opts pgx.TxOptions, key string, fingerprint uint64, value []byte) (tx pgx.Tx, recorded bool, found stores.Record, err error)
}

type pgxTxKey struct{}

// PgxTxFromContext returns the pgx transaction a handler must do its writes
// in under WithPgxTransaction: they commit together with the message's
// record. The middleware commits or rolls it back; the handler does
// neither.
func PgxTxFromContext(ctx context.Context) (pgx.Tx, bool) {
	tx, ok := ctx.Value(pgxTxKey{}).(pgx.Tx)
	return tx, ok && tx != nil
}

// ownPgxTx runs one attempt in a pgx transaction of the middleware's own,
// begun together with the record (a message without identity: without
// one), and commits it before returning.
func (g *Guard) ownPgxTx(d delivery, h message.HandlerFunc) error {
	conn, err := g.cfg.pgxPool.Acquire(d.ctx)
	if err != nil {
		return g.storeError(d, "begin transaction for", err)
	}
	defer conn.Release()
	var tx pgx.Tx
	if d.unrecorded {
		if tx, err = conn.BeginTx(d.ctx, g.cfg.pgxTxOptions); err != nil {
			return g.storeError(d, "begin transaction for", err)
		}
	} else {
		start := g.obs.startStore(d.ctx)
		var fresh bool
		var found stores.Record
		tx, fresh, found, err = g.pgxStore.BeginPgx(d.ctx, conn.Conn(), g.cfg.pgxTxOptions, d.key, d.fp, nil)
		g.obs.endStore(d.ctx, start, d.ev.Handler, "record")
		if err != nil {
			return g.storeError(d, "record", err)
		}
		if !fresh {
			rollback(d, g, tx)
			return g.notRecorded(d, found)
		}
		if err := g.txDue(d, found); err != nil {
			rollback(d, g, tx)
			return err
		}
	}
	committed := false
	defer func() {
		if !committed { // an error or a panic
			rollback(d, g, tx)
		}
	}()
	d.msg.SetContext(context.WithValue(g.withDelivery(d), pgxTxKey{}, tx))
	defer d.msg.SetContext(d.ctx)
	produced, err := g.runTx(d, h)
	if err == nil && len(produced) > 0 {
		err = g.toOutbox(d, nil, produced) // no outbox here: ErrNoOutbox
	}
	if !d.unrecorded { // a message without identity was reported as fail_open
		g.observe(d.ctx, d.msg, d.event(OutcomeRun, err))
	}
	if err != nil {
		return err
	}
	committed = true
	if err := tx.Commit(d.ctx); err != nil {
		if lostStore(err) || d.ctx.Err() != nil {
			return g.storeError(d, "commit", err)
		}
		return fmt.Errorf("idempotency: commit message %q: %w", d.ev.MessageID, err)
	}
	return nil
}

// rollback rolls tx back, even for a delivery whose context is done.
func rollback(d delivery, g *Guard, tx pgx.Tx) {
	ctx, cancel := g.storeContext(context.WithoutCancel(d.ctx))
	defer cancel()
	_ = tx.Rollback(ctx)
}
