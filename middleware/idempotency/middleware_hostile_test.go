package idempotency_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestHostileTransactionalFailOpenStillRunsInATransaction: under
// WithTransaction a handler writes through postgresstore.TxFromContext. A
// message without identity that fails open must still find the transaction
// there (without a record): before, it ran with none, so the inbox handler
// failed ("no transaction") on every delivery and the message, never
// handled, was retried and dead-lettered.
func TestHostileTransactionalFailOpenStillRunsInATransaction(t *testing.T) {
	t.Parallel()
	forEachTxMode(t, failOpenStillRunsInATransaction)
}

func failOpenStillRunsInATransaction(t *testing.T, l *ledgerDB, store stores.Store, mode idempotency.Option) {
	runs := 0
	h := idempotency.Middleware(store, mode)(noProduce(func(msg *message.Message) error {
		runs++
		return l.credit(msg)
	}))
	for i := range 2 {
		if _, err := h(msgOf([]byte(`{"not":"an envelope"}`))); err != nil {
			t.Fatalf("delivery %d of a message without identity: %v", i, err)
		}
	}
	if runs != 2 || l.balance(t, "alice") != 20 {
		t.Fatalf("runs=%d balance=%d: want 2 runs (fail open: no deduplication), both credits committed", runs, l.balance(t, "alice"))
	}
}

// TestHostileTransactionalFailOpenRollsBackOnError: the transaction of a
// message that fails open commits only when its handler succeeds, as for an
// identified one.
func TestHostileTransactionalFailOpenRollsBackOnError(t *testing.T) {
	t.Parallel()
	forEachTxMode(t, failOpenRollsBackOnError)
}

func failOpenRollsBackOnError(t *testing.T, l *ledgerDB, store stores.Store, mode idempotency.Option) {
	fail := errors.New("declined")
	h := idempotency.Middleware(store, mode)(noProduce(func(msg *message.Message) error {
		if err := l.credit(msg); err != nil {
			return err
		}
		return fail
	}))
	if _, err := h(msgOf([]byte("not json"))); !errors.Is(err, fail) {
		t.Fatalf("err = %v, want the handler's", err)
	}
	if b := l.balance(t, "alice"); b != 0 {
		t.Fatalf("balance %d after a failed fail-open delivery, want its write rolled back", b)
	}
}

// TestHostileTransactionalFailOpenProducesIntoTheOutbox: under WithOutbox a
// handler's returned messages go to the outbox in the delivery's
// transaction, for messages without identity too; none reaches the router
// (before: returned to the router, published outside any transaction).
func TestHostileTransactionalFailOpenProducesIntoTheOutbox(t *testing.T) {
	t.Parallel()
	l := newLedgerDB(t)
	mw := idempotency.Middleware(l.store, idempotency.WithTransaction(l.db), idempotency.WithOutbox(recordingOutbox(l, nil)))
	produced, err := deliverWithPublishTopic(t, true, mw, producing(l, nil), []byte("not an envelope"))
	if err != nil || len(produced) != 0 || l.outboxRows(t) != 1 || l.balance(t, "alice") != 10 {
		t.Fatalf("err=%v, %d returned to the router, %d outbox rows, balance %d; want none returned, 1 row, 10",
			err, len(produced), l.outboxRows(t), l.balance(t, "alice"))
	}
}

// TestHostileParkWaitEndsAtRouterClose: a copy waiting on a claim held
// elsewhere (a long park wait) does not hold up the router's shutdown: its
// message context ends at Close, and the copy is parked then.
func TestHostileParkWaitEndsAtRouterClose(t *testing.T) {
	t.Parallel()
	store := memstore.New()
	other := stores.WithClaimToken(context.Background(), "another-worker")
	if ok, _, err := store.Claim(other, idempotency.Key("h", "held"), time.Hour); err != nil || !ok {
		t.Fatal(ok, err)
	}
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	var entered atomic.Int32
	var parked atomic.Value
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			entered.Add(1)
			out, err := h(msg)
			if err != nil {
				parked.Store(err)
			}
			return out, err
		}
	}, idempotency.Middleware(store, idempotency.WithParkWait(time.Hour)))
	router.AddConsumerHandler("h", "topic", pubsub, func(*message.Message) error { return nil })
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	<-router.Running()
	if err := pubsub.Publish("topic", msgOf(envelopeWithID(t, "held"))); err != nil {
		t.Fatal(err)
	}
	for entered.Load() == 0 {
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond) // the copy waits on the claim
	start := time.Now()
	closed := make(chan error, 1)
	go func() { closed <- router.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("router.Close: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("router.Close still waiting after 10s on a copy in its park wait")
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("router.Close took %v with a copy in its park wait", took)
	}
	<-done
	if err, _ := parked.Load().(error); err != nil && !errors.Is(err, idempotency.ErrInFlight) {
		t.Fatalf("the waiting copy ended with %v, want ErrInFlight", err)
	}
}

// TestHostileClaimTokenSurvivesWrappers: a store wrapper that adds values
// to the context (tracing, logging) keeps the delivery's holder: two copies
// of one message through the wrapper never both run, and a failure releases
// the claim so that the next copy runs at once.
func TestHostileClaimTokenSurvivesWrappers(t *testing.T) {
	t.Parallel()
	inner := memstore.New()
	store := valueAddingStore{Store: inner}
	var runs atomic.Int32
	release := make(chan struct{})
	fail := errors.New("declined")
	var failing atomic.Bool
	h := idempotency.Middleware(store, idempotency.WithParkWait(0))(func(*message.Message) ([]*message.Message, error) {
		runs.Add(1)
		if failing.Load() {
			return nil, fail
		}
		<-release
		return nil, nil
	})
	payload := envelopeWithID(t, "wrapped")
	errs := make(chan error, 1)
	go func() { _, err := h(msgOf(payload)); errs <- err }()
	for runs.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	if _, err := h(msgOf(payload)); !errors.Is(err, idempotency.ErrInFlight) {
		t.Fatalf("second copy through the wrapper: %v, want ErrInFlight (the first holds the claim)", err)
	}
	close(release)
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
	failing.Store(true)
	other := envelopeWithID(t, "wrapped-fails")
	if _, err := h(msgOf(other)); !errors.Is(err, fail) {
		t.Fatal(err)
	}
	if r, err := inner.Lookup(context.Background(), "wrapped-fails"); err != nil || r.State != stores.StateUnknown {
		t.Fatalf("after a failed run through the wrapper the key is %v (%v), want its claim released", r.State, err)
	}
}

type wrapperKey struct{}

// valueAddingStore adds a value to the context of every call, as a tracing
// wrapper does, and re-wraps the token with stores.WithClaimToken(ctx,
// stores.ClaimToken(ctx)) on Claim.
type valueAddingStore struct{ stores.Store }

func (s valueAddingStore) Claim(ctx context.Context, key string, lease time.Duration) (bool, stores.Record, error) {
	ctx = stores.WithClaimToken(context.WithValue(ctx, wrapperKey{}, "span"), stores.ClaimToken(ctx))
	return s.Store.Claim(ctx, key, lease)
}

func (s valueAddingStore) Release(ctx context.Context, key string) error {
	return s.Store.Release(context.WithValue(ctx, wrapperKey{}, "span"), key)
}

// TestHostileDuplicatorWithAProducingHandler: Watermill's Duplicator
// ("processing messages twice, to ensure that the endpoint is idempotent")
// outside the guard calls it twice with the same message. A handler that
// returns messages runs once: the second call is a duplicate of the first,
// whose record waits for the router's ack. Before, the second call found
// the first's claim in flight, was parked (ErrInFlight), the router nacked,
// the first's claim was released, and the message came back for ever: the
// handler ran on every redelivery (dozens of runs in 3 s).
func TestHostileDuplicatorWithAProducingHandler(t *testing.T) {
	t.Parallel()
	for name, opts := range map[string][]idempotency.Option{
		"claims":   {idempotency.WithParkWait(50 * time.Millisecond)},
		"seen-set": {idempotency.WithoutClaim()},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			store := memstore.New()
			pubsub := newPubSub()
			r := newRouter(t)
			r.AddMiddleware(middleware.Duplicator, idempotency.Middleware(store, opts...))
			var runs atomic.Int32
			r.AddHandler("h", "in", pubsub, "out", pubsub, func(msg *message.Message) ([]*message.Message, error) {
				runs.Add(1)
				return []*message.Message{msgOf([]byte("follow-up"))}, nil
			})
			out, err := pubsub.Subscribe(context.Background(), "out")
			if err != nil {
				t.Fatal(err)
			}
			testenv.RunRouter(t, r)
			if err := pubsub.Publish("in", msgOf(envelopeWithID(t, "dup-1"))); err != nil {
				t.Fatal(err)
			}
			var followUps atomic.Int32
			go func() {
				for m := range out {
					followUps.Add(1)
					m.Ack()
				}
			}()
			time.Sleep(3 * time.Second)
			if n := runs.Load(); n != 1 {
				t.Fatalf("the handler ran %d times for one message under Duplicator, want 1", n)
			}
			if n := followUps.Load(); n != 1 {
				t.Fatalf("%d follow-ups published, want 1", n)
			}
			if rec, err := store.Lookup(context.Background(), idempotency.Key("h", "dup-1")); err != nil || !rec.Remembered() {
				t.Fatalf("the message is %v (%v) after its ack, want remembered", rec.State, err)
			}
		})
	}
}

// TestHostileSubMillisecondLeaseIsRefusedByNew: every shipped store
// but memstore refuses a claim lease under a millisecond (their unit), so
// such a lease would fail every delivery with the transient ErrStore, for
// ever (never dead-lettered, never run). New refuses it instead.
func TestHostileSubMillisecondLeaseIsRefusedByNew(t *testing.T) {
	t.Parallel()
	for _, lease := range []time.Duration{time.Nanosecond, 999 * time.Microsecond} {
		if _, err := idempotency.New(memstore.New(), idempotency.WithClaim(lease)); err == nil {
			t.Errorf("New with WithClaim(%v): no error, want the lease refused (stores keep leases in milliseconds)", lease)
		}
	}
	if _, err := idempotency.New(memstore.New(), idempotency.WithClaim(time.Millisecond)); err != nil {
		t.Fatalf("New with WithClaim(1ms): %v", err)
	}
}

// TestHostileFailOpenWithoutUUIDIsLoggedEveryTime: messages with no
// Watermill UUID (watermill-kafka's unmarshaler gives "" to a message a
// producer other than Watermill wrote) cannot be told apart, so each is
// logged at info: distinct messages without identity are never hidden at
// debug. Before, the first was logged at info and every later one at
// debug, for the life of the process (1 info line for 5 distinct
// messages).
func TestHostileFailOpenWithoutUUIDIsLoggedEveryTime(t *testing.T) {
	t.Parallel()
	logger := watermill.NewCaptureLogger()
	h := idempotency.Middleware(memstore.New(), idempotency.WithLogger(logger))(counting(new(int), nil))
	for i := range 5 {
		_, _ = h(message.NewMessage("", []byte(fmt.Sprintf("plain body %d", i))))
	}
	info := 0
	for _, l := range logger.Captured()[watermill.InfoLogLevel] {
		if l.Msg == "Message has no usable identity; handled without deduplication" {
			info++
		}
	}
	if info != 5 {
		t.Fatalf("%d info lines for 5 distinct messages without identity nor UUID, want 5", info)
	}
}

// TestHostileOptionsOfAnotherModeAreRefused: New refuses options that
// cannot work in the mode the others choose (the README: "options of the
// transactional mode without it" are refused), instead of ignoring them:
// WithTxOptions or WithTxRetries without WithTransaction (a serializable
// isolation the code asks for would silently not apply: the handler runs
// in the claim mode, with no transaction), and WithParkWait where nothing
// is ever parked (WithoutClaim, WithTransaction). Before, all four were
// accepted.
func TestHostileOptionsOfAnotherModeAreRefused(t *testing.T) {
	t.Parallel()
	l := newLedgerDB(t)
	for name, opts := range map[string][]idempotency.Option{
		"WithTxOptions without WithTransaction": {idempotency.WithTxOptions(&sql.TxOptions{Isolation: sql.LevelSerializable})},
		"WithTxRetries without WithTransaction": {idempotency.WithTxRetries(10)},
		"WithParkWait with WithoutClaim":        {idempotency.WithoutClaim(), idempotency.WithParkWait(time.Second)},
		"WithParkWait with WithTransaction":     {idempotency.WithTransaction(l.db), idempotency.WithParkWait(time.Second)},
	} {
		if _, err := idempotency.New(l.store, opts...); err == nil {
			t.Errorf("%s: accepted, want New to refuse it", name)
		}
	}
	for name, opts := range map[string][]idempotency.Option{
		"transactional": {idempotency.WithTransaction(l.db), idempotency.WithTxRetries(10),
			idempotency.WithTxOptions(&sql.TxOptions{Isolation: sql.LevelSerializable})},
		"claims": {idempotency.WithClaim(time.Minute), idempotency.WithParkWait(0)},
	} {
		if _, err := idempotency.New(l.store, opts...); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// TestHostileRollingDeployToTheTransactionalMode: during a rolling deploy
// from the claim mode (the default) to WithTransaction on one
// postgresstore table, a copy reaching a new worker while an old worker
// runs the message (its claim live) must not run: it is parked
// (ErrInFlight) and comes back once the old worker remembered it. Before,
// the record's statement took the live claim over and the copy ran too:
// two effects for one message.
func TestHostileRollingDeployToTheTransactionalMode(t *testing.T) {
	t.Parallel()
	forEachTxMode(t, rollingDeployToTheTransactionalMode)
}

func rollingDeployToTheTransactionalMode(t *testing.T, l *ledgerDB, store stores.Store, mode idempotency.Option) {
	started, release := make(chan struct{}), make(chan struct{})
	old := idempotency.Middleware(l.store, idempotency.WithScope("payments"))(noProduce(func(msg *message.Message) error {
		close(started)
		<-release
		_, err := l.db.ExecContext(context.Background(), `UPDATE `+l.ledger+` SET balance = balance + 10 WHERE account = 'alice'`)
		return err
	}))
	updated := idempotency.Middleware(store, idempotency.WithScope("payments"), mode)(noProduce(l.credit))
	payload := envelopeWithID(t, "pay-rolling")
	oldDone := make(chan error, 1)
	go func() { _, err := old(msgOf(payload)); oldDone <- err }()
	<-started
	_, err := updated(msgOf(payload))
	close(release)
	if oerr := <-oldDone; oerr != nil {
		t.Fatal(oerr)
	}
	if !errors.Is(err, idempotency.ErrInFlight) || !idempotency.IsTransient(err) {
		t.Errorf("the copy on the transactional worker while the old worker ran it: err = %v, want a transient ErrInFlight", err)
	}
	if _, err := updated(msgOf(payload)); err != nil {
		t.Fatalf("the redelivery after the old worker remembered it: %v", err)
	}
	if b := l.balance(t, "alice"); b != 10 {
		t.Fatalf("balance %d after one payment handled by an old and a new worker, want 10 (one effect)", b)
	}
}
