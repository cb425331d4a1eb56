package idempotency_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/babelqueue/watermill-idempotency/internal/sqlstate"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// ledgerDB is a real PostgreSQL database with a ledger table and a record
// table of the test's own.
type ledgerDB struct {
	db     *sql.DB
	pool   *pgxpool.Pool // the same database through pgx natively
	store  *postgresstore.Store
	ledger string
}

func newLedgerDB(t *testing.T) *ledgerDB {
	t.Helper()
	db := testenv.Postgres(t)
	suffix := testenv.RandomHex(4)
	l := &ledgerDB{db: db, pool: testenv.PgxPool(t, 0), ledger: "ledger_" + suffix}
	// Registered before anything is created: a Migrate that fails after
	// creating the record table (its claims' session refused, say) leaves
	// nothing behind either.
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := db.ExecContext(ctx, `DROP TABLE IF EXISTS `+l.ledger+`_audit, `+l.ledger+`, idem_tx_`+suffix); err != nil {
			t.Errorf("drop the test's tables: %v", err)
		}
	})
	store, err := postgresstore.New(db, postgresstore.WithTable("idem_tx_"+suffix))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	l.store = store
	if _, err := db.ExecContext(ctx, `CREATE TABLE `+l.ledger+` (account text PRIMARY KEY, balance bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	// A deferred foreign key lets a test make COMMIT itself fail.
	if _, err := db.ExecContext(ctx, `CREATE TABLE `+l.ledger+`_audit (account text REFERENCES `+l.ledger+` DEFERRABLE INITIALLY DEFERRED)`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `INSERT INTO `+l.ledger+` VALUES ('alice', 0), ('bob', 0)`); err != nil {
		t.Fatal(err)
	}
	return l
}

func (l *ledgerDB) balance(t *testing.T, account string) int64 {
	t.Helper()
	var b int64
	if err := l.db.QueryRow(`SELECT balance FROM `+l.ledger+` WHERE account = $1`, account).Scan(&b); err != nil {
		t.Fatal(err)
	}
	return b
}

func (l *ledgerDB) remembered(t *testing.T, id string) bool {
	t.Helper()
	seen, err := stores.Seen(context.Background(), l.store, id)
	if err != nil {
		t.Fatal(err)
	}
	return seen
}

// credit adds 10 to alice's balance in the delivery's transaction.
func (l *ledgerDB) credit(msg *message.Message) error {
	return l.exec(msg, `UPDATE `+l.ledger+` SET balance = balance + 10 WHERE account = 'alice'`)
}

// exec runs query in the delivery's transaction: the pgx one under
// WithPgxTransaction, database/sql's under WithTransaction.
func (l *ledgerDB) exec(msg *message.Message, query string) error {
	if tx, ok := idempotency.PgxTxFromContext(msg.Context()); ok {
		_, err := tx.Exec(msg.Context(), query)
		return err
	}
	tx, ok := postgresstore.TxFromContext(msg.Context())
	if !ok {
		return errors.New("no transaction in the handler's context")
	}
	_, err := tx.ExecContext(msg.Context(), query)
	return err
}

func noProduce(f func(*message.Message) error) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) { return nil, f(msg) }
}

func TestTransactionEffectAndRecordCommitTogether(t *testing.T) {
	t.Parallel()
	forEachTxMode(t, effectAndRecordCommitTogether)
}

func effectAndRecordCommitTogether(t *testing.T, l *ledgerDB, store stores.Store, mode idempotency.Option) {
	rec := &recorder{}
	runs := 0
	fail := errors.New("declined")
	var failNext bool
	h := idempotency.Middleware(store, mode, idempotency.WithObserver(rec))(noProduce(func(msg *message.Message) error {
		runs++
		if err := l.credit(msg); err != nil {
			return err
		}
		if failNext {
			return fail // after the write: it must be rolled back
		}
		return nil
	}))
	payload := envelopeWithID(t, "pay-1")

	failNext = true
	if _, err := h(msgOf(payload)); !errors.Is(err, fail) {
		t.Fatalf("err = %v", err)
	}
	if l.balance(t, "alice") != 0 || l.remembered(t, "pay-1") {
		t.Fatal("a failed handler left its effect or its record behind")
	}
	failNext = false
	for range 3 {
		if _, err := h(msgOf(payload)); err != nil {
			t.Fatal(err)
		}
	}
	if runs != 2 || l.balance(t, "alice") != 10 || !l.remembered(t, "pay-1") {
		t.Fatalf("runs=%d balance=%d: want 2 runs (fail, succeed), one credit, the record kept", runs, l.balance(t, "alice"))
	}
	want := []idempotency.Outcome{idempotency.OutcomeRun, idempotency.OutcomeRun, idempotency.OutcomeSkip, idempotency.OutcomeSkip}
	if got := rec.outcomes(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("outcomes %v, want %v", got, want)
	}
	// The same message with other content is a conflict, not a duplicate.
	other := []byte(strings.Replace(string(payload), "1042", "1043", 1))
	if _, err := h(msgOf(other)); !errors.Is(err, idempotency.ErrConflict) {
		t.Fatalf("other content under a remembered id: %v, want ErrConflict", err)
	}
	if acquired, inUse := l.pool.Stat().AcquiredConns(), l.db.Stats().InUse; acquired != 0 || inUse != 0 {
		t.Fatalf("connections still held: %d of the pgx pool, %d of database/sql", acquired, inUse)
	}
}

func TestTransactionRolledBackOnPanic(t *testing.T) {
	t.Parallel()
	forEachTxMode(t, func(t *testing.T, l *ledgerDB, store stores.Store, mode idempotency.Option) {
		h := idempotency.Middleware(store, mode)(noProduce(func(msg *message.Message) error {
			if err := l.credit(msg); err != nil {
				return err
			}
			panic("bug after the write")
		}))
		func() {
			defer func() {
				if recover() == nil {
					t.Fatal("panic swallowed")
				}
			}()
			_, _ = h(msgOf(envelopeWithID(t, "pay-1")))
		}()
		if l.balance(t, "alice") != 0 || l.remembered(t, "pay-1") {
			t.Fatal("a panicking handler left its effect or its record behind")
		}
	})
}

func TestTransactionFailedCommitPropagates(t *testing.T) {
	t.Parallel()
	forEachTxMode(t, func(t *testing.T, l *ledgerDB, store stores.Store, mode idempotency.Option) {
		h := idempotency.Middleware(store, mode)(noProduce(func(msg *message.Message) error {
			if err := l.credit(msg); err != nil {
				return err
			}
			// Violates the deferred foreign key: only COMMIT notices.
			return l.exec(msg, `INSERT INTO `+l.ledger+`_audit VALUES ('nobody')`)
		}))
		_, err := h(msgOf(envelopeWithID(t, "pay-1")))
		if err == nil || !strings.Contains(err.Error(), "commit") || errors.Is(err, idempotency.ErrStore) {
			t.Fatalf("err = %v, want the commit's failure, not a store error", err)
		}
		if l.balance(t, "alice") != 0 || l.remembered(t, "pay-1") {
			t.Fatal("a failed commit left the effect or the record behind")
		}
	})
}

// TestTransactionConcurrentDuplicate: a second delivery of a message whose
// first delivery is still in its transaction waits for it, then is skipped
// if the first committed, or runs if it rolled back.
func TestTransactionConcurrentDuplicate(t *testing.T) {
	t.Parallel()
	forEachTxMode(t, func(t *testing.T, l *ledgerDB, store stores.Store, mode idempotency.Option) {
		for _, firstFails := range []bool{false, true} {
			name := map[bool]string{false: "first commits", true: "first rolls back"}[firstFails]
			t.Run(name, func(t *testing.T) {
				id := "pay-" + map[bool]string{false: "commits", true: "rolls-back"}[firstFails]
				before := l.balance(t, "alice")
				inFirst := make(chan struct{})
				release := make(chan struct{})
				var runs atomic.Int32
				h := idempotency.Middleware(store, mode)(noProduce(func(msg *message.Message) error {
					n := runs.Add(1)
					if err := l.credit(msg); err != nil {
						return err
					}
					if n == 1 {
						close(inFirst)
						<-release
						if firstFails {
							return errors.New("first delivery fails")
						}
					}
					return nil
				}))
				payload := envelopeWithID(t, id)
				var firstErr, secondErr error
				firstDone, secondDone := make(chan struct{}), make(chan struct{})
				go func() { _, firstErr = h(msgOf(payload)); close(firstDone) }()
				<-inFirst
				go func() { _, secondErr = h(msgOf(payload)); close(secondDone) }()
				select {
				case <-secondDone:
					t.Fatal("the second delivery did not wait for the first one's transaction")
				case <-time.After(200 * time.Millisecond):
				}
				close(release)
				<-firstDone
				<-secondDone
				if secondErr != nil {
					t.Fatalf("second delivery: %v", secondErr)
				}
				wantRuns := map[bool]int32{false: 1, true: 2}[firstFails]
				if runs.Load() != wantRuns || (firstErr != nil) != firstFails {
					t.Fatalf("runs=%d firstErr=%v", runs.Load(), firstErr)
				}
				if credited := l.balance(t, "alice") - before; credited != 10 || !l.remembered(t, id) {
					t.Fatalf("credited %d: want exactly one credit of 10 and the record", credited)
				}
			})
		}
	})
}

// TestTransactionRetriesSerializationFailures: under SERIALIZABLE, handlers
// that read and write the same row conflict; the loser is retried with a
// fresh transaction and every message takes effect exactly once.
func TestTransactionRetriesSerializationFailures(t *testing.T) {
	t.Parallel()
	l := newLedgerDB(t)
	var runs atomic.Int32
	h := idempotency.Middleware(l.store, idempotency.WithTransaction(l.db),
		idempotency.WithTxOptions(&sql.TxOptions{Isolation: sql.LevelSerializable}), idempotency.WithTxRetries(20),
	)(noProduce(func(msg *message.Message) error {
		runs.Add(1)
		tx, _ := postgresstore.TxFromContext(msg.Context())
		var b int64
		if err := tx.QueryRowContext(msg.Context(), `SELECT balance FROM `+l.ledger+` WHERE account = 'bob'`).Scan(&b); err != nil {
			return err
		}
		time.Sleep(5 * time.Millisecond)
		_, err := tx.ExecContext(msg.Context(), `UPDATE `+l.ledger+` SET balance = $1 WHERE account = 'bob'`, b+1)
		return err
	}))
	const messages = 8
	var wg sync.WaitGroup
	errs := make(chan error, messages)
	for i := range messages {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := h(msgOf(envelopeWithID(t, "pay-"+string(rune('a'+i))))); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("delivery failed: %v", err)
	}
	if l.balance(t, "bob") != messages {
		t.Fatalf("balance = %d, want %d", l.balance(t, "bob"), messages)
	}
	if runs.Load() <= messages {
		t.Fatalf("%d runs for %d messages: no serialization failure happened, the test did not race", runs.Load(), messages)
	}
	t.Logf("%d handler runs for %d messages under SERIALIZABLE", runs.Load(), messages)
}

func TestTransactionOptionsAreValidated(t *testing.T) {
	t.Parallel()
	db, err := sql.Open("pgx", "postgres://127.0.0.1:1/never-connected") // nothing here connects
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := idempotency.New(memstore.New(), idempotency.WithTransaction(db)); !errors.Is(err, idempotency.ErrNotTxStore) {
		t.Fatalf("memstore with WithTransaction: %v", err)
	}
	pg, _ := postgresstore.New(db)
	if _, err := idempotency.New(pg, idempotency.WithTransaction(db), idempotency.WithClaim(time.Second)); err == nil {
		t.Fatal("WithTransaction with WithClaim accepted")
	}
	if _, err := idempotency.New(pg, idempotency.WithSubscriberTx(func(context.Context) (*sql.Tx, bool) { return nil, false })); err == nil {
		t.Fatal("WithSubscriberTx without WithTransaction accepted")
	}
	if _, err := idempotency.New(pg, idempotency.WithOutbox(func(*sql.Tx) (message.Publisher, error) { return nil, nil })); err == nil {
		t.Fatal("WithOutbox without WithTransaction accepted")
	}
}

// subscriberTx opens a transaction standing for the one a subscriber
// (watermill-sql's) consumes a message in, and a guard that reuses it.
func subscriberTx(t *testing.T, l *ledgerDB, opts ...idempotency.Option) (*sql.Tx, []idempotency.Option) {
	t.Helper()
	tx, err := l.db.BeginTx(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback() })
	return tx, append([]idempotency.Option{idempotency.WithTransaction(l.db),
		idempotency.WithSubscriberTx(func(context.Context) (*sql.Tx, bool) { return tx, true })}, opts...)
}

// TestSubscriberTxRetryInSameTransactionRunsCleanly: Retry (or a resend of
// a nacked message) runs the handler again in the subscriber's still-open
// transaction. The failed attempt's write and record must be gone, so the
// retry runs, and the commit holds one credit.
func TestSubscriberTxRetryInSameTransactionRunsCleanly(t *testing.T) {
	t.Parallel()
	l := newLedgerDB(t)
	tx, opts := subscriberTx(t, l)
	runs := 0
	h := idempotency.Middleware(l.store, opts...)(noProduce(func(msg *message.Message) error {
		runs++
		if err := l.credit(msg); err != nil {
			return err
		}
		if runs == 1 {
			return errors.New("fails once, after its write")
		}
		return nil
	}))
	msg := msgOf(envelopeWithID(t, "pay-1"))
	if _, err := h(msg); err == nil {
		t.Fatal("the first attempt did not fail")
	}
	if _, err := h(msg); err != nil { // the retry, same delivery, same transaction
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if runs != 2 || l.balance(t, "alice") != 10 || !l.remembered(t, "pay-1") {
		t.Fatalf("runs=%d balance=%d remembered=%v: want the retry to run, one credit (the retry's), the record",
			runs, l.balance(t, "alice"), l.remembered(t, "pay-1"))
	}
}

// TestSubscriberTxDeadLetteredAttemptLeavesNothing: a dead-letter middleware
// acks a failed delivery, so the subscriber commits its transaction. The
// failed attempt (an error or a panic, after a write) must leave neither its
// write nor its record, so that a redrive of the message runs.
func TestSubscriberTxDeadLetteredAttemptLeavesNothing(t *testing.T) {
	t.Parallel()
	for _, fault := range []string{"error", "panic"} {
		t.Run(fault, func(t *testing.T) {
			l := newLedgerDB(t)
			tx, opts := subscriberTx(t, l)
			runs := 0
			h := idempotency.Middleware(l.store, opts...)(noProduce(func(msg *message.Message) error {
				runs++
				if err := l.credit(msg); err != nil {
					return err
				}
				if runs == 1 && fault == "panic" {
					panic("bug after the write")
				}
				if runs == 1 {
					return errors.New("fails for good")
				}
				return nil
			}))
			func() {
				defer func() { _ = recover() }()
				if _, err := h(msgOf(envelopeWithID(t, "pay-1"))); err == nil {
					t.Error("the attempt did not fail")
				}
			}()
			if err := tx.Commit(); err != nil { // the dead-letter middleware acked it
				t.Fatal(err)
			}
			if l.balance(t, "alice") != 0 || l.remembered(t, "pay-1") {
				t.Fatalf("balance=%d remembered=%v after a dead-lettered attempt: want neither", l.balance(t, "alice"), l.remembered(t, "pay-1"))
			}
			// The redrive, in the next consuming transaction.
			tx2, opts2 := subscriberTx(t, l)
			h2 := idempotency.Middleware(l.store, opts2...)(noProduce(func(msg *message.Message) error {
				runs++
				return l.credit(msg)
			}))
			if _, err := h2(msgOf(envelopeWithID(t, "pay-1"))); err != nil {
				t.Fatal(err)
			}
			if err := tx2.Commit(); err != nil {
				t.Fatal(err)
			}
			if runs != 2 || l.balance(t, "alice") != 10 || !l.remembered(t, "pay-1") {
				t.Fatalf("runs=%d balance=%d: want the redrive to run once", runs, l.balance(t, "alice"))
			}
		})
	}
}

// TestSubscriberTxDeferredViolationFailsTheAttempt: an attempt whose write
// violates a DEFERRABLE INITIALLY DEFERRED foreign key fails in its own
// savepoint, as a handler failure (not transient), instead of at the
// subscriber's COMMIT of the whole batch; the transaction stays sound and
// the retry commits. The check leaves the transaction as it was: its
// constraint modes unchanged for later statements (deferred ones deferred,
// deferrable immediate ones immediate), the checks that passed
// checked again at COMMIT (not lost: a constraint trigger that passed
// during the attempt fails the COMMIT when what it reads has changed since),
// and what a check wrote in the attempt's check undone (a constraint
// trigger that logs each row it passes logs it once).
func TestSubscriberTxDeferredViolationFailsTheAttempt(t *testing.T) {
	t.Parallel()
	for _, after := range []string{"commit", "flag, then commit"} {
		t.Run(after, func(t *testing.T) {
			l := newLedgerDB(t)
			// A deferred constraint trigger on the audit table: it fails
			// while a flag row exists, and logs each row it passes.
			ddl := fmt.Sprintf(`CREATE TABLE %[1]s_flag (x int); CREATE TABLE %[1]s_log (account text);
				CREATE TABLE %[1]s_imm (v int UNIQUE DEFERRABLE INITIALLY IMMEDIATE);
				CREATE FUNCTION %[1]s_check() RETURNS trigger LANGUAGE plpgsql AS $$
				BEGIN IF EXISTS (SELECT 1 FROM %[1]s_flag) THEN RAISE EXCEPTION 'flagged'; END IF;
				INSERT INTO %[1]s_log VALUES (NEW.account); RETURN NULL; END $$;
				CREATE CONSTRAINT TRIGGER %[1]s_ct AFTER INSERT ON %[1]s_audit DEFERRABLE INITIALLY DEFERRED
				FOR EACH ROW EXECUTE FUNCTION %[1]s_check()`, l.ledger)
			if _, err := l.db.Exec(ddl); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				_, _ = l.db.Exec(fmt.Sprintf(`DROP TABLE IF EXISTS %[1]s_flag, %[1]s_log, %[1]s_imm; DROP FUNCTION IF EXISTS %[1]s_check() CASCADE`, l.ledger))
			})
			tx, opts := subscriberTx(t, l)
			runs := 0
			h := idempotency.Middleware(l.store, opts...)(noProduce(func(msg *message.Message) error {
				runs++
				tx, _ := postgresstore.TxFromContext(msg.Context())
				if err := l.credit(msg); err != nil {
					return err
				}
				account := "alice"
				if runs == 1 {
					account = "nobody" // violates the deferred foreign key
				}
				_, err := tx.ExecContext(msg.Context(), `INSERT INTO `+l.ledger+`_audit VALUES ($1)`, account)
				return err
			}))
			msg := msgOf(envelopeWithID(t, "pay-1"))
			_, err := h(msg)
			if err == nil || idempotency.IsTransient(err) || idempotency.IsPermanent(err) || !strings.Contains(err.Error(), "foreign key") {
				t.Fatalf("the violating attempt: %v; want it failed as a handler failure, naming the violation", err)
			}
			if _, err := h(msg); err != nil { // the retry, in the same transaction
				t.Fatalf("the retry: %v", err)
			}
			if after == "flag, then commit" {
				if _, err := tx.Exec(`INSERT INTO ` + l.ledger + `_flag VALUES (1)`); err != nil {
					t.Fatal(err)
				}
				if err := tx.Commit(); err == nil || !strings.Contains(err.Error(), "flagged") {
					t.Fatalf("COMMIT after the check's input changed: %v; want the trigger that passed in the attempt to fail it", err)
				}
				return
			}
			// The constraint modes are as they were: the deferred foreign
			// key still deferred, a deferrable but immediate unique
			// constraint still immediate.
			if _, err := tx.Exec(`INSERT INTO ` + l.ledger + `_audit VALUES ('nobody-yet')`); err != nil {
				t.Fatalf("the foreign key is no longer deferred after the attempt: %v", err)
			}
			if _, err := tx.Exec(`DELETE FROM ` + l.ledger + `_audit WHERE account = 'nobody-yet'`); err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(`SAVEPOINT immediate; INSERT INTO ` + l.ledger + `_imm VALUES (1), (1)`); err == nil {
				t.Fatal("the immediate unique constraint was deferred by the attempt's check")
			}
			if _, err := tx.Exec(`ROLLBACK TO SAVEPOINT immediate`); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			var logged int
			if err := l.db.QueryRow(`SELECT count(*) FROM ` + l.ledger + `_log WHERE account = 'alice'`).Scan(&logged); err != nil {
				t.Fatal(err)
			}
			if runs != 2 || l.balance(t, "alice") != 10 || !l.remembered(t, "pay-1") || logged != 1 {
				t.Fatalf("runs=%d balance=%d remembered=%v logged=%d: want the retry's credit and record, its row logged once",
					runs, l.balance(t, "alice"), l.remembered(t, "pay-1"), logged)
			}
		})
	}
}

// TestSubscriberTxConflictRollsBackTheTransaction: in a REPEATABLE READ
// subscriber transaction (watermill-sql's), the handler updates a row
// another transaction changed since the snapshot: a serialization failure,
// which every retry in that snapshot meets again. The attempt fails
// transient (ErrStore, never dead-lettered) and the subscriber's
// transaction is rolled back; the next attempt in it (Retry's, or the
// subscriber's resend) does not run the handler and succeeds, so that the
// subscriber acks, its commit fails and the message is read again in a
// fresh transaction.
func TestSubscriberTxConflictRollsBackTheTransaction(t *testing.T) {
	t.Parallel()
	l := newLedgerDB(t)
	ctx := context.Background()
	tx, err := l.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback() })
	var b int64
	if err := tx.QueryRow(`SELECT balance FROM ` + l.ledger + ` WHERE account = 'alice'`).Scan(&b); err != nil { // the snapshot
		t.Fatal(err)
	}
	if _, err := l.db.Exec(`UPDATE ` + l.ledger + ` SET balance = 5 WHERE account = 'alice'`); err != nil {
		t.Fatal(err)
	}
	runs := 0
	h := idempotency.Middleware(l.store, idempotency.WithTransaction(l.db),
		idempotency.WithSubscriberTx(func(context.Context) (*sql.Tx, bool) { return tx, true }))(noProduce(func(msg *message.Message) error {
		runs++
		return l.credit(msg)
	}))
	msg := msgOf(envelopeWithID(t, "pay-1"))
	_, err = h(msg)
	if !idempotency.IsTransient(err) || !sqlstate.Is(err, sqlstate.SerializationFailure) {
		t.Fatalf("the conflicting attempt: %v; want a transient error carrying the serialization failure", err)
	}
	if _, err := h(msg); err != nil || runs != 1 {
		t.Fatalf("the next attempt in the same transaction: %v after %d runs; want success without running", err, runs)
	}
	if err := tx.Commit(); !errors.Is(err, sql.ErrTxDone) {
		t.Fatalf("the subscriber's commit: %v; want sql.ErrTxDone (rolled back)", err)
	}
	if l.balance(t, "alice") != 5 || l.remembered(t, "pay-1") {
		t.Fatal("the conflicting attempt left its effect or its record behind")
	}
}

// recordingOutbox is an outbox publisher writing rows into the ledger's
// audit table of the transaction it is bound to.
func recordingOutbox(l *ledgerDB, fail error) func(*sql.Tx) (message.Publisher, error) {
	return func(tx *sql.Tx) (message.Publisher, error) { return txPublisher{tx: tx, l: l, fail: fail}, nil }
}

type txPublisher struct {
	tx   *sql.Tx
	l    *ledgerDB
	fail error
}

func (p txPublisher) Publish(_ string, msgs ...*message.Message) error {
	if p.fail != nil {
		return p.fail
	}
	for _, m := range msgs {
		if _, err := p.tx.ExecContext(m.Context(), `INSERT INTO `+p.l.ledger+` VALUES ($1, 0)`, "outbox:"+m.UUID); err != nil {
			return err
		}
	}
	return nil
}

func (txPublisher) Close() error { return nil }

func (l *ledgerDB) outboxRows(t *testing.T) int {
	t.Helper()
	var n int
	if err := l.db.QueryRow(`SELECT count(*) FROM ` + l.ledger + ` WHERE account LIKE 'outbox:%'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func producing(l *ledgerDB, fail error) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if err := l.credit(msg); err != nil {
			return nil, err
		}
		if fail != nil {
			return nil, fail
		}
		return []*message.Message{msgOf([]byte(`{}`))}, nil
	}
}

// deliverWithPublishTopic delivers payload once through a router whose
// handler publishes to topic "follow" (or calls it directly, with no publish
// topic), with mw
// around h, and returns what mw returned. The router publishes nothing.
func deliverWithPublishTopic(t *testing.T, publishTopic bool, mw message.HandlerMiddleware, h message.HandlerFunc, payload []byte) ([]*message.Message, error) {
	t.Helper()
	type result struct {
		produced []*message.Message
		err      error
	}
	results := make(chan result, 1)
	r := newRouter(t)
	r.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			produced, err := h(msg)
			results <- result{produced, err}
			return nil, nil
		}
	}, mw)
	pubsub := newPubSub()
	if !publishTopic { // a direct call: no router, no publish topic
		return mw(h)(msgOf(payload))
	}
	r.AddHandler("h", "in", pubsub, "follow", pubsub, h)
	stop := testenv.RunRouter(t, r)
	defer stop()
	if err := pubsub.Publish("in", msgOf(payload)); err != nil {
		t.Fatal(err)
	}
	select {
	case res := <-results:
		return res.produced, res.err
	case <-time.After(10 * time.Second):
		t.Fatal("no delivery")
		return nil, nil
	}
}

// TestTransactionOutbox: produced messages are written to the outbox in the
// delivery's transaction and none is returned to the router; they commit
// with the effect and the record, or not at all.
func TestTransactionOutbox(t *testing.T) {
	t.Parallel()
	t.Run("commits with the effect", func(t *testing.T) {
		l := newLedgerDB(t)
		mw := idempotency.Middleware(l.store, idempotency.WithTransaction(l.db), idempotency.WithOutbox(recordingOutbox(l, nil)))
		produced, err := deliverWithPublishTopic(t, true, mw, producing(l, nil), envelopeWithID(t, "pay-1"))
		if err != nil || len(produced) != 0 {
			t.Fatalf("produced=%d err=%v: want none for the router, no error", len(produced), err)
		}
		if l.balance(t, "alice") != 10 || !l.remembered(t, idempotency.Key("h", "pay-1")) || l.outboxRows(t) != 1 {
			t.Fatalf("balance=%d outbox=%d: want the effect, the record and one outbox row", l.balance(t, "alice"), l.outboxRows(t))
		}
	})
	for name, c := range map[string]struct {
		opts  func(l *ledgerDB) []idempotency.Option
		topic bool
		want  error
	}{
		"no outbox": {func(l *ledgerDB) []idempotency.Option { return nil }, true, idempotency.ErrNoOutbox},
		"no publish topic": {func(l *ledgerDB) []idempotency.Option {
			return []idempotency.Option{idempotency.WithOutbox(recordingOutbox(l, nil))}
		}, false, idempotency.ErrNoPublishTopic},
		"outbox fails": {func(l *ledgerDB) []idempotency.Option {
			return []idempotency.Option{idempotency.WithOutbox(recordingOutbox(l, errDisk))}
		}, true, errDisk},
	} {
		t.Run(name, func(t *testing.T) {
			l := newLedgerDB(t)
			mw := idempotency.Middleware(l.store, append(c.opts(l), idempotency.WithTransaction(l.db))...)
			produced, err := deliverWithPublishTopic(t, c.topic, mw, producing(l, nil), envelopeWithID(t, "pay-1"))
			if !errors.Is(err, c.want) || len(produced) != 0 {
				t.Fatalf("produced=%d err=%v, want %v", len(produced), err, c.want)
			}
			if l.balance(t, "alice") != 0 || l.remembered(t, idempotency.Key("h", "pay-1")) || l.remembered(t, "pay-1") || l.outboxRows(t) != 0 {
				t.Fatal("a delivery whose produced messages could not be written left something behind")
			}
		})
	}
}

var errDisk = errors.New("outbox write failed")

// TestOutboxFromContext: the handler can publish to the outbox itself.
func TestOutboxFromContext(t *testing.T) {
	t.Parallel()
	l := newLedgerDB(t)
	h := idempotency.Middleware(l.store, idempotency.WithTransaction(l.db), idempotency.WithOutbox(recordingOutbox(l, nil)))(noProduce(func(msg *message.Message) error {
		outbox, ok := idempotency.OutboxFromContext(msg.Context())
		if !ok {
			return errors.New("no outbox in the handler's context")
		}
		if err := outbox.Publish("elsewhere", msgOf([]byte(`{}`))); err != nil {
			return err
		}
		return errors.New("fails after publishing")
	}))
	if _, err := h(msgOf(envelopeWithID(t, "pay-1"))); err == nil {
		t.Fatal("no error")
	}
	if l.outboxRows(t) != 0 {
		t.Fatal("a failed delivery's outbox row was committed")
	}
	if _, ok := idempotency.OutboxFromContext(context.Background()); ok {
		t.Fatal("an outbox in an empty context")
	}
}
