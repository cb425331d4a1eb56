package testenv

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisSentinel starts a Redis Sentinel of its own (redis-server --sentinel)
// that monitors the Redis at REDIS_URL under the master name it returns, and
// returns a failover client that finds the master through it. The sentinel
// and the client are stopped when the test ends. It needs the redis-server
// binary; without it the test skips (fails under CI).
func RedisSentinel(t testing.TB) (client *redis.Client, master string) {
	t.Helper()
	Redis(t) // the monitored server must answer
	u, err := url.Parse(Getenv("REDIS_URL", DefaultRedisURL))
	if err != nil {
		t.Fatalf("REDIS_URL: %v", err)
	}
	host, port := u.Hostname(), u.Port()
	if port == "" {
		port = "6379"
	}
	if ips, err := net.LookupIP(host); err == nil && len(ips) > 0 {
		host = ips[0].String() // Sentinel wants an address
	}
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		Unavailable(t, "redis-server binary (to start a Sentinel)", err, "install Redis (apt-get install redis-server)")
		return nil, ""
	}
	sentinelPort, err := freePort()
	if err != nil {
		t.Fatal(err)
	}
	master = "bq" + RandomHex(4)
	dir := t.TempDir()
	conf := filepath.Join(dir, "sentinel.conf")
	body := fmt.Sprintf("port %d\nbind 127.0.0.1\ndir %s\nsentinel monitor %s %s %s 1\n", sentinelPort, dir, master, host, port)
	if err := os.WriteFile(conf, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, conf, "--sentinel")
	if err := cmd.Start(); err != nil {
		t.Fatalf("start sentinel: %v", err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })

	addr := fmt.Sprintf("127.0.0.1:%d", sentinelPort)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	probe := redis.NewSentinelClient(&redis.Options{Addr: addr})
	defer probe.Close()
	for {
		if got, err := probe.GetMasterAddrByName(ctx, master).Result(); err == nil && len(got) == 2 {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("sentinel on %s did not report master %s in time", addr, master)
		case <-time.After(50 * time.Millisecond):
		}
	}
	client = redis.NewFailoverClient(&redis.FailoverOptions{MasterName: master, SentinelAddrs: []string{addr}, DB: dbOf(u)})
	t.Cleanup(func() { _ = client.Close() })
	trackKeys(t, client)
	return client, master
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// dbOf is the database number in a redis:// URL's path (0 when none).
func dbOf(u *url.URL) int {
	var db int
	if len(u.Path) > 1 {
		_, _ = fmt.Sscanf(u.Path[1:], "%d", &db)
	}
	return db
}
