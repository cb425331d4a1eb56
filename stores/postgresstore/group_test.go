package postgresstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/storetest"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestContractUngroupedAndAsynchronous runs the store contract with every
// statement sent on its own, and with asynchronous commits of records.
func TestContractUngroupedAndAsynchronous(t *testing.T) {
	if testing.Short() {
		t.Skip("the contract again under two options: TestContract runs it in -short")
	}
	db := testenv.Postgres(t)
	db.SetMaxOpenConns(70)
	for name, opt := range map[string]postgresstore.Option{
		"WithoutGrouping":        postgresstore.WithoutGrouping(),
		"WithAsynchronousCommit": postgresstore.WithAsynchronousCommit(),
	} {
		t.Run(name, func(t *testing.T) {
			storetest.Run(t,
				func(t *testing.T) stores.Store { return newStore(t, db, opt) },
				storetest.WithTTLStore(func(t *testing.T, ttl time.Duration) stores.Store {
					return newStore(t, db, opt, postgresstore.WithTTL(ttl))
				}),
				storetest.WithTxDB(db))
		})
	}
}

// TestGroupedCallsKeepEveryAnswerApart: hundreds of concurrent claims,
// remembers and checks over overlapping keys, grouped into shared
// statements, each get their own answer: one claim winner per key, every
// remembered key seen with its own fingerprint, no error.
func TestGroupedCallsKeepEveryAnswerApart(t *testing.T) {
	t.Parallel()
	t.Run("pgx", func(t *testing.T) { groupedCallsKeepEveryAnswerApart(t, testenv.Postgres(t)) })
	// lib/pq passes no Go slice: the grouped statements' arrays go as strings.
	t.Run("lib/pq", func(t *testing.T) { groupedCallsKeepEveryAnswerApart(t, testenv.PostgresWithDriver(t, "postgres")) })
}

func groupedCallsKeepEveryAnswerApart(t *testing.T, db *sql.DB) {
	db.SetMaxOpenConns(16)
	db.SetMaxIdleConns(16)
	s := newStore(t, db, postgresstore.WithRowClaims()) // the grouped statements of claims of rows (lib/pq has them anyway)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	const keys, claimers = 50, 8
	var winners [keys]atomic.Int32
	var wg sync.WaitGroup
	errs := make(chan error, keys*claimers*3)
	for k := range keys {
		for c := range claimers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				key := fmt.Sprintf("claim-%d", k)
				cctx := stores.WithClaimToken(ctx, fmt.Sprintf("holder-%d-%d", k, c))
				claimed, _, err := s.Claim(cctx, key, time.Minute)
				if err != nil {
					errs <- err
					return
				}
				if claimed {
					winners[k].Add(1)
				}
			}()
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			key := fmt.Sprintf("record-%d", k)
			if err := s.Remember(ctx, key, uint64(1000+k), nil); err != nil {
				errs <- err
				return
			}
			seen, fp, err := testenv.LookupFingerprint(s, ctx, key)
			if err != nil {
				errs <- err
				return
			}
			if !seen || fp != uint64(1000+k) {
				errs <- fmt.Errorf("%s after remember: seen %v, fingerprint %d, want true, %d", key, seen, fp, 1000+k)
			}
			if seen, err := stores.Seen(ctx, s, fmt.Sprintf("never-%d", k)); err != nil || seen {
				errs <- fmt.Errorf("never-%d: seen %v, %v", k, seen, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for k := range keys {
		if n := winners[k].Load(); n != 1 {
			t.Errorf("claim-%d: %d winners among %d claimers, want 1", k, n, claimers)
		}
	}
	// Then 400 concurrent remembers and checks of distinct keys: grouped,
	// they take far fewer statements than calls.
	before := s.StatementCount()
	const calls = 400
	for i := range calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var err error
			if i%2 == 0 {
				err = s.Remember(ctx, fmt.Sprintf("phase2-%d", i), 0, nil)
			} else {
				_, err = stores.Seen(ctx, s, fmt.Sprintf("phase2-%d", i))
			}
			if err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if n := s.StatementCount() - before; n >= calls/2 {
		t.Errorf("%d statements for %d concurrent calls: they did not share statements", n, calls)
	} else {
		t.Logf("%d statements for %d concurrent calls", n, calls)
	}
}

// TestGroupedCallerReturnsByItsDeadline: a grouped statement stuck behind a
// row lock (another transaction holds the row) does not hold its callers past
// their own deadlines, and once the lock goes the store serves again.
func TestGroupedCallerReturnsByItsDeadline(t *testing.T) {
	db := testenv.Postgres(t)
	s := newStore(t, db, postgresstore.WithQueryTimeout(10*time.Second))
	bg := context.Background()
	if err := s.Remember(bg, "locked", 0, nil); err != nil {
		t.Fatal(err)
	}
	tx, err := db.BeginTx(bg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback() //nolint:errcheck
	if _, err := tx.ExecContext(bg, "SELECT 1 FROM "+s.Table()+" WHERE key = $1 FOR UPDATE", postgresstore.RowKey("locked")); err != nil {
		t.Fatal(err)
	}

	start := time.Now()
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(bg, 300*time.Millisecond)
			defer cancel()
			key := "locked"
			if i > 0 {
				key = fmt.Sprintf("queued-%d", i) // grouped behind the stuck statement
			}
			errs[i] = s.Remember(ctx, key, 0, nil)
		}()
	}
	wg.Wait()
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("callers returned after %v, want about their 300ms deadline", took)
	}
	if !errors.Is(errs[0], context.DeadlineExceeded) {
		t.Errorf("the caller behind the lock: %v, want a deadline error", errs[0])
	}
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(bg, 5*time.Second)
	defer cancel()
	if err := s.Remember(ctx, "after", 0, nil); err != nil {
		t.Fatalf("after the lock went: %v", err)
	}
	if seen, err := stores.Seen(ctx, s, "after"); err != nil || !seen {
		t.Fatalf("after the lock went: seen %v, %v", seen, err)
	}
}

// TestBurstSharesOneStatement: callers that become runnable at the same
// moment (a statement just released them) share one statement, the first of
// them included, instead of the first going alone and the rest after it.
// The first caller can only share when it waits for the others, so a store
// that sends it alone never takes a burst in one statement.
func TestBurstSharesOneStatement(t *testing.T) {
	db := testenv.Postgres(t)
	db.SetMaxOpenConns(8)
	db.SetMaxIdleConns(8)
	s := newStore(t, db, postgresstore.WithRowClaims()) // the grouped statements of claims of rows
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	const bursts, callers = 20, 8
	single := 0
	for b := range bursts {
		before := s.StatementCount()
		for _, err := range burst(callers, func(c int) error {
			_, err := stores.Seen(ctx, s, fmt.Sprintf("burst-%d-%d", b, c))
			return err
		}) {
			if err != nil {
				t.Error(err)
			}
		}
		if s.StatementCount()-before == 1 {
			single++
		}
	}
	if single == 0 {
		t.Fatalf("no burst of %d callers shared one statement in %d bursts", callers, bursts)
	}
	t.Logf("%d of %d bursts of %d callers took one statement", single, bursts, callers)
}

// TestAsynchronousCommitTurnsOffTheFlush: with WithAsynchronousCommit the
// statements that write records, alone and grouped, turn synchronous_commit
// off for their own transaction (the implicit one a statement runs in,
// whose commit then does not wait for the disk); without the option they
// leave it on. Each statement runs here inside a transaction that is then
// asked for the setting and rolled back.
func TestAsynchronousCommitTurnsOffTheFlush(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	keys := []string{postgresstore.RowKey("async-a"), postgresstore.RowKey("async-b")}
	for _, c := range []struct {
		name string
		opts []postgresstore.Option
		want string
	}{
		{"durable", nil, "on"},
		{"WithAsynchronousCommit", []postgresstore.Option{postgresstore.WithAsynchronousCommit()}, "off"},
	} {
		s := newStore(t, db, c.opts...)
		for name, run := range map[string]func(tx *sql.Tx) error{
			"alone": func(tx *sql.Tx) error {
				_, err := tx.ExecContext(ctx, s.Statements()["remember"], keys[0], nil, nil, "holder", 1)
				return err
			},
			"grouped": func(tx *sql.Tx) error {
				_, err := tx.ExecContext(ctx, s.Statements()["remember-many"], "{"+keys[0]+","+keys[1]+"}", "{NULL,NULL}", "{a,b}", "{1,2}")
				return err
			},
		} {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := run(tx); err != nil {
				t.Fatalf("%s, %s: %v", c.name, name, err)
			}
			var got string
			if err := tx.QueryRowContext(ctx, `SHOW synchronous_commit`).Scan(&got); err != nil {
				t.Fatal(err)
			}
			_ = tx.Rollback()
			if got != c.want {
				t.Errorf("%s, record written %s: synchronous_commit %q in its transaction, want %q", c.name, name, got, c.want)
			}
		}
	}
}

// TestGroupPauseWaitsOnlyWhileBusy: the session's round trips wait for more
// calls only while enough claims are held or being taken on it, and
// not at all with WithGroupPause(0); the option refuses what it cannot
// honour.
func TestGroupPauseWaitsOnlyWhileBusy(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, tc := range []struct {
		name string
		opts []postgresstore.Option
		busy time.Duration
	}{
		{"default", nil, 500 * time.Microsecond},
		{"WithGroupPause(2ms)", []postgresstore.Option{postgresstore.WithGroupPause(2 * time.Millisecond)}, 2 * time.Millisecond},
		{"WithGroupPause(0)", []postgresstore.Option{postgresstore.WithGroupPause(0)}, 0},
	} {
		s := newStore(t, db, append(tc.opts, postgresstore.WithSessionClaims())...)
		for i := range postgresstore.PauseSiblings + 2 {
			want := time.Duration(0)
			if i >= postgresstore.PauseSiblings {
				want = tc.busy
			}
			if got := s.SessionPause(); got != want {
				t.Errorf("%s, %d claims held: pause %v, want %v", tc.name, i, got, want)
			}
			if claimed, _, err := s.Claim(ctx, fmt.Sprintf("pause-%s-%d", tc.name, i), time.Minute); err != nil || !claimed {
				t.Fatalf("%s: claim %d: %v, %v", tc.name, i, claimed, err)
			}
		}
	}
	for _, d := range []time.Duration{-time.Microsecond, time.Second} {
		if _, err := postgresstore.New(db, postgresstore.WithGroupPause(d)); !errors.Is(err, postgresstore.ErrInvalidOption) {
			t.Errorf("WithGroupPause(%v): %v, want ErrInvalidOption", d, err)
		}
	}
}

// TestGroupPauseGivesWayToTheCaller: a call that leads a paused round trip
// returns by its own deadline, not after the pause.
func TestGroupPauseGivesWayToTheCaller(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- postgresstore.PausedGroupCall(ctx) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("a call under a 50ms deadline was still paused after 30s (the pause is an hour)")
	}
}
