package redisstore_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// BenchmarkDelivery: the middleware with redisstore per delivery, side by
// side (testenv.Compare: one at a time, every iteration runs all three; 16
// concurrent, each side on its own, since the store's pipelines would queue
// behind the other sides' commands) with two bare baselines through the
// same client:
//
//   - same-cmds: the very commands the store issues for that path (same
//     key, value and options), one by one. kit/same-cmds is the kit's
//     overhead over its wire cost.
//   - hand-cmds: what a hand-written guard would issue: GET then SET on a
//     readable key; under a claim SET NX PX, then a GET to tell why a claim
//     failed.
//
// "first" is a message never seen, "dup" a redelivery of a remembered one;
// "-claim" runs under WithClaim. With BENCH_CONTEXT_TIMEOUT=1 the client
// has go-redis's ContextTimeoutEnabled, which lets the store send a lone
// command from its caller's goroutine.
func BenchmarkDelivery(b *testing.B) {
	client := testenv.Redis(b)
	if os.Getenv("BENCH_CONTEXT_TIMEOUT") == "1" {
		o := client.Options()
		o.ContextTimeoutEnabled = true
		client = redis.NewClient(o)
		defer client.Close()
	}
	// Watermill hands handlers cancelable message contexts.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	prefix := testPrefix()
	defer testenv.DropKeys(context.Background(), client, prefix+"*") //nolint:errcheck // drop what the run wrote
	store := redisstore.New(client, redisstore.WithPrefix(prefix), redisstore.WithTTL(time.Hour))
	plain, claimed := testenv.KitDeliveries(b, ctx, store)
	must := func(err error) {
		if err != nil && err != redis.Nil {
			b.Fatal(err)
		}
	}
	// The store's key for a message, with "same" in the scope so the bare
	// commands never touch the kit's records.
	same := func(env *testenv.Envelope) string { return store.RedisKey(idempotency.Key("same", env.ID())) }
	hand := func(env *testenv.Envelope) string { return prefix + "hand:" + env.ID() }
	const fingerprint = "7331"
	setGet := func(k, v string, ttl time.Duration) {
		must(client.SetArgs(ctx, k, v, redis.SetArgs{Mode: "NX", TTL: ttl, Get: true}).Err())
	}
	testenv.RunCases(b, testenv.Compare, "same-cmds", "hand-cmds", []testenv.Case{
		{Name: "first", Kit: plain,
			Same: func(env *testenv.Envelope) {
				k := same(env)
				must(client.Get(ctx, k).Err())
				must(client.Set(ctx, k, fingerprint, time.Hour).Err())
			},
			Hand: func(env *testenv.Envelope) {
				k := hand(env)
				must(client.Get(ctx, k).Err())
				must(client.Set(ctx, k, "1", time.Hour).Err())
			}},
		{Name: "first-claim", Kit: claimed,
			Same: func(env *testenv.Envelope) {
				k := same(env)
				setGet(k, "c0123456789abcdef-1", time.Minute)
				must(client.Set(ctx, k, fingerprint, time.Hour).Err())
			},
			Hand: func(env *testenv.Envelope) {
				k := hand(env)
				must(client.SetNX(ctx, k, "c", time.Minute).Err())
				must(client.Set(ctx, k, "1", time.Hour).Err())
			}},
		{Name: "dup", Dup: true, Kit: plain,
			Same:      func(env *testenv.Envelope) { must(client.Get(ctx, same(env)).Err()) },
			SameSetup: func(env *testenv.Envelope) { must(client.Set(ctx, same(env), fingerprint, time.Hour).Err()) },
			Hand:      func(env *testenv.Envelope) { must(client.Get(ctx, hand(env)).Err()) },
			HandSetup: func(env *testenv.Envelope) { must(client.Set(ctx, hand(env), "1", time.Hour).Err()) }},
		{Name: "dup-claim", Dup: true, Kit: claimed,
			Same:      func(env *testenv.Envelope) { setGet(same(env), "c0123456789abcdef-1", time.Minute) },
			SameSetup: func(env *testenv.Envelope) { must(client.Set(ctx, same(env), fingerprint, time.Hour).Err()) },
			Hand: func(env *testenv.Envelope) {
				k := hand(env)
				must(client.SetNX(ctx, k, "c", time.Minute).Err())
				must(client.Get(ctx, k).Err())
			},
			HandSetup: func(env *testenv.Envelope) { must(client.Set(ctx, hand(env), "1", time.Hour).Err()) }},
	})
}
