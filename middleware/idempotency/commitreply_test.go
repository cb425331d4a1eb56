package idempotency_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestTransactionCommitReplyLostIsTransient: the reply to the delivery's
// COMMIT is lost with its connection (the server committed; the client
// hears nothing more than that its connection closed). Whether it
// committed is unknown to the middleware: the failure is the store's,
// transient, never dead-lettered, and the redelivery finds the message
// remembered with its effect once.
func TestTransactionCommitReplyLostIsTransient(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"WithTransaction", "WithPgxTransaction"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			l := newLedgerDB(t)
			dsn, proxy := testenv.PostgresProxyDSN(t)
			var opt idempotency.Option
			if mode == "WithTransaction" {
				db, err := sql.Open("pgx", dsn)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = db.Close() })
				opt = idempotency.WithTransaction(db)
			} else {
				pool, err := pgxpool.New(context.Background(), dsn)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(pool.Close)
				opt = idempotency.WithPgxTransaction(pool)
			}
			dlq := &dlqCapture{}
			dl, err := deadletter.Middleware(dlq)
			if err != nil {
				t.Fatal(err)
			}
			runs := 0
			h := dl(idempotency.Middleware(l.store, opt)(noProduce(func(msg *message.Message) error {
				runs++
				if err := l.credit(msg); err != nil {
					return err
				}
				proxy.DropReply.Store(runs == 1) // the next reply is the COMMIT's
				return nil
			})))
			payload := envelopeWithID(t, "pay-commit-reply-lost")
			_, err = h(msgOf(payload))
			if proxy.Dropped.Load() != 1 {
				t.Fatalf("%d replies dropped, want the commit's", proxy.Dropped.Load())
			}
			if dlq.len() != 0 || err == nil || !idempotency.IsTransient(err) || !errors.Is(err, idempotency.ErrStore) {
				t.Fatalf("the commit's reply lost: %d dead letter(s), error %v (IsTransient %v); want none dead-lettered and a store error for a redelivery",
					dlq.len(), err, idempotency.IsTransient(err))
			}
			if l.balance(t, "alice") != 10 || !l.remembered(t, "pay-commit-reply-lost") {
				t.Fatal("the server committed, but the effect or the record is not there")
			}
			if _, err := h(msgOf(payload)); err != nil {
				t.Fatal(err)
			}
			if runs != 1 || l.balance(t, "alice") != 10 {
				t.Fatalf("runs=%d balance=%d: want the one run, whose commit went through", runs, l.balance(t, "alice"))
			}
		})
	}
}
