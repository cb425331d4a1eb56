package testenv

import (
	"context"

	"github.com/redis/go-redis/v9"
)

// RedisPipelined sends f's command for every key in pipelines of 10,000
// (the load programs under bench/ write and drop millions of keys so).
func RedisPipelined(ctx context.Context, client *redis.Client, keys []string, f func(p redis.Pipeliner, key string)) error {
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
