package postgresstore_test

import (
	"bufio"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	_ "github.com/lib/pq" // the driver a session claim refuses

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func TestRowClaimsContract(t *testing.T) { runContract(t, postgresstore.WithRowClaims()) }

// sessionPair returns two workers' stores with session claims on one
// table, each on a pool of its own.
func sessionPair(t *testing.T) (a, b *postgresstore.Store) {
	t.Helper()
	a = newStore(t, testenv.Postgres(t), postgresstore.WithSessionClaims())
	b, err := postgresstore.New(testenv.Postgres(t), postgresstore.WithTable(a.Table()), postgresstore.WithSessionClaims())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return a, b
}

// waitClaim claims key on s until it is taken, and returns how long that
// took; it fails the test after within.
func waitClaim(t *testing.T, s *postgresstore.Store, ctx context.Context, key string, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		claimed, found, err := s.Claim(ctx, key, 5*time.Second)
		if err != nil {
			t.Fatalf("Claim(%q): %v", key, err)
		}
		if claimed {
			return time.Since(start)
		}
		if time.Since(start) > within {
			t.Fatalf("Claim(%q) still refused after %v (found %v)", key, within, found.State)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestSessionClaimsRefuseADriverOtherThanPgx(t *testing.T) {
	t.Parallel()
	db := testenv.PostgresWithDriver(t, "postgres")
	_, err := postgresstore.New(db, postgresstore.WithTable("idem_never_made"), postgresstore.WithSessionClaims())
	if !errors.Is(err, postgresstore.ErrNotPgx) {
		t.Fatalf("New with session claims on lib/pq = %v, want ErrNotPgx at once", err)
	}
}

func TestSessionClaimsRefuseOtherKindsOfClaims(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	for _, opt := range []postgresstore.Option{postgresstore.WithTransactionClaims(), postgresstore.WithPartitions(0)} {
		if _, err := postgresstore.New(db, postgresstore.WithSessionClaims(), opt); !errors.Is(err, postgresstore.ErrInvalidOption) {
			t.Errorf("New with session claims and another layout = %v, want ErrInvalidOption", err)
		}
	}
}

// A claim writes nothing: no row exists while it is held, and another
// worker's claim of the key is refused until the holder's record.
func TestSessionClaimWritesNoRow(t *testing.T) {
	t.Parallel()
	a, b := sessionPair(t)
	ctx := stores.WithClaimToken(context.Background(), "holder")
	key := "session-no-row-" + testenv.RandomHex(4)
	if claimed, _, err := a.Claim(ctx, key, 5*time.Second); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v; want claimed", claimed, err)
	}
	var rows int
	db := testenv.Postgres(t)
	if err := db.QueryRow(`SELECT count(*) FROM ` + a.Table()).Scan(&rows); err != nil || rows != 0 {
		t.Fatalf("rows in the table while a claim is held = %d, %v; want 0", rows, err)
	}
	if claimed, found, err := b.Claim(context.Background(), key, 5*time.Second); err != nil || claimed || found.State != stores.StateInFlight {
		t.Fatalf("the other worker's Claim = %v, %v, %v; want in flight", claimed, found.State, err)
	}
	if r, err := b.Lookup(context.Background(), key); err != nil || r.State != stores.StateInFlight {
		t.Fatalf("the other worker's Lookup = %v, %v; want in flight", r.State, err)
	}
	if err := a.Remember(ctx, key, 7, nil); err != nil {
		t.Fatal(err)
	}
	if claimed, found, err := b.Claim(context.Background(), key, 5*time.Second); err != nil || claimed || !found.Remembered() || found.Fingerprint != 7 {
		t.Fatalf("the other worker's Claim after the record = %v, %+v, %v; want the record", claimed, found, err)
	}
}

// The holder's connection is dropped while its handler runs: the claim
// is free for another worker at once, and the holder's record is refused
// (it never writes over the claim another worker took).
func TestSessionClaimConnectionDroppedUnderAHeldLock(t *testing.T) {
	t.Parallel()
	a, b := sessionPair(t)
	db := testenv.Postgres(t)
	holder := stores.WithClaimToken(context.Background(), "holder")
	key := "session-dropped-" + testenv.RandomHex(4)
	if claimed, _, err := a.Claim(holder, key, 5*time.Second); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v; want claimed", claimed, err)
	}
	if _, err := db.Exec(`SELECT pg_terminate_backend($1)`, a.SessionPID()); err != nil {
		t.Fatal(err)
	}
	took := waitClaim(t, b, stores.WithClaimToken(context.Background(), "next"), key, 5*time.Second)
	t.Logf("the other worker took the claim %v after the holder's session was terminated", took)
	if err := a.Remember(holder, key, 1, nil); err == nil {
		t.Fatal("the holder's Remember after its session was terminated and another worker took the claim = nil, want an error")
	}
	if held, err := a.Extend(holder, key, 5*time.Second); err != nil || held {
		t.Fatalf("the holder's Extend after its session was lost = %v, %v; want false", held, err)
	}
	if r, err := b.Lookup(context.Background(), key); err != nil || r.State != stores.StateInFlight {
		t.Fatalf("Lookup = %v, %v; want still in flight under the other worker", r.State, err)
	}
	// The Store opens a new session for what comes next.
	other := "session-dropped-next-" + testenv.RandomHex(4)
	if claimed, _, err := a.Claim(holder, other, 5*time.Second); err != nil || !claimed {
		t.Fatalf("Claim of another key after the session was lost = %v, %v; want claimed on a new session", claimed, err)
	}
}

// Two keys whose 64-bit lock keys collide: the second waits (in flight, a
// park), in the same worker and in another, and never runs beside the
// first; once the first is recorded, it is claimed.
func TestSessionClaimCollidingKeysPark(t *testing.T) {
	t.Parallel()
	a, b := sessionPair(t)
	a.CollideLocks(42)
	b.CollideLocks(42)
	ctx := stores.WithClaimToken(context.Background(), "first")
	k1, k2 := "collide-1-"+testenv.RandomHex(4), "collide-2-"+testenv.RandomHex(4)
	if claimed, _, err := a.Claim(ctx, k1, 5*time.Second); err != nil || !claimed {
		t.Fatalf("Claim(k1) = %v, %v", claimed, err)
	}
	for name, s := range map[string]*postgresstore.Store{"the same worker": a, "another worker": b} {
		claimed, found, err := s.Claim(stores.WithClaimToken(context.Background(), "second"), k2, 5*time.Second)
		if err != nil || claimed || found.State != stores.StateInFlight {
			t.Fatalf("Claim(k2) in %s while k1's colliding lock is held = %v, %v, %v; want in flight", name, claimed, found.State, err)
		}
	}
	if err := a.Remember(ctx, k1, 0, nil); err != nil {
		t.Fatal(err)
	}
	if claimed, found, err := b.Claim(stores.WithClaimToken(context.Background(), "second"), k2, 5*time.Second); err != nil || !claimed {
		t.Fatalf("Claim(k2) after k1's record = %v, %v, %v; want claimed", claimed, found.State, err)
	}
}

// A duplicate whose key's lock another session holds for a moment (a
// claimer passing through: it reads the record and gives the lock back)
// is told the key's final row, read after the lock was tried: the record,
// or the end, so that it is acked at once instead of parked and looked at
// again. What is not final (a failing record's count, an expired record)
// stays in flight while the lock is held.
func TestSessionClaimOfARecordedKeyWhoseLockIsTaken(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	a, b := sessionPair(t)
	key := func(name string) string { return "locked-" + name + "-" + testenv.RandomHex(4) }
	done, ended, failing := key("done"), key("ended"), key("failing")
	for _, k := range []string{done, ended, failing} {
		if claimed, _, err := a.Claim(stores.WithClaimToken(context.Background(), "first"), k, 5*time.Second); err != nil || !claimed {
			t.Fatalf("Claim(%s) = %v, %v", k, claimed, err)
		}
	}
	first := stores.WithClaimToken(context.Background(), "first")
	if err := a.Remember(first, done, 7, []byte("reply")); err != nil {
		t.Fatal(err)
	}
	end := &stores.End{Reason: "failed", At: time.Now().Truncate(time.Millisecond)}
	if err := a.Fail(first, ended, 7, stores.Failure{Attempts: 3, End: end}); err != nil {
		t.Fatal(err)
	}
	if err := a.Fail(first, failing, 7, stores.Failure{Attempts: 2}); err != nil {
		t.Fatal(err)
	}
	if err := a.Release(first, failing); err != nil {
		t.Fatal(err)
	}
	maHoldLocks(t, db, b, done, ended, failing)
	claim := func(k string) (bool, stores.Record) {
		t.Helper()
		claimed, found, err := b.Claim(stores.WithClaimToken(context.Background(), "duplicate"), k, 5*time.Second)
		if err != nil {
			t.Fatalf("Claim(%s) while its lock is held elsewhere: %v", k, err)
		}
		return claimed, found
	}
	if claimed, found := claim(done); claimed || !found.Remembered() || found.Fingerprint != 7 || string(found.Value) != "reply" {
		t.Errorf("the duplicate of a recorded key whose lock is held = %v, %+v; want the record (fingerprint 7, value \"reply\")", claimed, found)
	}
	if claimed, found := claim(ended); claimed || found.State != stores.StateEnded || found.Failure.End == nil || found.Failure.End.Reason != "failed" {
		t.Errorf("the duplicate of an ended key whose lock is held = %v, %+v; want the end", claimed, found)
	}
	if claimed, found := claim(failing); claimed || found.State != stores.StateInFlight || found.Failure.Attempts != 2 {
		t.Errorf("the duplicate of a failing key whose lock is held = %v, %+v; want in flight, carrying its 2 attempts", claimed, found)
	}
}

// The record races the loss of the session: whatever the interleaving, a
// Remember that returned nil left the record, so another worker never
// takes the claim of a message recorded as done.
func TestSessionClaimRecordRacingTheLossOfTheSession(t *testing.T) {
	t.Parallel()
	a, b := sessionPair(t)
	db := testenv.Postgres(t)
	outcomes := map[string]int{}
	for i := 0; i < 40; i++ {
		holder := stores.WithClaimToken(context.Background(), fmt.Sprint("holder-", i))
		key := fmt.Sprintf("race-%d-%s", i, testenv.RandomHex(4))
		if claimed, _, err := a.Claim(holder, key, 5*time.Second); err != nil || !claimed {
			t.Fatalf("Claim = %v, %v", claimed, err)
		}
		pid := a.SessionPID()
		var wg sync.WaitGroup
		var rememberErr error
		wg.Add(2)
		go func() { defer wg.Done(); rememberErr = a.Remember(holder, key, 9, nil) }()
		go func() {
			defer wg.Done()
			if i%2 == 0 {
				time.Sleep(time.Duration(i%5) * 100 * time.Microsecond)
			}
			_, _ = db.Exec(`SELECT pg_terminate_backend($1)`, pid)
		}()
		wg.Wait()
		claimed, found, err := b.Claim(stores.WithClaimToken(context.Background(), "next"), key, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case rememberErr == nil && claimed:
			t.Fatalf("round %d: the holder's Remember returned nil, and another worker then took the claim of the recorded key", i)
		case rememberErr == nil:
			outcomes["recorded"]++
		case claimed:
			outcomes["lost, then claimed elsewhere"]++
		case found.Remembered():
			outcomes["recorded, reply lost"]++
		default:
			outcomes["lost, found "+found.State.String()]++
		}
		if claimed {
			_ = b.Release(stores.WithClaimToken(context.Background(), "next"), key)
		}
	}
	t.Logf("outcomes: %v", outcomes)
}

// TestSessionLostClaimKeepsTheKeyInItsStore: the session lost under a
// claim whose holder is still at work in this process (the database
// restarted while its handler ran, or while its record was on the wire):
// another holder of the same Store finds the key in flight for the rest of
// the claim's lease instead of running the message again, and the first
// holder's record, retried, is written; then the key is done. Before, the
// Store took the key again for the second holder at once, and a duplicate
// delivered during a database restart ran its effect twice.
func TestSessionLostClaimKeepsTheKeyInItsStore(t *testing.T) {
	t.Parallel()
	a := newStore(t, testenv.Postgres(t), postgresstore.WithSessionClaims())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	first := stores.WithClaimToken(ctx, "first")
	second := stores.WithClaimToken(ctx, "second")
	if claimed, _, err := a.Claim(first, "kept", time.Minute); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	pid := a.SessionPID()
	db := testenv.Postgres(t)
	if _, err := db.Exec(`SELECT pg_terminate_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	// The Store finds the loss at its next round trip: a claim of another
	// key opens the next session.
	waitCond(t, "a new session", 10*time.Second, func() bool {
		claimed, _, err := a.Claim(stores.WithClaimToken(ctx, "probe"), "probe", time.Minute)
		return err == nil && claimed && a.SessionPID() != pid
	})
	claimed, found, err := a.Claim(second, "kept", time.Minute)
	if err != nil || claimed || found.State != stores.StateInFlight {
		t.Fatalf("another holder's Claim while the lost claim's lease runs = %v, %v, %v; want in flight", claimed, found.State, err)
	}
	if err := a.Remember(first, "kept", 7, nil); err != nil {
		t.Fatalf("the first holder's Remember after the loss: %v", err)
	}
	claimed, found, err = a.Claim(second, "kept", time.Minute)
	if err != nil || claimed || !found.Remembered() {
		t.Fatalf("Claim after the record = %v, %+v, %v; want the record", claimed, found, err)
	}
}

// TestSessionRecordLostWithTheSessionKeepsTheKeyInItsStore: a record whose
// round trip the session's loss cut (the database restarted under it)
// leaves the claim with its Store: another holder of the Store finds the
// key in flight, never free, and the holder's record, retried as the Guard
// retries it, is written. Before, the failed round trip ended the claim,
// and a duplicate delivered meanwhile ran the effect again. The record is
// held on the server by a row lock (an uncommitted insert of its key) while
// the session is terminated (or, if the client has not seen that yet, its
// statement times out, which ends the session too), so that it is cut
// every time.
func TestSessionRecordLostWithTheSessionKeepsTheKeyInItsStore(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	a := newStore(t, db, postgresstore.WithSessionClaims(), postgresstore.WithQueryTimeout(time.Second))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	holder, other := stores.WithClaimToken(ctx, "holder"), stores.WithClaimToken(ctx, "other")
	key := "cut-" + testenv.RandomHex(4)
	if claimed, _, err := a.Claim(holder, key, time.Minute); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	pid := a.SessionPID()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+a.Table()+` (key) VALUES ($1::uuid)`, postgresstore.RowKey(key)); err != nil {
		t.Fatal(err)
	}
	remembered := make(chan error, 1)
	go func() { remembered <- a.Remember(holder, key, 9, nil) }()
	waitCond(t, "the record waiting on the row lock", 10*time.Second, func() bool {
		var waiting bool
		err := db.QueryRowContext(ctx, `SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&waiting)
		return err == nil && waiting
	})
	if _, err := db.ExecContext(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	if err := <-remembered; err == nil {
		t.Fatal("the record cut by the session's loss returned nil")
	} else {
		t.Logf("the cut record: %v", err)
	}
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	claimed, found, err := a.Claim(other, key, time.Minute)
	if err != nil || claimed || found.State != stores.StateInFlight {
		t.Fatalf("another holder's Claim after the cut record = %v, %v, %v; want in flight", claimed, found.State, err)
	}
	waitCond(t, "the holder's record retried", 10*time.Second, func() bool { return a.Remember(holder, key, 9, nil) == nil })
	if claimed, found, err := a.Claim(other, key, time.Minute); err != nil || claimed || !found.Remembered() {
		t.Fatalf("Claim after the retried record = %v, %v, %v; want the record", claimed, found.State, err)
	}
}

// sessionHolderEnv names the environment of the holder process of the tests
// below (TestSessionHolderProcess).
const sessionHolderEnv = "BQ_SESSION_HOLDER_TABLE"

// TestSessionHolderProcess is the holder of the process tests: run by them
// in a process of its own, it claims the key on stdin's first line, says
// "claimed", then on a line "go" asks whether it still holds the claim and
// records the key, and says what it got.
func TestSessionHolderProcess(t *testing.T) {
	table := os.Getenv(sessionHolderEnv)
	if table == "" {
		t.Skip("the holder process of the session tests; run by them")
	}
	db := testenv.Postgres(t)
	s, err := postgresstore.New(db, postgresstore.WithTable(table), postgresstore.WithSessionClaims())
	if err != nil {
		t.Fatal(err)
	}
	in := bufio.NewScanner(os.Stdin)
	in.Scan()
	key := in.Text()
	ctx := stores.WithClaimToken(context.Background(), "holder")
	claimed, _, err := s.Claim(ctx, key, 2*time.Second)
	fmt.Printf("claimed %v %v\n", claimed, err)
	in.Scan()
	held, err := s.Extend(ctx, key, 2*time.Second)
	fmt.Printf("extend %v %v\n", held, err)
	err = s.Remember(ctx, key, 1, nil)
	fmt.Printf("remember %v\n", err)
}

// startHolder starts the holder process on a's table and key, and returns
// it once it holds the claim, with its stdin and stdout.
func startHolder(t *testing.T, a *postgresstore.Store, key string) (*exec.Cmd, io.WriteCloser, *bufio.Scanner) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestSessionHolderProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), sessionHolderEnv+"="+a.Table())
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	fmt.Fprintln(stdin, key)
	out := bufio.NewScanner(stdout)
	if !out.Scan() || out.Text() != "claimed true <nil>" {
		t.Fatalf("the holder process said %q, want it claimed", out.Text())
	}
	return cmd, stdin, out
}

// The holder process is killed: its claim is free within a second, with
// no lease to wait out.
func TestSessionClaimFreedWhenItsHolderIsKilled(t *testing.T) {
	t.Parallel()
	a, _ := sessionPair(t)
	key := "session-killed-" + testenv.RandomHex(4)
	cmd, _, _ := startHolder(t, a, key)
	ctx := stores.WithClaimToken(context.Background(), "next")
	if claimed, _, err := a.Claim(ctx, key, 5*time.Second); err != nil || claimed {
		t.Fatalf("Claim while the holder process lives = %v, %v; want in flight", claimed, err)
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	took := waitClaim(t, a, ctx, key, 10*time.Second)
	t.Logf("claimed %v after the holder process was killed (its lease: 2 s)", took)
	if took > time.Second {
		t.Fatalf("the claim of a killed holder was freed %v after its death, want within a second", took)
	}
}

// The holder process is stopped (SIGSTOP) while it holds the claim: the
// server ends its silent session once the lease passed, another worker
// takes the claim, and the holder, resumed, finds its claim gone and its
// record refused.
func TestSessionClaimOfAStoppedHolder(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out a lease")
	}
	t.Parallel()
	a, _ := sessionPair(t)
	key := "session-stopped-" + testenv.RandomHex(4)
	cmd, stdin, out := startHolder(t, a, key)
	if err := cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	ctx := stores.WithClaimToken(context.Background(), "next")
	took := waitClaim(t, a, ctx, key, 20*time.Second)
	t.Logf("claimed %v after the holder was stopped (its lease: 2 s)", took)
	if err := cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	fmt.Fprintln(stdin, "go")
	var said []string
	for out.Scan() {
		said = append(said, out.Text())
	}
	if len(said) < 2 || said[0] != "extend false <nil>" || !strings.Contains(said[1], stores.ErrClaimTaken.Error()) {
		t.Fatalf("the resumed holder said %q; want its claim gone and its record refused", said)
	}
	if r, err := a.Lookup(context.Background(), key); err != nil || r.State != stores.StateInFlight {
		t.Fatalf("Lookup after the resumed holder's Remember = %v, %v; want still in flight under the new holder", r.State, err)
	}
}

// Behind a pooler in transaction mode the session's locks would stay on a
// server connection other clients use: the Store refuses, with
// ErrSessionPooled, before it takes a claim. In session mode it works.
func TestSessionClaimsBehindAPooler(t *testing.T) {
	t.Parallel()
	direct := testenv.Postgres(t)
	table := newStore(t, direct).Table()
	for _, mode := range []string{"transaction", "session"} {
		db, err := sql.Open("pgx", testenv.PgBouncer(t, mode))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		s, err := postgresstore.New(db, postgresstore.WithTable(table), postgresstore.WithSessionClaims())
		if err != nil {
			t.Fatal(err)
		}
		// Migrate opens the session: a pooler in transaction mode is
		// refused at start-up.
		if err := s.Migrate(context.Background()); (mode == "transaction") != errors.Is(err, postgresstore.ErrSessionPooled) {
			t.Fatalf("Migrate through PgBouncer in %s mode = %v", mode, err)
		}
		ctx := stores.WithClaimToken(context.Background(), "holder")
		key := "pooled-" + mode + "-" + testenv.RandomHex(4)
		claimed, _, err := s.Claim(ctx, key, 5*time.Second)
		switch {
		case mode == "transaction" && !errors.Is(err, postgresstore.ErrSessionPooled):
			t.Fatalf("Claim through PgBouncer in transaction mode = %v, %v; want ErrSessionPooled", claimed, err)
		case mode == "transaction":
			t.Logf("refused: %v", err)
			if err := s.Remember(ctx, key, 0, nil); !errors.Is(err, postgresstore.ErrSessionPooled) {
				t.Fatalf("Remember after the pooler was found = %v, want ErrSessionPooled", err)
			}
			if _, err := s.Lookup(ctx, key); !errors.Is(err, postgresstore.ErrSessionPooled) {
				t.Fatalf("Lookup after the pooler was found = %v, want ErrSessionPooled", err)
			}
		case err != nil || !claimed:
			t.Fatalf("Claim through PgBouncer in session mode = %v, %v; want claimed", claimed, err)
		default:
			if err := s.Remember(ctx, key, 0, nil); err != nil {
				t.Fatalf("Remember through PgBouncer in session mode: %v", err)
			}
			_ = s.ReleaseAll(context.Background())
		}
	}
}

// A fleet mixing the two kinds of claims on one table, as while it
// switches from one to the other: a row claim and a session claim of one
// key exclude each other, both ways, so each message is claimed once.
func TestSessionAndRowClaimsExcludeEachOther(t *testing.T) {
	t.Parallel()
	rows := newStore(t, testenv.Postgres(t), postgresstore.WithRowClaims())
	session, err := postgresstore.New(testenv.Postgres(t), postgresstore.WithTable(rows.Table()), postgresstore.WithSessionClaims())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = session.ReleaseAll(context.Background()) })
	// The session is open before the race starts (opening it takes a
	// while on a loaded machine, which let the rows win every key), and
	// one contender of each kind goes through the keys backwards: however
	// uneven the two kinds' pace, they meet, and both win keys.
	if err := session.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	const keys, contenders = 100, 4
	var mu sync.Mutex
	wins := map[string][]string{}
	var wg sync.WaitGroup
	start := make(chan struct{})
	for c := range contenders {
		s, kind := rows, "row"
		if c%2 == 1 {
			s, kind = session, "session"
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for i := range keys {
				k := i
				if c >= 2 {
					k = keys - 1 - i
				}
				key := fmt.Sprintf("mixed-%d", k)
				ctx := stores.WithClaimToken(context.Background(), fmt.Sprintf("%s-%d-%d", kind, c, k))
				for {
					claimed, found, err := s.Claim(ctx, key, 10*time.Second)
					if err != nil {
						t.Error(err)
						return
					}
					if claimed {
						mu.Lock()
						wins[key] = append(wins[key], kind)
						mu.Unlock()
						time.Sleep(2 * time.Millisecond) // the handler
						if err := s.Remember(ctx, key, 0, nil); err != nil {
							t.Errorf("Remember(%s) by its %s claim: %v", key, kind, err)
						}
						break
					}
					if found.Remembered() {
						break
					}
					time.Sleep(time.Millisecond)
				}
			}
		}()
	}
	close(start)
	wg.Wait()
	byKind := map[string]int{}
	for key, w := range wins {
		if len(w) != 1 {
			t.Errorf("%s claimed %d times: %v", key, len(w), w)
		}
		byKind[w[0]]++
	}
	t.Logf("keys claimed by kind: %v", byKind)
	if len(wins) != keys || byKind["row"] == 0 || byKind["session"] == 0 {
		t.Fatalf("claims %d of %d keys, by kind %v: want every key, by both kinds", len(wins), keys, byKind)
	}
}

// A session that holds no claim stays open a minute: a consumer whose
// messages come seconds apart keeps its one session, instead of opening a
// new one (two connections, with its check) for every message.
func TestSessionKeptBetweenSparseMessages(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out a lease twice")
	}
	t.Parallel()
	a, _ := sessionPair(t)
	var pids []int32
	for i := range 3 {
		ctx := stores.WithClaimToken(context.Background(), fmt.Sprint("sparse-", i))
		key := fmt.Sprintf("sparse-%d-%s", i, testenv.RandomHex(4))
		if claimed, _, err := a.Claim(ctx, key, time.Second); err != nil || !claimed {
			t.Fatalf("Claim = %v, %v", claimed, err)
		}
		if err := a.Remember(ctx, key, 0, nil); err != nil {
			t.Fatal(err)
		}
		pids = append(pids, a.SessionPID())
		time.Sleep(1500 * time.Millisecond) // past the claim's lease, the idle timeout while it was held
	}
	if pids[0] == 0 || pids[1] != pids[0] || pids[2] != pids[0] {
		t.Fatalf("the session's server process per message: %v; want one session throughout", pids)
	}
}

// A Store nobody closes gives its session up once it held no claim for a
// while (a minute; a second here): the server ends the idle session, and
// the next claim opens a new one. Close ends it at once.
func TestSessionEndsWhenUnusedAndOnClose(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	s := newStore(t, db)
	s.SetSessionIdle(time.Second)
	alive := func(pid int32) bool {
		var n int
		if err := db.QueryRowContext(context.Background(), `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 1
	}
	claimAndRecord := func(key string) int32 {
		t.Helper()
		ctx := stores.WithClaimToken(context.Background(), key)
		if claimed, _, err := s.Claim(ctx, key, 200*time.Millisecond); err != nil || !claimed {
			t.Fatalf("Claim(%q) = %v, %v", key, claimed, err)
		}
		if err := s.Remember(ctx, key, 0, nil); err != nil {
			t.Fatal(err)
		}
		return s.SessionPID()
	}
	first := claimAndRecord("unused-1")
	if first == 0 || !alive(first) {
		t.Fatalf("the default claims opened no session (pid %d)", first)
	}
	deadline := time.Now().Add(15 * time.Second)
	for alive(first) {
		if time.Now().After(deadline) {
			t.Fatalf("the session (pid %d) of a Store unused for 15s is still open; want it ended after a second", first)
		}
		time.Sleep(50 * time.Millisecond)
	}
	second := claimAndRecord("unused-2")
	if second == 0 || second == first {
		t.Fatalf("the claim after the idle session ended ran on pid %d (first %d); want a new session", second, first)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	deadline = time.Now().Add(10 * time.Second)
	for alive(second) {
		if time.Now().After(deadline) {
			t.Fatalf("the session (pid %d) is still open 10s after Close", second)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if pid := claimAndRecord("after-close"); pid == 0 || pid == second {
		t.Fatalf("a claim after Close ran on pid %d; want a new session", pid)
	}
}

// The default claims: session claims with the pgx driver, rows with
// another (lib/pq here) or with the options that need rows.
func TestDefaultClaimsByDriver(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	if s := newStore(t, db); !s.SessionClaims() {
		t.Fatal("a Store on the pgx driver keeps its claims in rows; want session claims by default")
	}
	if s := newStore(t, db, postgresstore.WithRowClaims()); s.SessionClaims() {
		t.Fatal("WithRowClaims kept session claims")
	}
	if s := newStore(t, db, postgresstore.WithTransactionClaims()); s.SessionClaims() {
		t.Fatal("WithTransactionClaims kept session claims")
	}
	if s := newStore(t, testenv.PostgresWithDriver(t, "postgres")); s.SessionClaims() {
		t.Fatal("a Store on lib/pq took session claims")
	}
	for _, opts := range [][]postgresstore.Option{
		{postgresstore.WithRowClaims(), postgresstore.WithSessionClaims()},
		{postgresstore.WithRowClaims(), postgresstore.WithTransactionClaims()},
	} {
		if _, err := postgresstore.New(db, opts...); !errors.Is(err, postgresstore.ErrInvalidOption) {
			t.Fatalf("two kinds of claims: %v; want ErrInvalidOption", err)
		}
	}
}

// A holder that writes its record in a transaction of its own (RememberTx,
// as the API middleware's transactional mode does) keeps its claim while
// that transaction runs: its renewals say held, another worker finds the
// key in flight, and once the transaction commits both this worker and
// another find the record, not a claim.
func TestSessionClaimYieldedToItsTransaction(t *testing.T) {
	t.Parallel()
	a, b := sessionPair(t)
	db := testenv.Postgres(t)
	ctx := context.Background()
	holder := stores.WithClaimToken(ctx, "request-1")
	if claimed, _, err := a.Claim(holder, "order-7", time.Second); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	if recorded, found, err := a.RememberTx(holder, tx, "order-7", 7, nil); err != nil || !recorded {
		t.Fatalf("RememberTx by the claim's holder = %v, %+v, %v; want recorded", recorded, found, err)
	}
	// Renewals while the transaction runs, past the lease: held.
	for end := time.Now().Add(1500 * time.Millisecond); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		if held, err := a.Extend(holder, "order-7", time.Second); err != nil || !held {
			t.Fatalf("the holder's Extend while its transaction runs = %v, %v; want held", held, err)
		}
	}
	if claimed, found, err := b.Claim(stores.WithClaimToken(ctx, "request-2"), "order-7", time.Second); err != nil || claimed || found.State != stores.StateInFlight {
		t.Fatalf("another worker's Claim while the transaction runs = %v, %+v, %v; want in flight", claimed, found, err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	for _, s := range []*postgresstore.Store{a, b} {
		claimed, found, err := s.Claim(stores.WithClaimToken(ctx, "retry"), "order-7", time.Second)
		if err != nil || claimed || !found.Remembered() || found.Fingerprint != 7 {
			t.Fatalf("a retry's Claim after the commit = %v, %+v, %v; want the record", claimed, found, err)
		}
	}
	if err := a.Release(holder, "order-7"); err != nil {
		t.Fatal(err)
	}
	var locks int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = $1`, a.SessionPID()).Scan(&locks); err != nil || locks != 0 {
		t.Fatalf("advisory locks left on the holder's session: %d (%v); want none", locks, err)
	}
}

// A session whose last claim found its message done (a duplicate: the lock
// was taken, then given back) goes back to the idle timeout of a session
// holding nothing (a minute in production; 20 s here), not the claim's
// lease (1 s here): it was ended after the lease, and every quiet spell
// after a duplicate cost a new connection.
func TestSessionIdleAfterADuplicate(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	s := newStore(t, db)
	s.SetSessionIdle(20 * time.Second)
	ctx := stores.WithClaimToken(context.Background(), "first")
	if claimed, _, err := s.Claim(ctx, "dup", time.Second); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	if err := s.Remember(ctx, "dup", 0, nil); err != nil {
		t.Fatal(err)
	}
	if claimed, found, err := s.Claim(stores.WithClaimToken(context.Background(), "second"), "dup", time.Second); err != nil || claimed || !found.Remembered() {
		t.Fatalf("the duplicate's Claim = %v, %+v, %v; want the record", claimed, found, err)
	}
	pid := s.SessionPID()
	idleSince := time.Now()
	// Past five leases of silence (the server would have ended a session
	// left at the lease's idle timeout), well within the 20 s.
	for time.Since(idleSince) < 5*time.Second {
		time.Sleep(100 * time.Millisecond)
	}
	var n int
	if err := db.QueryRowContext(context.Background(), `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Fatalf("the session (pid %d) was ended within %v of a duplicate's claim; want it kept for the idle time of a session holding nothing (20s)",
			pid, time.Since(idleSince).Round(time.Millisecond))
	}
}

// A claim whose caller's context is already done when it arrives (a
// delivery handed out again past its deadline, as watermill-sql's resend
// does) fails, and leaves nothing behind: the next delivery of the key,
// in the same process, takes the claim. It used to leave the claim's
// reservation, so that every later claim of the key here was in flight for
// as long as the process lived.
func TestSessionClaimWithADoneContextLeavesNothing(t *testing.T) {
	t.Parallel()
	s := newStore(t, testenv.Postgres(t), postgresstore.WithSessionClaims())
	done, cancel := context.WithCancel(stores.WithClaimToken(context.Background(), "late"))
	cancel()
	if claimed, _, err := s.Claim(done, "resent", 5*time.Second); err == nil || claimed || !errors.Is(err, context.Canceled) {
		t.Fatalf("Claim with a done context = %v, %v; want context.Canceled", claimed, err)
	}
	claimed, found, err := s.Claim(stores.WithClaimToken(context.Background(), "next"), "resent", 5*time.Second)
	if err != nil || !claimed {
		t.Fatalf("the next delivery's Claim = %v (found %v), %v; want it claimed", claimed, found.State, err)
	}
}

// A Remember that holds no claim (a seen-set worker, or one whose claim
// was released) never writes over another worker's session claim, alone
// or grouped with others: it is refused with ErrClaimTaken, and the
// holder's own record is the one written.
func TestRememberWithoutAClaimSparesASessionClaim(t *testing.T) {
	t.Parallel()
	a, b := sessionPair(t)
	ctx := context.Background()
	holder := stores.WithClaimToken(ctx, "holder")
	const n = 8
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("held-%d", i)
		if claimed, _, err := a.Claim(holder, keys[i], time.Minute); err != nil || !claimed {
			t.Fatalf("Claim(%s) = %v, %v", keys[i], claimed, err)
		}
	}
	// Alone, then together (the pool's grouped statement).
	if err := b.Remember(ctx, keys[0], 0, nil); !errors.Is(err, stores.ErrClaimTaken) {
		t.Fatalf("Remember over another worker's session claim = %v; want ErrClaimTaken", err)
	}
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range keys {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = b.Remember(ctx, keys[i], 0, nil) }()
	}
	wg.Wait()
	for i, err := range errs {
		if !errors.Is(err, stores.ErrClaimTaken) {
			t.Errorf("grouped Remember(%s) over another worker's session claim = %v; want ErrClaimTaken", keys[i], err)
		}
	}
	for _, k := range keys {
		r, err := b.Lookup(ctx, k)
		if err != nil || r.State != stores.StateInFlight {
			t.Fatalf("Lookup(%s) while claimed = %v, %v; want in flight", k, r.State, err)
		}
		if err := a.Remember(holder, k, 0, nil); err != nil {
			t.Fatalf("the holder's Remember(%s) = %v", k, err)
		}
		if r, err := b.Lookup(ctx, k); err != nil || !r.Remembered() {
			t.Fatalf("Lookup(%s) after the holder's record = %v, %v; want remembered", k, r.State, err)
		}
	}
}

// The statements of a store with session claims read the table through
// its index with the plans the server keeps for them from the table's
// first moments (empty) to when it is large: a join of a grouped Lookup's
// keys with the table was planned as a scan of the whole table while it
// was small, and kept so as it grew, and the seen-set mode's PostgreSQL CPU
// per message more than doubled in the end-to-end benchmark. The session's
// own statements are planned generically once, as the session does.
func TestStatementsKeepReadingByTheIndex(t *testing.T) {
	t.Parallel()
	keys, ks, lks := planKeys()
	fps := postgresstore.Int64Array(make([]int64, len(keys)), nil)
	held := "{" + strings.TrimSuffix(strings.Repeat("f,", len(keys)), ",") + "}"
	for _, c := range []struct {
		name, args string
		session    bool // a statement of the session: planned generically
	}{
		{"seen-locked", fmt.Sprintf("'%s', '%s'", ks, lks), false},
		{"remember-many", fmt.Sprintf("'%s', '%s', '%s', '%s'", ks, fps, postgresstore.TextArray(keys), lks), false},
		{"claim-read", fmt.Sprintf("'%s'", ks), true},
		{"remember", fmt.Sprintf("'%s', '%s', '%s', '%s'", ks, fps, lks, held), true},
		{"remember-fresh", fmt.Sprintf("'%s', '%s', '%s'", ks, fps, lks), true},
		{"remember-value", fmt.Sprintf("'%s', 0, NULL, false, 1", keys[0]), true},
		{"fail", fmt.Sprintf(`'%s', 0, '{"attempts": 1}', 'holder', 1, false, false`, keys[0]), true},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			db := testenv.Postgres(t)
			s := newStore(t, db)
			query := s.Statements()[c.name]
			if c.session {
				query = s.SessionStatements()[c.name]
			}
			if query == "" {
				t.Fatalf("no statement %q", c.name)
			}
			if p := planKept(t, db, s.Table(), query, c.args, c.session); strings.Contains(p, "Seq Scan") {
				t.Errorf("the statement, planned while the table was empty, scans it once it holds 20,000 rows:\n%s", p)
			}
		})
	}
}

// planKeys returns the 32 row keys the plan tests run their statements
// with, as an array literal (ks), and 32 locks' keys (lks).
func planKeys() (keys []string, ks, lks string) {
	keys, locks := make([]string, 32), make([]int64, 32)
	for i := range keys {
		keys[i] = postgresstore.RowKey(fmt.Sprintf("k%d", i))
		locks[i] = int64(i)
	}
	return keys, postgresstore.TextArray(keys), postgresstore.Int64Array(locks, nil)
}

// planKept prepares query on a connection of db, lets the server settle
// the plan it keeps while table is empty (generic: forced to the generic
// plan, as the claims' session is), fills table with 20,000 rows and
// returns the plan the prepared statement then runs with.
func planKept(t *testing.T, db *sql.DB, table, query, args string, generic bool) string {
	t.Helper()
	ctx := context.Background()
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	if generic {
		if _, err := conn.ExecContext(ctx, `SET plan_cache_mode = force_generic_plan`); err != nil {
			t.Fatal(err)
		}
		defer func() { _, _ = conn.ExecContext(context.Background(), `RESET plan_cache_mode`) }()
	}
	if _, err := conn.ExecContext(ctx, `PREPARE kept AS `+query); err != nil {
		t.Fatal(err)
	}
	defer func() { _, _ = conn.ExecContext(context.Background(), `DEALLOCATE kept`) }()
	explain := func() string {
		return strings.Join(testenv.Column[string](ctx, t, conn, `EXPLAIN EXECUTE kept(`+args+`)`), "\n")
	}
	// Plans made while the table is empty: the server keeps the generic
	// one once it has made it (after five runs in the default mode).
	for range 6 {
		explain()
	}
	if _, err := db.ExecContext(ctx, `INSERT INTO `+table+` (key, expires_at) SELECT gen_random_uuid(), NULL FROM generate_series(1, 20000)`); err != nil {
		t.Fatal(err)
	}
	return explain()
}
