package redisstore_test

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/stores/storetest"
	"github.com/babelqueue/watermill-idempotency/testkit/conformance"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// testPrefix gives every store a key space of its own on the shared server.
func testPrefix() string {
	return "t" + testenv.RandomHex(4) + ":"
}

func TestContractSingle(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	runContract(t, client)
}

// TestContractWithoutPipelining runs the contract with every command sent on
// its own.
func TestContractWithoutPipelining(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	storetest.Run(t,
		func(t *testing.T) stores.Store { return newStore(t, client, redisstore.WithoutPipelining()) },
		storetest.WithTTLStore(func(t *testing.T, ttl time.Duration) stores.Store {
			return newStore(t, client, redisstore.WithTTL(ttl), redisstore.WithoutPipelining())
		}))
}

func TestContractCluster(t *testing.T) {
	t.Parallel()
	client := testenv.RedisCluster(t)
	runContract(t, client)
}

func runContract(t *testing.T, client redis.UniversalClient) {
	storetest.Run(t,
		func(t *testing.T) stores.Store { return newStore(t, client) },
		storetest.WithTTLStore(func(t *testing.T, ttl time.Duration) stores.Store {
			return newStore(t, client, redisstore.WithTTL(ttl))
		}),
		storetest.WithSecondInstance(func(t *testing.T, s stores.Store) stores.Store {
			// A second worker: the same key space.
			return redisstore.New(client, redisstore.WithPrefix(s.(*redisstore.Store).Prefix()))
		}))
}

// newStore returns a store on a key space of its own, whose keys are
// dropped when the test ends.
func newStore(t testing.TB, client redis.UniversalClient, opts ...redisstore.Option) *redisstore.Store {
	prefix := testPrefix()
	t.Cleanup(func() { dropKeys(client, prefix+"*") })
	return redisstore.New(client, append([]redisstore.Option{redisstore.WithPrefix(prefix)}, opts...)...)
}

func TestConformanceSequences(t *testing.T) {
	t.Parallel()
	for name, client := range map[string]func(*testing.T) redis.UniversalClient{
		"single":  func(t *testing.T) redis.UniversalClient { return testenv.Redis(t) },
		"cluster": func(t *testing.T) redis.UniversalClient { return testenv.RedisCluster(t) },
	} {
		t.Run(name, func(t *testing.T) {
			c := client(t)
			conformance.RunIdempotency(t, testPrefix(), func(t *testing.T) stores.Store {
				return redisstore.New(c, redisstore.WithPrefix(testPrefix()))
			})
		})
	}
}

func TestIntentChecks(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	conformance.RunIntentChecks(t, testPrefix(), func(t *testing.T) stores.Store {
		return redisstore.New(client, redisstore.WithPrefix(testPrefix()))
	})
}

func TestClusterSpreadsRecordsOverSlots(t *testing.T) {
	t.Parallel()
	client := testenv.RedisCluster(t)
	s := redisstore.New(client, redisstore.WithPrefix(testPrefix()))
	ctx := context.Background()
	nodes := map[int64]bool{}
	for i := range 64 {
		key := idempotency.Key("charge", "order-"+string(rune('a'+i%26))+hex.EncodeToString([]byte{byte(i)}))
		if err := s.Remember(ctx, key, 0, nil); err != nil {
			t.Fatal(err)
		}
		slots, err := client.ClusterKeySlot(ctx, s.RedisKey(key)).Result()
		if err != nil {
			t.Fatal(err)
		}
		nodes[slots*3/16384] = true
	}
	if len(nodes) < 3 {
		t.Fatalf("64 records landed on %d of 3 masters' slot ranges", len(nodes))
	}
}

func TestRecordLayout(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	prefix := testPrefix()
	s := redisstore.New(client, redisstore.WithPrefix(prefix), redisstore.WithTTL(time.Hour))
	ctx := context.Background()
	key := idempotency.Key("a-rather-long-handler-name", "f1e2d3c4-b5a6-4789-90ab-cdef01234567")
	if err := s.Remember(ctx, key, 0, nil); err != nil {
		t.Fatal(err)
	}
	rk := s.RedisKey(key)
	if len(rk) != len(prefix)+11 || !strings.HasPrefix(rk, prefix) {
		t.Fatalf("Redis key %q: want the prefix and an 11-byte digest", rk)
	}
	if def := redisstore.New(client).RedisKey(key); len(def) != 14 {
		t.Fatalf("default Redis key is %d bytes; 14 or less fits Redis's 16-byte allocation", len(def))
	}
	if v, _ := client.Get(ctx, rk).Result(); v != "1" {
		t.Fatalf("remembered value %q, want \"1\" (a shared integer)", v)
	}
	if ttl, _ := client.PTTL(ctx, rk).Result(); ttl <= 59*time.Minute || ttl > time.Hour {
		t.Fatalf("PTTL = %v, want about an hour", ttl)
	}
}

func TestInvalidOptionsAreRejected(t *testing.T) {
	t.Parallel()
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer client.Close()
	for _, bad := range []redisstore.Option{
		redisstore.WithPrefix(""), redisstore.WithPrefix("has space"), redisstore.WithPrefix("{tag}:"),
		redisstore.WithPrefix(strings.Repeat("p", 33)), redisstore.WithPrefix("é:"),
		redisstore.WithTTL(-time.Second), redisstore.WithTTL(time.Microsecond),
	} {
		func() {
			defer func() {
				r := recover()
				err, _ := r.(error)
				if !errors.Is(err, redisstore.ErrInvalidOption) {
					t.Fatalf("New with a bad option: recovered %v, want ErrInvalidOption", r)
				}
			}()
			redisstore.New(client, bad)
		}()
	}
}

// TestServerDownSurfacesErrors points a store at a port where no Redis
// listens: every call fails with an error, and the middleware fails the
// delivery for a retry instead of running the handler.
func TestServerDownSurfacesErrors(t *testing.T) {
	t.Parallel()
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
	defer client.Close()
	s := redisstore.New(client)
	ctx := context.Background()
	if _, err := stores.Seen(ctx, s, "k"); err == nil {
		t.Fatal("Seen: no error with the server down")
	}
	if err := s.Remember(ctx, "k", 0, nil); err == nil {
		t.Fatal("Remember: no error with the server down")
	}
	if _, _, err := s.Claim(ctx, "k", time.Second); err == nil {
		t.Fatal("Claim: no error with the server down")
	}
}

// TestConcurrentCommandsShareRoundTrips: commands of concurrent callers go
// out in shared pipelines, and every caller gets its own command's answer.
func TestConcurrentCommandsShareRoundTrips(t *testing.T) {
	t.Parallel()
	direct := testenv.Redis(t)
	client := redis.NewClient(direct.Options())
	defer client.Close()
	testenv.TrackKeys(t, client, direct)
	// Count the store's lookups (EVALSHA) and SETs, not the connection handshakes.
	store := redisstore.New(client, redisstore.WithPrefix(testPrefix()), redisstore.WithTTL(time.Minute))
	ctx := context.Background()
	if _, err := store.Lookup(ctx, "warm-up"); err != nil { // loads the lookup script
		t.Fatal(err)
	}
	counter := &testenv.RoundTrips{Count: func(cmd redis.Cmder) bool { return cmd.Name() == "evalsha" || cmd.Name() == "set" }}
	client.AddHook(counter)
	const callers, rounds = 64, 20
	var wrong, failed atomic.Int64
	var wg sync.WaitGroup
	for c := range callers {
		wg.Go(func() {
			for r := range rounds {
				key := fmt.Sprintf("caller-%d-round-%d", c, r)
				fp := uint64(c*rounds + r + 1)
				if err := store.Remember(ctx, key, fp, nil); err != nil {
					failed.Add(1)
					continue
				}
				seen, kept, err := testenv.LookupFingerprint(store, ctx, key)
				switch {
				case err != nil:
					failed.Add(1)
				case !seen || kept != store.Capabilities().KeptFingerprint(fp):
					wrong.Add(1)
				}
			}
		})
	}
	wg.Wait()
	if failed.Load() != 0 || wrong.Load() != 0 {
		t.Fatalf("%d commands failed, %d answers belonged to another caller", failed.Load(), wrong.Load())
	}
	commands := int64(2 * callers * rounds)
	got, trips := counter.Totals()
	if got != commands {
		t.Fatalf("%d commands reached the client, want %d", got, commands)
	}
	pipelines, _ := counter.Pipelines()
	t.Logf("%d commands in %d round trips (%d pipelines)", commands, trips, pipelines)
	if trips >= commands {
		t.Fatalf("%d concurrent callers' %d commands took %d round trips: nothing was shared", callers, commands, trips)
	}
}

// dropKeys deletes the keys matching pattern, on every master of a cluster.
func dropKeys(client redis.UniversalClient, pattern string) {
	ctx := context.Background()
	cluster, ok := client.(*redis.ClusterClient)
	if !ok {
		_ = testenv.DropKeys(ctx, client, pattern)
		return
	}
	_ = cluster.ForEachMaster(ctx, func(ctx context.Context, master *redis.Client) error {
		iter := master.Scan(ctx, 0, pattern, 1000).Iterator()
		for iter.Next(ctx) {
			_ = master.Unlink(ctx, iter.Val()).Err()
		}
		return iter.Err()
	})
}

// TestLoneCommandWithoutDeadlineGoesOutFromItsCaller: with go-redis's
// default client (no ContextTimeoutEnabled), a command that finds nothing
// in flight and whose context can be cancelled but has no deadline, as
// Watermill's message contexts, costs what it costs under a context that
// never ends: the caller sends it itself, with no goroutine and no detached
// context (the client's own timeouts bound it, as for any call without a
// deadline). Handing it to a goroutine cost a third more time per delivery,
// one at a time (docs/benchmarks.md).
func TestLoneCommandWithoutDeadlineGoesOutFromItsCaller(t *testing.T) {
	client := testenv.Redis(t)
	for _, opts := range [][]redisstore.Option{nil, {redisstore.WithoutPipelining()}} {
		store := newStore(t, client, opts...)
		cancelable, cancel := context.WithCancel(context.Background())
		defer cancel()
		allocs := func(ctx context.Context) float64 {
			return testing.AllocsPerRun(200, func() {
				if _, err := stores.Seen(ctx, store, "lone"); err != nil {
					t.Fatal(err)
				}
			})
		}
		never, canceled := allocs(context.Background()), allocs(cancelable)
		t.Logf("allocations per Seen: %.1f under a context that never ends, %.1f under a cancelable one", never, canceled)
		if canceled > never {
			t.Fatalf("a lone Seen allocates %.1f times under a cancelable context without deadline, %.1f under one that never ends: it was handed to a goroutine",
				canceled, never)
		}
	}
}
