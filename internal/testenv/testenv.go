// Package testenv connects integration tests to the real servers they need.
//
// Addresses come from REDIS_URL, REDIS_CLUSTER_ADDRS and POSTGRES_DSN, and
// default to the local servers (and the cluster .ci/redis-cluster starts).
// When a server is unreachable the test is skipped with a message saying how
// to start it, unless CI is set: then it fails, so CI never passes by
// skipping.
package testenv

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver
	"github.com/redis/go-redis/v9"
)

// Defaults for the environment variables.
const (
	DefaultRedisURL          = "redis://localhost:6379/0"
	DefaultRedisClusterAddrs = "127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003"
	DefaultPostgresDSN       = "postgres://postgres@localhost:5432/test?sslmode=disable"
)

// Getenv returns the variable's value, or def when it is unset or empty.
func Getenv(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// Unavailable skips the test, or fails it under CI.
func Unavailable(t testing.TB, what string, err error, howToStart string) {
	t.Helper()
	msg := fmt.Sprintf("%s unreachable (%v); %s", what, err, howToStart)
	if os.Getenv("CI") != "" {
		t.Fatal(msg + " [CI is set: failing instead of skipping]")
	}
	t.Skip(msg)
}

// Redis returns a client for REDIS_URL, closed when the test ends.
func Redis(t testing.TB) *redis.Client {
	t.Helper()
	url := Getenv("REDIS_URL", DefaultRedisURL)
	opts, err := redis.ParseURL(url)
	if err != nil {
		t.Fatalf("REDIS_URL %q: %v", url, err)
	}
	client := redis.NewClient(opts)
	t.Cleanup(func() { _ = client.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if err := client.Ping(ctx).Err(); err != nil {
		Unavailable(t, "Redis at "+url, err, "start it with `docker compose up -d redis` or set REDIS_URL")
	}
	return client
}

// RedisCluster returns a cluster client for REDIS_CLUSTER_ADDRS, closed when
// the test ends. It checks that the cluster is formed and has 3 masters.
func RedisCluster(t testing.TB) *redis.ClusterClient {
	t.Helper()
	addrs := strings.Split(Getenv("REDIS_CLUSTER_ADDRS", DefaultRedisClusterAddrs), ",")
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs})
	t.Cleanup(func() { _ = client.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	info, err := client.ClusterInfo(ctx).Result()
	if err == nil && !strings.Contains(info, "cluster_state:ok") {
		err = fmt.Errorf("cluster state is not ok")
	}
	if err != nil {
		Unavailable(t, "Redis Cluster at "+strings.Join(addrs, ","), err, "start one with `.ci/redis-cluster start` or set REDIS_CLUSTER_ADDRS")
	}
	var masters atomic.Int32 // ForEachMaster calls back concurrently
	_ = client.ForEachMaster(ctx, func(context.Context, *redis.Client) error { masters.Add(1); return nil })
	if masters.Load() < 3 {
		t.Fatalf("Redis Cluster has %d masters, want 3", masters.Load())
	}
	return client
}

// Postgres returns a database for POSTGRES_DSN, closed when the test ends.
func Postgres(t testing.TB) *sql.DB {
	t.Helper()
	dsn := Getenv("POSTGRES_DSN", DefaultPostgresDSN)
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatalf("POSTGRES_DSN %q: %v", dsn, err)
	}
	t.Cleanup(func() { _ = db.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		Unavailable(t, "PostgreSQL at "+dsn, err, "start it with `docker compose up -d postgres` or set POSTGRES_DSN")
	}
	return db
}
