package testenv

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// keyTracker is a go-redis hook that notes the keys a test's client
// writes, so that they can be removed when the test ends: every test leaves
// the server as it found it, whatever store or helper wrote through the
// client.
type keyTracker struct {
	mu   sync.Mutex
	keys map[string]struct{}
}

// trackKeys makes the test remove, when it ends, every key client wrote.
func trackKeys(t testing.TB, client redis.UniversalClient) { TrackKeys(t, client, client) }

// TrackKeys makes the test remove, when it ends, every key written through
// client, deleting them through dropWith (for a client that goes through a
// fault proxy, a direct client of the same server, opened before it).
// Benchmarks are left alone (they drop their keys themselves, and the hook
// would weigh on what they measure).
func TrackKeys(t testing.TB, client, dropWith redis.UniversalClient) {
	if _, bench := t.(*testing.B); bench {
		return
	}
	k := &keyTracker{keys: map[string]struct{}{}}
	client.AddHook(k)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := k.drop(ctx, dropWith); err != nil {
			t.Errorf("testenv: removing the keys the test wrote: %v", err)
		}
	})
}

func (k *keyTracker) drop(ctx context.Context, client redis.UniversalClient) error {
	k.mu.Lock()
	keys := make([]string, 0, len(k.keys))
	for key := range k.keys {
		keys = append(keys, key)
	}
	k.keys = map[string]struct{}{}
	k.mu.Unlock()
	for len(keys) > 0 {
		n := min(len(keys), 1000)
		// One UNLINK per key: on a Cluster, keys of different slots cannot
		// share a command; the pipeline still takes one round trip a node.
		_, err := client.Pipelined(ctx, func(p redis.Pipeliner) error {
			for _, key := range keys[:n] {
				p.Unlink(ctx, key)
			}
			return nil
		})
		if err != nil {
			return err
		}
		keys = keys[n:]
	}
	return nil
}

func (k *keyTracker) note(cmd redis.Cmder) {
	args := cmd.Args()
	var keys []any
	switch strings.ToLower(cmd.Name()) {
	case "eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro":
		if len(args) > 2 {
			if n, err := strconv.Atoi(fmt.Sprint(args[2])); err == nil && 3+n <= len(args) {
				keys = args[3 : 3+n]
			}
		}
	case "set", "setnx", "setex", "psetex", "getset", "getex", "getdel", "incr", "incrby", "decr", "decrby", "append",
		"hset", "hsetnx", "hmset", "hincrby", "expire", "pexpire", "expireat", "pexpireat", "persist",
		"rpush", "lpush", "sadd", "zadd", "xadd", "setrange", "pfadd", "restore":
		if len(args) > 1 {
			keys = args[1:2]
		}
	case "lmove", "blmove", "rpoplpush", "brpoplpush", "copy", "rename", "renamenx":
		if len(args) > 2 {
			keys = args[1:3]
		}
	case "mset", "msetnx":
		for i := 1; i < len(args); i += 2 {
			keys = append(keys, args[i])
		}
	case "xgroup":
		if len(args) > 2 && strings.EqualFold(toString(args[1]), "create") {
			keys = args[2:3]
		}
	}
	if len(keys) == 0 {
		return
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, key := range keys {
		if s := toString(key); s != "" {
			k.keys[s] = struct{}{}
		}
	}
}

func toString(v any) string {
	switch v := v.(type) {
	case string:
		return v
	case []byte:
		return string(v)
	default:
		return ""
	}
}

// DialHook implements redis.Hook.
func (*keyTracker) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook implements redis.Hook.
func (k *keyTracker) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		k.note(cmd)
		return next(ctx, cmd)
	}
}

// ProcessPipelineHook implements redis.Hook.
func (k *keyTracker) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			k.note(cmd)
		}
		return next(ctx, cmds)
	}
}
