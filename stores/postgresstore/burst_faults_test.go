package postgresstore_test

// Grouped statements under bursts and give-ups, on pgx and lib/pq, and the
// asynchronous commit's setting: where it applies and where it must not.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	_ "github.com/lib/pq" // the "postgres" database/sql driver

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// burst runs n calls released at the same instant and returns their errors.
func burst(n int, call func(i int) error) []error {
	errs := make([]error, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			errs[i] = call(i)
		}()
	}
	time.Sleep(5 * time.Millisecond)
	close(start)
	wg.Wait()
	return errs
}

// TestLibPQBurst: a burst of concurrent calls through lib/pq, grouped into
// shared statements (the first caller yields and carries the others), gets
// its answers: the grouped statements pass their arrays as strings, as
// every driver can (lib/pq refused Go slices).
func TestLibPQBurst(t *testing.T) {
	t.Parallel()
	db := testenv.PostgresWithDriver(t, "postgres")
	db.SetMaxOpenConns(8)
	db.SetMaxIdleConns(8)
	for name, opts := range map[string][]postgresstore.Option{
		"durable":                {},
		"WithAsynchronousCommit": {postgresstore.WithAsynchronousCommit()},
	} {
		t.Run(name, func(t *testing.T) {
			s := newStore(t, db, opts...)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			// Alone: fine.
			if err := s.Remember(ctx, "alone", 7, nil); err != nil {
				t.Fatalf("alone remember with lib/pq: %v", err)
			}
			if seen, fp, err := testenv.LookupFingerprint(s, ctx, "alone"); err != nil || !seen || fp != 7 {
				t.Fatalf("alone seen with lib/pq: %v %d %v", seen, fp, err)
			}
			// A burst of 8.
			var failed []string
			for kind, call := range map[string]func(i int) error{
				"Remember": func(i int) error { return s.Remember(ctx, fmt.Sprintf("r-%d", i), 0, nil) },
				"Seen":     func(i int) error { _, err := stores.Seen(ctx, s, fmt.Sprintf("r-%d", i)); return err },
				"Claim":    func(i int) error { _, _, err := s.Claim(ctx, fmt.Sprintf("c-%d", i), time.Minute); return err },
			} {
				for _, err := range burst(8, call) {
					if err != nil {
						failed = append(failed, kind+": "+err.Error())
						break
					}
				}
			}
			if len(failed) > 0 {
				t.Fatalf("a burst of 8 concurrent calls with lib/pq failed:\n%s", strings.Join(failed, "\n"))
			}
		})
	}
}

// TestAbandonedClaimReadsRacingWrite: a claim whose caller gave up (its
// deadline passed while its op waited in a group) returns without reading
// the op's result, which the statement still carrying the op writes later in
// another goroutine. Run with -race. The test goroutine stays away from pgx,
// fmt and the store's pool between the callers' return and the statement's
// end, because their sync.Pools and mutexes would order the two accesses by
// accident (TestAbandonedGroupedClaimDoesNotParkTheRedelivery is ordered
// that way, so it could not see the race).
func TestAbandonedClaimReadsRacingWrite(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	db.SetMaxOpenConns(8)
	other := testenv.Postgres(t)
	s := newStore(t, db, postgresstore.WithRowClaims(), postgresstore.WithStatementsInFlight(1))
	bg := context.Background()
	table, busyKey := s.Table(), postgresstore.RowKey("busy")
	keys, tokens := make([]string, 4), make([]string, 4)
	ctxs := make([]context.Context, 4)
	for i := range keys {
		keys[i], tokens[i] = fmt.Sprintf("queued-%d", i), fmt.Sprintf("gone-%d", i)
		ctxs[i] = stores.WithClaimToken(bg, tokens[i])
	}

	// Another transaction inserts "busy" uncommitted, and rolls back once
	// the queued callers gave up (a hold of a fixed time could end, on a
	// loaded machine, before the slow claim even waited for it): a claim
	// of "busy" waits for it.
	release, blockerDone := holdUncommittedUntilReleased(t, other, table, busyKey)
	slow := make(chan error, 1)
	go func() {
		_, _, err := s.Claim(bg, "busy", time.Minute)
		slow <- err
	}()
	waitForLockWaiter(t, other, table) // the slow claim holds the only slot

	type result struct {
		claimed bool
		err     error
	}
	results := make([]result, 4)
	var wg sync.WaitGroup
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(ctxs[i], 150*time.Millisecond)
			defer cancel()
			c, _, err := s.Claim(ctx, keys[i], time.Minute)
			results[i] = result{c, err}
		}()
	}
	wg.Wait()
	release()
	time.Sleep(1500 * time.Millisecond) // the blocker rolls back, the queued statement runs (away from pgx meanwhile)
	if err := <-blockerDone; err != nil {
		t.Fatal(err)
	}
	if err := <-slow; err != nil {
		t.Fatal(err)
	}
	for i := range results {
		if results[i].err == nil {
			t.Errorf("%s: claimed %v with no error, want its deadline", keys[i], results[i].claimed)
		}
		if results[i].claimed {
			t.Errorf("%s: Claim returned claimed=true together with error %v", keys[i], results[i].err)
		}
		// The store releases such a claim once the statement carrying it
		// returned: wait for that, up to 10 s.
		var n int
		for start := time.Now(); ; time.Sleep(20 * time.Millisecond) {
			if err := other.QueryRowContext(bg, `SELECT count(*) FROM `+table+` WHERE key = $1 AND claim = $2`,
				postgresstore.RowKey(keys[i]), tokens[i]).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n == 0 || time.Since(start) > 10*time.Second {
				break
			}
		}
		if n != 0 {
			t.Errorf("%s: the claim taken for a caller that gave up is still held 10 s later", keys[i])
		}
	}
}

// TestBurstAbandonedClaimReadsRacingWrite is the same race through
// the yielding caller's path: a burst of claims released together, one of them on a
// key another transaction is inserting; the caller that finds the free
// slot yields, takes the others queued meanwhile and starts the statement
// in a goroutine (go g.carry); every caller gives up at its deadline and
// reads o.claimed while that statement is still to write it.
func TestBurstAbandonedClaimReadsRacingWrite(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out three one-second row locks")
	}
	db := testenv.Postgres(t)
	db.SetMaxOpenConns(8)
	db.SetMaxIdleConns(8)
	other := testenv.Postgres(t)
	s := newStore(t, db, postgresstore.WithStatementsInFlight(1))
	bg := context.Background()
	table := s.Table()
	const rounds, callers = 3, 5
	var keys, tokens [rounds][callers]string
	var ctxs [rounds][callers]context.Context
	for r := range rounds {
		for i := range callers {
			keys[r][i], tokens[r][i] = fmt.Sprintf("b%d-%d", r, i), fmt.Sprintf("gone-%d-%d", r, i)
			ctxs[r][i] = stores.WithClaimToken(bg, tokens[r][i])
		}
	}
	var gaveUp [rounds][callers]bool
	for r := range rounds {
		busyKey := postgresstore.RowKey(keys[r][0])
		blockerDone := holdUncommitted(t, other, table, busyKey, 500*time.Millisecond)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range callers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				ctx, cancel := context.WithTimeout(ctxs[r][i], 100*time.Millisecond)
				defer cancel()
				_, _, err := s.Claim(ctx, keys[r][i], time.Minute)
				gaveUp[r][i] = err != nil
			}()
		}
		time.Sleep(5 * time.Millisecond)
		close(start)
		wg.Wait()
		time.Sleep(time.Second) // the blocker rolls back, the carried statement runs
		if err := <-blockerDone; err != nil {
			t.Fatal(err)
		}
	}
	for r := range rounds {
		for i := range callers {
			if !gaveUp[r][i] {
				continue
			}
			var n int
			if err := other.QueryRowContext(bg, `SELECT count(*) FROM `+table+` WHERE key = $1 AND claim = $2`,
				postgresstore.RowKey(keys[r][i]), tokens[r][i]).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n != 0 {
				t.Errorf("%s: the claim taken for a caller that gave up is still held", keys[r][i])
			}
		}
	}
}

// TestBurstAbandonedClaimsAreReleased: bursts of claims, one of them
// on a key another transaction is inserting (so the statement carrying it
// waits), all with a short deadline. Whoever leads (the yielding slot
// yielding caller or a queued leader), every caller returns by its
// deadline, and no claim taken for a caller that gave up stays held.
func TestBurstAbandonedClaimsAreReleased(t *testing.T) {
	db := testenv.Postgres(t)
	db.SetMaxOpenConns(8)
	db.SetMaxIdleConns(8)
	other := testenv.Postgres(t)
	s := newStore(t, db, postgresstore.WithQueryTimeout(2*time.Second))
	bg := context.Background()

	const rounds, callers, deadline = 4, 6, 150 * time.Millisecond
	var late atomic.Int32
	type gone struct{ key, token string }
	var mu sync.Mutex
	var abandoned []gone
	for r := range rounds {
		blocker, err := other.BeginTx(bg, nil)
		if err != nil {
			t.Fatal(err)
		}
		busy := fmt.Sprintf("busy-%d", r)
		if _, err := blocker.ExecContext(bg, `INSERT INTO `+s.Table()+` (key, expires_at, claim) VALUES ($1, NULL, 'other')`,
			postgresstore.RowKey(busy)); err != nil {
			t.Fatal(err)
		}
		burst(callers, func(i int) error {
			key := fmt.Sprintf("k-%d-%d", r, i)
			if i == 0 {
				key = busy
			}
			token := fmt.Sprintf("tok-%d-%d", r, i)
			ctx, cancel := context.WithTimeout(stores.WithClaimToken(bg, token), deadline)
			defer cancel()
			start := time.Now()
			claimed, _, err := s.Claim(ctx, key, time.Minute)
			if took := time.Since(start); took > deadline+250*time.Millisecond {
				late.Add(1)
			}
			if err != nil {
				mu.Lock()
				abandoned = append(abandoned, gone{key, token})
				mu.Unlock()
			} else if !claimed && key != busy {
				t.Errorf("%s: not claimed and no error", key)
			}
			return err
		})
		if err := blocker.Rollback(); err != nil {
			t.Fatal(err)
		}
	}
	if n := late.Load(); n > 0 {
		t.Errorf("%d callers returned well after their %v deadline", n, deadline)
	}
	// Give the carried statements and their undos time to finish.
	time.Sleep(time.Second)
	held := 0
	for _, g := range abandoned {
		var n int
		if err := db.QueryRowContext(bg, `SELECT count(*) FROM `+s.Table()+` WHERE key = $1 AND claim = $2`,
			postgresstore.RowKey(g.key), g.token).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			held++
			t.Errorf("%s: claim of %s still held though its caller got an error", g.key, g.token)
		}
	}
	t.Logf("%d callers gave up, %d of their claims left held", len(abandoned), held)
	// And the store serves at once afterwards: no slot leaked.
	ctx, cancel := context.WithTimeout(bg, time.Second)
	defer cancel()
	if _, _, err := s.Claim(ctx, "after", time.Minute); err != nil {
		t.Fatalf("after the bursts: %v", err)
	}
}

// TestNoMoreStatementsThanInFlight: with WithStatementsInFlight(2),
// bursts of remembers of a row another transaction holds locked, callers
// giving up after 50ms, never have more than 2 statements waiting at the
// server at once (besides cancelled ones the server has not yet dropped),
// and once the lock goes the store serves again.
func TestNoMoreStatementsThanInFlight(t *testing.T) {
	db := testenv.Postgres(t)
	db.SetMaxOpenConns(16)
	db.SetMaxIdleConns(16)
	other := testenv.Postgres(t)
	const maxInFlight = 2
	s := newStore(t, db, postgresstore.WithStatementsInFlight(maxInFlight), postgresstore.WithQueryTimeout(3*time.Second))
	bg := context.Background()
	if err := s.Remember(bg, "locked", 0, nil); err != nil {
		t.Fatal(err)
	}
	tx, err := other.BeginTx(bg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback() //nolint:errcheck
	if _, err := tx.ExecContext(bg, `SELECT 1 FROM `+s.Table()+` WHERE key = $1 FOR UPDATE`, postgresstore.RowKey("locked")); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	maxSeen := make(chan int, 1)
	go func() {
		most := 0
		for {
			select {
			case <-stop:
				maxSeen <- most
				return
			case <-time.After(10 * time.Millisecond):
			}
			var n int
			if err := other.QueryRowContext(bg, `SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE 'INSERT INTO "`+s.Table()+`"%' AND pid <> pg_backend_pid()`).Scan(&n); err == nil && n > most {
				most = n
			}
		}
	}()
	for range 6 {
		burst(6, func(i int) error {
			ctx, cancel := context.WithTimeout(bg, 50*time.Millisecond)
			defer cancel()
			return s.Remember(ctx, "locked", 0, nil)
		})
		time.Sleep(30 * time.Millisecond)
	}
	close(stop)
	// A statement whose caller gave up is cancelled on the server after its
	// slot passed on (the driver returns at once and sends the cancel
	// request on its way): on a loaded machine the server can still show it
	// active beside the two that took the slots. Allow for that, and still
	// tell the bound from none: without it a burst puts 6 at the server.
	const lingering = 2
	if most := <-maxSeen; most > maxInFlight+lingering {
		t.Errorf("%d remember statements at the server at once, want at most %d (and %d cancelled ones not yet gone)", most, maxInFlight, lingering)
	} else {
		t.Logf("at most %d remember statements at the server at once", most)
	}
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(bg, 2*time.Second)
	defer cancel()
	for i := range 2 * maxInFlight {
		if err := s.Remember(ctx, fmt.Sprintf("after-%d", i), 0, nil); err != nil {
			t.Fatalf("after the lock went: %v", err)
		}
	}
}

// TestAsyncSettingDoesNotLeak: set_config(..., true) in the record's
// statement must end with that statement's implicit transaction: on a pool
// of one connection, a remember (alone, grouped, and enough times for a
// generic plan) leaves synchronous_commit as the session had it, with pgx
// and with lib/pq.
func TestAsyncSettingDoesNotLeak(t *testing.T) {
	t.Parallel()
	for driver, open := range map[string]func(testing.TB) *sql.DB{
		"pgx": func(t testing.TB) *sql.DB { return testenv.Postgres(t) },
		"pq":  func(t testing.TB) *sql.DB { return testenv.PostgresWithDriver(t, "postgres") },
		"pgx-simple-protocol": func(t testing.TB) *sql.DB {
			testenv.Postgres(t)
			db, err := sql.Open("pgx", testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN)+"&default_query_exec_mode=simple_protocol")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = db.Close() })
			return db
		},
	} {
		t.Run(driver, func(t *testing.T) {
			db := open(t)
			db.SetMaxOpenConns(1)
			db.SetMaxIdleConns(1)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			s := newStore(t, db, postgresstore.WithAsynchronousCommit())
			for i := range 8 {
				if err := s.Remember(ctx, fmt.Sprintf("alone-%d", i%3), uint64(i+1), nil); err != nil {
					t.Fatal(err)
				}
			}
			var got string
			if err := db.QueryRowContext(ctx, `SHOW synchronous_commit`).Scan(&got); err != nil {
				t.Fatal(err)
			}
			if got != "on" {
				t.Fatalf("after an asynchronous record, the pooled connection has synchronous_commit %q, want on", got)
			}
			if driver != "pq" { // grouped statements need pgx (see TestLibPQBurst)
				for _, err := range burst(6, func(i int) error { return s.Remember(ctx, fmt.Sprintf("g-%d", i), 0, nil) }) {
					if err != nil {
						t.Fatal(err)
					}
				}
				if err := db.QueryRowContext(ctx, `SHOW synchronous_commit`).Scan(&got); err != nil {
					t.Fatal(err)
				}
				if got != "on" {
					t.Fatalf("after grouped asynchronous records: synchronous_commit %q, want on", got)
				}
			}
		})
	}
}

// TestAsyncCommitSeenInTheRecordsTransaction: a trigger on the
// table notes synchronous_commit as the record's own (implicit) transaction
// has it, for an insert and for the ON CONFLICT DO UPDATE path (over a
// claim, over a record), alone and grouped, with a schema-qualified table,
// WithTTL(0) and a TTL, grouped and WithoutGrouping. Then the records must
// read back with their fingerprints.
func TestAsyncCommitSeenInTheRecordsTransaction(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	db.SetMaxOpenConns(8)
	db.SetMaxIdleConns(8)
	bg := context.Background()
	schema := "burst_" + testenv.RandomHex(4)
	if _, err := db.ExecContext(bg, `CREATE SCHEMA `+schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), `DROP SCHEMA `+schema+` CASCADE`) })
	if _, err := db.ExecContext(bg, `CREATE TABLE `+schema+`.notes (op text, sc text);
		CREATE FUNCTION `+schema+`.note() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN INSERT INTO `+schema+`.notes VALUES (TG_OP, current_setting('synchronous_commit')); RETURN NEW; END $$`); err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, c := range []struct {
		name string
		opts []postgresstore.Option
	}{
		{"ttl0", nil},
		{"ttl", []postgresstore.Option{postgresstore.WithTTL(time.Hour)}},
		{"ungrouped", []postgresstore.Option{postgresstore.WithoutGrouping()}},
		{"ungrouped-ttl", []postgresstore.Option{postgresstore.WithoutGrouping(), postgresstore.WithTTL(time.Hour)}},
	} {
		t.Run(c.name, func(t *testing.T) {
			n++
			table := fmt.Sprintf("%s.Rec%d", schema, n)
			s, err := postgresstore.New(db, append([]postgresstore.Option{postgresstore.WithTable(table),
				postgresstore.WithAsynchronousCommit()}, c.opts...)...)
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Migrate(bg); err != nil {
				t.Fatal(err)
			}
			quoted := fmt.Sprintf(`%s."Rec%d"`, schema, n)
			if _, err := db.ExecContext(bg, `TRUNCATE `+schema+`.notes;
				CREATE TRIGGER note AFTER INSERT OR UPDATE ON `+quoted+` FOR EACH ROW EXECUTE FUNCTION `+schema+`.note()`); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(bg, 10*time.Second)
			defer cancel()
			const hi = uint64(math.MaxUint64 - 5) // all 64 bits kept
			// Insert alone; update over a record; update over a claim.
			if err := s.Remember(ctx, "a", 1, nil); err != nil {
				t.Fatal(err)
			}
			if err := s.Remember(ctx, "a", hi, nil); err != nil {
				t.Fatal(err)
			}
			if claimed, _, err := s.Claim(ctx, "claimed", time.Minute); err != nil || !claimed {
				t.Fatalf("claim: %v %v", claimed, err)
			}
			if err := s.Remember(ctx, "claimed", 9, nil); err != nil {
				t.Fatal(err)
			}
			// A burst: inserts and updates over a claim, grouped when grouping is on.
			for i := range 3 {
				if _, _, err := s.Claim(ctx, fmt.Sprintf("bc-%d", i), time.Minute); err != nil {
					t.Fatal(err)
				}
			}
			for _, err := range burst(6, func(i int) error {
				key := fmt.Sprintf("b-%d", i)
				if i < 3 {
					key = fmt.Sprintf("bc-%d", i)
				}
				return s.Remember(ctx, key, uint64(100+i), nil)
			}) {
				if err != nil {
					t.Fatal(err)
				}
			}
			// Every write ran with synchronous_commit off in its transaction.
			rows, err := db.QueryContext(ctx, `SELECT op, sc, count(*) FROM `+schema+`.notes GROUP BY 1, 2 ORDER BY 1, 2`)
			if err != nil {
				t.Fatal(err)
			}
			var notes []string
			for rows.Next() {
				var op, sc string
				var k int
				if err := rows.Scan(&op, &sc, &k); err != nil {
					t.Fatal(err)
				}
				notes = append(notes, fmt.Sprintf("%s/%s x%d", op, sc, k))
			}
			rows.Close()
			// Claims insert durably by design: only record writes count.
			var durableRecords int
			if err := db.QueryRowContext(ctx, `SELECT count(*) FROM `+schema+`.notes WHERE sc <> 'off' AND op = 'UPDATE'`).Scan(&durableRecords); err != nil {
				t.Fatal(err)
			}
			if durableRecords > 0 {
				t.Errorf("%d record updates committed with synchronous_commit on; notes: %v", durableRecords, notes)
			}
			var asyncWrites int
			if err := db.QueryRowContext(ctx, `SELECT count(*) FROM `+schema+`.notes WHERE sc = 'off'`).Scan(&asyncWrites); err != nil {
				t.Fatal(err)
			}
			// a insert, a update, claimed update, 3 bc updates, 3 b inserts
			if asyncWrites != 9 {
				t.Errorf("%d writes with synchronous_commit off, want 9; notes: %v", asyncWrites, notes)
			}
			// Read back.
			for key, want := range map[string]uint64{"a": hi, "claimed": 9, "bc-0": 100, "bc-2": 102, "b-3": 103, "b-5": 105} {
				seen, fp, err := testenv.LookupFingerprint(s, ctx, key)
				if err != nil || !seen || fp != want {
					t.Errorf("%s: seen %v fingerprint %d err %v, want true %d", key, seen, fp, err, want)
				}
				rec, err := s.Lookup(ctx, key)
				if err != nil || rec.State != stores.StateRemembered {
					t.Errorf("%s: inspect %+v %v, want remembered", key, rec, err)
				}
				if (s.Capabilities().TTL == 0) != rec.ExpiresAt.IsZero() {
					t.Errorf("%s: expires %v with TTL %v", key, rec.ExpiresAt, s.Capabilities().TTL)
				}
			}
			// The claim is gone: another holder cannot claim a remembered key.
			if claimed, _, err := s.Claim(stores.WithClaimToken(ctx, "someone"), "claimed", time.Minute); err != nil || claimed {
				t.Errorf("claim over a remembered key: %v %v", claimed, err)
			}
		})
	}
}

// TestClosedPoolDoesNotHang: every call on a closed pool returns an
// error at once (a statement that fails before reaching the server still
// settles its callers and frees its slot), in bursts, repeatedly.
func TestClosedPoolDoesNotHang(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	s := newStore(t, db)
	closed, err := sql.Open("pgx", testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN))
	if err != nil {
		t.Fatal(err)
	}
	_ = closed.Close()
	cs, err := postgresstore.New(closed, postgresstore.WithTable(s.Table()), postgresstore.WithAsynchronousCommit())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for range 5 {
		for _, err := range burst(6, func(i int) error {
			key := fmt.Sprint("k", i) // a key each: a claim of a key being claimed here is in flight, with no statement
			switch i % 3 {
			case 0:
				return cs.Remember(ctx, key, 0, nil)
			case 1:
				_, err := stores.Seen(ctx, cs, key)
				return err
			default:
				_, _, err := cs.Claim(ctx, key, time.Minute)
				return err
			}
		}) {
			if err == nil || errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("on a closed pool: %v, want its error at once", err)
			}
		}
	}
}

// holdUncommitted inserts key into table in a transaction on db that stays
// open for hold, then rolls back by itself (a claim of key waits for it
// meanwhile), and returns the channel that gets that transaction's error
// once it ended.
func holdUncommitted(t *testing.T, db *sql.DB, table, key string, hold time.Duration) <-chan error {
	t.Helper()
	return holdInTransaction(t, db, hold, `INSERT INTO `+table+` (key, expires_at, claim) VALUES ($1, NULL, 'other')`, key)
}

// waitForLockWaiter waits until a statement on table waits for a row lock
// at the server (as seen from db, a pool the test uses for nothing else
// meanwhile): the statement that holds the store's only slot is in place.
func waitForLockWaiter(t *testing.T, db *sql.DB, table string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for {
		var n int
		err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND position($1 in query) > 0 AND pid <> pg_backend_pid()`, table).Scan(&n)
		if err != nil {
			t.Fatalf("waiting for a statement on %s to wait for a lock: %v", table, err)
		}
		if n > 0 {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// holdLocked locks key's row of table (SELECT … FOR UPDATE) in a
// transaction on db that stays open for hold, then rolls back by itself,
// and returns the channel that gets that transaction's error once it ended.
func holdLocked(t *testing.T, db *sql.DB, table, key string, hold time.Duration) <-chan error {
	t.Helper()
	return holdInTransaction(t, db, hold, `SELECT 1 FROM `+table+` WHERE key = $1 FOR UPDATE`, key)
}

// holdUncommittedUntilReleased inserts key into table in a transaction on
// db that stays open until release is called (or the test ends), then
// rolls back, and returns release and the channel that gets that
// transaction's error (nil) once it ended.
func holdUncommittedUntilReleased(t *testing.T, db *sql.DB, table, key string) (release func(), done <-chan error) {
	t.Helper()
	return holdUntilReleased(t, db, `INSERT INTO `+table+` (key, expires_at, claim) VALUES ($1, NULL, 'other')`, key)
}

// holdUntilReleased runs query in a transaction on db that stays open
// until release is called (or the test ends), then rolls back, and returns
// release and the channel that gets that transaction's error once it ended.
func holdUntilReleased(t *testing.T, db *sql.DB, query string, args ...any) (release func(), done <-chan error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	tx, err := db.BeginTx(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.ExecContext(ctx, query, args...); err != nil {
		_ = tx.Rollback()
		t.Fatal(err)
	}
	ended := make(chan error, 1)
	go func() {
		<-ctx.Done()
		ended <- tx.Rollback()
	}()
	return cancel, ended
}

// holdLockedUntilReleased locks key's row of table in a transaction on db
// (SELECT … FOR UPDATE) that stays open until release is called (or the
// test ends), as holdUncommittedUntilReleased does: the row stays locked
// however long the caller takes to reach it on a loaded machine.
func holdLockedUntilReleased(t *testing.T, db *sql.DB, table, key string) (release func(), done <-chan error) {
	t.Helper()
	return holdUntilReleased(t, db, `SELECT 1 FROM `+table+` WHERE key = $1 FOR UPDATE`, key)
}

// holdInTransaction runs query in a transaction on db that stays open for
// hold, then rolls back by itself, and returns the channel that gets that
// transaction's error once it ended.
func holdInTransaction(t *testing.T, db *sql.DB, hold time.Duration, query string, args ...any) <-chan error {
	t.Helper()
	bg := context.Background()
	ready, done := make(chan error, 1), make(chan error, 1)
	go func() {
		tx, err := db.BeginTx(bg, nil)
		if err == nil {
			_, err = tx.ExecContext(bg, query, args...)
		}
		ready <- err
		if err != nil {
			return
		}
		_, err = tx.ExecContext(bg, `SELECT pg_sleep($1)`, hold.Seconds())
		_ = tx.Rollback()
		done <- err
	}()
	if err := <-ready; err != nil {
		t.Fatal(err)
	}
	return done
}

// TestGroupedStatementRetriedAfterADeadlock: a grouped statement chosen as
// a deadlock's victim (another transaction holds one of its keys and then
// waits for another it holds) runs again (the run after the deadlock can
// meet the other transaction once more), so its callers get their records, on pgx and on lib/pq alike (the deadlock is known by its
// SQLSTATE, which both drivers report).
func TestGroupedStatementRetriedAfterADeadlock(t *testing.T) {
	t.Parallel()
	for name, open := range map[string]func(testing.TB) *sql.DB{
		"pgx":    testenv.Postgres,
		"lib/pq": func(t testing.TB) *sql.DB { return testenv.PostgresWithDriver(t, "postgres") },
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel() // its own table, pools and holder
			db, other := open(t), open(t)
			db.SetMaxOpenConns(4)
			s := newStore(t, db, postgresstore.WithStatementsInFlight(1))
			bg := context.Background()
			ctx, cancel := context.WithTimeout(bg, 30*time.Second)
			defer cancel()
			// Two keys in the order the grouped statement locks them (sorted
			// row keys), and a third to hold the statement slot meanwhile.
			ka, kb := "deadlock-a", "deadlock-b"
			if postgresstore.RowKey(ka) > postgresstore.RowKey(kb) {
				ka, kb = kb, ka
			}
			insert := `INSERT INTO ` + s.Table() + ` (key, expires_at, claim) VALUES ($1, NULL, 'other')`
			holder, err := other.BeginTx(ctx, nil) // holds kb, later asks for ka
			if err != nil {
				t.Fatal(err)
			}
			defer holder.Rollback() //nolint:errcheck
			if _, err := holder.ExecContext(ctx, insert, postgresstore.RowKey(kb)); err != nil {
				t.Fatal(err)
			}
			slotDone := holdUncommitted(t, other, s.Table(), postgresstore.RowKey("deadlock-slot"), 300*time.Millisecond)
			first := make(chan error, 1)
			go func() { first <- s.Remember(ctx, "deadlock-slot", 0, nil) }() // waits for the slot's row
			time.Sleep(100 * time.Millisecond)
			grouped := make(chan error, 2)
			for _, k := range []string{ka, kb} {
				go func() { grouped <- s.Remember(ctx, k, 0, nil) }() // queued: one statement for both
			}
			<-slotDone
			if err := <-first; err != nil {
				t.Fatal(err)
			}
			time.Sleep(200 * time.Millisecond) // the grouped statement holds ka and waits for kb
			// The holder asks for ka: a deadlock, whose victim is the grouped
			// statement (it has waited longer, so its check runs first).
			_, lockErr := holder.ExecContext(ctx, insert, postgresstore.RowKey(ka))
			_ = holder.Rollback() // lets the statement's second run through
			for range 2 {
				if err := <-grouped; err != nil {
					t.Fatalf("grouped remember after a deadlock (the holder's insert: %v): %v", lockErr, err)
				}
			}
			for _, k := range []string{ka, kb} {
				if seen, err := stores.Seen(ctx, s, k); err != nil || !seen {
					t.Fatalf("%s: seen %v, %v; want remembered", k, seen, err)
				}
			}
		})
	}
}

// TestDeadlineErrorMatchesTheContext: a call that its deadline cut short
// (its row held by another transaction) returns an error matching
// context.DeadlineExceeded on pgx and on lib/pq alike (lib/pq reports the
// server's "canceling statement due to user request").
func TestDeadlineErrorMatchesTheContext(t *testing.T) {
	t.Parallel()
	for name, open := range map[string]func(testing.TB) *sql.DB{
		"pgx":    testenv.Postgres,
		"lib/pq": func(t testing.TB) *sql.DB { return testenv.PostgresWithDriver(t, "postgres") },
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel() // its own table and pools
			db, other := open(t), open(t)
			// Claims of rows: a claim's INSERT waits on the held row. (A
			// session claim takes the key's lock, which the raw INSERT
			// below does not, and reads past the uncommitted row:
			// TestCallsReturnByTheirDeadline covers its deadline.)
			s := newStore(t, db, postgresstore.WithRowClaims())
			// The row stays held until both calls returned, however long
			// they take on a loaded machine (a hold of a fixed second let
			// the second call through: "remember cut short by its
			// deadline: <nil>").
			release, done := holdUncommittedUntilReleased(t, other, s.Table(), postgresstore.RowKey("held"))
			for call, f := range map[string]func(context.Context) error{
				"remember": func(ctx context.Context) error { return s.Remember(ctx, "held", 0, nil) },
				"claim":    func(ctx context.Context) error { _, _, err := s.Claim(ctx, "held", time.Minute); return err },
			} {
				ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
				began := time.Now()
				err := f(ctx)
				cancel()
				if !errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("%s cut short by its deadline: %v after %v; want an error matching context.DeadlineExceeded", call, err, time.Since(began))
				}
			}
			release()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
		})
	}
}
