package postgresstore_test

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

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// newPartitioned returns a migrated store on a partitioned table of its
// own (period every, records kept ttl), dropped with its partitions when
// the test ends.
func newPartitioned(t testing.TB, db *sql.DB, every, ttl time.Duration, opts ...postgresstore.Option) *postgresstore.Store {
	t.Helper()
	opts = append([]postgresstore.Option{postgresstore.WithPartitions(every), postgresstore.WithTTL(ttl)}, opts...)
	return newStore(t, db, opts...)
}

// TestPartitionedContract: the partitioned layout keeps every promise of
// the store, RememberTx and the second instance included.
func TestPartitionedContract(t *testing.T) {
	runContract(t, postgresstore.WithPartitions(0), postgresstore.WithTTL(time.Hour))
}

// TestPartitionsRefused: the combinations the layout cannot keep are
// refused by New, and a table of the other layout by Migrate.
func TestPartitionsRefused(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	for name, opts := range map[string][]postgresstore.Option{
		"no TTL":             {postgresstore.WithPartitions(0)},
		"transaction claims": {postgresstore.WithPartitions(0), postgresstore.WithTTL(time.Hour), postgresstore.WithTransactionClaims()},
		"period under 1s":    {postgresstore.WithPartitions(time.Millisecond), postgresstore.WithTTL(time.Hour)},
		"long table name":    {postgresstore.WithPartitions(0), postgresstore.WithTTL(time.Hour), postgresstore.WithTable("a_table_name_far_too_long_for_partition_suffixes_x")},
	} {
		if _, err := postgresstore.New(db, opts...); !errors.Is(err, postgresstore.ErrInvalidOption) {
			t.Errorf("New with partitions and %s: %v, want ErrInvalidOption", name, err)
		}
	}
	plain := newStore(t, db)
	ctx := context.Background()
	for name, opts := range map[string][]postgresstore.Option{
		"a plain table": {postgresstore.WithTable(plain.Table()), postgresstore.WithPartitions(0), postgresstore.WithTTL(time.Hour)},
	} {
		s, err := postgresstore.New(db, opts...)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Migrate(ctx); !errors.Is(err, postgresstore.ErrLayout) {
			t.Errorf("Migrate of partitions on %s: %v, want ErrLayout", name, err)
		}
	}
	daily := newPartitioned(t, db, 0, time.Hour)
	// A transaction above READ COMMITTED would take its snapshot before
	// the key's lock is granted.
	tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	_, _, err = daily.RememberTx(ctx, tx, "repeatable", 1, nil)
	_ = tx.Rollback()
	if err == nil || !strings.Contains(err.Error(), "READ COMMITTED") {
		t.Errorf("RememberTx in a REPEATABLE READ transaction on a partitioned table: %v, want an error naming READ COMMITTED", err)
	}
	for name, opts := range map[string][]postgresstore.Option{
		"another period":   {postgresstore.WithTable(daily.Table()), postgresstore.WithPartitions(time.Hour), postgresstore.WithTTL(time.Hour)},
		"the plain layout": {postgresstore.WithTable(daily.Table())},
	} {
		s, err := postgresstore.New(db, opts...)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Migrate(ctx); !errors.Is(err, postgresstore.ErrLayout) {
			t.Errorf("Migrate with %s on a daily partitioned table: %v, want ErrLayout", name, err)
		}
	}
}

// untilBoundary sleeps until a few milliseconds before the next boundary
// of period on the database's clock.
func untilBoundary(t *testing.T, db *sql.DB, period time.Duration) {
	t.Helper()
	var now int64
	if err := db.QueryRow(`SELECT (extract(epoch from clock_timestamp()) * 1000)::bigint`).Scan(&now); err != nil {
		t.Fatal(err)
	}
	p := period.Milliseconds()
	next := (now/p + 1) * p
	time.Sleep(time.Duration(next-now-3) * time.Millisecond)
}

// duplicateRows returns how many rows the table holds for each row key
// that has more than one.
func duplicateRows(t *testing.T, db *sql.DB, table string) map[string]int {
	t.Helper()
	return testenv.CountsByKey(t, db, `SELECT key::text, count(*) FROM `+table+` GROUP BY key HAVING count(*) > 1`)
}

// TestPartitionBoundaryRace: many deliveries claiming the same keys at
// the moment a partition ends (1 s partitions, the claims fired a few
// milliseconds before the boundary, so that their statements straddle it)
// find exactly one winner per key, and the table holds one row per key
// across its partitions. Remember, RememberTx and Claim of keys written in
// the previous partition find them there.
func TestPartitionBoundaryRace(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("waits for partition boundaries")
	}
	db := testenv.Postgres(t)
	db.SetMaxOpenConns(24)
	db.SetMaxIdleConns(24)
	s := newPartitioned(t, db, time.Second, time.Hour)
	const rounds, keys, claimers = 6, 64, 12
	ctx := context.Background()
	for round := range rounds {
		var wins [keys]atomic.Int32
		var failed atomic.Value
		var wg sync.WaitGroup
		start := make(chan struct{})
		for c := range claimers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				cctx := stores.WithClaimToken(ctx, fmt.Sprintf("holder-%d", c))
				<-start
				// Every claimer claims the keys in the same order: the
				// claims of a key run at once, some before the boundary
				// and some after it.
				for k := range keys {
					claimed, _, err := s.Claim(cctx, fmt.Sprintf("race-%d-%d", round, k), time.Minute)
					if err != nil {
						failed.Store(err)
						return
					}
					if claimed {
						wins[k].Add(1)
					}
				}
			}()
		}
		untilBoundary(t, db, time.Second)
		close(start)
		wg.Wait()
		if err, _ := failed.Load().(error); err != nil {
			t.Fatal(err)
		}
		for k := range keys {
			if n := wins[k].Load(); n != 1 {
				t.Errorf("round %d: key %d was claimed %d times among %d claimers across a partition boundary, want once", round, k, n, claimers)
			}
		}
	}
	if dup := duplicateRows(t, db, s.Table()); len(dup) > 0 {
		t.Errorf("rows of one key in several partitions: %v", dup)
	}
	// The records of the rounds' keys, each in the partition of its claim,
	// are found and finished there by every call.
	key := "race-0-1"
	var holder string
	if err := db.QueryRow(`SELECT claim FROM `+s.Table()+` WHERE key = $1`, postgresstore.RowKey(key)).Scan(&holder); err != nil {
		t.Fatal(err)
	}
	hctx := stores.WithClaimToken(ctx, holder)
	if held, err := s.Extend(hctx, key, time.Minute); err != nil || !held {
		t.Fatalf("Extend of a claim in an older partition: %v, %v", held, err)
	}
	if err := s.Remember(hctx, key, 7, []byte("v")); err != nil {
		t.Fatalf("Remember of a claim in an older partition: %v", err)
	}
	if r, err := s.Lookup(ctx, key); err != nil || r.State != stores.StateRemembered || r.Fingerprint != 7 {
		t.Fatalf("Lookup of a record in an older partition: %+v, %v", r, err)
	}
	if claimed, found, err := s.Claim(ctx, key, time.Minute); err != nil || claimed || found.State != stores.StateRemembered {
		t.Fatalf("Claim of a record in an older partition: %v, %+v, %v", claimed, found, err)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	recorded, found, err := s.RememberTx(ctx, tx, key, 8, nil)
	_ = tx.Rollback()
	if err != nil || recorded || found.Fingerprint != 7 {
		t.Fatalf("RememberTx of a record in an older partition: %v, %+v, %v", recorded, found, err)
	}
	if err := s.Release(stores.WithClaimToken(ctx, "holder-0"), "race-0-2"); err != nil {
		t.Fatal(err)
	}
	if err := s.Forget(ctx, key); err != nil {
		t.Fatal(err)
	}
	if r, err := s.Lookup(ctx, key); err != nil || r.State != stores.StateUnknown {
		t.Fatalf("Lookup after Forget: %+v, %v", r, err)
	}
	if dup := duplicateRows(t, db, s.Table()); len(dup) > 0 {
		t.Errorf("rows of one key in several partitions: %v", dup)
	}
}

// TestPartitionsRoll: DeleteExpired creates the partitions ahead and drops
// those whose every record expired, and keeps one whose record a claim
// renewed past its partition's time; the renewed claim is found there.
func TestPartitionsRoll(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("waits for partitions to age")
	}
	db := testenv.Postgres(t)
	const period, ttl = time.Second, time.Second
	s := newPartitioned(t, db, period, ttl)
	s.SetDropMargin(0)
	ctx := context.Background()
	partitions := func() int {
		var n int
		if err := db.QueryRow(`SELECT count(*) FROM pg_inherits WHERE inhparent = $1::regclass`, s.Table()).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := partitions(); n != 5 {
		t.Fatalf("Migrate created %d partitions, want 5 (the previous period, the current one, 3 ahead)", n)
	}
	for i := range 50 {
		if err := s.Remember(ctx, fmt.Sprintf("short-%d", i), 1, nil); err != nil {
			t.Fatal(err)
		}
	}
	// A claim renewed for longer than its partition's time, in a
	// partition after the records'.
	untilBoundary(t, db, period)
	time.Sleep(10 * time.Millisecond)
	held := stores.WithClaimToken(ctx, "long")
	if claimed, _, err := s.Claim(held, "long", time.Minute); err != nil || !claimed {
		t.Fatalf("Claim: %v, %v", claimed, err)
	}
	var bucket int64
	if err := db.QueryRow(`SELECT bucket FROM `+s.Table()+` WHERE key = $1`, postgresstore.RowKey("long")).Scan(&bucket); err != nil {
		t.Fatal(err)
	}
	var dropped int64
	deadline := time.Now().Add(20 * time.Second)
	for {
		n, err := s.DeleteExpired(ctx)
		if err != nil {
			t.Fatal(err)
		}
		dropped += n
		if dropped >= 50 || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if dropped != 50 {
		t.Fatalf("DeleteExpired dropped partitions holding %d rows in 20 s, want the 50 expired records", dropped)
	}
	var left int
	if err := db.QueryRow(`SELECT count(*) FROM `+s.Table()+` WHERE key = $1 AND bucket = $2`, postgresstore.RowKey("long"), bucket).Scan(&left); err != nil || left != 1 {
		t.Fatalf("the renewed claim's row in its partition: %d rows, %v; want it kept", left, err)
	}
	if r, err := s.Lookup(ctx, "long"); err != nil || r.State != stores.StateInFlight {
		t.Fatalf("Lookup of the renewed claim after rolling: %+v, %v", r, err)
	}
	if err := s.Remember(held, "long", 3, nil); err != nil {
		t.Fatal(err)
	}
	// Partitions ahead are created as time goes on.
	before := time.Now()
	if _, err := s.DeleteExpired(ctx); err != nil {
		t.Fatal(err)
	}
	var newest int64
	if err := db.QueryRow(`SELECT max(substring(c.relname from '_p([0-9]+)$')::bigint) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = $1::regclass`, s.Table()).Scan(&newest); err != nil {
		t.Fatal(err)
	}
	if ahead := time.UnixMilli(newest).Sub(before); ahead < 2*period {
		t.Errorf("the newest partition starts %v from now, want at least 2 periods ahead", ahead)
	}
}

// BenchmarkLayouts times a first-seen Claim, its Remember and a Lookup,
// one call at a time, on the plain table and on a partitioned one holding
// a week of daily partitions (12).
func BenchmarkLayouts(b *testing.B) {
	db := testenv.Postgres(b)
	ctx := context.Background()
	for _, layout := range []string{"plain", "partitioned"} {
		var s *postgresstore.Store
		if layout == "plain" {
			s = newStore(b, db, postgresstore.WithTTL(7*24*time.Hour))
		} else {
			s = newPartitioned(b, db, 0, 7*24*time.Hour)
			day := (24 * time.Hour).Milliseconds()
			today := time.Now().UnixMilli() / day * day
			for d := int64(2); d <= 8; d++ {
				if _, err := db.Exec(fmt.Sprintf(`CREATE TABLE "%[1]s_p%[2]d" PARTITION OF %[1]s FOR VALUES FROM (%[2]d) TO (%[3]d)`,
					s.Table(), today-d*day, today-(d-1)*day)); err != nil {
					b.Fatal(err)
				}
			}
		}
		prefix := testenv.RandomHex(4)
		var n atomic.Int64 // keys never seen, whatever b.N's runs
		b.Run(layout+"/ClaimRemember", func(b *testing.B) {
			for range b.N {
				key := fmt.Sprintf("%s-%d", prefix, n.Add(1))
				if claimed, _, err := s.Claim(ctx, key, time.Minute); err != nil || !claimed {
					b.Fatal(claimed, err)
				}
				if err := s.Remember(ctx, key, 1, nil); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(layout+"/Lookup", func(b *testing.B) {
			for i := range b.N {
				if _, err := s.Lookup(ctx, fmt.Sprintf("%s-%d", prefix, i)); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
