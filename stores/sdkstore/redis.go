package sdkstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/internal/ctxerr"
	"github.com/babelqueue/watermill-idempotency/internal/redisdeadline"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// Default key prefixes of the SDK Redis stores.
const (
	DefaultPHPPrefix = "bq:idem:"  // PHP RedisStore
	DefaultGoPrefix  = "bq:idemp:" // Go SDK idempotency-redis
)

// Values the PHP RedisStore layout keeps.
const (
	phpClaimed = "1" // an in-flight claim (the kit adds ":" and the holder's token)
	phpSeen    = "2" // a remembered message
)

// claimScript takes the claim KEYS[1] for the holder value ARGV[1] for
// ARGV[2] milliseconds, when the key is absent. A key already holding
// ARGV[1] is the holder's own live claim (its claim sent again after the
// reply was lost): it counts as taken, and keeps its lease. Anything else
// (another holder's claim, a record) is not taken. One key, so it runs on a
// Redis Cluster.
var claimScript = redis.NewScript(`
local v = redis.call('GET', KEYS[1])
if not v then
	redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
	return 1
end
if v == ARGV[1] then return 1 end
return 0`)

// releaseScript deletes KEYS[1] while it holds the holder value ARGV[1]:
// never another holder's claim, never a record.
var releaseScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0`)

// extendScript sets the expiry of KEYS[1] to ARGV[2] milliseconds from now
// while it holds the holder value ARGV[1]: never another holder's claim,
// never a record. A lapsed claim is gone, so not held.
var extendScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0`)

// extendKey runs extendScript: whether the holder still held key, now for
// lease from now.
func extendKey(ctx context.Context, client redis.UniversalClient, key, holder string, lease time.Duration) (bool, error) {
	if lease < time.Millisecond {
		return false, fmt.Errorf("sdkstore: lease %v: want at least 1ms", lease)
	}
	n, err := extendScript.Run(ctx, client, []string{key}, holder, lease.Milliseconds()).Int()
	if err != nil {
		return false, fmt.Errorf("sdkstore: extend the claim %q: %w", key, ctxerr.Match(ctx, err))
	}
	return n == 1, nil
}

// phpRememberScript sets KEYS[1] to "2" (with an expiry of ARGV[2]
// milliseconds unless it is "0") unless it holds a claim ("1", the PHP
// SDK's, or "1:" and a holder's token, the kit's) other than the caller's
// (ARGV[1]): it then writes nothing and returns 0. A lapsed claim is gone.
var phpRememberScript = redis.NewScript(`
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, 1) == '1' and v ~= ARGV[1] then return 0 end
if ARGV[2] == '0' then redis.call('SET', KEYS[1], '2') else redis.call('SET', KEYS[1], '2', 'PX', ARGV[2]) end
return 1`)

// releaseKey runs releaseScript.
func releaseKey(ctx context.Context, client redis.UniversalClient, key, holder string) error {
	if err := releaseScript.Run(ctx, client, []string{key}, holder).Err(); err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("sdkstore: release %q: %w", key, ctxerr.Match(ctx, err))
	}
	return nil
}

// inspectScript returns the value of KEYS[1] and its PTTL (milliseconds;
// -1 when it has no expiry), or nil when the key is absent: one read of
// both, so a key expiring between them is never half seen.
var inspectScript = redis.NewScript(`
local v = redis.call('GET', KEYS[1])
if not v then return false end
return {v, redis.call('PTTL', KEYS[1])}`)

// expiresIn returns the instant ms milliseconds from now, or the zero time
// for a key with no expiry (ms < 0). Counted in milliseconds, so the
// longest expiries Redis keeps never overflow a time.Duration.
func expiresIn(ms int64) time.Time {
	if ms < 0 {
		return time.Time{}
	}
	return time.UnixMilli(time.Now().UnixMilli() + ms)
}

// keyPTTL returns the PTTL of key in milliseconds: -2 when it is absent,
// -1 when it has no expiry.
func keyPTTL(ctx context.Context, client redis.UniversalClient, key string) (int64, error) {
	cmd := redis.NewIntCmd(ctx, "pttl", key)
	_ = client.Process(ctx, cmd)
	ms, err := cmd.Result()
	if err != nil {
		return 0, fmt.Errorf("sdkstore: PTTL %q: %w", key, ctxerr.Match(ctx, err))
	}
	return ms, nil
}

// holderToken returns the claim holder of ctx: its token, or instance (the
// store's own) when ctx names none.
func holderToken(ctx context.Context, instance string) string {
	if token := stores.ClaimToken(ctx); token != "" {
		return token
	}
	return instance
}

// PHPRedisStore reads and writes the records of the PHP SDK's RedisStore:
// key prefix + meta.id; a claim is SET NX PX; a remembered message is the
// value "2". See the package documentation.
type PHPRedisStore struct {
	client   redis.UniversalClient
	cfg      config
	instance string // the claim holder of calls whose context names none
	inline   bool   // the client ends a command at its context's deadline (ContextTimeoutEnabled)
}

var _ stores.Store = (*PHPRedisStore)(nil)

// NewPHPRedis returns a store on client sharing the PHP SDK RedisStore's
// records. Options: WithPrefix, WithTTL, WithScopedKeys. The client stays
// the caller's.
func NewPHPRedis(client redis.UniversalClient, opts ...Option) (*PHPRedisStore, error) {
	cfg := newConfig(opts)
	if cfg.prefix == "" {
		cfg.prefix = DefaultPHPPrefix
	}
	if err := redisCommon(client, &cfg, false); err != nil {
		return nil, err
	}
	return &PHPRedisStore{client: client, cfg: cfg, instance: stores.NewClaimToken(), inline: redisdeadline.Honoured(client)}, nil
}

func redisCommon(client redis.UniversalClient, cfg *config, claims bool) error {
	if client == nil {
		return fmt.Errorf("%w: nil Redis client", ErrInvalidOption)
	}
	if err := checkPrefix("prefix", cfg.prefix); err != nil {
		return err
	}
	if cfg.table != "" || cfg.claimTable != "" {
		return fmt.Errorf("%w: a table does not apply to a Redis layout", ErrInvalidOption)
	}
	if !claims && cfg.claimPrefix != "" {
		return fmt.Errorf("%w: WithClaimPrefix applies to the Go SDK layout only", ErrInvalidOption)
	}
	return cfg.checkTTL()
}

// RedisKey returns the Redis key of key's record.
func (s *PHPRedisStore) RedisKey(key string) string { return s.cfg.prefix + key }

// Extend extends the caller's live claim on key (the store instance's own
// when ctx names no holder) to lease from now, in one compare-and-expire
// script; held is false when key holds no live claim of this holder.
func (s *PHPRedisStore) Extend(ctx context.Context, key string, lease time.Duration) (bool, error) {
	return watched(ctx, s.inline, "extend", func(ctx context.Context) (bool, error) {
		if err := s.cfg.checkKey(key); err != nil {
			return false, err
		}
		return extendKey(ctx, s.client, s.RedisKey(key), s.claimValue(ctx), lease)
	}, nil)
}

// claimValue is the value of the caller's claim: "1:" and the holder's
// token (the delivery's, or the store instance's when ctx names none). The
// PHP SDK reads it as "not seen" and its release deletes only "1", so it
// never drops a claim the kit holds.
func (s *PHPRedisStore) claimValue(ctx context.Context) string {
	return phpClaimed + ":" + holderToken(ctx, s.instance)
}

// Release deletes the caller's claim on key (the store instance's own when
// ctx names no holder) in one compare-and-delete script: never another
// holder's claim, the PHP SDK's "1" included, never a remembered record.
func (s *PHPRedisStore) Release(ctx context.Context, key string) error {
	return watched0(ctx, s.inline, "release", func(ctx context.Context) error {
		if err := s.cfg.checkKey(key); err != nil {
			return err
		}
		return releaseKey(ctx, s.client, s.RedisKey(key), s.claimValue(ctx))
	})
}

// GoRedisStore reads and writes the records of the Go SDK's
// idempotency-redis: a record is key prefix + meta.id with the value "1",
// and any such key counts as done. The kit's own in-flight claims live under
// the claim prefix, which the Go SDK never reads. See the package
// documentation.
type GoRedisStore struct {
	client   redis.UniversalClient
	cfg      config
	instance string // the claim holder of calls whose context names none
	inline   bool   // the client ends a command at its context's deadline (ContextTimeoutEnabled)
}

var _ stores.Store = (*GoRedisStore)(nil)

// NewGoRedis returns a store on client sharing the Go SDK idempotency-redis
// records. Options: WithPrefix, WithClaimPrefix, WithTTL (give the SDK's),
// WithScopedKeys. The client stays the caller's.
func NewGoRedis(client redis.UniversalClient, opts ...Option) (*GoRedisStore, error) {
	cfg := newConfig(opts)
	if cfg.prefix == "" {
		cfg.prefix = DefaultGoPrefix
	}
	if cfg.claimPrefix == "" {
		cfg.claimPrefix = strings.TrimSuffix(cfg.prefix, ":") + "-claim:"
	}
	if err := redisCommon(client, &cfg, true); err != nil {
		return nil, err
	}
	if err := checkPrefix("claim prefix", cfg.claimPrefix); err != nil {
		return nil, err
	}
	if strings.HasPrefix(cfg.claimPrefix, cfg.prefix) || strings.HasPrefix(cfg.prefix, cfg.claimPrefix) {
		return nil, fmt.Errorf("%w: claim prefix %q and record prefix %q overlap: a claim could be read as a Go SDK record", ErrInvalidOption, cfg.claimPrefix, cfg.prefix)
	}
	return &GoRedisStore{client: client, cfg: cfg, instance: stores.NewClaimToken(), inline: redisdeadline.Honoured(client)}, nil
}

// RedisKey returns the Redis key of key's record, the one the Go SDK reads.
func (s *GoRedisStore) RedisKey(key string) string { return s.cfg.prefix + key }

// ClaimKey returns the Redis key of the kit's in-flight claim on key.
func (s *GoRedisStore) ClaimKey(key string) string { return s.cfg.claimPrefix + key }

// seen reports whether key's record exists, whoever wrote it.
func (s *GoRedisStore) seen(ctx context.Context, key string) (bool, error) {
	if err := s.cfg.checkKey(key); err != nil {
		return false, err
	}
	n, err := s.client.Exists(ctx, s.RedisKey(key)).Result()
	if err != nil {
		return false, fmt.Errorf("sdkstore: EXISTS %q: %w", s.RedisKey(key), ctxerr.Match(ctx, err))
	}
	return n == 1, nil
}

// Forget deletes key's record and any claim on it.
func (s *GoRedisStore) Forget(ctx context.Context, key string) error {
	return watched0(ctx, s.inline, "forget", func(ctx context.Context) error {
		if err := s.cfg.checkKey(key); err != nil {
			return err
		}
		// Two commands, not one DEL of two keys: on a Redis Cluster the keys
		// live in different slots.
		if err := s.client.Del(ctx, s.RedisKey(key)).Err(); err != nil {
			return fmt.Errorf("sdkstore: DEL %q: %w", s.RedisKey(key), ctxerr.Match(ctx, err))
		}
		if err := s.client.Del(ctx, s.ClaimKey(key)).Err(); err != nil {
			return fmt.Errorf("sdkstore: DEL %q: %w", s.ClaimKey(key), ctxerr.Match(ctx, err))
		}
		return nil
	})
}

// claimValue is the value of the caller's claim: "c" and the holder's
// token (the delivery's, or the store instance's when ctx names none).
func (s *GoRedisStore) claimValue(ctx context.Context) string {
	return "c" + holderToken(ctx, s.instance)
}
