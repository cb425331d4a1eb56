package testenv

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"
)

// TestRedisRemovesWhatATestWrote: the keys a test writes through Redis(t),
// by command, script or pipeline, are gone when it ends.
func TestRedisRemovesWhatATestWrote(t *testing.T) {
	observer := Redis(t)
	ctx := context.Background()
	base := "bq-test-track-" + RandomHex(4) + ":"
	keys := []string{base + "set", base + "script", base + "piped", base + "stream"}
	t.Run("writes", func(t *testing.T) {
		c := Redis(t)
		c.Set(ctx, keys[0], "1", 0)
		c.Eval(ctx, `return redis.call('SET', KEYS[1], ARGV[1])`, []string{keys[1]}, "1")
		_, _ = c.Pipelined(ctx, func(p redis.Pipeliner) error { p.HSet(ctx, keys[2], "f", "v"); return nil })
		c.XAdd(ctx, &redis.XAddArgs{Stream: keys[3], Values: map[string]any{"a": "b"}})
		if n, _ := observer.Exists(ctx, keys...).Result(); n != 4 {
			t.Fatalf("%d of 4 keys written", n)
		}
	})
	if n, _ := observer.Exists(ctx, keys...).Result(); n != 0 {
		t.Fatalf("%d keys left after the test that wrote them", n)
	}
}
