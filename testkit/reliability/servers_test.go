package reliability

import (
	"database/sql"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// postgresServer is a PostgreSQL cluster of the test's own, run as the
// postgres system user, that the test can restart.
type postgresServer struct {
	t       *testing.T
	bin     string
	dir     string
	port    int
	asOwner func(args ...string) *exec.Cmd
}

func startPostgresServer(t *testing.T) *postgresServer {
	t.Helper()
	bins, _ := filepath.Glob("/usr/lib/postgresql/*/bin/initdb")
	sort.Strings(bins)
	if len(bins) == 0 {
		testenv.Unavailable(t, "PostgreSQL server binaries", fmt.Errorf("no /usr/lib/postgresql/*/bin/initdb"), "install postgresql")
	}
	owner, err := user.Lookup("postgres")
	if err != nil || os.Geteuid() != 0 {
		testenv.Unavailable(t, "a PostgreSQL cluster of the test's own", fmt.Errorf("needs root and a postgres user (%v)", err), "run as root")
	}
	uid, _ := strconv.Atoi(owner.Uid)
	gid, _ := strconv.Atoi(owner.Gid)
	dir, err := os.MkdirTemp("", "bq-pg-")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(dir, uid, gid); err != nil {
		t.Fatal(err)
	}
	s := &postgresServer{t: t, bin: filepath.Dir(bins[len(bins)-1]), dir: dir, port: freePort(t)}
	s.asOwner = func(args ...string) *exec.Cmd {
		cmd := exec.Command(args[0], args[1:]...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}}
		cmd.Dir = dir
		return cmd
	}
	if out, err := s.asOwner(filepath.Join(s.bin, "initdb"), "-D", filepath.Join(dir, "data"), "-A", "trust", "-U", "postgres", "--no-sync").CombinedOutput(); err != nil {
		t.Fatalf("initdb: %v\n%s", err, out)
	}
	s.start()
	t.Cleanup(func() {
		_ = s.asOwner(filepath.Join(s.bin, "pg_ctl"), "-D", filepath.Join(dir, "data"), "-m", "immediate", "stop").Run()
		_ = os.RemoveAll(dir)
	})
	return s
}

func (s *postgresServer) start() {
	s.t.Helper()
	out, err := s.asOwner(filepath.Join(s.bin, "pg_ctl"), "-D", filepath.Join(s.dir, "data"), "-l", filepath.Join(s.dir, "log"), "-w",
		"-o", fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c fsync=on", s.port, s.dir), "start").CombinedOutput()
	if err != nil {
		s.t.Fatalf("pg_ctl start: %v\n%s", err, out)
	}
}

// restart crashes the server (immediate mode: no clean shutdown) and starts
// it again after down.
func (s *postgresServer) restart(down time.Duration) {
	s.t.Helper()
	if out, err := s.asOwner(filepath.Join(s.bin, "pg_ctl"), "-D", filepath.Join(s.dir, "data"), "-m", "immediate", "stop").CombinedOutput(); err != nil {
		s.t.Fatalf("pg_ctl stop: %v\n%s", err, out)
	}
	time.Sleep(down)
	s.start()
}

func (s *postgresServer) dsn() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable&connect_timeout=2", s.port)
}

func (s *postgresServer) open(t *testing.T) *sql.DB {
	t.Helper()
	db, err := sql.Open("pgx", s.dsn())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}
