package sdkstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

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

// phpReleaseScript deletes a claim, never a remembered record: with a holder
// token (ARGV[1]) only the value that holder wrote; without one (an
// anonymous caller) any claim, the PHP SDK's "1" included.
var phpReleaseScript = redis.NewScript(`
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
if ARGV[1] ~= '' then
	if v == ARGV[1] then return redis.call('DEL', KEYS[1]) end
	return 0
end
if v == '1' or string.sub(v, 1, 2) == '1:' then return redis.call('DEL', KEYS[1]) end
return 0`)

// PHPRedisStore reads and writes the records of the PHP SDK's RedisStore:
// key prefix + meta.id; a claim is SET NX PX; a remembered message is the
// value "2". See the package documentation.
type PHPRedisStore struct {
	client   redis.UniversalClient
	cfg      config
	instance string // the holder of claims whose context names none
}

var (
	_ stores.Store    = (*PHPRedisStore)(nil)
	_ stores.Claimer  = (*PHPRedisStore)(nil)
	_ stores.Expiring = (*PHPRedisStore)(nil)
)

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
	return &PHPRedisStore{client: client, cfg: cfg, instance: stores.NewClaimToken()}, nil
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

// TTL returns how long a remembered key is kept; 0 means forever.
func (s *PHPRedisStore) TTL() time.Duration { return s.cfg.ttl }

// Seen reports whether key's value is "2".
func (s *PHPRedisStore) Seen(ctx context.Context, key string) (bool, error) {
	if err := s.cfg.checkKey(key); err != nil {
		return false, err
	}
	v, err := s.client.Get(ctx, s.RedisKey(key)).Result()
	if errors.Is(err, redis.Nil) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("sdkstore: GET %q: %w", s.RedisKey(key), err)
	}
	return v == phpSeen, nil
}

// Remember sets key's value to "2", with the TTL when one is set.
func (s *PHPRedisStore) Remember(ctx context.Context, key string) error {
	if err := s.cfg.checkKey(key); err != nil {
		return err
	}
	if err := s.client.Set(ctx, s.RedisKey(key), phpSeen, s.cfg.ttl).Err(); err != nil {
		return fmt.Errorf("sdkstore: SET %q: %w", s.RedisKey(key), err)
	}
	return nil
}

// Forget deletes key's record or claim.
func (s *PHPRedisStore) Forget(ctx context.Context, key string) error {
	if err := s.cfg.checkKey(key); err != nil {
		return err
	}
	if err := s.client.Del(ctx, s.RedisKey(key)).Err(); err != nil {
		return fmt.Errorf("sdkstore: DEL %q: %w", s.RedisKey(key), err)
	}
	return nil
}

// claimValue is the value of the caller's claim: "1:" and its holder (the
// context's token, or the store instance's own). The PHP SDK reads it as
// "not seen" and its release deletes only "1", so it never drops a claim
// the kit holds.
func (s *PHPRedisStore) claimValue(ctx context.Context) string {
	return phpClaimed + ":" + holderOf(ctx, s.instance)
}

// holderOf is the claim holder of ctx: its token, or instance.
func holderOf(ctx context.Context, instance string) string {
	if token := stores.ClaimToken(ctx); token != "" {
		return token
	}
	return instance
}

// claimScript sets KEYS[1] to ARGV[1] for ARGV[2] ms unless it exists;
// a key that already holds ARGV[1] (the same holder's live claim, its
// command sent again after a lost reply) is reported taken by it, its
// lease unchanged.
var claimScript = redis.NewScript(`
local v = redis.call('GET', KEYS[1])
if not v then
	redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
	return 1
end
if v == ARGV[1] then return 1 end
return 0`)

// Claim takes key with SET NX PX lease, for the caller's holder.
func (s *PHPRedisStore) Claim(ctx context.Context, key string, lease time.Duration) (bool, error) {
	if err := s.cfg.checkKey(key); err != nil {
		return false, err
	}
	if lease < time.Millisecond {
		return false, fmt.Errorf("sdkstore: lease %v: want at least 1ms", lease)
	}
	n, err := claimScript.Run(ctx, s.client, []string{s.RedisKey(key)}, s.claimValue(ctx), lease.Milliseconds()).Int()
	if err != nil {
		return false, fmt.Errorf("sdkstore: claim %q: %w", s.RedisKey(key), err)
	}
	return n == 1, nil
}

// Release deletes the caller's claim on key (the store instance's for a
// context naming no holder) in one compare-and-delete script; never
// another holder's claim nor a remembered record.
func (s *PHPRedisStore) Release(ctx context.Context, key string) error {
	if err := s.cfg.checkKey(key); err != nil {
		return err
	}
	if err := phpReleaseScript.Run(ctx, s.client, []string{s.RedisKey(key)}, s.claimValue(ctx)).Err(); err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("sdkstore: release %q: %w", s.RedisKey(key), err)
	}
	return nil
}

// goReleaseScript deletes a kit claim held by ARGV[1] (any kit claim when it
// is empty).
var goReleaseScript = redis.NewScript(`
local v = redis.call('GET', KEYS[1])
if v and (ARGV[1] == '' or v == ARGV[1]) then return redis.call('DEL', KEYS[1]) end
return 0`)

// GoRedisStore reads and writes the records of the Go SDK's
// idempotency-redis: a record is key prefix + meta.id with the value "1",
// and any such key counts as done. The kit's own in-flight claims live under
// the claim prefix, which the Go SDK never reads. See the package
// documentation.
type GoRedisStore struct {
	client   redis.UniversalClient
	cfg      config
	instance string // the holder of claims whose context names none
}

var (
	_ stores.Store    = (*GoRedisStore)(nil)
	_ stores.Claimer  = (*GoRedisStore)(nil)
	_ stores.Expiring = (*GoRedisStore)(nil)
)

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
	return &GoRedisStore{client: client, cfg: cfg, instance: stores.NewClaimToken()}, nil
}

// RedisKey returns the Redis key of key's record, the one the Go SDK reads.
func (s *GoRedisStore) RedisKey(key string) string { return s.cfg.prefix + key }

// ClaimKey returns the Redis key of the kit's in-flight claim on key.
func (s *GoRedisStore) ClaimKey(key string) string { return s.cfg.claimPrefix + key }

// TTL returns how long a remembered key is kept; 0 means forever.
func (s *GoRedisStore) TTL() time.Duration { return s.cfg.ttl }

// Seen reports whether key's record exists, whoever wrote it.
func (s *GoRedisStore) Seen(ctx context.Context, key string) (bool, error) {
	if err := s.cfg.checkKey(key); err != nil {
		return false, err
	}
	n, err := s.client.Exists(ctx, s.RedisKey(key)).Result()
	if err != nil {
		return false, fmt.Errorf("sdkstore: EXISTS %q: %w", s.RedisKey(key), err)
	}
	return n == 1, nil
}

// Remember writes key's record ("1", with the TTL) and then drops the
// caller's claim. The record comes first: a claimer that gets in after the
// claim is gone finds the record.
func (s *GoRedisStore) Remember(ctx context.Context, key string) error {
	if err := s.cfg.checkKey(key); err != nil {
		return err
	}
	if err := s.client.Set(ctx, s.RedisKey(key), "1", s.cfg.ttl).Err(); err != nil {
		return fmt.Errorf("sdkstore: SET %q: %w", s.RedisKey(key), err)
	}
	return s.release(ctx, key)
}

// Forget deletes key's record and any claim on it.
func (s *GoRedisStore) Forget(ctx context.Context, key string) error {
	if err := s.cfg.checkKey(key); err != nil {
		return err
	}
	// Two commands, not one DEL of two keys: on a Redis Cluster the keys
	// live in different slots.
	if err := s.client.Del(ctx, s.RedisKey(key)).Err(); err != nil {
		return fmt.Errorf("sdkstore: DEL %q: %w", s.RedisKey(key), err)
	}
	if err := s.client.Del(ctx, s.ClaimKey(key)).Err(); err != nil {
		return fmt.Errorf("sdkstore: DEL %q: %w", s.ClaimKey(key), err)
	}
	return nil
}

// claimValue is the value of the caller's claim: "c" and its holder (the
// context's token, or the store instance's own).
func (s *GoRedisStore) claimValue(ctx context.Context) string {
	return "c" + holderOf(ctx, s.instance)
}

// Claim takes the kit's claim on key (SET NX PX under the claim prefix),
// then looks for a record: if there is one, it drops the claim and reports
// false. The claim comes first, so a claimer racing a Remember either finds
// the other's claim or, once that is gone, its record.
func (s *GoRedisStore) Claim(ctx context.Context, key string, lease time.Duration) (bool, error) {
	if err := s.cfg.checkKey(key); err != nil {
		return false, err
	}
	if lease < time.Millisecond {
		return false, fmt.Errorf("sdkstore: lease %v: want at least 1ms", lease)
	}
	n, err := claimScript.Run(ctx, s.client, []string{s.ClaimKey(key)}, s.claimValue(ctx), lease.Milliseconds()).Int()
	if err != nil {
		return false, fmt.Errorf("sdkstore: claim %q: %w", s.ClaimKey(key), err)
	}
	if n != 1 {
		return false, nil
	}
	seen, err := s.Seen(ctx, key)
	if err == nil && !seen {
		return true, nil
	}
	// Remembered (or unreadable): give the claim back at once.
	if rerr := s.release(ctx, key); rerr != nil && err == nil {
		err = rerr
	}
	return false, err
}

// Release drops the caller's claim on key (the store instance's for a
// context naming no holder). It never touches the record nor another
// holder's claim.
func (s *GoRedisStore) Release(ctx context.Context, key string) error {
	if err := s.cfg.checkKey(key); err != nil {
		return err
	}
	return s.release(ctx, key)
}

func (s *GoRedisStore) release(ctx context.Context, key string) error {
	if err := goReleaseScript.Run(ctx, s.client, []string{s.ClaimKey(key)}, s.claimValue(ctx)).Err(); err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("sdkstore: release %q: %w", s.ClaimKey(key), err)
	}
	return nil
}
