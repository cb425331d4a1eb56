package postgresstore_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestTransactionClaimReleaseLeftByItsCallerEnds: a Release whose caller
// left at its deadline while PostgreSQL was slow (its replies 500ms late)
// returns the context's error, and its end goes on: the claim's
// transaction ends as asked (the rollback of a plain claim, the commit of
// a claim carrying a count: its count kept, the claim cleared), its
// connection goes back to the pool idle, no session is left idle in a
// transaction, and the key can be claimed again.
func TestTransactionClaimReleaseLeftByItsCallerEnds(t *testing.T) {
	t.Parallel()
	s, db, direct, proxy := slowTxClaimStore(t, "idem_le_")
	for _, counted := range []bool{false, true} {
		key := "plain"
		if counted {
			key = "counted"
		}
		ctx := stores.WithClaimToken(context.Background(), "h-"+key)
		if claimed, _, err := s.Claim(ctx, key, time.Minute); err != nil || !claimed {
			t.Fatalf("claim %s: %v, %v", key, claimed, err)
		}
		if counted {
			if err := s.Fail(ctx, key, 1, stores.Failure{Attempts: 1, FirstFailure: time.Now()}); err != nil {
				t.Fatal(err)
			}
		}
		proxy.Delay.Store(int64(500 * time.Millisecond))
		rctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		start := time.Now()
		err := s.Release(rctx, key)
		took := time.Since(start)
		cancel()
		proxy.Delay.Store(0)
		if !errors.Is(err, context.DeadlineExceeded) || took > 400*time.Millisecond {
			t.Fatalf("%s: Release under a 100ms deadline returned %v after %v", key, err, took)
		}
		deadline := time.Now().Add(10 * time.Second)
		for {
			var inTx int
			if err := direct.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE state LIKE 'idle in transaction%' AND query LIKE '%` + s.Table() + `%'`).Scan(&inTx); err != nil {
				t.Fatal(err)
			}
			if inTx == 0 && db.Stats().InUse == 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: 10 s after the release, %d sessions idle in a transaction, %d connections in use", key, inTx, db.Stats().InUse)
			}
			time.Sleep(20 * time.Millisecond)
		}
		r, err := s.Lookup(context.Background(), key)
		if err != nil {
			t.Fatal(err)
		}
		if counted && r.Failure.Attempts != 1 {
			t.Fatalf("%s: after the release the record is %+v; want its count of 1 kept", key, r)
		}
		other := stores.WithClaimToken(context.Background(), "other-"+key)
		if claimed, _, err := s.Claim(other, key, time.Minute); err != nil || !claimed {
			t.Fatalf("%s: claimed again by another: %v, %v", key, claimed, err)
		}
		if err := s.Release(other, key); err != nil {
			t.Fatal(err)
		}
	}
}

// TestTransactionClaimsReleaseAllPastItsDeadline: ReleaseAll when a worker
// stops, PostgreSQL slow (its replies 500ms late) and the call's deadline
// 100ms: it returns the context's error by then, and every claim is
// released all the same once PostgreSQL answers, none left held for its
// lease (a minute) in a transaction open on a connection of the pool.
func TestTransactionClaimsReleaseAllPastItsDeadline(t *testing.T) {
	t.Parallel()
	s, _, _, proxy := slowTxClaimStore(t, "idem_ra_")
	keys := []string{"a", "b", "c", "d"}
	for _, key := range keys {
		if claimed, _, err := s.Claim(stores.WithClaimToken(context.Background(), "h-"+key), key, time.Minute); err != nil || !claimed {
			t.Fatalf("claim %s: %v, %v", key, claimed, err)
		}
	}
	proxy.Delay.Store(int64(500 * time.Millisecond))
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	start := time.Now()
	err := s.ReleaseAll(ctx)
	took := time.Since(start)
	cancel()
	proxy.Delay.Store(0)
	if !errors.Is(err, context.DeadlineExceeded) || took > 400*time.Millisecond {
		t.Fatalf("ReleaseAll under a 100ms deadline returned %v after %v", err, took)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		free := 0
		for _, key := range keys {
			other := stores.WithClaimToken(context.Background(), "other-"+key)
			cctx, cancel := context.WithTimeout(other, time.Second)
			claimed, _, err := s.Claim(cctx, key, time.Minute)
			cancel()
			if err == nil && claimed {
				free++
				if err := s.Release(other, key); err != nil {
					t.Fatal(err)
				}
			}
		}
		if free == len(keys) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("5 s after ReleaseAll, %d of the %d claims are still held (their lease: a minute)", len(keys)-free, len(keys))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestTransactionClaimRememberPastItsDeadline: a Remember of a transaction
// claim whose commit's reply comes after the caller's deadline (replies
// 500ms late, a 100ms deadline) reports the deadline's error, saying the
// record may have committed (not ErrClaimLost); the redelivery's claim then finds the record remembered
// (skipped: the handler does not run twice) or the key free, never a claim
// left open, and no session stays idle in a transaction.
func TestTransactionClaimRememberPastItsDeadline(t *testing.T) {
	t.Parallel()
	s, _, direct, proxy := slowTxClaimStore(t, "idem_rm_")
	ctx := stores.WithClaimToken(context.Background(), "first")
	if claimed, _, err := s.Claim(ctx, "k", time.Minute); err != nil || !claimed {
		t.Fatalf("claim: %v, %v", claimed, err)
	}
	proxy.Delay.Store(int64(500 * time.Millisecond))
	rctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	err := s.Remember(rctx, "k", 7, []byte("v"))
	cancel()
	proxy.Delay.Store(0)
	if err == nil {
		t.Skip("the commit's reply came in time")
	}
	// Unanswered, the commit may have happened: the error is the
	// deadline's, not a claim lost before its record committed.
	if errors.Is(err, postgresstore.ErrClaimLost) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Remember whose commit went unanswered by its deadline: %v; want the deadline's error, not ErrClaimLost", err)
	}
	redelivery := stores.WithClaimToken(context.Background(), "redelivery")
	deadline := time.Now().Add(5 * time.Second)
	for {
		cctx, cancel := context.WithTimeout(redelivery, time.Second)
		claimed, found, err := s.Claim(cctx, "k", time.Minute)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		if claimed || found.Remembered() {
			t.Logf("the redelivery: claimed %v, found %v", claimed, found.State)
			if claimed {
				if err := s.Release(redelivery, "k"); err != nil {
					t.Fatal(err)
				}
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("5 s after the Remember, the redelivery still finds %v", found.State)
		}
		time.Sleep(20 * time.Millisecond)
	}
	var inTx int
	if err := direct.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE state LIKE 'idle in transaction%' AND query LIKE '%` + s.Table() + `%'`).Scan(&inTx); err != nil || inTx != 0 {
		t.Fatalf("%d sessions idle in a transaction (%v)", inTx, err)
	}
}

// slowTxClaimStore returns a migrated store with transaction claims on a
// table of its own (named prefix and random hex), as proxiedStore makes
// it.
func slowTxClaimStore(t *testing.T, prefix string) (s *postgresstore.Store, db, direct *sql.DB, proxy *testenv.FaultProxy) {
	t.Helper()
	return proxiedStore(t, prefix, postgresstore.WithTransactionClaims())
}

// proxiedStore returns a migrated store made with opts on a table of its
// own (named prefix and random hex), on a pgx pool (db) reaching
// PostgreSQL through proxy, whose replies the test can delay; a pool
// straight to the server (direct) drops the table when the test ends,
// after the store's claims were released and the store closed with the
// delay lifted.
func proxiedStore(t *testing.T, prefix string, opts ...postgresstore.Option) (s *postgresstore.Store, db, direct *sql.DB, proxy *testenv.FaultProxy) {
	t.Helper()
	direct = testenv.Postgres(t)
	dsn, proxy := testenv.PostgresProxyDSN(t)
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	s, err = postgresstore.New(db, append([]postgresstore.Option{postgresstore.WithTable(prefix + testenv.RandomHex(4))}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = direct.Exec(`DROP TABLE IF EXISTS ` + s.Table()) })
	t.Cleanup(func() {
		proxy.Delay.Store(0)
		_ = s.ReleaseAll(context.Background())
		_ = s.Close()
	})
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return s, db, direct, proxy
}
