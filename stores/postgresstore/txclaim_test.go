package postgresstore_test

import (
	"bufio"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/storetest"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// newTxStore is newStore with claims held in transactions, and a check, when
// the test ends, that none of them is left open (idle in transaction).
func newTxStore(t testing.TB, db *sql.DB, opts ...postgresstore.Option) *postgresstore.Store {
	t.Helper()
	s := newStore(t, db, append([]postgresstore.Option{postgresstore.WithTransactionClaims()}, opts...)...)
	t.Cleanup(func() {
		if err := s.ReleaseAll(context.Background()); err != nil {
			t.Error(err)
		}
		noneIdleInTransaction(t, s.Table())
	})
	return s
}

// noneIdleInTransaction fails t if a session whose last statement named
// table is still idle in a transaction, once claims a test left on purpose
// had their leases to lapse.
func noneIdleInTransaction(t testing.TB, table string) {
	t.Helper()
	db, err := sql.Open("pgx", testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN))
	if err != nil {
		t.Error(err)
		return
	}
	defer db.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		var n int
		var seen sql.NullString
		err := db.QueryRow(`SELECT count(*), string_agg(pid || ': ' || left(query, 120), '; ') FROM pg_stat_activity
			WHERE state LIKE 'idle in transaction%' AND position($1 in query) > 0`, table).Scan(&n, &seen)
		if err != nil {
			t.Error(err)
			return
		}
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("%d sessions left idle in a transaction on %s: %s", n, table, seen.String)
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestTxClaimsContract(t *testing.T) {
	t.Parallel() // on a table and a pool of its own
	db := testenv.Postgres(t)
	db.SetMaxOpenConns(80) // the 64-way claim race: 64 claimers waiting at once
	runTxContract(t, db)
}

func TestTxClaimsContractOnLibPQ(t *testing.T) {
	if testing.Short() {
		t.Skip("the transaction claims' contract again through lib/pq")
	}
	db := testenv.PostgresWithDriver(t, "postgres")
	db.SetMaxOpenConns(80)
	runTxContract(t, db)
}

// contractClaimWait is the claim wait of the stores the contract suite
// runs on (the default wait is the other tests').
const contractClaimWait = 50 * time.Millisecond

func runTxContract(t *testing.T, db *sql.DB) {
	storetest.Run(t,
		func(t *testing.T) stores.Store {
			return newTxStore(t, db, postgresstore.WithClaimWait(contractClaimWait))
		},
		storetest.WithTTLStore(func(t *testing.T, ttl time.Duration) stores.Store {
			return newTxStore(t, db, postgresstore.WithTTL(ttl), postgresstore.WithClaimWait(contractClaimWait))
		}),
		storetest.WithSecondInstance(func(t *testing.T, s stores.Store) stores.Store {
			second, err := postgresstore.New(testenv.Postgres(t), postgresstore.WithTable(s.(*postgresstore.Store).Table()), postgresstore.WithTransactionClaims(),
				postgresstore.WithClaimWait(contractClaimWait))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = second.ReleaseAll(context.Background()) })
			return second
		}),
		// A claim of another holder is waited for (the claim wait) before
		// it is reported in flight; the suite's checks "within the lease"
		// make a few such claims and need a lease well past their waits.
		storetest.WithShortLease(20*contractClaimWait),
		storetest.WithTxDB(db))
}

func TestTxClaimsOptions(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	for name, opts := range map[string][]postgresstore.Option{
		"negative wait":         {postgresstore.WithTransactionClaims(), postgresstore.WithClaimWait(-time.Second)},
		"wait without the mode": {postgresstore.WithClaimWait(time.Second)},
	} {
		if _, err := postgresstore.New(db, opts...); !errors.Is(err, postgresstore.ErrInvalidOption) {
			t.Errorf("%s: New = %v, want ErrInvalidOption", name, err)
		}
	}
}

// orderMessage returns a message carrying an envelope of its own.
func orderMessage(t testing.TB) *message.Message {
	t.Helper()
	e, err := envelope.New("urn:babel:orders:created", map[string]any{"order": 1})
	if err != nil {
		t.Fatal(err)
	}
	payload, err := e.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	return message.NewMessage(watermill.NewUUID(), payload)
}

// TestTxClaimConcurrentCopyWaitsThenIsParked: a copy of a message whose
// first delivery runs waits on the claim's row for the park wait, and is
// parked; once the first delivery committed, a later copy is skipped.
func TestTxClaimConcurrentCopyWaitsThenIsParked(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	s := newTxStore(t, db, postgresstore.WithClaimWait(100*time.Millisecond))
	const parkWait = 400 * time.Millisecond
	running, finish := make(chan struct{}), make(chan struct{})
	var runs atomic.Int32
	h := idempotency.Middleware(s, idempotency.WithParkWait(parkWait))(func(*message.Message) ([]*message.Message, error) {
		if runs.Add(1) == 1 {
			close(running)
			<-finish
		}
		return nil, nil
	})
	msg := orderMessage(t)
	first := make(chan error, 1)
	go func() {
		_, err := h(msg.Copy())
		first <- err
	}()
	<-running
	start := time.Now()
	_, err := h(msg.Copy())
	took := time.Since(start)
	if !errors.Is(err, idempotency.ErrInFlight) {
		t.Fatalf("a copy while the first delivery runs: %v, want ErrInFlight", err)
	}
	if took < parkWait || took > parkWait+3*time.Second {
		t.Fatalf("the copy was parked after %v, want after the park wait of %v (and a bounded wait more)", took, parkWait)
	}
	close(finish)
	if err := <-first; err != nil {
		t.Fatalf("first delivery: %v", err)
	}
	if _, err := h(msg.Copy()); err != nil || runs.Load() != 1 {
		t.Fatalf("a copy after the first committed: %v, %d runs; want skipped, 1 run", err, runs.Load())
	}
	if r, err := s.Lookup(context.Background(), idempotency.Key("", mustID(t, msg))); err != nil || !r.Remembered() {
		t.Fatalf("Lookup after the commit = %v, %v; want remembered", r.State, err)
	}
}

// TestTxClaimCopyFindsTheCommitAtOnce: copies waiting on the claim (one in
// another worker, on the claim's row; one in this process, on the claim
// itself) learn of the commit when it happens, not at the end of their
// wait, and find the record with its fingerprint.
func TestTxClaimCopyFindsTheCommitAtOnce(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	s := newTxStore(t, db, postgresstore.WithClaimWait(10*time.Second))
	other := newTxStore(t, testenv.Postgres(t), postgresstore.WithTable(s.Table()), postgresstore.WithClaimWait(10*time.Second))
	ctx := context.Background()
	a := stores.WithClaimToken(ctx, "a")
	if ok, _, err := s.Claim(a, "k", time.Minute); err != nil || !ok {
		t.Fatalf("Claim = %v, %v", ok, err)
	}
	type result struct {
		who   string
		ok    bool
		found stores.Record
		err   error
		at    time.Time
	}
	done := make(chan result, 2)
	for who, store := range map[string]*postgresstore.Store{"another worker": other, "this process": s} {
		go func() {
			ok, found, err := store.Claim(stores.WithClaimToken(ctx, "b"), "k", time.Minute)
			done <- result{who, ok, found, err, time.Now()}
		}()
	}
	waitForLockWaiter(t, db, s.Table())
	if err := s.Remember(a, "k", 0xfeed, nil); err != nil {
		t.Fatal(err)
	}
	committed := time.Now()
	for range 2 {
		r := <-done
		if r.err != nil || r.ok || !r.found.Remembered() || r.found.Fingerprint != 0xfeed {
			t.Fatalf("the waiting Claim in %s = %v, %+v, %v; want the remembered record with its fingerprint", r.who, r.ok, r.found, r.err)
		}
		if late := r.at.Sub(committed); late > 2*time.Second {
			t.Fatalf("the waiting Claim in %s returned %v after the commit, want at once", r.who, late)
		}
	}
}

func mustID(t testing.TB, msg *message.Message) string {
	t.Helper()
	e, err := envelope.Parse(msg.Payload)
	if err != nil {
		t.Fatal(err)
	}
	return e.Meta.ID
}

// TestTxClaimFailedHandlerRollsBack: a handler's error rolls the claim back:
// no row is left, nothing stays open, and the redelivery runs at once.
func TestTxClaimFailedHandlerRollsBack(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	s := newTxStore(t, db)
	var runs atomic.Int32
	boom := errors.New("boom")
	h := idempotency.Middleware(s, idempotency.WithParkWait(0))(func(*message.Message) ([]*message.Message, error) {
		if runs.Add(1) == 1 {
			return nil, boom
		}
		return nil, nil
	})
	msg := orderMessage(t)
	if _, err := h(msg.Copy()); !errors.Is(err, boom) {
		t.Fatalf("first delivery: %v, want the handler's error", err)
	}
	var rows int
	if err := db.QueryRow(`SELECT count(*) FROM ` + s.Table()).Scan(&rows); err != nil || rows != 0 {
		t.Fatalf("rows after a failed handler: %d, %v; want 0", rows, err)
	}
	noneIdleInTransaction(t, s.Table())
	if _, err := h(msg.Copy()); err != nil || runs.Load() != 2 {
		t.Fatalf("redelivery: %v after %d runs; want it to run at once", err, runs.Load())
	}
	if err := db.QueryRow(`SELECT count(*) FROM ` + s.Table() + ` WHERE claim IS NULL`).Scan(&rows); err != nil || rows != 1 {
		t.Fatalf("records after the redelivery succeeded: %d, %v; want 1", rows, err)
	}
}

// TestTxClaimTerminatedBackend: the claim's session is terminated
// (pg_terminate_backend): the claim is free at once for another holder, and
// the holder learns it: its Remember fails with ErrClaimLost, and writes
// nothing over the other's claim.
func TestTxClaimTerminatedBackend(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	s := newTxStore(t, db, postgresstore.WithClaimWait(50*time.Millisecond))
	other := newTxStore(t, testenv.Postgres(t), postgresstore.WithTable(s.Table()), postgresstore.WithClaimWait(50*time.Millisecond))
	ctx := context.Background()
	a, b := stores.WithClaimToken(ctx, "a"), stores.WithClaimToken(ctx, "b")
	if ok, _, err := s.Claim(a, "k", time.Minute); err != nil || !ok {
		t.Fatalf("Claim = %v, %v", ok, err)
	}
	if ok, found, err := other.Claim(b, "k", time.Minute); err != nil || ok || found.State != stores.StateInFlight {
		t.Fatalf("Claim by another worker while held = %v, %v, %v; want in flight", ok, found.State, err)
	}
	terminateHolder(t, db, s.Table())
	if took := claimWithin(t, other, b, "k", 2*time.Second); took > 2*time.Second {
		t.Fatalf("Claim by another worker %v after the holder's backend was terminated; want it taken within 2s", took)
	}
	err := s.Remember(a, "k", 1, nil)
	if !errors.Is(err, postgresstore.ErrClaimLost) {
		t.Fatalf("Remember by the holder whose backend was terminated: %v, want ErrClaimLost", err)
	}
	if err := s.Remember(a, "k", 1, nil); !errors.Is(err, stores.ErrClaimTaken) {
		t.Fatalf("Remember again by that holder while another worker holds the key: %v, want ErrClaimTaken (nothing written)", err)
	}
	if err := other.Remember(b, "k", 2, nil); err != nil {
		t.Fatal(err)
	}
	if r, err := s.Lookup(ctx, "k"); err != nil || r.Fingerprint != 2 {
		t.Fatalf("Lookup = %+v, %v; want the new holder's record (fingerprint 2)", r, err)
	}
}

// TestTxClaimPoolExhausted: claims that would take the pool's last
// connection are refused with ErrPoolExhausted at once, rather than wait
// for a connection handlers might need too.
func TestTxClaimPoolExhausted(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	db.SetMaxOpenConns(3)
	s := newTxStore(t, db)
	ctx := context.Background()
	for i := range 2 {
		if ok, _, err := s.Claim(stores.WithClaimToken(ctx, fmt.Sprint(i)), fmt.Sprint("k", i), time.Minute); err != nil || !ok {
			t.Fatalf("claim %d of a pool of 3: %v, %v", i, ok, err)
		}
	}
	start := time.Now()
	_, _, err := s.Claim(stores.WithClaimToken(ctx, "2"), "k2", time.Minute)
	if !errors.Is(err, postgresstore.ErrPoolExhausted) || time.Since(start) > time.Second {
		t.Fatalf("third claim on a pool of 3: %v after %v; want ErrPoolExhausted at once", err, time.Since(start))
	}
	if _, err := s.Lookup(ctx, "k9"); err != nil {
		t.Fatalf("a Lookup while two claims hold two connections of three: %v", err)
	}
	for i := range 2 {
		if err := s.Remember(stores.WithClaimToken(ctx, fmt.Sprint(i)), fmt.Sprint("k", i), 0, nil); err != nil {
			t.Fatal(err)
		}
	}
	if ok, _, err := s.Claim(stores.WithClaimToken(ctx, "2"), "k2", time.Minute); err != nil || !ok {
		t.Fatalf("a claim once the others committed: %v, %v", ok, err)
	}
	if err := s.Release(stores.WithClaimToken(ctx, "2"), "k2"); err != nil {
		t.Fatal(err)
	}
}

// TestTxClaimsOfTwoStoresLeaveTheHandlerAConnection: two stores with
// WithTransactionClaims on one pool of 4 connections (two handlers' tables,
// one *sql.DB). Once the first holds 3 claims (its 4th refused), the
// second's first claim is refused too: the claims of both never take the
// pool's last connection, and a handler's statement gets one within its
// deadline. Concurrent claims of both stores hold at most 3 of the 4.
// Before, each store counted only its own claims: the second store's first
// claim took the 4th connection and the handler's SELECT 1 waited out its
// deadline.
func TestTxClaimsOfTwoStoresLeaveTheHandlerAConnection(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	db.SetMaxOpenConns(4)
	a, b := newTxStore(t, db), newTxStore(t, db)
	ctx := context.Background()
	handler := func(when string) {
		t.Helper()
		hctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		var one int
		if err := db.QueryRowContext(hctx, `SELECT 1`).Scan(&one); err != nil {
			t.Fatalf("a handler's SELECT 1 %s: %v (in use: %d of %d)", when, err, db.Stats().InUse, db.Stats().MaxOpenConnections)
		}
	}
	for i := range 3 {
		if ok, _, err := a.Claim(stores.WithClaimToken(ctx, fmt.Sprint("a", i)), fmt.Sprint("k", i), time.Minute); err != nil || !ok {
			t.Fatalf("claim %d of the first store on a pool of 4: %v, %v", i, ok, err)
		}
	}
	if _, _, err := a.Claim(stores.WithClaimToken(ctx, "a3"), "k3", time.Minute); !errors.Is(err, postgresstore.ErrPoolExhausted) {
		t.Fatalf("the first store's 4th claim on a pool of 4: %v; want ErrPoolExhausted", err)
	}
	start := time.Now()
	ok, _, err := b.Claim(stores.WithClaimToken(ctx, "b0"), "k0", time.Minute)
	if !errors.Is(err, postgresstore.ErrPoolExhausted) || time.Since(start) > time.Second {
		t.Fatalf("the second store's first claim while the first holds 3 of 4 connections = %v, %v after %v; want ErrPoolExhausted at once (it would take the last)",
			ok, err, time.Since(start).Round(time.Millisecond))
	}
	handler("while the claims of two stores hold all they may")
	if err := a.ReleaseAll(ctx); err != nil {
		t.Fatal(err)
	}
	if ok, _, err := b.Claim(stores.WithClaimToken(ctx, "b0"), "k0", time.Minute); err != nil || !ok {
		t.Fatalf("the second store's claim once the first released its claims: %v, %v", ok, err)
	}
	if err := b.ReleaseAll(ctx); err != nil {
		t.Fatal(err)
	}

	// Both stores at once: at most 3 held, whoever asks first.
	var held atomic.Int32
	for _, err := range burst(12, func(i int) error {
		s := []*postgresstore.Store{a, b}[i%2]
		ok, _, err := s.Claim(stores.WithClaimToken(ctx, fmt.Sprint("c", i)), fmt.Sprint("c", i), time.Minute)
		switch {
		case errors.Is(err, postgresstore.ErrPoolExhausted):
			return nil
		case err != nil:
			return err
		case ok:
			held.Add(1)
		}
		return nil
	}) {
		if err != nil {
			t.Error(err)
		}
	}
	n := held.Load()
	if n > 3 {
		t.Fatalf("12 concurrent claims of two stores on a pool of 4 hold %d connections, want at most 3", n)
	}
	handler("while concurrent claims of two stores hold what they could")
	if n < 3 { // refused where one would have fitted (racing for the last connections): the pool is not stuck
		if ok, _, err := b.Claim(stores.WithClaimToken(ctx, "after"), "after", time.Minute); err != nil || !ok {
			t.Fatalf("a claim after the burst, %d of 4 connections held by claims: %v, %v", n, ok, err)
		}
	}
}

// TestTxClaimWrapTxOwnClaim: a record written in a transaction of the
// caller's by the holder of the key's claim (an HTTP request under its
// claim) does not wait for the claim's own transaction: it takes its place.
func TestTxClaimWrapTxOwnClaim(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	s := newTxStore(t, db)
	ctx, cancel := context.WithTimeout(stores.WithClaimToken(context.Background(), "request"), 3*time.Second)
	defer cancel()
	if ok, _, err := s.Claim(ctx, "k", time.Minute); err != nil || !ok {
		t.Fatalf("Claim = %v, %v", ok, err)
	}
	tx, recorded, _, err := s.BeginTx(ctx, db, nil, "k", 0, []byte("answer"))
	if err != nil || !recorded {
		t.Fatalf("BeginTx by the claim's holder = %v, %v; want recorded", recorded, err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if r, err := s.Lookup(ctx, "k"); err != nil || string(r.Value) != "answer" {
		t.Fatalf("Lookup = %+v, %v", r, err)
	}
}

// The holder process of TestTxClaimFreedWhenHolderKilled.
const holderEnv = "POSTGRESSTORE_TX_HOLDER"

// TestTxClaimFreedWhenHolderKilled: a worker process runs a message under a
// transaction claim with the default lease and is SIGKILLed mid-
// handler: the claim dies with its connection, and the message runs in
// this process (another worker) within a couple of seconds, not after the
// lease.
func TestTxClaimFreedWhenHolderKilled(t *testing.T) {
	if os.Getenv(holderEnv) != "" {
		holdUntilKilled(t)
		return
	}
	t.Parallel()
	db := testenv.Postgres(t)
	s := newTxStore(t, db, postgresstore.WithClaimWait(50*time.Millisecond))
	msg := orderMessage(t)

	child := exec.Command(os.Args[0], "-test.run=^TestTxClaimFreedWhenHolderKilled$", "-test.v")
	child.Env = append(os.Environ(), holderEnv+"="+s.Table(), "POSTGRESSTORE_TX_PAYLOAD="+string(msg.Payload))
	out, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	child.Stderr = os.Stderr
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = child.Process.Kill(); _ = child.Wait() })
	lines := bufio.NewScanner(out)
	for lines.Scan() && !strings.Contains(lines.Text(), "HANDLER RUNNING") {
	}

	var runs atomic.Int32
	h := idempotency.Middleware(s, idempotency.WithParkWait(0))(func(*message.Message) ([]*message.Message, error) {
		runs.Add(1)
		return nil, nil
	})
	if _, err := h(msg.Copy()); !errors.Is(err, idempotency.ErrInFlight) {
		t.Fatalf("a copy while the other worker runs it: %v, want ErrInFlight", err)
	}
	if err := child.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	for runs.Load() == 0 {
		if _, err := h(msg.Copy()); err != nil && !errors.Is(err, idempotency.ErrInFlight) {
			t.Fatal(err)
		}
		if took := time.Since(killed); took > 3*time.Second {
			t.Fatalf("the message did not run here within %v of the holder's death", took)
		}
	}
	t.Logf("ran here %v after the holder was killed (lease %v)", time.Since(killed).Round(time.Millisecond), idempotency.DefaultLease)
}

// holdUntilKilled is the worker process: it runs the message under the
// middleware with a handler that never returns.
func holdUntilKilled(t *testing.T) {
	db := testenv.Postgres(t)
	s, err := postgresstore.New(db, postgresstore.WithTable(os.Getenv(holderEnv)), postgresstore.WithTransactionClaims())
	if err != nil {
		t.Fatal(err)
	}
	h := idempotency.Middleware(s)(func(*message.Message) ([]*message.Message, error) {
		fmt.Println("HANDLER RUNNING")
		select {}
	})
	_, _ = h(message.NewMessage(watermill.NewUUID(), []byte(os.Getenv("POSTGRESSTORE_TX_PAYLOAD"))))
}

// TestTxClaimRenewedOutlivesItsLease: a claim renewed every third of its
// lease is held long past it (the server's idle timeout restarts with every
// renewal); once renewals stop, it is free within about the lease; a
// renewal of a claim whose session was terminated reports it lost.
func TestTxClaimRenewedOutlivesItsLease(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	s := newTxStore(t, db)
	other := newTxStore(t, testenv.Postgres(t), postgresstore.WithTable(s.Table()), postgresstore.WithClaimWait(20*time.Millisecond))
	ctx := context.Background()
	a, b := stores.WithClaimToken(ctx, "a"), stores.WithClaimToken(ctx, "b")
	const lease = 400 * time.Millisecond
	var key string
	for attempt := 1; ; attempt++ {
		key = fmt.Sprintf("k%d", attempt)
		if renewedPastItsLease(t, s, other, a, b, key, lease) {
			break
		}
		if attempt == 3 {
			t.Fatalf("in 3 attempts the machine never renewed the claim within its lease of %v", lease)
		}
		t.Logf("attempt %d: a renewal came later than the lease of %v; again", attempt, lease)
	}
	if held, err := s.Extend(b, key, lease); err != nil || held {
		t.Fatalf("a renewal by another holder: held %v, %v; want not held", held, err)
	}
	if took := claimWithin(t, other, b, key, lease+2*time.Second); took > lease+2*time.Second {
		t.Fatalf("the claim still held %v after its renewals stopped (lease %v)", took, lease)
	} else {
		t.Logf("free %v after the last renewal (lease %v)", took.Round(time.Millisecond), lease)
	}
	if held, err := s.Extend(a, key, lease); err != nil || held {
		t.Fatalf("a renewal after the claim lapsed: held %v, %v; want not held", held, err)
	}
	if err := s.Remember(a, key, 0, nil); !errors.Is(err, stores.ErrClaimTaken) {
		t.Fatalf("Remember by the holder whose claim lapsed and was taken by another worker: %v, want ErrClaimTaken", err)
	}
	if err := other.Release(b, key); err != nil {
		t.Fatal(err)
	}

	// A renewal of a claim whose session was terminated: lost.
	if ok, _, err := s.Claim(a, "k2", time.Minute); err != nil || !ok {
		t.Fatalf("Claim = %v, %v", ok, err)
	}
	terminateHolder(t, db, s.Table())
	if held, err := s.Extend(a, "k2", time.Minute); err != nil || held {
		t.Fatalf("a renewal after the holder's backend was terminated: held %v, %v; want lost", held, err)
	}
	if ok, _, err := other.Claim(b, "k2", time.Minute); err != nil || !ok {
		t.Fatalf("Claim by another worker after the loss = %v, %v; want taken", ok, err)
	}
}

// terminateHolder ends the one session holding a claim open on table
// (pg_terminate_backend).
func terminateHolder(t *testing.T, db *sql.DB, table string) {
	t.Helper()
	var killed int
	if err := db.QueryRow(`SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE state LIKE 'idle in transaction%' AND position($1 in query) > 0`, table).Scan(&killed); err != nil || killed != 1 {
		t.Fatalf("terminating the holder's backend: %d terminated, %v", killed, err)
	}
}

// claimWithin claims key on s for holder ctx again and again until it is
// taken, and returns how long that took; it gives up (returning more than
// limit) once limit has passed.
// renewedPastItsLease claims key for a with lease and renews the claim
// every third of it for four leases; after each renewal the claim must be
// held and b must find it in flight. The server ends a claim whose session
// stays idle for its lease, so an answer counts only when it came back
// within the lease of the statement before it began: on a machine so
// loaded that one came later, the claim may rightly have lapsed, and it
// returns false (the claim given up) for the test to start again.
func renewedPastItsLease(t *testing.T, s, other *postgresstore.Store, a, b context.Context, key string, lease time.Duration) bool {
	t.Helper()
	last := time.Now() // when the last statement on the claim's session began
	if ok, _, err := s.Claim(a, key, lease); err != nil || !ok {
		t.Fatalf("Claim = %v, %v", ok, err)
	}
	start := last
	for time.Since(start) < 4*lease {
		time.Sleep(lease / 3)
		renewal := time.Now()
		held, err := s.Extend(a, key, lease)
		if err != nil {
			t.Fatalf("renewal %v after the claim: %v", time.Since(start), err)
		}
		if !held {
			if idle := time.Since(last); idle < lease {
				t.Fatalf("renewal %v after the claim, %v after the statement before it: held false; want held", time.Since(start), idle)
			}
			return false
		}
		last = renewal
		ok, found, err := other.Claim(b, key, time.Minute)
		if err != nil {
			t.Fatalf("Claim by another worker: %v", err)
		}
		if ok {
			if idle := time.Since(last); idle < lease {
				t.Fatalf("Claim by another worker %v after a claim renewed every third of its lease of %v, %v after the last renewal = %v, %v; want in flight",
					time.Since(start), lease, idle, ok, found.State)
			}
			if err := other.Release(b, key); err != nil {
				t.Fatal(err)
			}
			return false
		}
	}
	return true
}

func claimWithin(t *testing.T, s *postgresstore.Store, ctx context.Context, key string, limit time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		ok, _, err := s.Claim(ctx, key, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if ok || time.Since(start) > limit {
			return time.Since(start)
		}
	}
}

// TestTxClaimKeptAliveByTheMiddleware: the middleware renews a transaction
// claim while its handler runs, so a handler four times longer than the
// lease keeps its claim throughout (another worker finds it in flight),
// and its record commits once it ends.
func TestTxClaimKeptAliveByTheMiddleware(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	s := newTxStore(t, db)
	other := newTxStore(t, testenv.Postgres(t), postgresstore.WithTable(s.Table()), postgresstore.WithClaimWait(20*time.Millisecond))
	const lease = 300 * time.Millisecond
	running, finish := make(chan struct{}), make(chan struct{})
	h := idempotency.Middleware(s, idempotency.WithClaim(lease))(func(*message.Message) ([]*message.Message, error) {
		close(running)
		<-finish
		return nil, nil
	})
	msg := orderMessage(t)
	key := idempotency.Key("", mustID(t, msg))
	first := make(chan error, 1)
	go func() {
		_, err := h(msg.Copy())
		first <- err
	}()
	<-running
	probe := stores.WithClaimToken(context.Background(), "another worker")
	for start := time.Now(); time.Since(start) < 4*lease; time.Sleep(lease / 10) {
		if ok, found, err := other.Claim(probe, key, time.Minute); err != nil || ok {
			t.Fatalf("Claim by another worker %v into a handler run under a lease of %v = %v, %v, %v; want in flight",
				time.Since(start), lease, ok, found.State, err)
		}
	}
	close(finish)
	if err := <-first; err != nil {
		t.Fatalf("the long delivery: %v", err)
	}
	if ok, found, err := other.Claim(probe, key, time.Minute); err != nil || ok || !found.Remembered() {
		t.Fatalf("Claim by another worker after the long delivery = %v, %v, %v; want remembered", ok, found.State, err)
	}
}
