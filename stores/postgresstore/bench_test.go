package postgresstore_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/internal/testenv"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
)

// BenchmarkDelivery: the middleware with postgresstore per delivery, side by
// side with the bare SQL a hand-written guard would issue (a primary-key
// SELECT, then an INSERT … ON CONFLICT), over the same connection pool.
func BenchmarkDelivery(b *testing.B) {
	db := testenv.Postgres(b)
	db.SetMaxOpenConns(16)
	db.SetMaxIdleConns(16)
	// Watermill hands handlers cancelable message contexts, so the driver
	// watches the context on both sides, as in production.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	store := newStore(b, db, postgresstore.WithTTL(time.Hour))
	raw := store.Table() + "_raw"
	if _, err := db.ExecContext(ctx, `CREATE TABLE `+raw+` (key uuid PRIMARY KEY, expires_at bigint, claim text)`); err != nil {
		b.Fatal(err)
	}
	defer db.ExecContext(ctx, `DROP TABLE `+raw) //nolint:errcheck
	rawSeen := `SELECT EXISTS (SELECT 1 FROM ` + raw + ` WHERE key = $1 AND claim IS NULL)`
	rawRemember := `INSERT INTO ` + raw + ` (key, expires_at) VALUES ($1, $2) ON CONFLICT (key) DO UPDATE SET expires_at = EXCLUDED.expires_at, claim = NULL`
	rawClaim := `INSERT INTO ` + raw + ` (key, expires_at, claim) VALUES ($1, $2, 'c') ON CONFLICT (key) DO NOTHING`

	noop := func(*message.Message) ([]*message.Message, error) { return nil, nil }
	plain := idempotency.Middleware(store)(noop)
	claimed := idempotency.Middleware(store, idempotency.WithClaim(time.Minute))(noop)
	deliver := func(h message.HandlerFunc) func(*testenv.Envelope) {
		return func(env *testenv.Envelope) {
			msg := message.NewMessage("bench", env.Payload)
			msg.SetContext(ctx)
			if _, err := h(msg); err != nil {
				b.Fatal(err)
			}
		}
	}
	exec := func(q string, args ...any) {
		if _, err := db.ExecContext(ctx, q, args...); err != nil {
			b.Fatal(err)
		}
	}
	seen := func(id string) {
		var ok bool
		if err := db.QueryRowContext(ctx, rawSeen, id).Scan(&ok); err != nil {
			b.Fatal(err)
		}
	}
	expiry := time.Now().Add(time.Hour).UnixMilli()
	for _, c := range []int{1, 16} {
		for _, v := range []struct {
			name  string
			dup   bool
			op    func(env *testenv.Envelope)
			setup func(env *testenv.Envelope)
		}{
			{"first/kit", false, deliver(plain), nil},
			{"first/raw-SELECT+INSERT", false, func(env *testenv.Envelope) {
				id := env.ID()
				seen(id)
				exec(rawRemember, id, expiry)
			}, nil},
			{"first/kit-claim", false, deliver(claimed), nil},
			{"first/raw-CLAIM+INSERT", false, func(env *testenv.Envelope) {
				id := env.ID()
				exec(rawClaim, id, expiry)
				exec(rawRemember, id, expiry)
			}, nil},
			{"dup/kit", true, deliver(plain), deliver(plain)},
			{"dup/raw-SELECT", true, func(env *testenv.Envelope) { seen(env.ID()) },
				func(env *testenv.Envelope) { exec(rawRemember, env.ID(), expiry) }},
			{"dup/kit-claim", true, deliver(claimed), deliver(claimed)},
			{"dup/raw-CLAIM+SELECT", true, func(env *testenv.Envelope) {
				id := env.ID()
				exec(rawClaim, id, expiry)
				seen(id)
			}, func(env *testenv.Envelope) { exec(rawRemember, env.ID(), expiry) }},
		} {
			b.Run(fmt.Sprintf("%s/c=%d", v.name, c), func(b *testing.B) {
				testenv.RunConcurrently(b, c, func(env *testenv.Envelope, next func() uint64) {
					if !v.dup {
						env.SetID(next())
					} else if env.ID()[:4] == "0000" {
						env.SetID(1<<62 | next())
						v.setup(env)
					}
					v.op(env)
				})
			})
		}
	}
}

// BenchmarkTransactional: deliveries of a handler that credits an account,
// with the transactional inbox (record and credit in one transaction), with
// the plain store (credit, then the record), and the credit alone with no
// idempotency at all.
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
	for _, c := range []int{1, 16} {
		for _, v := range []struct {
			name string
			h    message.HandlerFunc
		}{
			{"write-alone", autocommit},
			{"plain-store", idempotency.Middleware(store)(autocommit)},
			{"transactional", idempotency.Middleware(store, idempotency.WithTransaction(db))(inTx)},
		} {
			b.Run(fmt.Sprintf("%s/c=%d", v.name, c), func(b *testing.B) {
				testenv.RunConcurrently(b, c, func(env *testenv.Envelope, next func() uint64) {
					env.SetID(next())
					if _, err := v.h(message.NewMessage("bench", env.Payload)); err != nil {
						b.Fatal(err)
					}
				})
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "deliveries/s")
			})
		}
	}
}
