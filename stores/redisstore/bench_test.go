package redisstore_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/internal/testenv"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
)

// BenchmarkDelivery: the middleware with redisstore per delivery, side by
// side with the bare go-redis commands it issues, so the overhead over the
// wire is visible. "first" is a message never seen, "dup" a redelivery of a
// remembered one; "claim" runs under WithClaim.
func BenchmarkDelivery(b *testing.B) {
	client := testenv.Redis(b)
	ctx := context.Background()
	prefix := testPrefix()
	defer func() { // drop what the run wrote
		iter := client.Scan(ctx, 0, prefix+"*", 10000).Iterator()
		for iter.Next(ctx) {
			client.Unlink(ctx, iter.Val())
		}
	}()
	store := redisstore.New(client, redisstore.WithPrefix(prefix), redisstore.WithTTL(time.Hour))
	noop := func(*message.Message) ([]*message.Message, error) { return nil, nil }
	plain := idempotency.Middleware(store)(noop)
	claimed := idempotency.Middleware(store, idempotency.WithClaim(time.Minute))(noop)
	rawKey := func(env *testenv.Envelope) string { return prefix + "raw:" + env.ID() }
	deliver := func(h message.HandlerFunc) func(*testenv.Envelope) {
		return func(env *testenv.Envelope) {
			if _, err := h(message.NewMessage("bench", env.Payload)); err != nil {
				b.Fatal(err)
			}
		}
	}
	must := func(err error) {
		if err != nil && err.Error() != "redis: nil" {
			b.Fatal(err)
		}
	}
	for _, c := range []int{1, 16} {
		for _, v := range []struct {
			name  string
			dup   bool
			op    func(env *testenv.Envelope)
			setup func(env *testenv.Envelope)
		}{
			{"first/kit", false, deliver(plain), nil},
			{"first/raw-GET+SET", false, func(env *testenv.Envelope) {
				k := rawKey(env)
				must(client.Get(ctx, k).Err())
				must(client.Set(ctx, k, "1", time.Hour).Err())
			}, nil},
			{"first/kit-claim", false, deliver(claimed), nil},
			{"first/raw-SETNX+SET", false, func(env *testenv.Envelope) {
				k := rawKey(env)
				must(client.SetNX(ctx, k, "c", time.Minute).Err())
				must(client.Set(ctx, k, "1", time.Hour).Err())
			}, nil},
			{"dup/kit", true, deliver(plain), deliver(plain)},
			{"dup/raw-GET", true, func(env *testenv.Envelope) { must(client.Get(ctx, rawKey(env)).Err()) },
				func(env *testenv.Envelope) { must(client.Set(ctx, rawKey(env), "1", time.Hour).Err()) }},
			{"dup/kit-claim", true, deliver(claimed), deliver(claimed)},
			{"dup/raw-SETNX+GET", true, func(env *testenv.Envelope) {
				k := rawKey(env)
				must(client.SetNX(ctx, k, "c", time.Minute).Err())
				must(client.Get(ctx, k).Err())
			}, func(env *testenv.Envelope) { must(client.Set(ctx, rawKey(env), "1", time.Hour).Err()) }},
		} {
			b.Run(fmt.Sprintf("%s/c=%d", v.name, c), func(b *testing.B) {
				testenv.RunConcurrently(b, c, func(env *testenv.Envelope, next func() uint64) {
					if !v.dup {
						env.SetID(next())
					} else if env.ID()[:4] == "0000" { // first use: a fresh id, remembered once
						env.SetID(1<<62 | next())
						v.setup(env)
					}
					v.op(env)
				})
			})
		}
	}
}
