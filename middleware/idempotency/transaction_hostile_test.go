package idempotency_test

import (
	"database/sql"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
)

// TestTransactionRacingCopiesUnderIsolationLevels: copies of one message
// delivered at once to the transactional mode (database/sql's BeginTx and
// pgx's BeginPgx), at every isolation level, on a new key and on a key
// whose record has expired, take effect exactly once; a copy that lost a
// serialization race past its retries fails as a transient store error,
// never otherwise.
func TestTransactionRacingCopiesUnderIsolationLevels(t *testing.T) {
	t.Parallel()
	for _, driver := range []string{"database/sql", "pgx"} {
		for _, iso := range []string{"read committed", "repeatable read", "serializable"} {
			for _, row := range []string{"new", "expired"} {
				t.Run(driver+"/"+iso+"/"+row, func(t *testing.T) {
					t.Parallel()
					l := newLedgerDB(t)
					opts := []idempotency.Option{idempotency.WithTxRetries(10)}
					if driver == "pgx" {
						opts = append(opts, idempotency.WithPgxTransaction(l.pool),
							idempotency.WithPgxTxOptions(pgx.TxOptions{IsoLevel: pgx.TxIsoLevel(iso)}))
					} else {
						level := map[string]sql.IsolationLevel{"read committed": sql.LevelReadCommitted,
							"repeatable read": sql.LevelRepeatableRead, "serializable": sql.LevelSerializable}[iso]
						opts = append(opts, idempotency.WithTransaction(l.db), idempotency.WithTxOptions(&sql.TxOptions{Isolation: level}))
					}
					payload := envelopeWithID(t, "pay-race")
					if row == "expired" {
						short, err := postgresstore.New(l.db, postgresstore.WithTable(l.store.Table()), postgresstore.WithTTL(time.Millisecond))
						if err != nil {
							t.Fatal(err)
						}
						h := idempotency.Middleware(short, append(opts, idempotency.WithReplayHorizon(0))...)(noProduce(func(*message.Message) error { return nil }))
						if _, err := h(msgOf(payload)); err != nil {
							t.Fatal(err)
						}
						time.Sleep(5 * time.Millisecond)
					}
					var runs atomic.Int32
					h := idempotency.Middleware(l.store, opts...)(noProduce(func(msg *message.Message) error {
						runs.Add(1)
						time.Sleep(5 * time.Millisecond)
						return l.credit(msg)
					}))
					var wg sync.WaitGroup
					for range 6 {
						wg.Add(1)
						go func() {
							defer wg.Done()
							if _, err := h(msgOf(payload)); err != nil && !errors.Is(err, idempotency.ErrStore) {
								t.Errorf("a copy failed, not as a transient store error: %v", err)
							}
						}()
					}
					wg.Wait()
					if b := l.balance(t, "alice"); b != 10 {
						t.Fatalf("balance %d after %d handler runs, want exactly one credit", b, runs.Load())
					}
				})
			}
		}
	}
}
