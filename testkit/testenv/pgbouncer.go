package testenv

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// PgBouncer starts a PgBouncer of the test's own in front of the PostgreSQL
// server of POSTGRES_DSN (DefaultPostgresDSN when unset), pooling by mode
// ("session", "transaction" or "statement"), and returns the DSN of the
// same database through it. The process and its directory are gone when the
// test ends.
//
// The DSN has the form
//
//	postgres://<user>@127.0.0.1:<port>/<database>?sslmode=disable&default_query_exec_mode=simple_protocol
//
// with POSTGRES_DSN's user and database, and works as is with
// sql.Open("pgx", dsn), pgx.Connect and pgxpool. It asks pgx for the simple
// protocol (default_query_exec_mode=simple_protocol: the arguments go inline
// in the query text, nothing is prepared) because behind a transaction
// pooler a statement pgx prepared on one server connection is not there on
// the next; a caller that builds its own pgx config from the DSN must keep
// that mode (or QueryExecModeExec) for the same reason.
//
// PgBouncer's settings: clients are let in without a password (auth_type
// trust, the user listed in the auth file), it listens on 127.0.0.1 only, on
// a free port, without a Unix socket, with 4 server connections per pool
// (default_pool_size), at most 100 clients, and ignores the startup
// parameters extra_float_digits and options. It logs to the test's output
// if it fails to start. Run as root, it runs as the user postgres (nobody
// when there is none), since PgBouncer refuses to run as root.
//
// Without the pgbouncer binary (in PATH or /usr/sbin: Debian's pgbouncer
// package) the test is skipped, or failed when CI is set; so is it when
// POSTGRES_DSN's server does not answer.
func PgBouncer(t testing.TB, mode string) (dsn string) {
	t.Helper()
	switch mode {
	case "session", "transaction", "statement":
	default:
		t.Fatalf("PgBouncer: pool mode %q, want session, transaction or statement", mode)
	}
	bin, err := exec.LookPath("pgbouncer")
	if err != nil {
		if _, statErr := os.Stat("/usr/sbin/pgbouncer"); statErr == nil {
			bin, err = "/usr/sbin/pgbouncer", nil
		}
	}
	if err != nil {
		Unavailable(t, "pgbouncer binary", err, "install PgBouncer (apt-get install pgbouncer)")
		return ""
	}
	Postgres(t) // the server behind it must answer
	serverDSN := Getenv("POSTGRES_DSN", DefaultPostgresDSN)
	server, err := pgx.ParseConfig(serverDSN)
	if err != nil {
		t.Fatalf("POSTGRES_DSN %q: %v", Redact(serverDSN), err)
	}

	var lastErr error
	for attempt := 0; attempt < 3; attempt++ {
		var retry bool
		dsn, retry, lastErr = startPgBouncer(t, bin, mode, server)
		if lastErr == nil {
			return dsn
		}
		if !retry {
			break
		}
	}
	t.Fatalf("PgBouncer: %v", lastErr)
	return ""
}

// startPgBouncer starts one pgbouncer on a free port and waits until a
// SELECT 1 goes through it. retry: it lost the port to another process
// before it could listen on it.
func startPgBouncer(t testing.TB, bin, mode string, server *pgx.ConnConfig) (dsn string, retry bool, err error) {
	t.Helper()
	port, err := freePort()
	if err != nil {
		return "", false, err
	}
	dir, err := os.MkdirTemp("", "bq-pgbouncer-")
	if err != nil {
		return "", false, err
	}
	removeDir := func() { _ = os.RemoveAll(dir) }

	// The name clients ask for: POSTGRES_DSN's database when PgBouncer's
	// ini takes it as it is, else an alias of it.
	db := server.Database
	if db == "" || strings.Trim(db, identChars) != "" {
		db = "bq_pgbouncer"
	}
	serverConn := fmt.Sprintf("host=%s port=%d dbname=%s user=%s",
		pgbouncerValue(server.Host), server.Port, pgbouncerValue(server.Database), pgbouncerValue(server.User))
	if server.Password != "" {
		serverConn += " password=" + pgbouncerValue(server.Password)
	}
	ini := fmt.Sprintf(`[databases]
%s = %s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = %s
default_pool_size = 4
max_client_conn = 100
ignore_startup_parameters = extra_float_digits,options
logfile =
pidfile =
`, db, serverConn, port, filepath.Join(dir, "userlist.txt"), mode)
	userlist := fmt.Sprintf("%s \"\"\n", quoteIdent(server.User))
	files := map[string]string{"pgbouncer.ini": ini, "userlist.txt": userlist}
	for name, body := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o600); err != nil {
			removeDir()
			return "", false, err
		}
	}

	args := []string{filepath.Join(dir, "pgbouncer.ini")}
	if os.Geteuid() == 0 {
		// PgBouncer will not run as root: it runs as -u's user, which
		// must be able to read its files.
		u, err := user.Lookup("postgres")
		if err != nil {
			u, err = user.Lookup("nobody")
		}
		if err != nil {
			removeDir()
			return "", false, fmt.Errorf("running as root, and no user postgres or nobody to run pgbouncer as: %w", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		for _, p := range []string{dir, filepath.Join(dir, "pgbouncer.ini"), filepath.Join(dir, "userlist.txt")} {
			if err := os.Chown(p, uid, gid); err != nil {
				removeDir()
				return "", false, err
			}
		}
		args = append([]string{"-u", u.Username}, args...)
	}

	out := &lockedBuffer{}
	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		removeDir()
		return "", false, fmt.Errorf("start %s: %w", bin, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	stop := func() {
		_ = cmd.Process.Signal(syscall.SIGTERM) // immediate shutdown, connections closed
		select {
		case <-exited:
		case <-time.After(5 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
		removeDir()
	}

	dsn = (&url.URL{
		Scheme:   "postgres",
		User:     url.User(server.User),
		Host:     fmt.Sprintf("127.0.0.1:%d", port),
		Path:     "/" + db,
		RawQuery: "sslmode=disable&default_query_exec_mode=simple_protocol",
	}).String()

	deadline := time.Now().Add(15 * time.Second)
	for {
		err = selectOne(dsn)
		if err == nil {
			t.Cleanup(stop)
			return dsn, false, nil
		}
		select {
		case waitErr := <-exited:
			exited <- waitErr // for stop
			stop()
			log := out.String()
			return "", strings.Contains(log, "in use"), fmt.Errorf("pgbouncer exited (%v) before it answered:\n%s", waitErr, log)
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			stop()
			return "", false, fmt.Errorf("no SELECT 1 through pgbouncer on 127.0.0.1:%d within 15 s (last: %v); its output:\n%s", port, err, out.String())
		}
	}
}

// selectOne runs SELECT 1 on a connection of its own to dsn.
func selectOne(dsn string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	var one int
	if err := conn.QueryRow(ctx, "SELECT 1").Scan(&one); err != nil {
		return err
	}
	if one != 1 {
		return errors.New("SELECT 1 did not return 1")
	}
	return nil
}

// pgbouncerValue is a value of a PgBouncer connection string, quoted when it
// holds anything but letters, digits and a few safe characters.
func pgbouncerValue(v string) string {
	if v != "" && strings.Trim(v, identChars+"-./:") == "" {
		return v
	}
	return "'" + strings.ReplaceAll(v, "'", "''") + "'"
}

// identChars are the characters of a database name pgbouncer.ini takes
// unquoted.
const identChars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"

// quoteIdent double-quotes a user name for the auth file.
func quoteIdent(v string) string { return `"` + strings.ReplaceAll(v, `"`, `""`) + `"` }

// lockedBuffer collects a process's output, read while it still writes.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
