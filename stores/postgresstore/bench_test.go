package postgresstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/babelqueue/watermill-idempotency/internal/proccpu"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency/watermillsql"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// BenchmarkDelivery: the middleware with postgresstore per delivery, side
// by side (testenv.RunSideBySide: every iteration runs all three, so they
// share the load, including PostgreSQL's background writes and the WAL
// flushes of the first-seen paths) with two bare baselines over the same
// connection pool:
//
//   - same-SQL: the very statements the store issues for that path, with
//     the same arguments, straight through database/sql. kit/same-SQL is
//     the kit's overhead over its wire cost.
//   - hand-SQL: what a hand-written guard would issue (a primary-key
//     SELECT, an INSERT … ON CONFLICT), on a table without the fingerprint
//     and with no expiry or claim checks on the database clock.
func BenchmarkDelivery(b *testing.B) {
	db := testenv.Postgres(b)
	db.SetMaxOpenConns(48)
	db.SetMaxIdleConns(48)
	// Watermill hands handlers cancelable message contexts, so the driver
	// watches the context on all sides, as in production.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	store := newStore(b, db, postgresstore.WithTTL(time.Hour))
	hand := store.Table() + "_hand"
	if _, err := db.ExecContext(ctx, `CREATE TABLE `+hand+` (key uuid PRIMARY KEY, expires_at bigint, claim text)`); err != nil {
		b.Fatal(err)
	}
	defer db.ExecContext(ctx, `DROP TABLE `+hand) //nolint:errcheck
	// The same statements on a table of their own.
	bare := newStore(b, db, postgresstore.WithTTL(time.Hour)).Statements()

	handSeen := `SELECT EXISTS (SELECT 1 FROM ` + hand + ` WHERE key = $1 AND claim IS NULL)`
	handRemember := `INSERT INTO ` + hand + ` (key, expires_at) VALUES ($1, $2) ON CONFLICT (key) DO UPDATE SET expires_at = EXCLUDED.expires_at, claim = NULL`
	handClaim := `INSERT INTO ` + hand + ` (key, expires_at, claim) VALUES ($1, $2, 'c') ON CONFLICT (key) DO NOTHING`

	plain, claimed := testenv.KitDeliveries(b, ctx, store)
	exec := func(q string, args ...any) {
		if _, err := db.ExecContext(ctx, q, args...); err != nil {
			b.Fatal(err)
		}
	}
	// query scans the columns of the row q returns, if any.
	query := func(q string, columns int, args ...any) {
		dest := make([]any, columns)
		for i := range dest {
			dest[i] = new(any)
		}
		if err := db.QueryRowContext(ctx, q, args...).Scan(dest...); err != nil && !errors.Is(err, sql.ErrNoRows) {
			b.Fatal(err)
		}
	}
	key := func(env *testenv.Envelope) string { return postgresstore.RowKey(idempotency.Key("", env.ID())) }
	// lock stands for the key's advisory lock, which the Remember tries shared.
	const fingerprint, leaseMS, lock = int64(7331), int64(60000), int64(1)
	expiry := time.Now().Add(time.Hour).UnixMilli()
	testenv.RunCases(b, testenv.RunSideBySide, "same-SQL", "hand-SQL", []testenv.Case{
		{Name: "first", Kit: plain,
			Same: func(env *testenv.Envelope) {
				k := key(env)
				query(bare["lookup"], 5, k)
				exec(bare["remember"], k, fingerprint, nil, "tok", lock)
			},
			Hand: func(env *testenv.Envelope) {
				query(handSeen, 1, env.ID())
				exec(handRemember, env.ID(), expiry)
			}},
		{Name: "first-claim", Kit: claimed,
			Same: func(env *testenv.Envelope) {
				k := key(env)
				exec(bare["claim"], k, leaseMS, "tok")
				exec(bare["remember"], k, fingerprint, nil, "tok", lock)
			},
			Hand: func(env *testenv.Envelope) {
				exec(handClaim, env.ID(), expiry)
				exec(handRemember, env.ID(), expiry)
			}},
		{Name: "dup", Dup: true, Kit: plain,
			Same:      func(env *testenv.Envelope) { query(bare["lookup"], 5, key(env)) },
			SameSetup: func(env *testenv.Envelope) { exec(bare["remember"], key(env), fingerprint, nil, "tok", lock) },
			Hand:      func(env *testenv.Envelope) { query(handSeen, 1, env.ID()) },
			HandSetup: func(env *testenv.Envelope) { exec(handRemember, env.ID(), expiry) }},
		{Name: "dup-claim", Dup: true, Kit: claimed,
			Same: func(env *testenv.Envelope) {
				k := key(env)
				exec(bare["claim"], k, leaseMS, "tok")
				query(bare["claim-row"], 8, k, "tok")
			},
			SameSetup: func(env *testenv.Envelope) { exec(bare["remember"], key(env), fingerprint, nil, "tok", lock) },
			Hand: func(env *testenv.Envelope) {
				exec(handClaim, env.ID(), expiry)
				query(handSeen, 1, env.ID())
			},
			HandSetup: func(env *testenv.Envelope) { exec(handRemember, env.ID(), expiry) }},
	})
}

// BenchmarkTransactional: deliveries of a handler that credits an account,
// with the transactional inbox (record and credit in one transaction), with
// the inbox and the outbox (record, credit and one produced message in one
// transaction), with the plain store (credit, then the record), and the
// credit alone with no idempotency at all.
func BenchmarkTransactional(b *testing.B) {
	db := testenv.Postgres(b)
	db.SetMaxOpenConns(32)
	db.SetMaxIdleConns(32)
	ctx := context.Background()
	store := newStore(b, db, postgresstore.WithTTL(time.Hour))
	accounts := store.Table() + "_accounts"
	if _, err := db.ExecContext(ctx, `CREATE TABLE `+accounts+` (id int PRIMARY KEY, cents bigint NOT NULL);
		INSERT INTO `+accounts+` SELECT g, 0 FROM generate_series(0, 255) g`); err != nil {
		b.Fatal(err)
	}
	defer db.ExecContext(ctx, `DROP TABLE `+accounts) //nolint:errcheck
	credit := `UPDATE ` + accounts + ` SET cents = cents + 1 WHERE id = $1`
	var account atomic.Uint32 // spread the writes over 256 rows
	autocommit := func(msg *message.Message) ([]*message.Message, error) {
		_, err := db.ExecContext(msg.Context(), credit, account.Add(1)%256)
		return nil, err
	}
	inTx := func(msg *message.Message) ([]*message.Message, error) {
		tx, ok := postgresstore.TxFromContext(msg.Context())
		if !ok {
			b.Fatal("no transaction")
		}
		_, err := tx.ExecContext(msg.Context(), credit, account.Add(1)%256)
		return nil, err
	}
	// The outbox: the same credit, and one follow-up message written to the
	// outbox table in the transaction (the relay publishes it afterwards,
	// outside the delivery, and is not measured).
	outboxTopic := store.Table() + "_outbox"
	outbox, err := watermillsql.NewOutbox(ctx, db, watermillsql.OutboxConfig{Topic: outboxTopic})
	if err != nil {
		b.Fatal(err)
	}
	defer db.ExecContext(ctx, fmt.Sprintf(`DROP TABLE "watermill_%s", "watermill_offsets_%s"`, outboxTopic, outboxTopic)) //nolint:errcheck
	followUp := []byte(`{"job":"urn:babel:bench:credited","trace_id":"7c1b1d8e-0c1e-4c2b-9a54-0e1d2f3a4b5c","data":{"account":1},"meta":{"id":"f0d8b5f1-5c55-4c8a-9d8b-3f2c1e0a9b7d","queue":"credited","lang":"go","schema_version":1,"created_at":1700000000000},"attempts":0}`)
	inTxOutbox := func(msg *message.Message) ([]*message.Message, error) {
		if _, err := inTx(msg); err != nil {
			return nil, err
		}
		pub, ok := idempotency.OutboxFromContext(msg.Context())
		if !ok {
			b.Fatal("no outbox")
		}
		follow := message.NewMessage("follow", followUp)
		follow.SetContext(msg.Context())
		return nil, pub.Publish("credited", follow)
	}
	variants := []struct {
		name string
		h    message.HandlerFunc
	}{
		{"write-alone", autocommit},
		{"plain-store", idempotency.Middleware(store)(autocommit)},
		{"transactional", idempotency.Middleware(store, idempotency.WithTransaction(db))(inTx)},
		{"transactional+outbox", idempotency.Middleware(store, idempotency.WithTransaction(db), idempotency.WithOutbox(outbox.Publisher))(inTxOutbox)},
	}
	deliver := func(b *testing.B, h message.HandlerFunc) func(env *testenv.Envelope, next func() uint64) {
		return func(env *testenv.Envelope, next func() uint64) {
			env.SetID(next())
			if _, err := h(message.NewMessage("bench", env.Payload)); err != nil {
				b.Fatal(err)
			}
		}
	}
	// Interleaved: every iteration delivers one message through each
	// variant, so a busy machine weighs on all alike; the outbox first, so
	// its ratios to the others are reported.
	b.Run("side-by-side/c=1", func(b *testing.B) {
		sides := make([]testenv.Side, 0, len(variants))
		for i := len(variants) - 1; i >= 0; i-- {
			sides = append(sides, testenv.Side{Name: variants[i].name, Op: deliver(b, variants[i].h)})
		}
		testenv.RunSideBySide(b, 1, sides...)
	})
	for _, c := range []int{1, 16} {
		for _, v := range variants {
			b.Run(fmt.Sprintf("%s/c=%d", v.name, c), func(b *testing.B) {
				testenv.RunConcurrently(b, c, deliver(b, v.h))
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "deliveries/s")
			})
		}
	}
}

// BenchmarkRealWork: deliveries of a handler that does what a payment
// handler does, one transaction per message (BEGIN, one INSERT, COMMIT),
// alone and in the kit's transactional modes, the four side by side at the
// concurrency of bench/e2e's consumers (testenv.RunSideBySide: every
// iteration of every goroutine runs each side once, so the machine's load
// weighs on all alike):
//
//   - sql-alone: the handler's own transaction through database/sql;
//   - sql-transactional: WithTransaction, the INSERT in the transaction it
//     hands the handler;
//   - pgx-alone: the handler's own transaction on a pgx pool;
//   - pgx-transactional: WithPgxTransaction, the INSERT in its transaction.
//
// Each side's time per delivery is reported ("<side>-µs"); at a fixed
// concurrency, alone's time over a side's is that side's share of the
// handler's throughput (sql-alone/sql-transactional is reported; divide
// pgx-alone-µs by pgx-transactional-µs for the pgx mode). The store's
// grouped statements (the claim and seen-set modes) are measured end to end
// (bench/e2e -handler write): interleaved with other sides here, their
// groups would wait on statements that carry few calls.
func BenchmarkRealWork(b *testing.B) {
	const concurrency = 32
	db := testenv.Postgres(b)
	db.SetMaxOpenConns(2 * concurrency)
	db.SetMaxIdleConns(2 * concurrency)
	pool := testenv.PgxPool(b, 2*concurrency)
	ctx := context.Background()
	store := newStore(b, db, postgresstore.WithTTL(time.Hour))
	effects := store.Table() + "_effects"
	if _, err := db.ExecContext(ctx, `CREATE TABLE `+effects+` (message_id text PRIMARY KEY, amount_cents bigint NOT NULL)`); err != nil {
		b.Fatal(err)
	}
	defer db.ExecContext(ctx, `DROP TABLE `+effects) //nolint:errcheck
	insert := `INSERT INTO ` + effects + ` (message_id, amount_cents) VALUES ($1, 129900)`
	sqlTx := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if tx, ok := postgresstore.TxFromContext(ctx); ok {
			_, err := tx.ExecContext(ctx, insert, msg.UUID)
			return nil, err
		}
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return nil, err
		}
		defer tx.Rollback() //nolint:errcheck // after Commit: a no-op
		if _, err := tx.ExecContext(ctx, insert, msg.UUID); err != nil {
			return nil, err
		}
		return nil, tx.Commit()
	}
	pgxTx := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if tx, ok := idempotency.PgxTxFromContext(ctx); ok {
			_, err := tx.Exec(ctx, insert, msg.UUID)
			return nil, err
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			return nil, err
		}
		defer tx.Rollback(ctx) //nolint:errcheck // after Commit: a no-op
		if _, err := tx.Exec(ctx, insert, msg.UUID); err != nil {
			return nil, err
		}
		return nil, tx.Commit(ctx)
	}
	sides := []struct {
		name, against string
		h             message.HandlerFunc
	}{
		{"sql-alone", "", sqlTx},
		{"sql-transactional", "", idempotency.Middleware(store, idempotency.WithTransaction(db))(sqlTx)},
		// The same mode recording with RememberTx after its own BEGIN (a
		// TxStore without BeginTx): the upsert BeginTx's plain INSERT
		// replaces.
		{"sql-transactional-upsert", "", idempotency.Middleware(struct{ stores.TxStore }{store}, idempotency.WithTransaction(db))(sqlTx)},
		{"pgx-alone", "", pgxTx},
		{"pgx-transactional", "pgx-alone", idempotency.Middleware(store, idempotency.WithPgxTransaction(pool))(pgxTx)},
	}
	run := make([]testenv.Side, len(sides))
	for i, s := range sides {
		run[i] = testenv.Side{Name: s.name, Against: s.against, Op: func(env *testenv.Envelope, next func() uint64) {
			env.SetID(next())
			if _, err := s.h(message.NewMessage(watermill.NewUUID(), env.Payload)); err != nil {
				b.Fatal(err)
			}
		}}
	}
	b.Run(fmt.Sprintf("c=%d", concurrency), func(b *testing.B) { testenv.RunSideBySide(b, concurrency, run...) })
}

// BenchmarkSessionDelivery: a claim and its record through session claims
// (the default), 32 callers at once (16 per GOMAXPROCS on two cores), so
// that the session's round trips carry many of them together as under a
// busy consumer. Its allocations per delivery are the store's (plus one
// key and one claim token a delivery here); its time is mostly the round
// trips' wait. Read with -benchmem.
func BenchmarkSessionDelivery(b *testing.B) {
	db := testenv.Postgres(b)
	store := newStore(b, db)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var n atomic.Int64
	prefix := testenv.RandomHex(4) + "-"
	b.SetParallelism(32 / max(1, runtime.GOMAXPROCS(0)))
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			key := prefix + strconv.FormatInt(n.Add(1), 10)
			c := stores.WithClaimToken(ctx, key)
			if ok, _, err := store.Claim(c, key, time.Minute); err != nil || !ok {
				b.Errorf("Claim(%s) = %v, %v; want a claim", key, ok, err)
				return
			}
			if err := store.Remember(c, key, 7, nil); err != nil {
				b.Errorf("Remember(%s): %v", key, err)
				return
			}
		}
	})
}

// BenchmarkSessionRoundServerCPU: what one round trip of the session's own
// statements costs the server, in CPU time of the server process that runs
// it (read from /proc: skipped for a server on another machine), as a busy
// session sends them one after the other: the records of the keys the
// round trip before claimed (fresh claims: plain inserts, each lock given
// back) and the locks and the read of keys new claims. Each size runs with
// the commit's WAL flush (sync, the default) and without it (async:
// synchronous_commit off for the round trip, as WithAsynchronousCommit),
// beside a round trip of one empty statement (floor). Read
// server-µs/round; ns/op is the round trip's wall time. Nothing else runs
// on the connection, so the figures are the statements' own cost, without
// the cache misses and wake-ups of a busy machine.
func BenchmarkSessionRoundServerCPU(b *testing.B) {
	db := testenv.Postgres(b)
	store := newStore(b, db)
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN))
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = conn.Close(ctx) }()
	var pid int
	// Planned once, generically, as the session's statements are.
	if err := conn.QueryRow(ctx, `SELECT pg_backend_pid(), set_config('plan_cache_mode', 'force_generic_plan', false)`).Scan(&pid, nil); err != nil {
		b.Fatal(err)
	}
	if comm, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/comm"); err != nil || !strings.HasPrefix(string(comm), "postgres") {
		b.Skipf("the server process %d is not on this machine: its CPU time cannot be read", pid)
	}
	records, locks, read := store.SessionRoundStatements()
	prefix := testenv.RandomHex(4) + "-"
	var made int
	claim := func(k int) (keys, lockArray string) {
		rowKeys := make([]string, k)
		lockKeys := make([]int64, k)
		for i := range rowKeys {
			made++
			key := prefix + strconv.Itoa(made)
			rowKeys[i], lockKeys[i] = postgresstore.RowKey(key), store.RowLock(key)
		}
		return postgresstore.QuotedArray(k, func(i int) string { return rowKeys[i] }),
			postgresstore.IntArray(k, func(i int) int64 { return lockKeys[i] })
	}
	send := func(batch *pgx.Batch) {
		if err := conn.SendBatch(ctx, batch).Close(); err != nil {
			b.Fatal(err)
		}
	}
	sendOne := func(sql string, args ...any) {
		batch := &pgx.Batch{}
		batch.Queue(sql, args...)
		send(batch)
	}
	measure := func(b *testing.B, round func()) {
		before := proccpu.Of(pid)
		b.ResetTimer()
		for range b.N {
			round()
		}
		b.StopTimer()
		b.ReportMetric(float64((proccpu.Of(pid)-before).Microseconds())/float64(b.N), "server-µs/round")
	}
	b.Run("floor", func(b *testing.B) {
		measure(b, func() { sendOne(`SELECT 1`) })
	})
	for _, k := range []int{1, 8, 16} {
		for _, commit := range []string{"sync", "async"} {
			b.Run(fmt.Sprintf("keys=%d/%s", k, commit), func(b *testing.B) {
				fingerprints := postgresstore.IntArray(k, func(int) int64 { return 7 })
				held, heldLocks := claim(k)
				sendOne(locks, heldLocks)
				defer func() { _, _ = conn.Exec(ctx, `SELECT pg_advisory_unlock_all()`) }()
				measure(b, func() {
					batch := &pgx.Batch{}
					if commit == "async" {
						batch.Queue(`SELECT set_config('synchronous_commit', 'off', true)`)
					}
					batch.Queue(records, held, fingerprints, heldLocks)
					held, heldLocks = claim(k)
					batch.Queue(locks, heldLocks)
					batch.Queue(read, held)
					send(batch)
				})
			})
		}
	}
}
