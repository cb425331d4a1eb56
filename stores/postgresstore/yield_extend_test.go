package postgresstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestSessionYieldedClaimLostWithItsTransaction: a session claim made way
// for its holder's transaction (BeginTx), whose connection then ended
// (killed by the server: the record rolled back, the key's lock gone).
// Another worker claims the key; the first holder's Extend must then say
// lost, as the contract has it for another holder's claim. It said held,
// without asking anyone, while the other worker held the claim.
func TestSessionYieldedClaimLostWithItsTransaction(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	ctx := context.Background()
	a := newStore(t, db)
	b := newStoreOnTable(t, db, a.Table())
	key := "yield-lost-" + testenv.RandomHex(4)
	holder := stores.WithClaimToken(ctx, "holder")
	if claimed, _, err := a.Claim(holder, key, time.Minute); err != nil || !claimed {
		t.Fatalf("Claim: %v, %v", claimed, err)
	}
	tx, recorded, _, err := a.BeginTx(holder, db, nil, key, 1, nil)
	if err != nil || !recorded {
		t.Fatalf("BeginTx: %v, %v", recorded, err)
	}
	defer func() { _ = tx.Rollback() }()
	var pid int
	if err := tx.QueryRow(`SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`SELECT pg_terminate_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	other := stores.WithClaimToken(ctx, "other")
	deadline := time.Now().Add(5 * time.Second)
	for {
		claimed, _, err := b.Claim(other, key, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if claimed {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("5s on, the other worker cannot claim the key its holder's killed transaction held")
		}
		time.Sleep(10 * time.Millisecond)
	}
	held, err := a.Extend(holder, key, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if held {
		t.Fatal("Extend of the yielded claim says held while another worker holds the key's claim (its transaction ended with its connection)")
	}
	if held, err := b.Extend(other, key, time.Minute); err != nil || !held {
		t.Fatalf("the other worker's Extend: %v, %v", held, err)
	}
	if err := b.Release(other, key); err != nil {
		t.Fatal(err)
	}

	// Its transaction committed: the key's lock held a moment by a claim
	// of another worker finding the record leaves the done holder's
	// claim held (it is not told it lost the run it committed).
	key = "yield-done-" + testenv.RandomHex(4)
	if claimed, _, err := a.Claim(holder, key, time.Minute); err != nil || !claimed {
		t.Fatalf("Claim: %v, %v", claimed, err)
	}
	tx, recorded, _, err = a.BeginTx(holder, db, nil, key, 1, nil)
	if err != nil || !recorded {
		t.Fatalf("BeginTx: %v, %v", recorded, err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.ExecContext(ctx, `SELECT pg_advisory_lock($1)`, a.RowLock(key)); err != nil {
		t.Fatal(err)
	}
	held, err = a.Extend(holder, key, time.Minute)
	if _, uerr := conn.ExecContext(ctx, `SELECT pg_advisory_unlock($1)`, a.RowLock(key)); uerr != nil {
		t.Fatal(uerr)
	}
	if err != nil || !held {
		t.Fatalf("Extend of the yielded claim whose transaction committed, the key's lock held a moment elsewhere: %v, %v; want held", held, err)
	}
}

// TestSessionYieldedClaimExtendOnAStarvedPool: the store's pool is held
// whole by transactions (the caller's own here, MaxOpenConns 1): Extend of
// the claim yielded to it says held within a second or so, the question
// of whether another worker took the key going unanswered.
func TestSessionYieldedClaimExtendOnAStarvedPool(t *testing.T) {
	t.Parallel()
	s, db, _, _ := proxiedStore(t, "idem_ystarve_")
	db.SetMaxOpenConns(1)
	holder := stores.WithClaimToken(context.Background(), "holder")
	if claimed, _, err := s.Claim(holder, "k", time.Minute); err != nil || !claimed {
		t.Fatalf("Claim: %v, %v", claimed, err)
	}
	tx, recorded, _, err := s.BeginTx(holder, db, nil, "k", 1, nil)
	if err != nil || !recorded {
		t.Fatalf("BeginTx: %v, %v", recorded, err)
	}
	defer func() { _ = tx.Rollback() }()
	start := time.Now()
	held, err := s.Extend(holder, "k", time.Minute)
	if took := time.Since(start); err != nil || !held || took > 3*time.Second {
		t.Fatalf("Extend of the yielded claim on a pool its transaction holds: %v, %v after %v; want held within a second or so", held, err, took)
	}
}
