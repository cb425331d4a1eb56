package testenv

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"testing"
	"time"
)

// DefaultPostgresSubscriberDSN is where the tests that run watermill-sql's
// subscriber look for a PostgreSQL server of their own when
// POSTGRES_SUBSCRIBER_DSN is unset: the postgres-subscriber service of
// docker-compose.yml (and the cluster .ci/run starts).
const DefaultPostgresSubscriberDSN = "postgres://postgres@localhost:5433/test?sslmode=disable"

const howToStartSubscriberPostgres = "start it with `docker compose up -d postgres-subscriber` or set POSTGRES_SUBSCRIBER_DSN"

// PostgresSubscriberDSN returns the DSN of the PostgreSQL server for a test
// that consumes with watermill-sql's subscriber (directly, through the
// outbox relay, or through a program it runs).
//
// That subscriber reads only the messages written before the oldest
// transaction still open anywhere on its server: a transaction another
// program leaves open, in any database, stalls it until it ends. So these
// tests run on a server that nothing else uses: POSTGRES_SUBSCRIBER_DSN, or
// DefaultPostgresSubscriberDSN when the variable is unset and a server
// answers there. Without either the test falls back to POSTGRES_DSN and
// logs that an open transaction elsewhere on that server can stall it;
// under CI it fails instead. A POSTGRES_SUBSCRIBER_DSN that does not answer
// skips the test (fails it under CI), as Postgres does.
func PostgresSubscriberDSN(t testing.TB) string {
	t.Helper()
	dsn, fallback, err := lookupPostgresSubscriberDSN()
	switch {
	case err != nil:
		Unavailable(t, "PostgreSQL at "+Redact(dsn), err, howToStartSubscriberPostgres)
	case fallback != nil && os.Getenv("CI") != "":
		t.Fatalf("%v [CI is set: the watermill-sql subscriber needs a server of its own]", fallback)
	case fallback != nil:
		t.Logf("note: %v", fallback)
	}
	return dsn
}

// LookupPostgresSubscriberDSN is PostgresSubscriberDSN for a TestMain,
// which has no test to skip or fail: it returns the DSN and, when that is
// POSTGRES_DSN's for want of a server of the subscriber's own, why (nil
// otherwise). A server that does not answer is left for the tests to find.
func LookupPostgresSubscriberDSN() (dsn string, fallback error) {
	dsn, fallback, _ = lookupPostgresSubscriberDSN()
	return dsn, fallback
}

// lookupPostgresSubscriberDSN picks the DSN: POSTGRES_SUBSCRIBER_DSN (err:
// it does not answer), else DefaultPostgresSubscriberDSN if it answers,
// else POSTGRES_DSN (fallback says why; err: it does not answer either).
func lookupPostgresSubscriberDSN() (dsn string, fallback, err error) {
	if dsn := os.Getenv("POSTGRES_SUBSCRIBER_DSN"); dsn != "" {
		return dsn, nil, pingPostgres(dsn)
	}
	defaultErr := pingPostgres(DefaultPostgresSubscriberDSN)
	if defaultErr == nil {
		return DefaultPostgresSubscriberDSN, nil, nil
	}
	dsn = Getenv("POSTGRES_DSN", DefaultPostgresDSN)
	fallback = fmt.Errorf("no PostgreSQL of the watermill-sql subscriber's own (POSTGRES_SUBSCRIBER_DSN unset, %s: %v): "+
		"using POSTGRES_DSN %s, where a transaction another program leaves open stalls the subscriber; %s",
		Redact(DefaultPostgresSubscriberDSN), defaultErr, Redact(dsn), howToStartSubscriberPostgres)
	return dsn, fallback, pingPostgres(dsn)
}

// PostgresForSubscriber returns a database on PostgresSubscriberDSN's
// server through pgx's stdlib driver, closed when the test ends: for the
// tables of a test that consumes with watermill-sql's subscriber (its
// topics, and the stores and ledgers its handlers write in the same
// transactions).
//
// The test shares the server with the other tests of its kind (a shared
// hold of the server, see PostgresForSubscriberAlone), and waits, before
// it starts, while a test that holds transactions open for seconds has it
// alone.
func PostgresForSubscriber(t testing.TB) *sql.DB {
	t.Helper()
	return postgresForSubscriber(t, false)
}

// PostgresForSubscriberAlone is PostgresForSubscriber for a test whose
// subscribers hold their transactions open for seconds on purpose (a
// handler slower than watermill-sql's AckDeadline): every such
// transaction stalls every other watermill-sql subscriber on the server.
// It waits until no other test holds the server (three minutes at most;
// then it goes on and logs so) and has it alone until it ends; the tests
// of PostgresForSubscriber wait meanwhile.
func PostgresForSubscriberAlone(t testing.TB) *sql.DB {
	t.Helper()
	return postgresForSubscriber(t, true)
}

// subscriberServerLock is the key of the session-level advisory lock by
// which the tests share the subscriber's server (any value nothing else
// uses).
const subscriberServerLock = 0x62715f737562 // "bq_sub"

func postgresForSubscriber(t testing.TB, alone bool) *sql.DB {
	t.Helper()
	dsn := PostgresSubscriberDSN(t)
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatalf("PostgreSQL %q: %v", Redact(dsn), err)
	}
	t.Cleanup(func() { _ = db.Close() })
	holdSubscriberServer(t, dsn, alone)
	return db
}

// holdSubscriberServer takes the advisory lock of the subscriber's server,
// shared or alone, on a connection of its own (not one of the test's pool:
// a test may keep its pool to one connection), until the test ends. The
// lock is asked for again and again (pg_try_*), never queued for: a test
// that waits in the server's lock queue would hold back the tests asking
// after it, its own included. A lock is a session's, so holding it opens
// no transaction.
func holdSubscriberServer(t testing.TB, dsn string, alone bool) {
	t.Helper()
	lockDB, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatalf("PostgreSQL %q: %v", Redact(dsn), err)
	}
	ctx := context.Background()
	conn, err := lockDB.Conn(ctx)
	if err != nil {
		_ = lockDB.Close()
		Unavailable(t, "PostgreSQL at "+Redact(dsn), err, howToStartSubscriberPostgres)
	}
	t.Cleanup(func() { _ = conn.Close(); _ = lockDB.Close() }) // the session's end releases the lock
	try, wait := "SELECT pg_try_advisory_lock_shared($1)", 10*time.Minute
	if alone {
		try, wait = "SELECT pg_try_advisory_lock($1)", 3*time.Minute
	}
	deadline := time.Now().Add(wait)
	for {
		var got bool
		if err := conn.QueryRowContext(ctx, try, subscriberServerLock).Scan(&got); err != nil {
			t.Fatalf("take the subscriber server's advisory lock: %v", err)
		}
		if got {
			return
		}
		if time.Now().After(deadline) {
			t.Logf("note: the subscriber's server was held by other tests for %v; going on beside them", wait)
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// pingPostgres connects to dsn once, within a few seconds.
func pingPostgres(dsn string) error {
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return db.PingContext(ctx)
}
