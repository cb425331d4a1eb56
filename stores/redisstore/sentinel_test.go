package redisstore_test

import (
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/stores/storetest"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestContractSentinel runs the store contract through a failover client that
// finds the master through a real Redis Sentinel.
func TestContractSentinel(t *testing.T) {
	client, _ := testenv.RedisSentinel(t)
	storetest.Run(t,
		func(t *testing.T) stores.Store { return redisstore.New(client, redisstore.WithPrefix(testPrefix())) },
		storetest.WithTTLStore(func(t *testing.T, ttl time.Duration) stores.Store {
			return redisstore.New(client, redisstore.WithPrefix(testPrefix()), redisstore.WithTTL(ttl))
		}))
}
