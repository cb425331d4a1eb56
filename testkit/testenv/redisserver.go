package testenv

import (
	"context"
	"net"
	"os/exec"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisServer is a Redis of the test's own, on a free port, that writes
// every command to its append-only file (appendfsync always), so that a
// SIGKILL and a restart keep what it acknowledged, as a production store
// must. The test can kill and restart it without disturbing the shared
// Redis; it is killed when the test ends. Build it with StartRedisServer.
type RedisServer struct {
	t    testing.TB
	port int
	dir  string
	cmd  *exec.Cmd
}

// StartRedisServer starts a RedisServer; it skips the test (fails it in CI)
// when redis-server is not installed.
func StartRedisServer(t testing.TB) *RedisServer {
	t.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		Unavailable(t, "redis-server binary", err, "install redis-server")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	_ = ln.Close()
	s := &RedisServer{t: t, port: port, dir: t.TempDir()}
	s.Start()
	t.Cleanup(s.Kill)
	return s
}

// Addr is the server's address (host:port).
func (s *RedisServer) Addr() string { return "127.0.0.1:" + strconv.Itoa(s.port) }

// Start starts the server (again, after Kill) and waits until it answers.
func (s *RedisServer) Start() {
	s.t.Helper()
	s.cmd = exec.Command("redis-server", "--port", strconv.Itoa(s.port), "--bind", "127.0.0.1", "--dir", s.dir,
		"--appendonly", "yes", "--appendfsync", "always", "--save", "")
	if err := s.cmd.Start(); err != nil {
		s.t.Fatal(err)
	}
	client := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1})
	defer client.Close()
	for range 200 {
		if client.Ping(context.Background()).Err() == nil {
			return
		}
		time.Sleep(25 * time.Millisecond)
	}
	s.t.Fatal("the test's redis-server did not start")
}

// Kill stops the server the hard way (SIGKILL).
func (s *RedisServer) Kill() {
	if s.cmd != nil && s.cmd.Process != nil {
		_ = s.cmd.Process.Signal(syscall.SIGKILL)
		_ = s.cmd.Wait()
		s.cmd = nil
	}
}
