package idempotency_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// TestTransactionHandlerBrokeItsConnectionIsHandlerFailure: the handler
// ends its transaction's connection itself (a statement of its own that
// fails fatally, its error swallowed) and returns nil. The COMMIT is never
// sent (pgx fails it with its closed connection before writing it):
// nothing committed, and the failure is the handler's, whatever it does on
// every redelivery. It is dead-lettered, not redelivered for ever as a
// lost COMMIT reply (which may have committed) is.
func TestTransactionHandlerBrokeItsConnectionIsHandlerFailure(t *testing.T) {
	t.Parallel()
	forEachTxMode(t, handlerBrokeItsConnection)
}

func handlerBrokeItsConnection(t *testing.T, l *ledgerDB, store stores.Store, mode idempotency.Option) {
	dlq := &dlqCapture{}
	dl, err := deadletter.Middleware(dlq)
	if err != nil {
		t.Fatal(err)
	}
	runs := 0
	h := dl(idempotency.Middleware(store, mode)(noProduce(func(msg *message.Message) error {
		runs++
		if err := l.credit(msg); err != nil {
			return err
		}
		_ = l.exec(msg, `SELECT pg_terminate_backend(pg_backend_pid())`) // swallowed: the handler's bug
		return nil
	})))
	payload := envelopeWithID(t, "pay-broke-own-conn")
	_, err = h(msgOf(payload))
	for _, m := range dlq.msgs {
		t.Logf("dead-lettered: reason %q, error %q", m.Metadata.Get(deadletter.MetadataReason), m.Metadata.Get(deadletter.MetadataError))
	}
	if idempotency.IsTransient(err) || dlq.len() != 1 {
		t.Fatalf("the handler broke its own connection before COMMIT: %d dead letter(s), error %v (IsTransient %v); want the handler's failure dead-lettered, not a store failure redelivered for ever",
			dlq.len(), err, idempotency.IsTransient(err))
	}
	if runs != 1 || l.balance(t, "alice") != 0 || l.remembered(t, "pay-broke-own-conn") {
		t.Fatalf("runs=%d balance=%d: want one run, nothing committed", runs, l.balance(t, "alice"))
	}
}
