package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.uber.org/goleak"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestHostileNoGoroutineOutlivesTheRouter: a router running the guard on
// Redis and on PostgreSQL through every path (first runs, duplicates,
// failures, parked copies, handlers returning messages, a store call
// given up at its deadline) leaves no goroutine of the kit's behind once
// it is closed and the stores' statements have settled. Not parallel: it
// counts goroutines.
func TestHostileNoGoroutineOutlivesTheRouter(t *testing.T) {
	if testing.Short() {
		t.Skip("slow: a router run per store")
	}
	redisClient := testenv.Redis(t)
	db := testenv.Postgres(t)
	pg, err := postgresstore.New(db, postgresstore.WithTable("idem_leak_"+testenv.RandomHex(4)))
	if err != nil {
		t.Fatal(err)
	}
	if err := pg.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = db.Exec(`DROP TABLE ` + pg.Table()) })
	prefix := "bq-leak-" + testenv.RandomHex(4) + ":"
	for name, store := range map[string]stores.Store{
		"redis":    redisstore.New(redisClient, redisstore.WithPrefix(prefix)),
		"postgres": pg,
	} {
		t.Run(name, func(t *testing.T) {
			leaks := goleak.IgnoreCurrent()
			pubsub := newPubSub()
			r := newRouter(t)
			var n atomic.Int32
			r.AddMiddleware(idempotency.Middleware(store, idempotency.WithParkWait(30*time.Millisecond),
				idempotency.WithStoreTimeout(2*time.Second)))
			r.AddHandler("h", "in", pubsub, "out", pubsub, func(msg *message.Message) ([]*message.Message, error) {
				switch i := n.Add(1); {
				case i%5 == 0:
					return nil, errors.New("declined")
				case i%3 == 0:
					return []*message.Message{msgOf([]byte("follow-up"))}, nil
				}
				return nil, nil
			})
			stop := testenv.RunRouter(t, r)
			for i := range 60 {
				if err := pubsub.Publish("in", msgOf(envelopeWithID(t, fmt.Sprintf("leak-%d", i%20)))); err != nil {
					t.Fatal(err)
				}
			}
			time.Sleep(time.Second)
			stop()
			if err := pubsub.Close(); err != nil {
				t.Fatal(err)
			}
			for i := range 20 {
				_ = store.Forget(context.Background(), idempotency.Key("h", fmt.Sprintf("leak-%d", i)))
			}
			goleak.VerifyNone(t, leaks)
		})
	}
}
