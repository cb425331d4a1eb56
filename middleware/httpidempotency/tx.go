package httpidempotency

import (
	"context"
	"fmt"
	"net/http"

	"github.com/babelqueue/watermill-idempotency/internal/sqlstate"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// uniqueViolation is the SQLSTATE of a uniqueness conflict.
const uniqueViolation = "23505"

// conflict reports an error a fresh transaction may not meet: a
// serialization failure, a deadlock or a uniqueness conflict.
func conflict(err error) bool {
	return sqlstate.Is(err, sqlstate.SerializationFailure) || sqlstate.Is(err, sqlstate.DeadlockDetected) ||
		sqlstate.Is(err, uniqueViolation)
}

// runTx runs the handler of WrapTx with the key claimed: in a transaction
// that also writes the record with the saved response, committed before
// the response is sent. After a conflict it looks at the key again (the
// winner's commit is visible by then: PostgreSQL reports a uniqueness
// conflict once the other transaction committed) and replays what
// committed, or runs in a fresh transaction, at most WithTxRetries more
// times. It reports whether the claim was settled.
func (h *guarded) runTx(w http.ResponseWriter, r *http.Request, c *call) bool {
	g := h.g
	for attempt := 1; ; attempt++ {
		again, err := h.attemptTx(w, r, c)
		if !again {
			return true
		}
		if attempt > g.cfg.txRetries {
			g.release(c)
			g.logger().Error("httpidempotency: the transaction kept conflicting", "operation", h.op.Name, "attempts", attempt, "error", err)
			g.problem(w, http.StatusServiceUnavailable, ProblemTransactionFailed, "The request conflicted with others",
				"Nothing was committed. Retry it with the same Idempotency-Key.", g.cfg.retryAfter)
			return true
		}
		// The key again: the winner's record, or still ours to run.
		ctx, cancel := g.storeCtx(c)
		claimed, found, err := g.store.Claim(ctx, c.key, h.op.lease)
		cancel()
		switch {
		case err != nil:
			h.storeUnavailable(w, "claim the key again after a conflict", err)
			return false
		case claimed:
			continue
		case found.State == stores.StateRemembered:
			h.replay(w, r, c, found)
			return true
		default: // another request took the key after this one lost its claim
			h.inProgress(w, found)
			return true
		}
	}
}

// attemptTx is one transaction. It returns again with the conflict when a
// fresh transaction should be tried; otherwise the request was answered.
func (h *guarded) attemptTx(w http.ResponseWriter, r *http.Request, c *call) (again bool, err error) {
	g, op := h.g, &h.op
	ctx := c.lease.Context() // ends, and rolls the transaction back, if the claim is lost
	tx, err := g.cfg.txDB.BeginTx(ctx, g.cfg.txOptions)
	if err != nil {
		g.release(c)
		h.storeUnavailable(w, "begin a transaction", err)
		return false, nil
	}
	done := false
	defer func() {
		if !done { // an early answer, a conflict or a panic
			_ = tx.Rollback()
		}
	}()
	cw := newCapture(w, op.maxResponse, false)
	if herr := h.tx(cw, c.request(r, stores.WithTx(ctx, tx)), tx); herr != nil {
		if conflict(herr) {
			return true, herr
		}
		_ = tx.Rollback()
		g.release(c)
		g.logger().Error("httpidempotency: the handler failed; rolled back", "operation", op.Name, "error", herr)
		g.problem(w, http.StatusInternalServerError, ProblemHandlerFailed, "The request failed",
			"Nothing was committed. Retrying with the same Idempotency-Key runs it again.", 0)
		return false, nil
	}
	status := cw.statusCode()
	if !op.Keep(status) {
		_ = tx.Rollback()
		g.release(c)
		cw.flush()
		return false, nil
	}
	value, full, limit := h.encode(c, cw), []byte(nil), g.caps.MaxValue
	if g.tiered() {
		full, value = h.tieredValues(c, cw)
		limit = g.responseCaps.MaxValue
	}
	if cw.overflow || len(value) > g.caps.MaxValue || len(full) > limit || (g.tiered() && full == nil) {
		_ = tx.Rollback()
		g.release(c)
		g.problem(w, http.StatusInternalServerError, ProblemResponseTooLarge, "The response is too large to save",
			"The response was over the size this operation saves, so nothing was committed: a retry would not get the same response.", 0)
		return false, nil
	}
	if full != nil && !g.saveResponseTx(ctx, tx, c, full) {
		// Not a TxStore on this database: written before the commit, so
		// that a retry after it finds it (best effort; a response left by
		// a transaction that then rolls back is never replayed: it names
		// another save time than the record of a later run).
		g.saveResponse(c, full)
	}
	// As this request's claim holder, so that the record replaces its own
	// claim (a live claim of another holder is reported in flight).
	recorded, found, err := g.txStore.RememberTx(stores.WithClaimToken(ctx, stores.ClaimToken(c.base)), tx, c.key, c.fp, value)
	switch {
	case err != nil && conflict(err):
		return true, err
	case err != nil:
		_ = tx.Rollback()
		g.release(c)
		if ctx.Err() != nil {
			err = fmt.Errorf("the request lost its claim on its key, so its transaction ended (%w): %w", context.Cause(ctx), err)
		}
		g.logger().Error("httpidempotency: could not write the record in the transaction; rolled back", "operation", op.Name, "error", err)
		g.problem(w, http.StatusServiceUnavailable, ProblemTransactionFailed, "The request could not be committed",
			"Nothing was committed. Retry it with the same Idempotency-Key.", g.cfg.retryAfter)
		return false, nil
	case !recorded && found.State == stores.StateRemembered:
		// Another request with the key committed while this one ran (its
		// claim was lost): this one rolls back and replays that one.
		_ = tx.Rollback()
		h.replay(w, r, c, found)
		return false, nil
	case !recorded:
		// This request lost its claim and another request holds the key
		// now: roll back and let the client retry once that one ends.
		_ = tx.Rollback()
		h.inProgress(w, found)
		return false, nil
	}
	done = true
	if err := tx.Commit(); err != nil {
		if conflict(err) {
			return true, err
		}
		// Committed or not (the connection may have gone at COMMIT), the
		// claim can go: Release never drops a record.
		g.release(c)
		g.logger().Error("httpidempotency: commit failed", "operation", op.Name, "error", err)
		g.problem(w, http.StatusServiceUnavailable, ProblemTransactionFailed, "The request could not be committed",
			"Retry it with the same Idempotency-Key: you will get its response if it committed, or it runs again.", g.cfg.retryAfter)
		return false, nil
	}
	cw.flush()
	return false, nil
}

// unguardedTx runs a request without a key (KeyOptional) in a transaction
// of its own, with no record.
func (h *guarded) unguardedTx(w http.ResponseWriter, r *http.Request) {
	g := h.g
	ctx := r.Context()
	tx, err := g.cfg.txDB.BeginTx(ctx, g.cfg.txOptions)
	if err != nil {
		g.logger().Error("httpidempotency: could not begin a transaction", "operation", h.op.Name, "error", err)
		g.problem(w, http.StatusServiceUnavailable, ProblemStoreUnavailable, "Database unavailable", "The request did not run.", g.cfg.retryAfter)
		return
	}
	defer func() { _ = tx.Rollback() }()
	cw := newCapture(w, h.op.maxResponse, false)
	err = h.tx(cw, r.WithContext(stores.WithTx(ctx, tx)), tx)
	switch {
	case err != nil:
		g.logger().Error("httpidempotency: the handler failed; rolled back", "operation", h.op.Name, "error", err)
		g.problem(w, http.StatusInternalServerError, ProblemHandlerFailed, "The request failed", "Nothing was committed.", 0)
	case !h.op.Keep(cw.statusCode()):
		cw.flush() // a status the operation does not keep: rolled back
	case cw.overflow:
		g.problem(w, http.StatusInternalServerError, ProblemResponseTooLarge, "The response is too large",
			"The response was over the size this operation sends from a transaction, so nothing was committed.", 0)
	default:
		if err := tx.Commit(); err != nil {
			g.logger().Error("httpidempotency: commit failed", "operation", h.op.Name, "error", err)
			g.problem(w, http.StatusServiceUnavailable, ProblemTransactionFailed, "The request could not be committed", "", g.cfg.retryAfter)
			return
		}
		cw.flush()
	}
}
