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
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/babelqueue/watermill-idempotency/internal/sqlstate"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestTxPathsCommitReplyDropped: BeginTx, RememberTx and BeginPgx of a key
// the caller claimed, in every claim mode, then the reply to the caller's
// COMMIT lost on the way back (the server committed; the connection drops
// with the reply). The commit returns at once with pgx's closed
// connection (no SQLSTATE: the commit's fate unknown), the effect
// and the record are there once, the holder's Release (what the
// middleware does after a failed delivery) is no ErrClaimTaken, the
// redelivery finds the key remembered with the effect once, and nothing
// is left in a transaction or in use.
func TestTxPathsCommitReplyDropped(t *testing.T) {
	t.Parallel()
	for _, mode := range tpModes {
		for _, entry := range []string{"BeginTx", "RememberTx", "BeginPgx"} {
			t.Run(mode.name+"/"+entry, func(t *testing.T) {
				t.Parallel()
				s, db, direct, _, effects := tpStore(t, mode.opt)
				// The caller's transactions go through a proxy of their own,
				// so that the dropped reply is its commit's.
				dsn, cproxy := testenv.PostgresProxyDSN(t)
				cdb, err := sql.Open("pgx", dsn)
				if err != nil {
					t.Fatal(err)
				}
				defer func() { _ = cdb.Close() }()
				ctx, cancel := context.WithTimeout(stores.WithClaimToken(context.Background(), "first"), 5*time.Second)
				defer cancel()
				var commit func() error
				var conn *pgx.Conn
				if entry == "BeginPgx" {
					if conn, err = pgx.Connect(ctx, dsn); err != nil {
						t.Fatal(err)
					}
					defer func() { _ = conn.Close(context.Background()) }()
					if claimed, _, err := s.Claim(ctx, "k", time.Minute); err != nil || !claimed {
						t.Fatalf("claim: %v, %v", claimed, err)
					}
					tx, recorded, found, err := s.BeginPgx(ctx, conn, pgx.TxOptions{}, "k", 0, nil)
					if err != nil || !recorded {
						t.Fatalf("begin: %v, %v, %v", recorded, found.State, err)
					}
					if _, err := tx.Exec(ctx, `INSERT INTO `+effects+` VALUES ('k')`); err != nil {
						t.Fatal(err)
					}
					commit = func() error { return tx.Commit(ctx) }
				} else {
					tx := tpClaimAndWrite(ctx, t, s, cdb, entry, effects)
					commit = tx.Commit
				}
				cproxy.DropReply.Store(true)
				start := time.Now()
				err = commit()
				took := time.Since(start)
				t.Logf("commit with its reply dropped: %v after %v (%d replies dropped)", err, took.Round(time.Millisecond), cproxy.Dropped.Load())
				if cproxy.Dropped.Load() != 1 {
					t.Fatalf("%d replies dropped, want the commit's", cproxy.Dropped.Load())
				}
				if err == nil {
					t.Fatal("the commit whose reply was lost reported success")
				}
				// What a caller branches on: the connection closed, the
				// commit's fate unknown, and no refusal (no SQLSTATE).
				if _, refused := sqlstate.Of(err); refused || !errors.Is(err, pgconn.ErrConnClosed) {
					t.Errorf("the commit whose reply was lost: %v; want pgx's closed connection, with no SQLSTATE", err)
				}
				if took > time.Second {
					t.Fatalf("the commit whose reply was lost returned after %v", took)
				}
				var n int
				if err := direct.QueryRow(`SELECT count(*) FROM ` + effects).Scan(&n); err != nil || n != 1 {
					t.Fatalf("the effect is there %d times (%v), want once: the server committed", n, err)
				}
				rctx, rcancel := context.WithTimeout(stores.WithClaimToken(context.Background(), "first"), 2*time.Second)
				rerr := s.Release(rctx, "k")
				rcancel()
				if errors.Is(rerr, stores.ErrClaimTaken) {
					t.Fatalf("the holder's release after the lost commit: %v", rerr)
				}
				if r, err := s.Lookup(context.Background(), "k"); err != nil || !r.Remembered() {
					t.Fatalf("Lookup after the lost commit: %v, %v; want remembered", r.State, err)
				}
				if conn != nil && !conn.IsClosed() && conn.PgConn().TxStatus() != 'I' {
					t.Errorf("the pgx conn is left in a transaction (%c)", conn.PgConn().TxStatus())
				}
				tpAfter(t, s, db, direct, effects, "k")
				deadline := time.Now().Add(5 * time.Second)
				for cdb.Stats().InUse != 0 {
					if time.Now().After(deadline) {
						t.Fatalf("5s on, %d of the caller's connections in use", cdb.Stats().InUse)
					}
					time.Sleep(20 * time.Millisecond)
				}
			})
		}
	}
}

// TestSessionClaimKilledWhileMakingWay: with session claims, the session
// holding the caller's claim is ended while the claim makes way for the
// caller's transaction: by the server (pg_terminate_backend) or by the
// network (the proxy cut), once the lock's giving back ran and its reply
// is held up (sent), or while it waits behind another claim's round trip
// on the wire (queued), under a caller's deadline or none (a router's
// message context). The caller records in its transaction (or is told in
// flight or an error, and records nothing), a concurrent redelivery on
// another worker never claims the key while the caller's transaction
// holds its record, the caller's claim is still its own while its
// transaction holds the key (Extend says held: the key is not lost to
// anyone), and once committed the record and the effect are there once.
func TestSessionClaimKilledWhileMakingWay(t *testing.T) {
	t.Parallel()
	for _, entry := range []string{"BeginTx", "RememberTx", "BeginPgx"} {
		for _, how := range []string{"terminated", "cut"} {
			for _, when := range []string{"sent", "queued"} {
				for _, deadline := range []bool{true, false} {
					t.Run(fmt.Sprintf("%s/%s/%s/deadline=%v", entry, how, when, deadline), func(t *testing.T) {
						t.Parallel()
						killedWhileMakingWay(t, entry, how, when, deadline)
					})
				}
			}
		}
	}
}

func killedWhileMakingWay(t *testing.T, entry, how, when string, withDeadline bool) {
	s, db, direct, proxy, effects := tpStore(t, postgresstore.WithSessionClaims())
	other, err := postgresstore.New(testenv.Postgres(t), postgresstore.WithTable(s.Table()))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = other.Close() }()
	cdb := testenv.Postgres(t) // the caller's transactions, straight to the server
	tok := stores.WithClaimToken(context.Background(), "first")
	if claimed, _, err := s.Claim(tok, "k", time.Minute); err != nil || !claimed {
		t.Fatalf("claim: %v, %v", claimed, err)
	}
	pid := s.SessionPID()
	if pid == 0 {
		t.Fatal("no session")
	}
	lastQuery := func() (q string, start time.Time) {
		if err := direct.QueryRow(`SELECT coalesce(query, ''), coalesce(query_start, now()) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&q, &start); err != nil {
			t.Fatal(err)
		}
		return q, start
	}
	waitFor := func(what string, ok func(q string, start time.Time) bool) {
		deadline := time.Now().Add(3 * time.Second)
		for {
			q, start := lastQuery()
			if ok(q, start) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("3s on, no %s: the session's last statement is %q", what, q)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	// The session's replies held: its round trip is on the wire when it
	// is ended.
	_, before := lastQuery()
	proxy.Delay.Store(int64(400 * time.Millisecond))
	otherClaim := make(chan error, 1)
	if when == "queued" {
		// Another claim's round trip on the wire first: the lock's giving
		// back waits for the session behind it.
		go func() {
			_, _, err := s.Claim(stores.WithClaimToken(context.Background(), "someone"), "other", time.Minute)
			otherClaim <- err
		}()
		waitFor("other claim's round trip", func(q string, start time.Time) bool {
			return start.After(before) // the round trip's statements ran; their replies are held
		})
	} else {
		otherClaim <- nil
	}
	type result struct {
		exec     func(query string) error
		commit   func() error
		rollback func()
		recorded bool
		found    stores.Record
		err      error
	}
	done := make(chan result, 1)
	ctx, cancel := context.WithCancel(tok)
	if withDeadline {
		ctx, cancel = context.WithTimeout(tok, 5*time.Second)
	}
	defer cancel()
	var conn *pgx.Conn
	if entry == "BeginPgx" {
		if conn, err = pgx.Connect(context.Background(), testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN)); err != nil {
			t.Fatal(err)
		}
		defer func() { _ = conn.Close(context.Background()) }()
	}
	go func() {
		var r result
		if entry == "BeginPgx" {
			var tx pgx.Tx
			tx, r.recorded, r.found, r.err = s.BeginPgx(ctx, conn, pgx.TxOptions{}, "k", 0, nil)
			if r.err == nil {
				r.exec = func(q string) error { _, err := tx.Exec(ctx, q); return err }
				r.commit = func() error { return tx.Commit(ctx) }
				r.rollback = func() { _ = tx.Rollback(context.Background()) }
			}
		} else {
			var tx *sql.Tx
			tx, r.recorded, r.found, r.err = tpBegin(ctx, s, cdb, entry, "k")
			if r.err == nil {
				r.exec = func(q string) error { _, err := tx.ExecContext(ctx, q); return err }
				r.commit = tx.Commit
				r.rollback = func() { _ = tx.Rollback() }
			}
		}
		done <- r
	}()
	if when == "sent" {
		waitFor("unlock", func(q string, _ time.Time) bool { return strings.Contains(q, "pg_advisory_unlock") })
	}
	switch how {
	case "terminated":
		if _, err := direct.Exec(`SELECT pg_terminate_backend($1)`, pid); err != nil {
			t.Fatal(err)
		}
	case "cut":
		proxy.Cut()
		proxy.Restore()
	}
	proxy.Delay.Store(0)
	var r result
	select {
	case r = <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("10s on, the caller's begin has not returned")
	}
	t.Logf("with the session %s as the claim made way (%s): recorded %v, %v, %v; the other claim: %v", how, when, r.recorded, r.found.State, r.err, <-otherClaim)
	if r.err != nil {
		tpAfter(t, s, db, direct, effects, "k")
		return
	}
	if !r.recorded {
		r.rollback()
		tpAfter(t, s, db, direct, effects, "k")
		return
	}
	if err := r.exec(`INSERT INTO ` + effects + ` VALUES ('k')`); err != nil {
		t.Fatal(err)
	}
	// A redelivery on another worker, while the caller's transaction
	// holds the record: in flight.
	rctx, rcancel := context.WithTimeout(stores.WithClaimToken(context.Background(), "redelivery"), 2*time.Second)
	claimed, found, err := other.Claim(rctx, "k", time.Minute)
	rcancel()
	if err != nil || claimed {
		t.Fatalf("the redelivery's claim while the caller's record is uncommitted: %v, %v, %v", claimed, found.State, err)
	}
	// The caller's keeper renews: the key is held by its transaction, so
	// the claim is not lost.
	held, err := s.Extend(tok, "k", time.Minute)
	if err != nil || !held {
		t.Errorf("Extend of the caller's claim while its transaction holds the key: %v, %v; want held", held, err)
	}
	if err := r.commit(); err != nil {
		t.Fatal(err)
	}
	tpAfter(t, s, db, direct, effects, "k")
}

// TestTxPathsExtendWhileRecorded: with session claims, the holder of a
// claim renews it (Extend, as a keeper does) while its own transaction
// holds the key's record, uncommitted: the claim made way for it, and
// the renewal says it held at once. (Only session claims keep a claim
// that made way: with claims of rows the renewal waits for the row the
// transaction locked, until the transaction ends or the renewal's
// deadline passes; a transaction claim ended as it made way, and the
// renewal says so.)
func TestTxPathsExtendWhileRecorded(t *testing.T) {
	t.Parallel()
	for _, entry := range []string{"BeginTx", "RememberTx"} {
		t.Run(entry, func(t *testing.T) {
			t.Parallel()
			s, db, direct, _, effects := tpStore(t, postgresstore.WithSessionClaims())
			tok := stores.WithClaimToken(context.Background(), "first")
			tx := tpClaimAndWrite(tok, t, s, db, entry, effects)
			ctx, cancel := context.WithTimeout(tok, time.Second)
			start := time.Now()
			held, err := s.Extend(ctx, "k", time.Minute)
			took := time.Since(start)
			cancel()
			t.Logf("Extend while the holder's transaction holds the record: %v, %v after %v", held, err, took.Round(time.Millisecond))
			if err != nil || !held || took > 100*time.Millisecond {
				t.Errorf("Extend while the holder's transaction holds the record: %v, %v after %v; want held at once", held, err, took)
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			tpAfter(t, s, db, direct, effects, "k")
		})
	}
}

// TestTxPathsYieldReplyDropped: in the claim modes that make way for the
// caller's record (session and transaction claims), the reply to the
// statement giving the caller's claim up (the session's unlock, the claim
// transaction's rollback) is lost with its connection. The caller, whose
// own claim it was, records the key in its transaction (never told in
// flight for its own claim), the redelivery finds it remembered with the
// effect once, and nothing is left behind.
func TestTxPathsYieldReplyDropped(t *testing.T) {
	t.Parallel()
	for _, mode := range tpModes[:2] {
		for _, entry := range []string{"BeginTx", "RememberTx", "BeginPgx"} {
			t.Run(mode.name+"/"+entry, func(t *testing.T) {
				t.Parallel()
				for round := range 30 {
					yieldReplyDropped(t, mode.opt, entry, round)
				}
			})
		}
	}
}

func yieldReplyDropped(t *testing.T, opt postgresstore.Option, entry string, round int) {
	s, db, direct, proxy, effects := tpStore(t, opt)
	cdb := testenv.Postgres(t) // the caller's transactions, straight to the server
	tok := stores.WithClaimToken(context.Background(), "first")
	if claimed, _, err := s.Claim(tok, "k", time.Minute); err != nil || !claimed {
		t.Fatalf("claim: %v, %v", claimed, err)
	}
	ctx, cancel := context.WithTimeout(tok, 5*time.Second)
	defer cancel()
	var (
		recorded bool
		found    stores.Record
		err      error
		exec     func(q string) error
		commit   func() error
	)
	proxy.DropReply.Store(true)
	if entry == "BeginPgx" {
		conn, cerr := pgx.Connect(context.Background(), testenv.Getenv("POSTGRES_DSN", testenv.DefaultPostgresDSN))
		if cerr != nil {
			t.Fatal(cerr)
		}
		defer func() { _ = conn.Close(context.Background()) }()
		var tx pgx.Tx
		tx, recorded, found, err = s.BeginPgx(ctx, conn, pgx.TxOptions{}, "k", 0, nil)
		if err == nil {
			defer func() { _ = tx.Rollback(context.Background()) }()
			exec = func(q string) error { _, err := tx.Exec(ctx, q); return err }
			commit = func() error { return tx.Commit(ctx) }
		}
	} else {
		var tx *sql.Tx
		tx, recorded, found, err = tpBegin(ctx, s, cdb, entry, "k")
		if err == nil {
			defer func() { _ = tx.Rollback() }()
			exec = func(q string) error { _, err := tx.ExecContext(ctx, q); return err }
			commit = tx.Commit
		}
	}
	dropped := proxy.Dropped.Load()
	proxy.DropReply.Store(false)
	if err != nil || !recorded {
		t.Fatalf("round %d: %s of the caller's own key with the claim's giving up unanswered (%d replies dropped): %v, %v, %v; want recorded", round, entry, dropped, recorded, found.State, err)
	}
	if dropped != 1 {
		t.Fatalf("round %d: %d replies dropped, want the claim's giving up's", round, dropped)
	}
	if err := exec(`INSERT INTO ` + effects + ` VALUES ('k')`); err != nil {
		t.Fatal(err)
	}
	if err := commit(); err != nil {
		t.Fatal(err)
	}
	tpAfter(t, s, db, direct, effects, "k")
}

// TestSessionClaimRedeliveryHereWhileMadeWay: with session claims, a
// redelivery on the same worker (another holder of the same Store) asks
// for the key while the claim's holder records it in its transaction
// (the claim made way): the redelivery is told in flight, and the holder's
// claim is still its own (Extend says held), until its transaction commits
// and the redelivery finds the key remembered with the effect once.
func TestSessionClaimRedeliveryHereWhileMadeWay(t *testing.T) {
	t.Parallel()
	for _, entry := range []string{"BeginTx", "RememberTx"} {
		t.Run(entry, func(t *testing.T) {
			t.Parallel()
			s, db, direct, _, effects := tpStore(t, postgresstore.WithSessionClaims())
			tok := stores.WithClaimToken(context.Background(), "first")
			tx := tpClaimAndWrite(tok, t, s, db, entry, effects)
			defer func() { _ = tx.Rollback() }()
			redelivery := stores.WithClaimToken(context.Background(), "redelivery")
			for i := range 3 {
				claimed, found, err := s.Claim(redelivery, "k", time.Minute)
				if err != nil || claimed || found.State != stores.StateInFlight {
					t.Fatalf("the redelivery's claim %d while the holder's record is uncommitted: %v, %v, %v; want in flight", i, claimed, found.State, err)
				}
				held, err := s.Extend(tok, "k", time.Minute)
				if err != nil || !held {
					t.Fatalf("after the redelivery's claim %d, Extend of the holder's claim: %v, %v; want held", i, held, err)
				}
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			claimed, found, err := s.Claim(redelivery, "k", time.Minute)
			if err != nil || claimed || !found.Remembered() {
				t.Fatalf("the redelivery's claim after the commit: %v, %v, %v; want remembered", claimed, found.State, err)
			}
			tpAfter(t, s, db, direct, effects, "k")
		})
	}
}

// TestSessionClaimMakingWayRacesARedelivery: with session claims, while
// the holder's claim makes way for its transaction (and, every other
// round, its session is ended by the server meanwhile), another worker's
// redelivery asks for the key without pause, and runs the message when it
// claims it (its effect, then Remember). Whatever the interleaving, the
// effect is written exactly once per key: the holder records only where
// the redelivery did not run, and the redelivery claims only where the
// holder did not record.
func TestSessionClaimMakingWayRacesARedelivery(t *testing.T) {
	t.Parallel()
	for _, entry := range []string{"BeginTx", "RememberTx"} {
		t.Run(entry, func(t *testing.T) {
			t.Parallel()
			s, db, direct, _, effects := tpStore(t, postgresstore.WithSessionClaims())
			other, err := postgresstore.New(testenv.Postgres(t), postgresstore.WithTable(s.Table()))
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = other.Close() }()
			cdb := testenv.Postgres(t)
			tok := stores.WithClaimToken(context.Background(), "first")
			var holderRan, redeliveryRan int
			for round := range 20 {
				key := fmt.Sprintf("race-%d", round)
				if claimed, _, err := s.Claim(tok, key, time.Minute); err != nil || !claimed {
					t.Fatalf("claim: %v, %v", claimed, err)
				}
				redone := make(chan bool, 1)
				go func() {
					rtok := stores.WithClaimToken(context.Background(), "redelivery")
					end := time.Now().Add(10 * time.Second)
					for time.Now().Before(end) {
						claimed, found, err := other.Claim(rtok, key, time.Minute)
						if err == nil && claimed {
							_, err := direct.Exec(`INSERT INTO `+effects+` VALUES ($1)`, key)
							if err == nil {
								err = other.Remember(rtok, key, 0, nil)
							}
							if err != nil {
								t.Errorf("the redelivery's run: %v", err)
							}
							redone <- true
							return
						}
						if err == nil && found.Remembered() {
							redone <- false
							return
						}
						time.Sleep(time.Millisecond)
					}
					t.Errorf("round %d: 10s on, the redelivery neither claimed nor found the key remembered", round)
					redone <- false
				}()
				if round%2 == 1 {
					if pid := s.SessionPID(); pid != 0 {
						go func() { _, _ = direct.Exec(`SELECT pg_terminate_backend($1)`, pid) }()
					}
				}
				ctx, cancel := context.WithTimeout(tok, 5*time.Second)
				tx, recorded, found, err := tpBegin(ctx, s, cdb, entry, key)
				switch {
				case err != nil:
					t.Logf("round %d: %s: %v", round, entry, err)
				case recorded:
					if _, err := tx.ExecContext(ctx, `INSERT INTO `+effects+` VALUES ($1)`, key); err != nil {
						t.Fatal(err)
					}
					if err := tx.Commit(); err != nil {
						t.Logf("round %d: commit: %v", round, err)
					} else {
						holderRan++
					}
				default:
					_ = tx.Rollback()
					t.Logf("round %d: %s found %v", round, entry, found.State)
				}
				cancel()
				rctx, rcancel := context.WithTimeout(tok, 2*time.Second)
				_ = s.Release(rctx, key)
				rcancel()
				if <-redone {
					redeliveryRan++
				}
				var n int
				if err := direct.QueryRow(`SELECT count(*) FROM `+effects+` WHERE k = $1`, key).Scan(&n); err != nil {
					t.Fatal(err)
				}
				if n != 1 {
					t.Fatalf("round %d: the effect written %d times", round, n)
				}
			}
			t.Logf("of 20 rounds the holder ran %d, the redelivery %d", holderRan, redeliveryRan)
			deadline := time.Now().Add(5 * time.Second)
			for {
				var inTx int
				if err := direct.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE state LIKE 'idle in transaction%' AND query LIKE '%` + s.Table() + `%'`).Scan(&inTx); err != nil {
					t.Fatal(err)
				}
				if inTx == 0 && db.Stats().InUse == 0 && cdb.Stats().InUse == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("5s on, %d sessions idle in a transaction, %d+%d connections in use", inTx, db.Stats().InUse, cdb.Stats().InUse)
				}
				time.Sleep(20 * time.Millisecond)
			}
		})
	}
}
