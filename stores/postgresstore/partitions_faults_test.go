package postgresstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// partsFaultStore is a partitioned store (daily partitions, a TTL of an
// hour) on a pgx pool through a fault proxy (proxiedStore), with the
// pool, a pool straight to the server and the proxy.
func partsFaultStore(t *testing.T) (s *postgresstore.Store, db, direct *sql.DB, proxy *testenv.FaultProxy) {
	t.Helper()
	return proxiedStore(t, "idem_pf_", postgresstore.WithPartitions(0), postgresstore.WithTTL(time.Hour))
}

// TestPartitionedCallsByTheirDeadline: with every reply of PostgreSQL
// 300ms late, each call of a partitioned store under a 100ms deadline
// returns by then (and a margin) with an error matching the context's.
func TestPartitionedCallsByTheirDeadline(t *testing.T) {
	t.Parallel()
	s, db, _, proxy := partsFaultStore(t)
	var callerTx *sql.Tx // RememberTx's, begun before the replies come late
	calls := map[string]func(ctx context.Context, key string) error{
		"Claim": func(ctx context.Context, key string) error {
			_, _, err := s.Claim(ctx, key, time.Minute)
			return err
		},
		"Remember": func(ctx context.Context, key string) error { return s.Remember(ctx, key, 7, nil) },
		"Release":  func(ctx context.Context, key string) error { return s.Release(ctx, key) },
		"Extend": func(ctx context.Context, key string) error {
			_, err := s.Extend(ctx, key, time.Minute)
			return err
		},
		"Lookup": func(ctx context.Context, key string) error {
			_, err := s.Lookup(ctx, key)
			return err
		},
		"Forget": func(ctx context.Context, key string) error { return s.Forget(ctx, key) },
		"Fail": func(ctx context.Context, key string) error {
			return s.Fail(ctx, key, 0, stores.Failure{Attempts: 1, FirstFailure: time.Now()})
		},
		"Fail/end": func(ctx context.Context, key string) error {
			return s.Fail(ctx, key, 0, stores.Failure{Attempts: 1, FirstFailure: time.Now(), End: &stores.End{Reason: "failed", At: time.Now()}})
		},
		"Reopen": func(ctx context.Context, key string) error {
			_, err := s.Reopen(ctx, key, "")
			return err
		},
		"RememberTx": func(ctx context.Context, key string) error {
			defer func() { _ = callerTx.Rollback() }()
			_, _, err := s.RememberTx(ctx, callerTx, key, 0, nil)
			return err
		},
		"BeginTx": func(ctx context.Context, key string) error {
			tx, _, _, err := s.BeginTx(ctx, db, nil, key, 0, nil)
			if err == nil {
				_ = tx.Rollback()
			}
			return err
		},
		"DeleteExpired": func(ctx context.Context, _ string) error {
			_, err := s.DeleteExpired(ctx)
			return err
		},
		"Migrate": func(ctx context.Context, _ string) error { return s.Migrate(ctx) },
	}
	for name, call := range calls {
		for _, held := range []bool{false, true} {
			key := fmt.Sprintf("%s-%v", name, held)
			tok := stores.WithClaimToken(context.Background(), "first")
			if held {
				if claimed, _, err := s.Claim(tok, key, time.Minute); err != nil || !claimed {
					t.Fatalf("claim %s: %v, %v", key, claimed, err)
				}
			}
			if name == "RememberTx" {
				var err error
				if callerTx, err = db.BeginTx(context.Background(), nil); err != nil {
					t.Fatal(err)
				}
				if _, err := callerTx.Exec(`SELECT 1`); err != nil {
					t.Fatal(err)
				}
			}
			proxy.Delay.Store(int64(300 * time.Millisecond))
			ctx, cancel := context.WithTimeout(tok, 100*time.Millisecond)
			start := time.Now()
			err := call(ctx, key)
			took := time.Since(start)
			cancel()
			proxy.Delay.Store(0)
			switch {
			case err == nil:
				t.Errorf("%s (claimed %v) succeeded under a 100ms deadline with replies 300ms late", name, held)
			case !errors.Is(err, context.DeadlineExceeded):
				t.Errorf("%s (claimed %v) under a 100ms deadline: %v, not the context's error", name, held, err)
			case strings.Count(err.Error(), "postgresstore:") != 1:
				t.Errorf("%s (claimed %v) under a 100ms deadline: %q, want the store's error once, of this call", name, held, err)
			}
			if took > 250*time.Millisecond {
				t.Errorf("%s (claimed %v) under a 100ms deadline returned after %v", name, held, took.Round(time.Millisecond))
			}
			t.Logf("%s (claimed %v): %v after %v", name, held, err, took.Round(time.Millisecond))
			_ = s.Release(tok, key)
		}
	}
}

// TestPartitionedClaimLeftByItsCaller: a partitioned store's claim whose
// caller left at its deadline (the reply 300ms late past a 100ms deadline),
// whose reply was lost with its connection, or that took over a lapsed
// claim as its caller left, is not held for its lease: after the holder's
// Release where the caller got an error (the middleware's releaseGivenUp),
// another worker's redelivery claims the key within 2s.
func TestPartitionedClaimLeftByItsCaller(t *testing.T) {
	t.Parallel()
	for _, fault := range []string{"late", "late/takeover", "dropped", "dropped/takeover"} {
		t.Run(fault, func(t *testing.T) {
			t.Parallel()
			s, _, direct, proxy := partsFaultStore(t)
			other, err := postgresstore.New(direct, postgresstore.WithTable(s.Table()), postgresstore.WithPartitions(0), postgresstore.WithTTL(time.Hour))
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = other.Close() }()
			tok := stores.WithClaimToken(context.Background(), "first")
			if fault == "late/takeover" || fault == "dropped/takeover" {
				// A claim of a worker gone, lapsed: taken over.
				gone := stores.WithClaimToken(context.Background(), "gone")
				if claimed, _, err := other.Claim(gone, "k", time.Millisecond); err != nil || !claimed {
					t.Fatalf("claim: %v, %v", claimed, err)
				}
				time.Sleep(5 * time.Millisecond) // the 1ms lease runs out
			}
			var claimed bool
			if fault == "late" || fault == "late/takeover" {
				proxy.Delay.Store(int64(300 * time.Millisecond))
				ctx, cancel := context.WithTimeout(tok, 100*time.Millisecond)
				start := time.Now()
				claimed, _, err = s.Claim(ctx, "k", time.Minute)
				took := time.Since(start)
				cancel()
				proxy.Delay.Store(0)
				t.Logf("claim under a 100ms deadline: %v, %v after %v", claimed, err, took.Round(time.Millisecond))
				if err == nil || !errors.Is(err, context.DeadlineExceeded) || took > 250*time.Millisecond {
					t.Fatalf("claim under a 100ms deadline with replies 300ms late: %v, %v after %v", claimed, err, took)
				}
			} else {
				proxy.DropReply.Store(true)
				ctx, cancel := context.WithTimeout(tok, 2*time.Second)
				claimed, _, err = s.Claim(ctx, "k", time.Minute)
				cancel()
				t.Logf("claim with its reply lost: %v, %v (%d replies dropped)", claimed, err, proxy.Dropped.Load())
			}
			if err != nil {
				rctx, cancel := context.WithTimeout(tok, 2*time.Second)
				rerr := s.Release(rctx, "k")
				cancel()
				t.Logf("the holder's release: %v", rerr)
			} else if claimed {
				t.Logf("claimed: the test needs the claim to fail; released")
				_ = s.Release(tok, "k")
			}
			redelivery := stores.WithClaimToken(context.Background(), "redelivery")
			start := time.Now()
			for {
				claimed, found, err := other.Claim(redelivery, "k", time.Minute)
				if err == nil && claimed {
					break
				}
				if time.Since(start) > 2*time.Second {
					var claim sql.NullString
					_ = direct.QueryRow(`SELECT claim FROM `+s.Table()+` WHERE key = $1`, postgresstore.RowKey("k")).Scan(&claim)
					t.Fatalf("2s on, the redelivery still finds %v (%v); the row's claim: %v", found.State, err, claim)
				}
				time.Sleep(20 * time.Millisecond)
			}
			t.Logf("the redelivery claimed after %v", time.Since(start).Round(time.Millisecond))
			_ = other.Release(redelivery, "k")
		})
	}
}

// TestPartitionsRollByItsDeadline: DeleteExpired of a partitioned store
// whose expired partition's detach waits for a transaction reading the
// table returns by its deadline (and a margin), each time, with nothing
// or the context's error; once the transaction ends, another instance of
// the store drops the partition (the roll's lock was not left held, the
// detach cut short is finished), and no session is left holding the
// roll's lock or idle in a transaction.
func TestPartitionsRollByItsDeadline(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("waits for partitions to age")
	}
	db := testenv.Postgres(t)
	const period, ttl = time.Second, time.Second
	s := newPartitioned(t, db, period, ttl)
	s.SetDropMargin(0)
	for i := range 5 {
		if err := s.Remember(context.Background(), fmt.Sprintf("roll-%d", i), 1, nil); err != nil {
			t.Fatal(err)
		}
	}
	reader, err := db.BeginTx(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = reader.Rollback() }()
	var n int
	if err := reader.QueryRow(`SELECT count(*) FROM ` + s.Table()).Scan(&n); err != nil || n != 5 {
		t.Fatalf("the reader's count: %d, %v", n, err)
	}
	const deadline = 300 * time.Millisecond
	var gaveUp, calls int
	start := time.Now()
	for gaveUp < 3 {
		if time.Since(start) > 15*time.Second {
			t.Fatalf("15s on, %d of %d rolls gave up at their deadline: the detach never waited", gaveUp, calls)
		}
		ctx, cancel := context.WithTimeout(context.Background(), deadline)
		at := time.Now()
		dropped, err := s.DeleteExpired(ctx)
		took := time.Since(at)
		cancel()
		calls++
		switch {
		case err != nil && !errors.Is(err, context.DeadlineExceeded):
			t.Fatalf("DeleteExpired under a %v deadline: %v, not the context's error", deadline, err)
		case err != nil:
			gaveUp++
		case dropped != 0:
			t.Fatalf("DeleteExpired dropped %d rows while a transaction reads them", dropped)
		}
		if took > deadline+300*time.Millisecond {
			t.Fatalf("DeleteExpired under a %v deadline returned %v after %v", deadline, err, took)
		}
		if err == nil {
			time.Sleep(100 * time.Millisecond) // the partition ages
		}
	}
	t.Logf("%d of %d rolls gave up at their %v deadline while the reader held the partition", gaveUp, calls, deadline)
	if err := reader.Rollback(); err != nil {
		t.Fatal(err)
	}
	other, err := postgresstore.New(testenv.Postgres(t), postgresstore.WithTable(s.Table()), postgresstore.WithPartitions(period), postgresstore.WithTTL(ttl))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = other.Close() }()
	other.SetDropMargin(0)
	var dropped int64
	start = time.Now()
	for dropped < 5 {
		if time.Since(start) > 10*time.Second {
			t.Fatalf("10s after the reader ended, another instance dropped %d of the 5 expired rows", dropped)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		n, err := other.DeleteExpired(ctx)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		dropped += n
		if dropped < 5 {
			time.Sleep(50 * time.Millisecond)
		}
	}
	t.Logf("another instance dropped the expired rows %v after the reader ended", time.Since(start).Round(time.Millisecond))
	// A detach the server finished for a roll that had left is dropped by
	// the next roll: no table named as a partition is left unattached.
	start = time.Now()
	for {
		var detaching, orphans int
		if err := db.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%DETACH PARTITION%' AND query LIKE '%' || $1 || '%' AND pid <> pg_backend_pid()`, s.Table()).Scan(&detaching); err != nil {
			t.Fatal(err)
		}
		if detaching == 0 {
			if _, err := other.DeleteExpired(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
		if err := db.QueryRow(`SELECT count(*) FROM pg_class WHERE relkind = 'r' AND NOT relispartition AND left(relname, $1) = $2`, len(s.Table())+2, s.Table()+"_p").Scan(&orphans); err != nil {
			t.Fatal(err)
		}
		if orphans == 0 && detaching == 0 {
			break
		}
		if time.Since(start) > 5*time.Second {
			t.Fatalf("5s on, %d tables named as partitions are left unattached (%d detaches running)", orphans, detaching)
		}
		time.Sleep(20 * time.Millisecond)
	}
	var held, inTx int
	if err := db.QueryRow(`SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid <> pg_backend_pid()
		AND ((classid::int8 << 32) | objid::int8) = $1`, postgresstore.RollLock(s.Table())).Scan(&held); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE state LIKE 'idle in transaction%' AND query LIKE '%` + s.Table() + `%'`).Scan(&inTx); err != nil {
		t.Fatal(err)
	}
	if held != 0 || inTx != 0 {
		t.Fatalf("after the rolls: %d sessions hold the roll's lock, %d idle in a transaction", held, inTx)
	}
}

// TestPartitionedTxPathsMissingPartitionByTheirDeadline: the caller's
// record (RememberTx, BeginTx, BeginPgx) meets no partition for the
// current time (DeleteExpired not run for longer than the periods created
// ahead), while the store's own pool answers 300ms late: under a 100ms
// deadline the call returns by then (and a margin) with the context's
// error, and the partition is created all the same for the next attempt.
func TestPartitionedTxPathsMissingPartitionByTheirDeadline(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("waits for the partitions to run out")
	}
	for _, entry := range []string{"RememberTx", "BeginTx", "BeginPgx"} {
		t.Run(entry, func(t *testing.T) {
			t.Parallel()
			const period = time.Second
			s, _, direct, proxy := proxiedStore(t, "idem_pf_", postgresstore.WithPartitions(period), postgresstore.WithTTL(time.Hour))
			newest := func() (newest, now int64) {
				if err := direct.QueryRow(`SELECT max(substring(c.relname from '_p([0-9]+)$')::bigint), (extract(epoch from clock_timestamp()) * 1000)::bigint
					FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = $1::regclass`, s.Table()).Scan(&newest, &now); err != nil {
					t.Fatal(err)
				}
				return newest, now
			}
			// The partitions run out: the current time is past the newest.
			deadline := time.Now().Add(10 * time.Second)
			for {
				last, now := newest()
				if now >= last+period.Milliseconds()+50 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("10s on, the partitions have not run out")
				}
				time.Sleep(50 * time.Millisecond)
			}
			before, _ := newest()
			proxy.Delay.Store(int64(300 * time.Millisecond))
			ctx, cancel := context.WithTimeout(stores.WithClaimToken(context.Background(), "first"), 100*time.Millisecond)
			start := time.Now()
			var err error
			switch entry {
			case "BeginPgx":
				conn, cerr := pgx.Connect(context.Background(), testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN))
				if cerr != nil {
					t.Fatal(cerr)
				}
				defer func() { _ = conn.Close(context.Background()) }()
				var tx pgx.Tx
				if tx, _, _, err = s.BeginPgx(ctx, conn, pgx.TxOptions{}, "k", 0, nil); err == nil {
					_ = tx.Rollback(context.Background())
				}
			default:
				var tx *sql.Tx
				if tx, _, _, err = tpBegin(ctx, s, direct, entry, "k"); err == nil {
					_ = tx.Rollback()
				}
			}
			took := time.Since(start)
			cancel()
			proxy.Delay.Store(0)
			t.Logf("%s with no partition for now, the store's replies 300ms late: %v after %v", entry, err, took.Round(time.Millisecond))
			if err == nil || !errors.Is(err, context.DeadlineExceeded) || took > 250*time.Millisecond {
				t.Errorf("%s under a 100ms deadline: %v after %v; want the context's error by then", entry, err, took)
			}
			deadline = time.Now().Add(5 * time.Second)
			for {
				if last, _ := newest(); last > before {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("5s on, no partition was created for the next attempt")
				}
				time.Sleep(20 * time.Millisecond)
			}
		})
	}
}

// TestPartitionsRollDeadlineSweep: with every reply 200ms late, a
// partitioned store's DeleteExpired under deadlines from 1.2s to 2s
// returns by each (and a margin) with nothing or the context's error: the
// roll's lock is given back within the caller's deadline, or goes with its
// connection. Afterwards no session holds the roll's lock. (A roll takes
// about 1.5s of round trips here: the deadlines end it at every step.)
func TestPartitionsRollDeadlineSweep(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("a sweep of deadlines: seconds")
	}
	s, _, direct, proxy := partsFaultStore(t)
	proxy.Delay.Store(int64(200 * time.Millisecond))
	var late, rolls int
	for d := 1200 * time.Millisecond; d <= 2000*time.Millisecond; d += 40 * time.Millisecond {
		rolls++
		ctx, cancel := context.WithTimeout(context.Background(), d)
		start := time.Now()
		_, err := s.DeleteExpired(ctx)
		took := time.Since(start)
		cancel()
		if err != nil && !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("deadline %v: %v, not the context's error", d, err)
		}
		if took > d+120*time.Millisecond {
			late++
			t.Errorf("deadline %v: returned %v after %v", d, err, took.Round(time.Millisecond))
		}
	}
	proxy.Delay.Store(0)
	t.Logf("%d of %d rolls returned past their deadline", late, rolls)
	deadline := time.Now().Add(5 * time.Second)
	for {
		var held int
		if err := direct.QueryRow(`SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted
			AND ((classid::int8 << 32) | objid::int8) = $1`, postgresstore.RollLock(s.Table())).Scan(&held); err != nil {
			t.Fatal(err)
		}
		if held == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("5s after the rolls, %d sessions hold the roll's lock", held)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
