// Package testenv connects integration tests to the real servers they need.
//
// Addresses come from REDIS_URL, REDIS_CLUSTER_ADDRS and POSTGRES_DSN, and
// default to the local servers (and the cluster .ci/redis-cluster starts).
// When a server is unreachable the test is skipped with a message saying how
// to start it, unless CI is set: then it fails, so CI never passes by
// skipping.
package testenv

import (
	"bytes"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver
	"github.com/redis/go-redis/v9"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
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

// Redis returns a client for REDIS_URL, closed when the test ends. Every
// key written through it is removed when the test ends (see trackKeys).
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
	trackKeys(t, client)
	return client
}

// RedisCluster returns a cluster client for REDIS_CLUSTER_ADDRS, closed when
// the test ends; the keys written through it are removed then. It checks
// that the cluster is formed and has 3 masters.
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
	trackKeys(t, client)
	return client
}

// Postgres returns a database for POSTGRES_DSN through pgx's stdlib driver,
// closed when the test ends.
func Postgres(t testing.TB) *sql.DB {
	t.Helper()
	return PostgresWithDriver(t, "pgx")
}

// PostgresWithDriver is Postgres through the database/sql driver registered
// as driverName (the caller imports it: "postgres" is lib/pq's).
func PostgresWithDriver(t testing.TB, driverName string) *sql.DB {
	t.Helper()
	dsn := Getenv("POSTGRES_DSN", DefaultPostgresDSN)
	db, err := sql.Open(driverName, dsn)
	if err != nil {
		t.Fatalf("POSTGRES_DSN %q: %v", Redact(dsn), err)
	}
	t.Cleanup(func() { _ = db.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		Unavailable(t, "PostgreSQL at "+Redact(dsn), err, "start it with `docker compose up -d postgres` or set POSTGRES_DSN")
	}
	return db
}

// PgxPool returns a pgx connection pool (pgx used natively, without
// database/sql) on POSTGRES_DSN of at most maxConns connections (0: pgx's
// default, 4 or the number of CPUs), closed when the test ends;
// unreachable, the test is skipped (failed under CI).
func PgxPool(t testing.TB, maxConns int32) *pgxpool.Pool {
	t.Helper()
	dsn := Getenv("POSTGRES_DSN", DefaultPostgresDSN)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatalf("POSTGRES_DSN %q: %v", Redact(dsn), err)
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("POSTGRES_DSN %q: %v", Redact(dsn), err)
	}
	t.Cleanup(pool.Close)
	if err := pool.Ping(ctx); err != nil {
		Unavailable(t, "PostgreSQL at "+Redact(dsn), err, "start it with `docker compose up -d postgres` or set POSTGRES_DSN")
	}
	return pool
}

// Envelope is a realistic ~300-byte order envelope for benchmarks, whose
// meta.id can be rewritten in place with SetID.
type Envelope struct {
	Payload []byte
	idAt    int
}

// NewEnvelope returns a fresh Envelope (each caller gets its own bytes).
func NewEnvelope(tb testing.TB) *Envelope {
	tb.Helper()
	const id = "00000000-0000-4000-8000-000000000000"
	e, err := envelope.New("urn:babel:orders:created", map[string]any{
		"order_id": 1042, "customer_id": "c-8812", "amount_cents": 129900, "currency": "EUR",
		"items": []map[string]any{{"sku": "SKU-1", "qty": 2}, {"sku": "SKU-9", "qty": 1}},
	}, envelope.WithQueue("orders"), envelope.WithID(id))
	if err != nil {
		tb.Fatal(err)
	}
	payload, err := e.Marshal()
	if err != nil {
		tb.Fatal(err)
	}
	return &Envelope{Payload: payload, idAt: bytes.Index(payload, []byte(id))}
}

// SetID writes n as 16 hex digits into the first 16 hex positions of the
// meta.id, which stays a well-formed UUID.
func (e *Envelope) SetID(n uint64) {
	const hex = "0123456789abcdef"
	id := e.Payload[e.idAt : e.idAt+36]
	for i := 17; i >= 0; i-- {
		if i == 8 || i == 13 {
			continue // keep the dashes: the id stays a UUID
		}
		id[i] = hex[n&0xf]
		n >>= 4
	}
}

// ID returns the current meta.id.
func (e *Envelope) ID() string { return string(e.Payload[e.idAt : e.idAt+36]) }

// RunConcurrently runs op b.N times across concurrency goroutines (1 runs
// it on the benchmark goroutine). Each goroutine gets an Envelope of its own
// whose meta.id op may set from next, a counter unique across goroutines and
// runs.
func RunConcurrently(b *testing.B, concurrency int, op func(env *Envelope, next func() uint64)) {
	b.Helper()
	next := uniqueIDs()
	if concurrency <= 1 {
		env := NewEnvelope(b)
		b.ResetTimer()
		for b.Loop() {
			op(env, next)
		}
		return
	}
	b.SetParallelism((concurrency + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		env := NewEnvelope(b)
		for pb.Next() {
			op(env, next)
		}
	})
}

// uniqueIDs returns a counter of meta.ids for one benchmark run. Ids must be
// new in every run: a repetition (-count) or another sub-benchmark on the
// same store must not find them remembered. It starts at random, clear of
// the 1<<62 range DeliveryOp uses for duplicates.
func uniqueIDs() func() uint64 {
	var counter atomic.Uint64
	counter.Store(mrand.Uint64() >> 2)
	return func() uint64 { return counter.Add(1) }
}

// Side is one contender of RunSideBySide: Op is one delivery (or the bare
// commands standing in for one) on env, whose meta.id it may set from next.
type Side struct {
	Name string
	Op   func(env *Envelope, next func() uint64)
	// Against names the side this one is compared with; empty: the
	// first side.
	Against string
}

// RunSideBySide measures sides[0] against the others: every iteration runs
// every side once, each on an Envelope of its own, starting from a side that
// rotates from one iteration to the next, across concurrency goroutines (1
// runs on the benchmark goroutine). So drift, background work (WAL flushes,
// autovacuum, the other sides' load) and the order of sub-benchmarks weigh
// on all sides alike, which separate sub-benchmarks cannot promise on a busy
// machine. Before timing, each goroutine runs every side a few times (warm
// connections and prepared statements). It reports each side's mean time
// per call ("<name>-µs") and, for every side but the first, the time of
// the side it is compared with (Against, else the first) over its own
// ("<against>/<name>"); ns/op is a whole iteration.
//
// As with RunConcurrently, next gives ids unique across goroutines and runs.
func RunSideBySide(b *testing.B, concurrency int, sides ...Side) {
	b.Helper()
	next := uniqueIDs()
	total := make([]atomic.Int64, len(sides))
	var rounds atomic.Int64
	newEnvs := func() []*Envelope {
		envs := make([]*Envelope, len(sides))
		for i := range envs {
			envs[i] = NewEnvelope(b)
		}
		return envs
	}
	loop := func(envs []*Envelope, more func() bool, record bool) {
		took := make([]int64, len(sides))
		var n int
		for more() {
			for j := range sides {
				i := (n + j) % len(sides)
				t0 := time.Now()
				sides[i].Op(envs[i], next)
				took[i] += int64(time.Since(t0))
			}
			n++
		}
		if record {
			for i := range took {
				total[i].Add(took[i])
			}
			rounds.Add(int64(n))
		}
	}
	times := func(n int) func() bool { return func() bool { n--; return n >= 0 } }
	if concurrency <= 1 {
		envs := newEnvs()
		loop(envs, times(4), false)
		b.ResetTimer()
		loop(envs, b.Loop, true)
	} else {
		var warm sync.WaitGroup
		for range concurrency {
			warm.Go(func() { loop(newEnvs(), times(4), false) })
		}
		warm.Wait()
		b.SetParallelism((concurrency + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) { loop(newEnvs(), pb.Next, true) })
	}
	n := rounds.Load()
	if n == 0 {
		return
	}
	for i, side := range sides {
		b.ReportMetric(float64(total[i].Load())/float64(n)/1e3, side.Name+"-µs")
		if i == 0 {
			continue
		}
		base := 0
		for j := range sides {
			if sides[j].Name == side.Against {
				base = j
			}
		}
		b.ReportMetric(float64(total[base].Load())/float64(total[i].Load()), sides[base].Name+"/"+side.Name)
	}
}

// Compare measures sides[0] against the others. One at a time
// (concurrency 1) they run side by side in every iteration (RunSideBySide):
// the time of a delivery. Concurrently each runs in a sub-benchmark of its
// own, named after it (RunConcurrently; ns/op is the time per delivery at
// that concurrency, the inverse of throughput), since concurrent sides
// interleaved would mix their loads: a store that pipelines would queue
// behind the other sides' commands.
func Compare(b *testing.B, concurrency int, sides ...Side) {
	b.Helper()
	if concurrency <= 1 {
		RunSideBySide(b, 1, sides...)
		return
	}
	for _, side := range sides {
		b.Run(side.Name, func(b *testing.B) { RunConcurrently(b, concurrency, side.Op) })
	}
}

// Case is one delivery path of a store benchmark: the kit's delivery beside
// the bare commands it issues (Same) and a hand-written guard's (Hand).
// With Dup, each side's message is remembered once first, by Kit itself,
// SameSetup and HandSetup.
type Case struct {
	Name                 string
	Dup                  bool
	Kit, Same, Hand      func(env *Envelope)
	SameSetup, HandSetup func(env *Envelope)
}

// RunCases runs every case at concurrency 1 and 16 as sub-benchmarks
// "<case>/c=<n>", its sides named "kit", sameName and handName, through
// compare (RunSideBySide or Compare).
func RunCases(b *testing.B, compare func(b *testing.B, concurrency int, sides ...Side), sameName, handName string, cases []Case) {
	b.Helper()
	for _, c := range []int{1, 16} {
		for _, v := range cases {
			b.Run(fmt.Sprintf("%s/c=%d", v.Name, c), func(b *testing.B) {
				compare(b, c,
					Side{Name: "kit", Op: DeliveryOp(v.Dup, v.Kit, v.Kit)},
					Side{Name: sameName, Op: DeliveryOp(v.Dup, v.Same, v.SameSetup)},
					Side{Name: handName, Op: DeliveryOp(v.Dup, v.Hand, v.HandSetup)})
			})
		}
	}
}

// DeliveryOp adapts op for RunSideBySide: a message never seen (a fresh
// meta.id every call) or, with dup, a redelivery (one meta.id per Envelope,
// remembered once by setup before its first use).
func DeliveryOp(dup bool, op, setup func(env *Envelope)) func(*Envelope, func() uint64) {
	return func(env *Envelope, next func() uint64) {
		if !dup {
			env.SetID(next())
		} else if env.ID()[:4] == "0000" {
			env.SetID(1<<62 | next())
			setup(env)
		}
		op(env)
	}
}

// RedisInfo returns the fields of one section of the server's INFO.
func RedisInfo(ctx context.Context, client *redis.Client, section string) (map[string]string, error) {
	info, err := client.Info(ctx, section).Result()
	if err != nil {
		return nil, err
	}
	fields := map[string]string{}
	for _, line := range strings.Split(info, "\r\n") {
		if k, v, ok := strings.Cut(line, ":"); ok {
			fields[k] = v
		}
	}
	return fields, nil
}

// Pipelined calls f for each of keys on a pipeline of client, sent ten
// thousand keys at a time: how the load programs write and drop a million
// keys quickly.
func Pipelined(ctx context.Context, client *redis.Client, keys []string, f func(redis.Pipeliner, string)) error {
	const batch = 10_000
	for i := 0; i < len(keys); i += batch {
		p := client.Pipeline()
		for _, k := range keys[i:min(i+batch, len(keys))] {
			f(p, k)
		}
		if _, err := p.Exec(ctx); err != nil {
			return err
		}
	}
	return nil
}

// RedisUsedMemory returns INFO memory's used_memory of the server.
func RedisUsedMemory(ctx context.Context, client *redis.Client) (int64, error) {
	info, err := RedisInfo(ctx, client, "memory")
	if err != nil {
		return 0, err
	}
	v, ok := info["used_memory"]
	if !ok {
		return 0, fmt.Errorf("no used_memory in INFO memory")
	}
	return strconv.ParseInt(v, 10, 64)
}

// RedisBytesPerKey measures what keys cost a Redis server: it reads
// used_memory, runs write for every key in pipelines, reads used_memory
// again, runs unlink for every key to remove what write made, and returns
// the growth divided by the number of keys.
func RedisBytesPerKey(ctx context.Context, client *redis.Client, keys []string, write, unlink func(p redis.Pipeliner, key string)) (float64, error) {
	before, err := RedisUsedMemory(ctx, client)
	if err != nil {
		return 0, err
	}
	if err := Pipelined(ctx, client, keys, write); err != nil {
		return 0, err
	}
	after, err := RedisUsedMemory(ctx, client)
	if err != nil {
		return 0, err
	}
	if err := Pipelined(ctx, client, keys, unlink); err != nil {
		return 0, err
	}
	return float64(after-before) / float64(len(keys)), nil
}

// DropKeys unlinks every key matching pattern, 10,000 a command.
func DropKeys(ctx context.Context, client redis.UniversalClient, pattern string) error {
	var cursor uint64
	for {
		keys, next, err := client.Scan(ctx, cursor, pattern, 10000).Result()
		if err != nil {
			return err
		}
		if len(keys) > 0 {
			if err := client.Unlink(ctx, keys...).Err(); err != nil {
				return err
			}
		}
		if cursor = next; cursor == 0 {
			return nil
		}
	}
}

// RoundTrips is a go-redis hook that counts the commands a client sends
// and the round trips they take: single commands, and pipelines with the
// commands in them. With Count set, only the commands it accepts count (a
// pipeline counts when it carries one of them).
type RoundTrips struct {
	Count func(redis.Cmder) bool

	singles, pipelines, pipelined atomic.Int64
}

// Singles returns the commands sent on their own.
func (r *RoundTrips) Singles() int64 { return r.singles.Load() }

// Pipelines returns the pipelines sent, and the commands they carried.
func (r *RoundTrips) Pipelines() (pipelines, commands int64) {
	return r.pipelines.Load(), r.pipelined.Load()
}

// Totals returns the commands sent and the round trips they took.
func (r *RoundTrips) Totals() (commands, trips int64) {
	pipelines, pipelined := r.Pipelines()
	singles := r.Singles()
	return singles + pipelined, singles + pipelines
}

func (r *RoundTrips) counts(cmd redis.Cmder) bool { return r.Count == nil || r.Count(cmd) }

// DialHook implements redis.Hook.
func (*RoundTrips) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook implements redis.Hook.
func (r *RoundTrips) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if r.counts(cmd) {
			r.singles.Add(1)
		}
		return next(ctx, cmd)
	}
}

// ProcessPipelineHook implements redis.Hook.
func (r *RoundTrips) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		var n int64
		for _, cmd := range cmds {
			if r.counts(cmd) {
				n++
			}
		}
		if n > 0 {
			r.pipelines.Add(1)
			r.pipelined.Add(n)
		}
		return next(ctx, cmds)
	}
}

// StreamDrained reports whether the consumer group of stream has read
// entries entries and acked every one (none pending).
func StreamDrained(ctx context.Context, client *redis.Client, stream, group string, entries int) bool {
	groups, err := client.XInfoGroups(ctx, stream).Result()
	if err != nil {
		return false
	}
	for _, g := range groups {
		if g.Name == group {
			return g.EntriesRead == int64(entries) && g.Pending == 0
		}
	}
	return false
}

// SQLTopicDrained reports whether a watermill-sql consumer group (default
// PostgreSQL schema and offsets adapter) has committed every message of
// topic.
func SQLTopicDrained(ctx context.Context, db *sql.DB, topic, group string) bool {
	var done bool
	err := db.QueryRowContext(ctx, fmt.Sprintf(`SELECT coalesce((SELECT offset_acked FROM "watermill_offsets_%s" WHERE consumer_group = $1), 0)
		>= (SELECT max("offset") FROM "watermill_%s")`, topic, topic), group).Scan(&done)
	return err == nil && done
}

// RandomHex returns n random bytes in hex, for names unique to a run.
func RandomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// KitDeliveries returns the middleware on store around a handler that does
// nothing, as a delivery of an Envelope with ctx as its message context:
// plain, and under WithClaim.
func KitDeliveries(b *testing.B, ctx context.Context, store stores.Store) (plain, claimed func(*Envelope)) {
	noop := func(*message.Message) ([]*message.Message, error) { return nil, nil }
	deliver := func(h message.HandlerFunc) func(*Envelope) {
		return func(env *Envelope) {
			msg := message.NewMessage("bench", env.Payload)
			msg.SetContext(ctx)
			if _, err := h(msg); err != nil {
				b.Fatal(err)
			}
		}
	}
	return deliver(idempotency.Middleware(store)(noop)),
		deliver(idempotency.Middleware(store, idempotency.WithClaim(time.Minute))(noop))
}

// RunRouter runs r until the test ends or stop is called, whichever comes
// first, and returns once r is running. The test fails if r does not start
// within 5 seconds or returns an error.
func RunRouter(t testing.TB, r *message.Router) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("router: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	select {
	case <-r.Running():
	case <-time.After(5 * time.Second):
		t.Fatal("router did not start")
	}
	return stop
}

// RunExample runs an example's run function within timeout and fails the
// test, printing the output, if it returns an error or its output lacks any
// of wants.
func RunExample(t testing.TB, timeout time.Duration, run func(ctx context.Context, out io.Writer) error, wants ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var out bytes.Buffer
	if err := run(ctx, &out); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	for _, want := range wants {
		if !strings.Contains(out.String(), want) {
			t.Fatalf("output lacks %q:\n%s", want, out.String())
		}
	}
}

// PublishCopies publishes n distinct envelopes of job to topic, the i-th
// copies(i) times in a row (interleaved with the others, as redeliveries
// and duplicate publishes arrive), in batches. It returns the envelopes'
// meta.ids and the number of messages published.
func PublishCopies(t testing.TB, pub message.Publisher, topic, job string, n int, copies func(i int) int) (ids []string, entries int) {
	t.Helper()
	ids = make([]string, n)
	var batch []*message.Message
	flush := func() {
		if err := pub.Publish(topic, batch...); err != nil {
			t.Fatal(err)
		}
		batch = batch[:0]
	}
	for i := range n {
		e, err := envelope.New(job, map[string]any{"i": i}, envelope.WithQueue(topic))
		if err != nil {
			t.Fatal(err)
		}
		payload, err := e.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		ids[i] = e.Meta.ID
		for range copies(i) {
			batch = append(batch, message.NewMessage(watermill.NewUUID(), payload))
			entries++
		}
		if len(batch) >= 500 {
			flush()
		}
	}
	if len(batch) > 0 {
		flush()
	}
	return ids, entries
}

// LookupFingerprint looks key up in s and returns whether it is remembered
// and the fingerprint kept with it.
func LookupFingerprint(s stores.Store, ctx context.Context, key string) (bool, uint64, error) {
	r, err := s.Lookup(ctx, key)
	return r.Remembered(), r.Fingerprint, err
}
