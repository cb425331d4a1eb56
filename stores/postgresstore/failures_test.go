package postgresstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// twoFailures is a count of two failed runs, the first a minute ago, the
// next due in a second, to the millisecond the store keeps.
func twoFailures() stores.Failure {
	now := time.Now()
	return stores.Failure{Attempts: 2, FirstFailure: now.Add(-time.Minute).Truncate(time.Millisecond),
		NotBefore: now.Add(time.Second).Truncate(time.Millisecond)}
}

// anEnd is the end of a message dead-lettered after three runs.
func anEnd(marker string) stores.Failure {
	f := twoFailures()
	f.Attempts, f.NotBefore = 3, time.Time{}
	f.End = &stores.End{Reason: "failed", At: time.Now().Truncate(time.Millisecond), Topic: "orders.dlq", Marker: marker}
	return f
}

// sameFailure fails t unless got is want.
func sameFailure(t *testing.T, got, want stores.Failure, when string) {
	t.Helper()
	same := got.Attempts == want.Attempts && got.FirstFailure.Equal(want.FirstFailure) && got.NotBefore.Equal(want.NotBefore) &&
		(got.End == nil) == (want.End == nil)
	if same && got.End != nil {
		g, w := *got.End, *want.End
		same = g.Reason == w.Reason && g.At.Equal(w.At) && g.Topic == w.Topic && g.Marker == w.Marker
	}
	if !same {
		t.Fatalf("%s: failure %+v (end %+v), want %+v (end %+v)", when, got, got.End, want, want.End)
	}
}

// oldSchema is the table as the store created it before it kept failures.
const oldSchema = `CREATE TABLE %s (
    key         uuid   PRIMARY KEY,
    expires_at  bigint,
    claim       text,
    fingerprint bigint,
    value       bytea
)`

// TestMigrateFromTheSchemaWithoutFailures: a table of the previous schema
// (no failure column), with a record, a value and a live claim in it, is
// brought up to date in place by Migrate: the rows are kept and read as
// before, and failing and ended records are kept from then on. The
// partitioned layout, its existing partition included, is migrated the
// same way.
func TestMigrateFromTheSchemaWithoutFailures(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	ctx := context.Background()
	for _, layout := range []string{"plain", "partitioned"} {
		t.Run(layout, func(t *testing.T) {
			table := "idem_old_" + testenv.RandomHex(4)
			t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), `DROP TABLE IF EXISTS `+table) })
			opts := []postgresstore.Option{postgresstore.WithTable(table), postgresstore.WithTTL(time.Hour)}
			now := time.Now().UnixMilli()
			if layout == "plain" {
				// Claims of rows, as the workers of the earlier schema kept.
				opts = append(opts, postgresstore.WithRowClaims())
				mustExec(t, db, fmt.Sprintf(oldSchema, table))
			} else {
				const period = int64(24 * time.Hour / time.Millisecond)
				bucket := now / period * period
				opts = append(opts, postgresstore.WithPartitions(0))
				mustExec(t, db, fmt.Sprintf(`CREATE TABLE %[1]s (
					key uuid NOT NULL, expires_at bigint NOT NULL, claim text, fingerprint bigint, value bytea,
					bucket bigint NOT NULL DEFAULT ((extract(epoch from statement_timestamp()) * 1000)::bigint / %[2]d * %[2]d),
					PRIMARY KEY (key, bucket)) PARTITION BY RANGE (bucket);
					COMMENT ON TABLE %[1]s IS 'watermill-idempotency: partitioned every %[2]d ms';
					CREATE TABLE %[1]s_p%[3]d PARTITION OF %[1]s FOR VALUES FROM (%[3]d) TO (%[4]d)`, table, period, bucket, bucket+period))
			}
			// Rows the previous version wrote: a record with a fingerprint,
			// one with a value, and a live claim.
			mustExec(t, db, fmt.Sprintf(`INSERT INTO %s (key, expires_at, claim, fingerprint, value) VALUES
				('%s', %d, NULL, 42, NULL), ('%s', %d, NULL, 7, '\x616e73776572'), ('%s', %d, 'old-holder', NULL, NULL)`,
				table, postgresstore.RowKey("remembered"), now+3600_000, postgresstore.RowKey("valued"), now+3600_000,
				postgresstore.RowKey("claimed"), now+3600_000))

			s, err := postgresstore.New(db, opts...)
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Migrate(ctx); err != nil {
				t.Fatalf("Migrate of a table without the failure column: %v", err)
			}
			var columns int
			if err := db.QueryRowContext(ctx, `SELECT count(*) FROM information_schema.columns WHERE table_name = $1 AND column_name = 'failure' AND data_type = 'jsonb'`,
				table).Scan(&columns); err != nil || columns != 1 {
				t.Fatalf("after Migrate the table has %d failure columns of type jsonb (%v), want 1", columns, err)
			}
			if err := s.Migrate(ctx); err != nil {
				t.Fatalf("Migrate again: %v", err)
			}
			if r, err := s.Lookup(ctx, "remembered"); err != nil || !r.Remembered() || r.Fingerprint != 42 {
				t.Fatalf("an old record after Migrate = %+v, %v; want remembered with fingerprint 42", r, err)
			}
			if r, err := s.Lookup(ctx, "valued"); err != nil || string(r.Value) != "answer" {
				t.Fatalf("an old record with a value after Migrate = %+v, %v; want its value", r, err)
			}
			if ok, found, err := s.Claim(ctx, "claimed", time.Minute); err != nil || ok || found.State != stores.StateInFlight {
				t.Fatalf("Claim of a key an old claim holds = %v, %+v, %v; want in flight", ok, found, err)
			}
			// The new records, in the migrated table, the old rows' partition
			// included.
			f := twoFailures()
			if err := s.Fail(ctx, "failing", 9, f); err != nil {
				t.Fatal(err)
			}
			if err := s.Fail(ctx, "remembered", 9, f); err != nil {
				t.Fatal(err)
			}
			if r, err := s.Lookup(ctx, "remembered"); err != nil || !r.Remembered() {
				t.Fatalf("an old record after Fail = %+v, %v; want remembered", r, err)
			}
			r, err := s.Lookup(ctx, "failing")
			if err != nil || r.State != stores.StateFailing || r.Fingerprint != 9 {
				t.Fatalf("Lookup of a failing key = %+v, %v; want failing with fingerprint 9", r, err)
			}
			sameFailure(t, r.Failure, f, "Lookup of a failing key")
			ok, found, err := s.Claim(ctx, "failing", time.Minute)
			if err != nil || !ok || found.State != stores.StateFailing {
				t.Fatalf("Claim of a failing key = %v, %+v, %v; want claimed with the count", ok, found, err)
			}
			sameFailure(t, found.Failure, f, "Claim of a failing key")

			// Workers of the previous release beside this one: they read a
			// row with a claim as in flight and one without as remembered
			// (their claim's SELECT: claim IS NULL), so a failing or ended
			// record must not look remembered to them (they would ack the
			// message unrun), and their Remember (which leaves the failure
			// column alone) must leave a remembered record.
			if err := s.Fail(ctx, "ended", 0, anEnd("")); err != nil {
				t.Fatal(err)
			}
			for _, key := range []string{"failing", "ended"} {
				var remembered bool
				if err := db.QueryRowContext(ctx, `SELECT claim IS NULL FROM `+table+` WHERE key = $1`, postgresstore.RowKey(key)).Scan(&remembered); err != nil || remembered {
					t.Fatalf("an earlier worker reads the %s record as remembered (%v): it would ack the message unrun", key, err)
				}
			}
			mustExec(t, db, `UPDATE `+table+` SET claim = NULL, fingerprint = 9 WHERE key = '`+postgresstore.RowKey("failing")+`'`)
			if r, err := s.Lookup(ctx, "failing"); err != nil || !r.Remembered() || r.Failure.Attempts != 0 {
				t.Fatalf("a key an earlier worker remembered over its count = %+v, %v; want remembered, no count", r, err)
			}
			if ok, found, err := s.Claim(stores.WithClaimToken(ctx, "next"), "failing", time.Minute); err != nil || ok || !found.Remembered() {
				t.Fatalf("Claim of a key an earlier worker remembered over its count = %v, %+v, %v; want the record found", ok, found, err)
			}
		})
	}
}

func mustExec(t *testing.T, db *sql.DB, query string) {
	t.Helper()
	if _, err := db.ExecContext(context.Background(), query); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
}

// TestBeginOverFailures: BEGIN with the record (BeginPgx, BeginTx through
// pgx and lib/pq), on the plain and the partitioned layout, records a key
// whose runs failed before and reports the count, which a rollback leaves
// as it was and a commit drops; an ended key is not recorded, the end is
// found.
func TestBeginOverFailures(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	ctx := context.Background()
	for _, layout := range []string{"plain", "partitioned"} {
		var s *postgresstore.Store
		if layout == "plain" {
			s = newStore(t, db, postgresstore.WithTTL(time.Hour))
		} else {
			s = newPartitioned(t, db, 0, time.Hour)
		}
		for name, begin := range beginners(t, s) {
			t.Run(layout+"/"+name, func(t *testing.T) {
				key := "failing-" + layout + "-" + name
				f := twoFailures()
				if err := s.Fail(ctx, key, 31, f); err != nil {
					t.Fatal(err)
				}
				b := mustBegin(t, begin, key, 31, nil)
				if !b.recorded || b.found.State != stores.StateFailing || b.found.Fingerprint != 31 {
					t.Fatalf("begin over a failing key = %v, %+v; want recorded, the failing record found", b.recorded, b.found)
				}
				sameFailure(t, b.found.Failure, f, "the record begin over a failing key found")
				if err := b.rollback(); err != nil {
					t.Fatal(err)
				}
				if r, err := s.Lookup(ctx, key); err != nil || r.State != stores.StateFailing || r.Failure.Attempts != 2 {
					t.Fatalf("after the rollback the key is %+v, %v; want failing, 2 runs", r, err)
				}
				b = mustBegin(t, begin, key, 31, []byte("done"))
				if !b.recorded || b.found.Failure.Attempts != 2 {
					t.Fatalf("begin over a failing key again = %v, %+v; want recorded with 2 runs", b.recorded, b.found)
				}
				if err := b.commit(); err != nil {
					t.Fatal(err)
				}
				if r, err := s.Lookup(ctx, key); err != nil || !r.Remembered() || r.Failure.Attempts != 0 || string(r.Value) != "done" {
					t.Fatalf("after the commit the key is %+v, %v; want remembered with its value and no count", r, err)
				}

				ended := "ended-" + layout + "-" + name
				end := anEnd("")
				if err := s.Fail(ctx, ended, 32, end); err != nil {
					t.Fatal(err)
				}
				b = mustBegin(t, begin, ended, 32, nil)
				if b.recorded || b.found.State != stores.StateEnded || b.found.Fingerprint != 32 {
					t.Fatalf("begin over an ended key = %v, %+v; want not recorded, the end found", b.recorded, b.found)
				}
				sameFailure(t, b.found.Failure, end, "the end begin found")
				if err := b.rollback(); err != nil {
					t.Fatal(err)
				}
			})
		}
	}
}

// TestDeleteExpiredKeepsACountBehindALapsedClaim: a claim that carries a
// count of failures and lapses (its holder died) leaves the count behind:
// DeleteExpired, which removes lapsed claims, keeps it on either layout
// until the count's own expiry, and the next claim takes it over.
func TestDeleteExpiredKeepsACountBehindALapsedClaim(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	ctx := context.Background()
	for _, layout := range []string{"plain", "partitioned"} {
		t.Run(layout, func(t *testing.T) {
			var s *postgresstore.Store
			if layout == "plain" {
				s = newStore(t, db, postgresstore.WithTTL(time.Hour))
			} else {
				s = newPartitioned(t, db, time.Second, time.Hour)
			}
			dies := stores.WithClaimToken(ctx, "dies")
			if ok, _, err := s.Claim(dies, "plain-lapsed", 50*time.Millisecond); err != nil || !ok {
				t.Fatal(ok, err)
			}
			if ok, _, err := s.Claim(dies, "k", 50*time.Millisecond); err != nil || !ok {
				t.Fatal(ok, err)
			}
			f := twoFailures()
			if err := s.Fail(dies, "k", 5, f); err != nil {
				t.Fatal(err)
			}
			deadline := time.Now().Add(10 * time.Second)
			for {
				r, err := s.Lookup(ctx, "k")
				if err != nil {
					t.Fatal(err)
				}
				if r.State == stores.StateFailing {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("the claim of 50ms still %v after 10s", r.State)
				}
				time.Sleep(20 * time.Millisecond)
			}
			if _, err := s.DeleteExpired(ctx); err != nil {
				t.Fatal(err)
			}
			r, err := s.Lookup(ctx, "k")
			if err != nil || r.State != stores.StateFailing {
				t.Fatalf("after DeleteExpired a lapsed claim carrying a count is %+v, %v; want the failing record", r, err)
			}
			sameFailure(t, r.Failure, f, "Lookup after DeleteExpired")
			if r, err := s.Lookup(ctx, "plain-lapsed"); err != nil || r.State != stores.StateUnknown {
				t.Fatalf("after DeleteExpired a lapsed claim without a count is %+v, %v; want unknown", r, err)
			}
			ok, found, err := s.Claim(stores.WithClaimToken(ctx, "next"), "k", time.Minute)
			if err != nil || !ok || found.State != stores.StateFailing || found.Fingerprint != 5 {
				t.Fatalf("Claim after the holder died = %v, %+v, %v; want claimed with the count", ok, found, err)
			}
			sameFailure(t, found.Failure, f, "Claim after the holder died")
		})
	}
}

// TestPartitionKeptForALateCount: on the partitioned layout, a claim
// renewed long after its partition's period and then failed carries a
// count that outlives every expiry its partition otherwise holds: the
// partition is not dropped while the count lives (before: only the rows'
// expires_at counted, and the count went with the partition).
func TestPartitionKeptForALateCount(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out a partition period and a retention (6 s)")
	}
	t.Parallel()
	db := testenv.Postgres(t)
	ctx := context.Background()
	const period, ttl = time.Second, 4 * time.Second
	s := newPartitioned(t, db, period, ttl)
	s.SetDropMargin(0)
	holder := stores.WithClaimToken(ctx, "holder")
	if ok, _, err := s.Claim(holder, "k", time.Second); err != nil || !ok {
		t.Fatal(ok, err)
	}
	var bucket int64
	if err := db.QueryRowContext(ctx, `SELECT bucket FROM `+s.Table()+` WHERE key = $1`, postgresstore.RowKey("k")).Scan(&bucket); err != nil {
		t.Fatal(err)
	}
	// The holder works on for 3 s, renewing its claim, then fails.
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		if held, err := s.Extend(holder, "k", time.Second); err != nil || !held {
			t.Fatalf("Extend = %v, %v", held, err)
		}
	}
	f := twoFailures()
	if err := s.Fail(holder, "k", 5, f); err != nil {
		t.Fatal(err)
	}
	// Once the partition's period ended a retention ago, and the claim
	// lapsed (the holder died), the count still lives.
	dbNow := func() int64 {
		var now int64
		if err := db.QueryRowContext(ctx, `SELECT (extract(epoch from statement_timestamp()) * 1000)::bigint`).Scan(&now); err != nil {
			t.Fatal(err)
		}
		return now
	}
	for dbNow() <= bucket+(period+ttl).Milliseconds() {
		time.Sleep(50 * time.Millisecond)
	}
	var r stores.Record
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		var err error
		if r, err = s.Lookup(ctx, "k"); err != nil || r.State == stores.StateFailing {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the claim of 1 s is still %v 10 s after its holder died", r.State)
		}
	}
	if _, err := s.DeleteExpired(ctx); err != nil {
		t.Fatal(err)
	}
	r, err := s.Lookup(ctx, "k")
	if err != nil || r.State != stores.StateFailing {
		t.Fatalf("after DeleteExpired the key is %+v, %v; want failing: its partition was dropped with a live count", r, err)
	}
	sameFailure(t, r.Failure, f, "Lookup after DeleteExpired")
	if time.Now().After(r.ExpiresAt) {
		t.Skipf("the machine took past the count's expiry (%v) to get here: nothing was shown", r.ExpiresAt)
	}
}

// TestGroupedLookupsOfFailures: concurrent Lookups share grouped
// statements; each gets its key's state and count (failing, ended, a
// claim carrying a count, remembered, unknown).
func TestGroupedLookupsOfFailures(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	db.SetMaxOpenConns(8)
	db.SetMaxIdleConns(8)
	ctx := context.Background()
	s := newStore(t, db, postgresstore.WithTTL(time.Hour))
	holder := stores.WithClaimToken(ctx, "holder")
	f, end := twoFailures(), anEnd("m")
	if err := s.Fail(ctx, "failing", 1, f); err != nil {
		t.Fatal(err)
	}
	if err := s.Fail(ctx, "ended", 2, end); err != nil {
		t.Fatal(err)
	}
	if ok, _, err := s.Claim(holder, "claimed", time.Minute); err != nil || !ok {
		t.Fatal(ok, err)
	}
	if err := s.Fail(holder, "claimed", 3, f); err != nil {
		t.Fatal(err)
	}
	if err := s.Remember(ctx, "remembered", 4, nil); err != nil {
		t.Fatal(err)
	}
	keys := []string{"failing", "ended", "claimed", "remembered", "unknown"}
	want := map[string]stores.State{"failing": stores.StateFailing, "ended": stores.StateEnded, "claimed": stores.StateInFlight,
		"remembered": stores.StateRemembered, "unknown": stores.StateUnknown}
	attempts := map[string]int{"failing": 2, "ended": 3, "claimed": 2}
	shared := 0
	for round := range 20 {
		before := s.StatementCount()
		for _, err := range burst(len(keys), func(i int) error {
			key := keys[i]
			r, err := s.Lookup(ctx, key)
			switch {
			case err != nil:
				return fmt.Errorf("round %d: Lookup(%q): %w", round, key, err)
			case r.State != want[key] || r.Failure.Attempts != attempts[key]:
				return fmt.Errorf("round %d: Lookup(%q) = %v with %d runs, want %v with %d", round, key, r.State, r.Failure.Attempts, want[key], attempts[key])
			case key == "ended" && (r.Failure.End == nil || r.Failure.End.Marker != "m"):
				return fmt.Errorf("round %d: the end found is %+v, want marker m", round, r.Failure.End)
			}
			return nil
		}) {
			if err != nil {
				t.Error(err)
			}
		}
		if s.StatementCount()-before < uint64(len(keys)) {
			shared++
		}
	}
	if shared == 0 {
		t.Fatal("no burst of Lookups shared a statement in 20: the grouped statement was not exercised")
	}
}

// TestTxClaimFailKeepsTheClaimAcrossWorkers: under WithTransactionClaims,
// a holder's Fail keeps its claim (its transaction commits the count and
// locks the row again): another worker finds the message in flight with
// its count, even once the count's committed claim outlived its lease
// while the holder renews; a holder that releases leaves the count to the
// next claim at once; a holder whose session dies leaves it too, and the
// other worker takes the message over with it.
func TestTxClaimFailKeepsTheClaimAcrossWorkers(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	ctx := context.Background()
	const wait = 50 * time.Millisecond
	a := newTxStore(t, db, postgresstore.WithTTL(time.Hour), postgresstore.WithClaimWait(wait))
	b, err := postgresstore.New(testenv.Postgres(t), postgresstore.WithTable(a.Table()), postgresstore.WithTransactionClaims(),
		postgresstore.WithTTL(time.Hour), postgresstore.WithClaimWait(wait))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.ReleaseAll(context.Background()) })
	holder, other := stores.WithClaimToken(ctx, "a"), stores.WithClaimToken(ctx, "b")
	f := twoFailures()

	// Released: the count is left to the next claim at once.
	if ok, _, err := a.Claim(holder, "released", time.Minute); err != nil || !ok {
		t.Fatal(ok, err)
	}
	if err := a.Fail(holder, "released", 7, f); err != nil {
		t.Fatal(err)
	}
	if err := a.Release(holder, "released"); err != nil {
		t.Fatal(err)
	}
	ok, found, err := b.Claim(other, "released", time.Minute)
	if err != nil || !ok || found.State != stores.StateFailing || found.Fingerprint != 7 {
		t.Fatalf("another worker's Claim after the holder failed and released = %v, %+v, %v; want claimed with the count", ok, found, err)
	}
	sameFailure(t, found.Failure, f, "the count another worker took over")
	if err := b.Release(other, "released"); err != nil {
		t.Fatal(err)
	}

	// Held: in flight with its count, whatever the committed claim's lease.
	const lease = time.Second
	if ok, _, err := a.Claim(holder, "k", lease); err != nil || !ok {
		t.Fatal(ok, err)
	}
	if err := a.Fail(holder, "k", 7, f); err != nil {
		t.Fatal(err)
	}
	if r, err := a.Lookup(ctx, "k"); err != nil || r.State != stores.StateInFlight || r.Failure.Attempts != 2 {
		t.Fatalf("the holder's Lookup after its Fail = %+v, %v; want in flight with 2 runs", r, err)
	}
	if ok, found, err := a.Claim(holder, "k", lease); err != nil || !ok || found.Failure.Attempts != 2 {
		t.Fatalf("the holder's Claim again = %v, %+v, %v; want claimed with 2 runs", ok, found, err)
	}
	ok, found, err = b.Claim(other, "k", time.Minute)
	if err != nil || ok || found.State != stores.StateInFlight || found.Failure.Attempts != 2 {
		t.Fatalf("another worker's Claim after the holder's Fail = %v, %+v, %v; want in flight with 2 runs", ok, found, err)
	}
	for end := time.Now().Add(2 * lease); time.Now().Before(end); time.Sleep(lease / 10) {
		if held, err := a.Extend(holder, "k", lease); err != nil || !held {
			t.Fatalf("the holder's Extend = %v, %v; want held", held, err)
		}
	}
	if ok, found, err := b.Claim(other, "k", time.Minute); err != nil || ok {
		t.Fatalf("another worker's Claim past the committed claim's lease, the holder renewing = %v, %+v, %v; want not claimed", ok, found, err)
	}
	// A long lease now: the server's idle timeout (the lease) must not end
	// the holder's session before the test does, on a loaded machine.
	if held, err := a.Extend(holder, "k", time.Minute); err != nil || !held {
		t.Fatalf("the holder's Extend = %v, %v; want held", held, err)
	}

	// The holder's session dies: the other worker takes the count over.
	var killed int
	if err := db.QueryRowContext(ctx, `SELECT count(pg_terminate_backend(pid)) FROM (SELECT DISTINCT pid FROM pg_locks
		WHERE relation = $1::regclass AND pid <> pg_backend_pid()) l`, a.Table()).Scan(&killed); err != nil || killed != 1 {
		t.Fatalf("terminated %d sessions holding a claim (%v), want 1", killed, err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		ok, found, err = b.Claim(other, "k", time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("another worker's Claim 10 s after the holder died = %+v, want claimed", found)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if found.State != stores.StateFailing || found.Fingerprint != 7 {
		t.Fatalf("the record another worker took over = %+v, want the failing record", found)
	}
	sameFailure(t, found.Failure, f, "the count taken over from a dead holder")
	if err := b.Fail(other, "k", 7, anEnd("")); err != nil {
		t.Fatal(err)
	}
	if r, err := b.Lookup(ctx, "k"); err != nil || r.State != stores.StateEnded {
		t.Fatalf("after the other worker ended the message, it is %+v, %v; want ended", r, err)
	}
}

// TestFailingRecordTakeoverCutShortKeepsTheCount: a Claim takes over a
// failing record while another transaction holds its row locked, and the
// caller's deadline passes while the takeover waits (grouped and not).
// The takeover runs on, detached from the caller: once the lock goes it
// takes the claim for a caller that gave up, and releases it, leaving the
// failing record with its count; the redelivery claims it at once and
// finds the count.
func TestFailingRecordTakeoverCutShortKeepsTheCount(t *testing.T) {
	t.Parallel()
	for name, opts := range map[string][]postgresstore.Option{
		"grouped":         {postgresstore.WithRowClaims()},
		"WithoutGrouping": {postgresstore.WithRowClaims(), postgresstore.WithoutGrouping()},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := testenv.Postgres(t)
			s := newStore(t, db, append([]postgresstore.Option{postgresstore.WithTTL(time.Hour)}, opts...)...)
			bg := context.Background()
			f := twoFailures()
			if err := s.Fail(bg, "k", 3, f); err != nil {
				t.Fatal(err)
			}
			release, locked := holdLockedUntilReleased(t, testenv.Postgres(t), s.Table(), postgresstore.RowKey("k"))
			ctx, cancel := context.WithTimeout(stores.WithClaimToken(bg, "gave-up"), 200*time.Millisecond)
			claimed, _, err := s.Claim(ctx, "k", time.Hour)
			cancel()
			release()
			if claimed || err == nil {
				t.Fatalf("a claim behind a locked failing record = %v, %v; want its deadline", claimed, err)
			}
			if err := <-locked; err != nil {
				t.Fatal(err)
			}
			var r stores.Record
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				if r, err = s.Lookup(bg, "k"); err != nil {
					t.Fatal(err)
				}
				if r.State == stores.StateFailing {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("the key is %v 5 s after the lock went, want failing: the claim taken for the caller that gave up was not released", r.State)
				}
			}
			sameFailure(t, r.Failure, f, "the failing record after the abandoned takeover")
			ok, found, err := s.Claim(stores.WithClaimToken(bg, "redelivery"), "k", time.Hour)
			if err != nil || !ok || found.Failure.Attempts != 2 {
				t.Fatalf("the redelivery's claim = %v, %+v, %v; want claimed with 2 runs", ok, found, err)
			}
		})
	}
}

// TestTxClaimCutShortLeavesNothing: under WithTransactionClaims a Claim
// whose INSERT waits on another transaction's row of the key is cancelled
// (the caller gives up, before its claim wait). pgx closes the connection;
// the server's statement, in a transaction that was never to be committed
// by anyone, takes the row once the other transaction rolls back, and is
// rolled back with its session: nothing of the claim is left, and the
// next delivery claims the key at once.
func TestTxClaimCutShortLeavesNothing(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	s := newTxStore(t, db, postgresstore.WithClaimWait(5*time.Second))
	bg := context.Background()
	release, done := holdUncommittedUntilReleased(t, testenv.Postgres(t), s.Table(), postgresstore.RowKey("k"))
	ctx, cancel := context.WithCancel(stores.WithClaimToken(bg, "gave-up"))
	time.AfterFunc(200*time.Millisecond, cancel)
	start := time.Now()
	claimed, _, err := s.Claim(ctx, "k", time.Hour)
	if claimed || !errors.Is(err, context.Canceled) || time.Since(start) > 2*time.Second {
		t.Fatalf("a transaction claim cancelled while it waits = %v, %v after %v; want the cancellation at once", claimed, err, time.Since(start))
	}
	release()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		ok, found, err := s.Claim(stores.WithClaimToken(bg, "redelivery"), "k", time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the redelivery's claim 5 s after the other transaction ended = %+v: the cancelled claim left something", found)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := s.ReleaseAll(bg); err != nil {
		t.Fatal(err)
	}
	var rows int
	if err := db.QueryRowContext(bg, `SELECT count(*) FROM `+s.Table()).Scan(&rows); err != nil || rows != 0 {
		t.Fatalf("%d rows left in the table (%v), want none", rows, err)
	}
}
