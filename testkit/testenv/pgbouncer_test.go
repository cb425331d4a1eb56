package testenv_test

import (
	"context"
	"database/sql"
	"net/url"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestPgBouncerTransactionModeSharesServerConnections: behind
// PgBouncer(t, "transaction") a client holds a server connection only for
// a transaction. Client A's SELECT runs on server connection p, which then
// goes back to the pool; client B's transaction gets p; A's next SELECT, on
// the same *sql.Conn, runs on another server connection while B holds p.
func TestPgBouncerTransactionModeSharesServerConnections(t *testing.T) {
	t.Parallel()
	dsn := testenv.PgBouncer(t, "transaction")
	if u, err := url.Parse(dsn); err != nil || u.Query().Get("default_query_exec_mode") != "simple_protocol" {
		t.Fatalf("DSN %s (%v): want default_query_exec_mode=simple_protocol", dsn, err)
	}
	p, inB, again := pidsAcrossClients(t, dsn)
	if inB != p {
		t.Errorf("client B's transaction ran on server pid %d, want %d, the one client A's SELECT released", inB, p)
	}
	if again == p {
		t.Errorf("client A's second SELECT ran on pid %d again while client B's transaction held it", p)
	}
}

// TestPgBouncerSessionModeKeepsServerConnections: behind
// PgBouncer(t, "session") each client keeps its server connection, so the
// sequence of the transaction-mode test never shares one, round after
// round.
func TestPgBouncerSessionModeKeepsServerConnections(t *testing.T) {
	t.Parallel()
	dsn := testenv.PgBouncer(t, "session")
	for round := range 3 {
		p, inB, again := pidsAcrossClients(t, dsn)
		if inB == p || again != p {
			t.Errorf("round %d: client A on pid %d then %d, client B's transaction on %d; want A's own pid twice and B on another", round, p, again, inB)
		}
	}
}

// pidsAcrossClients opens clients A and B on dsn and returns the server pid
// of A's first SELECT, that of B's transaction begun after it, and that of
// A's second SELECT while B's transaction is still open.
func pidsAcrossClients(t *testing.T, dsn string) (first, inB, again int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	a, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()

	pid := func(q interface {
		QueryRowContext(context.Context, string, ...any) *sql.Row
	}) int {
		t.Helper()
		var pid int
		if err := q.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
			t.Fatal(err)
		}
		return pid
	}
	first = pid(a)
	tx, err := b.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	inB = pid(tx)
	again = pid(a)
	return first, inB, again
}
