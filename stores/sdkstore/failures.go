package sdkstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/internal/ctxerr"
	"github.com/babelqueue/watermill-idempotency/internal/failrec"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// notSupported is the Fail and Reopen of the layouts that cannot keep
// failures (Capabilities().Failures is false): the SQL layouts (see
// Failures in the package documentation).
type notSupported struct{}

// Fail is not supported by this layout.
func (notSupported) Fail(context.Context, string, uint64, stores.Failure) error {
	return fmt.Errorf("sdkstore: fail: %w", stores.ErrNotSupported)
}

// Reopen is not supported by this layout.
func (notSupported) Reopen(context.Context, string, string) (bool, error) {
	return false, fmt.Errorf("sdkstore: reopen: %w", stores.ErrNotSupported)
}

// ttlArg is the TTL argument of a failure script: milliseconds, "0" for
// none.
func ttlArg(ttl time.Duration) any {
	if ttl <= 0 {
		return "0"
	}
	return ttl.Milliseconds()
}

// failureKind is the kind argument of failrec.FailScript for f.
func failureKind(f stores.Failure) string {
	if f.End != nil {
		return failrec.EndedMark
	}
	return failrec.FailingMark
}

// runScript runs script on one key with args and returns its reply; a nil
// reply (redis.Nil) is no error.
func runScript(ctx context.Context, client redis.UniversalClient, script *redis.Script, key string, args ...any) (any, error) {
	v, err := script.Run(ctx, client, []string{key}, args...).Result()
	if errors.Is(err, redis.Nil) {
		return nil, nil
	}
	return v, ctxerr.Match(ctx, err)
}

// readFailure reads a failing or ended record from the reply of
// failrec.InspectScript (value, PTTL); the zero Record when there is none.
func readFailure(reply any) stores.Record {
	v, _ := reply.([]any)
	if len(v) < 2 {
		return stores.Record{}
	}
	value, _ := v[0].(string)
	if value == "" || (value[:1] != failrec.FailingMark && value[:1] != failrec.EndedMark) {
		return stores.Record{}
	}
	r := failrec.Parse(value)
	if ms, _ := v[1].(int64); ms > 0 {
		r.ExpiresAt = expiresIn(ms)
	}
	return r
}

// Go SDK Redis layout: failures live in the kit's claim key, which the Go
// SDK never reads (internal/failrec's layout, as redisstore keeps them):
// one key and one script per call, so a claim and the count it carries
// change together.

// goHeldSource returns 1 when KEYS[1] holds a live claim of a holder
// other than ARGV[1] (a plain one, or one that carries a count).
const goHeldSource = failrec.LuaCounts + `
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
local m = string.sub(v, 1, 1)
if m == 'c' then
	if v ~= ARGV[1] then return 1 end
	return 0
end
if m == 'k' then
	local lease, exp, holder = count_claim(v)
	if holder ~= ARGV[1] and lease > now_ms() then return 1 end
end
return 0`

var goHeldScript = redis.NewScript(goHeldSource)

// goClearSource drops KEYS[1] once the record is written: the caller's
// claim (ARGV[1]), a failing or ended record, a claim that carries a count
// of the caller's or past its lease; never another holder's live claim.
const goClearSource = failrec.LuaCounts + `
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
local m = string.sub(v, 1, 1)
if v == ARGV[1] or m == 'f' or m == 'e' then return redis.call('DEL', KEYS[1]) end
if m == 'k' then
	local lease, exp, holder = count_claim(v)
	if holder == ARGV[1] or lease <= now_ms() then return redis.call('DEL', KEYS[1]) end
end
return 0`

var goClearScript = redis.NewScript(goClearSource)

// Claim takes the kit's claim on key, or returns the record in its way. A
// failing record is taken over (found is then that record, its count
// carried by the claim); an ended one is not claimed.
func (s *GoRedisStore) Claim(ctx context.Context, key string, lease time.Duration) (bool, stores.Record, error) {
	return watchedClaim(ctx, s.inline, func(ctx context.Context) (bool, stores.Record, error) {
		claimed, carried, err := s.claim(ctx, key, lease)
		if err != nil {
			return false, stores.Record{}, err
		}
		if claimed {
			return true, carried, nil
		}
		found, failed, err := s.inspectFailed(ctx, key)
		if err != nil {
			return false, stores.Record{}, err
		}
		switch {
		case found.State == stores.StateUnknown: // gone since: in flight a moment ago
			found.State = stores.StateInFlight
		case found.Remembered() && failed:
			// A Go SDK consumer ran the message, whatever the kit had counted
			// or ended: the count or end is dropped.
			if _, err := runScript(ctx, s.client, goClearScript, s.ClaimKey(key), s.claimValue(ctx)); err != nil {
				return false, stores.Record{}, fmt.Errorf("sdkstore: claim %q: %w", s.ClaimKey(key), ctxerr.Match(ctx, err))
			}
		}
		return false, found, nil
	}, func(ctx context.Context) error { return s.Release(ctx, key) })
}

// claim takes the kit's claim on key under the claim prefix (absent: what
// SET NX PX does; the caller's own live claim: kept, with its lease; a
// failing record, or a lapsed claim that carries a count: taken over, the
// count carried), then looks for a record: if there is one, it drops the
// caller's claim and reports false. The claim comes first, so a claimer
// racing a Remember either finds the other's claim or, once that is gone,
// its record. carried is the failing record the claim carries.
func (s *GoRedisStore) claim(ctx context.Context, key string, lease time.Duration) (claimed bool, carried stores.Record, err error) {
	if err := s.cfg.checkKey(key); err != nil {
		return false, stores.Record{}, err
	}
	if lease < time.Millisecond {
		return false, stores.Record{}, fmt.Errorf("sdkstore: lease %v: want at least 1ms", lease)
	}
	reply, err := runScript(ctx, s.client, failrec.ClaimScript, s.ClaimKey(key), s.claimValue(ctx), lease.Milliseconds())
	if err != nil {
		return false, stores.Record{}, fmt.Errorf("sdkstore: claim %q: %w", s.ClaimKey(key), ctxerr.Match(ctx, err))
	}
	v, _ := reply.([]any)
	if len(v) == 0 || v[0] != int64(1) {
		return false, stores.Record{}, nil
	}
	if len(v) > 1 {
		failing, _ := v[1].(string)
		carried = failrec.Parse(failing)
	}
	seen, err := s.seen(ctx, key)
	if err == nil && !seen {
		return true, carried, nil
	}
	if err != nil { // unreadable: give the claim back at once
		_ = s.Release(ctx, key)
		return false, stores.Record{}, err
	}
	// Remembered (a Go SDK consumer ran the message, whatever the kit had
	// counted): drop the claim just taken, and the count or end with it.
	if _, err := runScript(ctx, s.client, goClearScript, s.ClaimKey(key), s.claimValue(ctx)); err != nil {
		return false, stores.Record{}, fmt.Errorf("sdkstore: claim %q: %w", s.ClaimKey(key), ctxerr.Match(ctx, err))
	}
	return false, stores.Record{}, nil
}

// Release drops the caller's claim on key (the store instance's own when
// ctx names no holder); never another holder's. A claim that carries a
// count leaves the failing record behind. It never touches the record.
func (s *GoRedisStore) Release(ctx context.Context, key string) error {
	return watched0(ctx, s.inline, "release", func(ctx context.Context) error {
		if err := s.cfg.checkKey(key); err != nil {
			return err
		}
		if _, err := runScript(ctx, s.client, failrec.ReleaseScript, s.ClaimKey(key), s.claimValue(ctx)); err != nil {
			return fmt.Errorf("sdkstore: release %q: %w", s.ClaimKey(key), ctxerr.Match(ctx, err))
		}
		return nil
	})
}

// Extend extends the caller's live claim on key (the store instance's own
// when ctx names no holder), under the claim prefix, to lease from now, in
// one compare-and-expire script; held is false when key holds no live
// claim of this holder (a remembered key has none).
func (s *GoRedisStore) Extend(ctx context.Context, key string, lease time.Duration) (bool, error) {
	return watched(ctx, s.inline, "extend", func(ctx context.Context) (bool, error) {
		if err := s.cfg.checkKey(key); err != nil {
			return false, err
		}
		if lease < time.Millisecond {
			return false, fmt.Errorf("sdkstore: lease %v: want at least 1ms", lease)
		}
		reply, err := runScript(ctx, s.client, failrec.ExtendScript, s.ClaimKey(key), s.claimValue(ctx), lease.Milliseconds())
		if err != nil {
			return false, fmt.Errorf("sdkstore: extend the claim %q: %w", s.ClaimKey(key), ctxerr.Match(ctx, err))
		}
		return reply == int64(1), nil
	}, nil)
}

// inspect reports key's record: a live record key (whoever wrote it) is
// remembered, expiring with the key's TTL; otherwise the kit's claim key
// tells: a live claim is in flight until its lease ends (with the count it
// carries), a failing or ended record is that; otherwise key is unknown.
// The claim key is read before the record: Remember writes the record
// before it drops the claim, so a Remember in progress is never reported
// unknown.
func (s *GoRedisStore) inspect(ctx context.Context, key string) (stores.Record, error) {
	r, _, err := s.inspectFailed(ctx, key)
	return r, err
}

// inspectFailed is inspect, and reports whether the claim key holds a
// failing or ended record, or a claim that carries a count.
func (s *GoRedisStore) inspectFailed(ctx context.Context, key string) (r stores.Record, failed bool, err error) {
	if err := s.cfg.checkKey(key); err != nil {
		return stores.Record{}, false, err
	}
	reply, err := runScript(ctx, s.client, failrec.InspectScript, s.ClaimKey(key))
	if err != nil {
		return stores.Record{}, false, fmt.Errorf("sdkstore: inspect %q: %w", s.ClaimKey(key), ctxerr.Match(ctx, err))
	}
	record, err := keyPTTL(ctx, s.client, s.RedisKey(key))
	if err != nil {
		return stores.Record{}, false, err
	}
	v, _ := reply.([]any)
	var value string
	if len(v) >= 2 {
		value, _ = v[0].(string)
	}
	failed = value != "" && (value[:1] == failrec.FailingMark || value[:1] == failrec.EndedMark || value[:1] == failrec.CountMark)
	switch {
	case record != -2:
		return stores.Record{State: stores.StateRemembered, ExpiresAt: expiresIn(record)}, failed, nil
	case len(v) < 2:
		return stores.Record{}, false, nil
	case len(v) == 3: // a claim that carries a count, and the server's clock
		now, _ := v[2].(int64)
		return failrec.LookupCount(value, now), failed, nil
	case failed:
		return readFailure(reply), failed, nil
	}
	pttl, _ := v[1].(int64)
	return stores.Record{State: stores.StateInFlight, ExpiresAt: expiresIn(pttl)}, false, nil
}

// remember writes key's record ("1", with the TTL) and then drops what the
// claim key holds for it: the caller's claim, a failing or ended record.
// The record comes first: a claimer that gets in after the claim is gone
// finds the record. Another holder's live claim is left alone, and no
// record written (stores.ErrClaimTaken). The claim and the record are two
// keys (in two slots of a Redis Cluster, so no one script covers both):
// the claim is read first, and a claim that lapses between that read and
// the record is one its holder had stopped renewing.
func (s *GoRedisStore) remember(ctx context.Context, key string) error {
	if err := s.cfg.checkKey(key); err != nil {
		return err
	}
	held, err := runScript(ctx, s.client, goHeldScript, s.ClaimKey(key), s.claimValue(ctx))
	switch {
	case err != nil:
		return fmt.Errorf("sdkstore: remember %q: %w", s.RedisKey(key), ctxerr.Match(ctx, err))
	case held == int64(1):
		return fmt.Errorf("sdkstore: remember %q: %w", s.RedisKey(key), stores.ErrClaimTaken)
	}
	if err := s.client.Set(ctx, s.RedisKey(key), "1", s.cfg.ttl).Err(); err != nil {
		return fmt.Errorf("sdkstore: SET %q: %w", s.RedisKey(key), ctxerr.Match(ctx, err))
	}
	if _, err := runScript(ctx, s.client, goClearScript, s.ClaimKey(key), s.claimValue(ctx)); err != nil {
		return fmt.Errorf("sdkstore: remember %q: %w", s.ClaimKey(key), ctxerr.Match(ctx, err))
	}
	return nil
}

// Fail records that key's runs failed (and, with f.End, that it ended) in
// the kit's claim key; see [stores.Store]. Without an end, the caller's
// live claim stays and carries the count; with one, the ended record
// replaces the claim. Another holder's live claim is left alone
// (stores.ErrClaimTaken); a remembered key (a live record, whoever wrote
// it) is left as it is. The records expire with the store's TTL.
func (s *GoRedisStore) Fail(ctx context.Context, key string, _ uint64, f stores.Failure) error {
	return watched0(ctx, s.inline, "fail", func(ctx context.Context) error {
		seen, err := s.seen(ctx, key)
		if err != nil || seen {
			return err
		}
		reply, err := runScript(ctx, s.client, failrec.FailScript, s.ClaimKey(key), s.claimValue(ctx), failureKind(f),
			failrec.Value(0, f), ttlArg(s.cfg.ttl))
		switch {
		case err != nil:
			return fmt.Errorf("sdkstore: fail %q: %w", s.ClaimKey(key), ctxerr.Match(ctx, err))
		case reply == int64(0):
			return fmt.Errorf("sdkstore: fail %q: %w", s.ClaimKey(key), stores.ErrClaimTaken)
		}
		return nil
	})
}

// Reopen drops key's ended record when its end's marker is marker, and
// reports whether it did; see [stores.Store]. One compare-and-delete
// script: of concurrent Reopens, one drops it.
func (s *GoRedisStore) Reopen(ctx context.Context, key string, marker string) (bool, error) {
	return watched(ctx, s.inline, "reopen", func(ctx context.Context) (bool, error) {
		if err := s.cfg.checkKey(key); err != nil {
			return false, err
		}
		reply, err := runScript(ctx, s.client, failrec.ReopenScript, s.ClaimKey(key), failrec.EndedPrefix(marker))
		if err != nil {
			return false, fmt.Errorf("sdkstore: reopen %q: %w", s.ClaimKey(key), ctxerr.Match(ctx, err))
		}
		return reply == int64(1), nil
	}, nil)
}

// PHP RedisStore layout: the claim lives in the PHP SDK's own key, which
// the PHP SDK reads (any value but "2" is busy to it), so failures live
// beside it, under a failure key of the kit's own that the PHP SDK never
// reads: the failing or ended record alone (failrec's "f" and "e"). The
// count a claim carries is that record, left where it is while the key is
// claimed: it outlives the claim by itself.

// failurePrefix returns the prefix of the kit's failure keys for the
// record prefix p: p without its final colon followed by "-fail:"
// ("bq:idem-fail:"), which no record key starts with; for a prefix without
// a final colon, p followed by U+001E and "fail:", which no record key
// holds either (a meta.id holds no control character).
func failurePrefix(p string) string {
	if strings.HasSuffix(p, ":") {
		return strings.TrimSuffix(p, ":") + "-fail:"
	}
	return p + "\x1efail:"
}

// FailureKey returns the Redis key of the kit's failing or ended record of
// key, beside the PHP SDK's key.
func (s *PHPRedisStore) FailureKey(key string) string { return failurePrefix(s.cfg.prefix) + key }

// Claim takes the claim on key, or returns the record in its way: one
// round trip for the claim and the failure key, read together. A failing
// record is claimed (found is then that record, which stays while the
// claim lasts); an ended one is not (the claim just taken is dropped).
func (s *PHPRedisStore) Claim(ctx context.Context, key string, lease time.Duration) (bool, stores.Record, error) {
	return watchedClaim(ctx, s.inline, func(ctx context.Context) (bool, stores.Record, error) {
		if err := s.cfg.checkKey(key); err != nil {
			return false, stores.Record{}, err
		}
		if lease < time.Millisecond {
			return false, stores.Record{}, fmt.Errorf("sdkstore: lease %v: want at least 1ms", lease)
		}
		var claim *redis.Cmd
		var failure *redis.Cmd
		_, err := s.client.Pipelined(ctx, func(p redis.Pipeliner) error {
			claim = claimScript.EvalSha(ctx, p, []string{s.RedisKey(key)}, s.claimValue(ctx), lease.Milliseconds())
			failure = failrec.InspectScript.EvalSha(ctx, p, []string{s.FailureKey(key)})
			return nil
		})
		if err != nil && !errors.Is(err, redis.Nil) && !redis.HasErrorPrefix(err, "NOSCRIPT") {
			return false, stores.Record{}, fmt.Errorf("sdkstore: claim %q: %w", s.RedisKey(key), ctxerr.Match(ctx, err))
		}
		if redis.HasErrorPrefix(claim.Err(), "NOSCRIPT") || redis.HasErrorPrefix(failure.Err(), "NOSCRIPT") {
			// The scripts are not loaded yet: one by one, which loads them.
			claim = claimScript.Run(ctx, s.client, []string{s.RedisKey(key)}, s.claimValue(ctx), lease.Milliseconds())
			failure = failrec.InspectScript.Run(ctx, s.client, []string{s.FailureKey(key)})
		}
		if err := claim.Err(); err != nil {
			return false, stores.Record{}, fmt.Errorf("sdkstore: claim %q: %w", s.RedisKey(key), ctxerr.Match(ctx, err))
		}
		if err := failure.Err(); err != nil && !errors.Is(err, redis.Nil) {
			return false, stores.Record{}, fmt.Errorf("sdkstore: claim %q: %w", s.FailureKey(key), ctxerr.Match(ctx, err))
		}
		if claim.Val() == int64(1) {
			found := readFailure(failure.Val())
			if found.State != stores.StateEnded {
				return true, found, nil
			}
			if err := s.Release(ctx, key); err != nil {
				return false, stores.Record{}, err
			}
			return false, found, nil
		}
		found, err := s.inspect(ctx, key)
		if err != nil {
			return false, stores.Record{}, err
		}
		switch found.State {
		case stores.StateUnknown: // gone since: in flight a moment ago
			found.State = stores.StateInFlight
		case stores.StateRemembered:
			// A PHP consumer ran the message, whatever the kit had counted:
			// the count or end beside its record is dropped.
			if readFailure(failure.Val()).State != stores.StateUnknown {
				if err := s.client.Del(ctx, s.FailureKey(key)).Err(); err != nil {
					return false, stores.Record{}, fmt.Errorf("sdkstore: DEL %q: %w", s.FailureKey(key), ctxerr.Match(ctx, err))
				}
			}
		}
		return false, found, nil
	}, func(ctx context.Context) error { return s.Release(ctx, key) })
}

// inspect reports key's record, reading the PHP SDK's key and the kit's
// failure key together: "2" is remembered (expiring only when WithTTL
// bounds the kit's records); "1" (the PHP SDK's claim) or "1:" and a
// holder's token (the kit's) is in flight until the key's expiry, with the
// count of a failing record beside it; an absent key is the failing or
// ended record beside it, or unknown. Any other value is reported in
// flight too: neither side reads it as done, and neither can claim the
// key while it is there.
func (s *PHPRedisStore) inspect(ctx context.Context, key string) (stores.Record, error) {
	if err := s.cfg.checkKey(key); err != nil {
		return stores.Record{}, err
	}
	rk := s.RedisKey(key)
	var record, failure *redis.Cmd
	_, err := s.client.Pipelined(ctx, func(p redis.Pipeliner) error {
		record = inspectScript.EvalSha(ctx, p, []string{rk})
		failure = failrec.InspectScript.EvalSha(ctx, p, []string{s.FailureKey(key)})
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) && !redis.HasErrorPrefix(err, "NOSCRIPT") {
		return stores.Record{}, fmt.Errorf("sdkstore: inspect %q: %w", rk, ctxerr.Match(ctx, err))
	}
	if redis.HasErrorPrefix(record.Err(), "NOSCRIPT") || redis.HasErrorPrefix(failure.Err(), "NOSCRIPT") {
		record = inspectScript.Run(ctx, s.client, []string{rk})
		failure = failrec.InspectScript.Run(ctx, s.client, []string{s.FailureKey(key)})
	}
	for _, cmd := range []*redis.Cmd{record, failure} {
		if err := cmd.Err(); err != nil && !errors.Is(err, redis.Nil) {
			return stores.Record{}, fmt.Errorf("sdkstore: inspect %q: %w", rk, ctxerr.Match(ctx, err))
		}
	}
	failed := readFailure(failure.Val())
	reply, _ := record.Val().([]any)
	if len(reply) == 0 {
		return failed, nil
	}
	if len(reply) != 2 {
		return stores.Record{}, fmt.Errorf("sdkstore: inspect %q: unexpected reply %v", rk, reply)
	}
	value, _ := reply[0].(string)
	pttl, _ := reply[1].(int64)
	if value == phpSeen {
		return stores.Record{State: stores.StateRemembered, ExpiresAt: expiresIn(pttl)}, nil
	}
	r := stores.Record{State: stores.StateInFlight, ExpiresAt: expiresIn(pttl)}
	if failed.State == stores.StateFailing {
		r.Failure = failed.Failure
	}
	return r, nil
}

// remember sets key's value to "2", with the TTL when one is set, in one
// script that leaves another holder's live claim alone (the PHP SDK's "1"
// included): stores.ErrClaimTaken. A failing or ended record beside it is
// dropped once the record is written.
func (s *PHPRedisStore) remember(ctx context.Context, key string) error {
	if err := s.cfg.checkKey(key); err != nil {
		return err
	}
	var written *redis.Cmd
	var failed *redis.IntCmd
	_, err := s.client.Pipelined(ctx, func(p redis.Pipeliner) error {
		written = phpRememberScript.EvalSha(ctx, p, []string{s.RedisKey(key)}, s.claimValue(ctx), s.cfg.ttl.Milliseconds())
		failed = p.Exists(ctx, s.FailureKey(key))
		return nil
	})
	if redis.HasErrorPrefix(err, "NOSCRIPT") {
		written = phpRememberScript.Run(ctx, s.client, []string{s.RedisKey(key)}, s.claimValue(ctx), s.cfg.ttl.Milliseconds())
		err = written.Err()
	}
	switch {
	case err != nil:
		return fmt.Errorf("sdkstore: remember %q: %w", s.RedisKey(key), ctxerr.Match(ctx, err))
	case written.Val() == int64(0):
		return fmt.Errorf("sdkstore: remember %q: %w", s.RedisKey(key), stores.ErrClaimTaken)
	case failed.Val() == 0 && failed.Err() == nil:
		return nil
	}
	if err := s.client.Del(ctx, s.FailureKey(key)).Err(); err != nil {
		return fmt.Errorf("sdkstore: DEL %q: %w", s.FailureKey(key), ctxerr.Match(ctx, err))
	}
	return nil
}

// Forget deletes key's record or claim, and any failing or ended record
// beside it.
func (s *PHPRedisStore) Forget(ctx context.Context, key string) error {
	return watched0(ctx, s.inline, "forget", func(ctx context.Context) error {
		if err := s.cfg.checkKey(key); err != nil {
			return err
		}
		// Two commands, not one DEL of two keys: on a Redis Cluster the keys
		// live in different slots.
		for _, k := range []string{s.RedisKey(key), s.FailureKey(key)} {
			if err := s.client.Del(ctx, k).Err(); err != nil {
				return fmt.Errorf("sdkstore: DEL %q: %w", k, ctxerr.Match(ctx, err))
			}
		}
		return nil
	})
}

// Fail records that key's runs failed (and, with f.End, that it ended)
// under the kit's failure key; see [stores.Store]. Without an end, the
// caller's claim stays, and the record beside it is its count; with one,
// the ended record is written and then the caller's claim dropped. Another
// holder's live claim (the PHP SDK's "1" included) is left alone
// (stores.ErrClaimTaken); a remembered key ("2") is left as it is. The
// claim and the failure key are two keys (in two slots of a Redis
// Cluster): the claim is read first, then the record written. The records
// expire with the store's TTL.
func (s *PHPRedisStore) Fail(ctx context.Context, key string, _ uint64, f stores.Failure) error {
	return watched0(ctx, s.inline, "fail", func(ctx context.Context) error {
		if err := s.cfg.checkKey(key); err != nil {
			return err
		}
		own := s.claimValue(ctx)
		v, err := s.client.Get(ctx, s.RedisKey(key)).Result()
		switch {
		case errors.Is(err, redis.Nil):
			v = ""
		case err != nil:
			return fmt.Errorf("sdkstore: fail: GET %q: %w", s.RedisKey(key), ctxerr.Match(ctx, err))
		case v == phpSeen:
			return nil
		case v != own:
			return fmt.Errorf("sdkstore: fail %q: %w", s.RedisKey(key), stores.ErrClaimTaken)
		}
		if err := s.client.Set(ctx, s.FailureKey(key), failrec.Value(0, f), s.cfg.ttl).Err(); err != nil {
			return fmt.Errorf("sdkstore: SET %q: %w", s.FailureKey(key), ctxerr.Match(ctx, err))
		}
		if f.End != nil && v == own {
			return releaseKey(ctx, s.client, s.RedisKey(key), own)
		}
		return nil
	})
}

// Reopen drops key's ended record when its end's marker is marker, and
// reports whether it did; see [stores.Store]. One compare-and-delete
// script: of concurrent Reopens, one drops it.
func (s *PHPRedisStore) Reopen(ctx context.Context, key string, marker string) (bool, error) {
	return watched(ctx, s.inline, "reopen", func(ctx context.Context) (bool, error) {
		if err := s.cfg.checkKey(key); err != nil {
			return false, err
		}
		reply, err := runScript(ctx, s.client, failrec.ReopenScript, s.FailureKey(key), failrec.EndedPrefix(marker))
		if err != nil {
			return false, fmt.Errorf("sdkstore: reopen %q: %w", s.FailureKey(key), ctxerr.Match(ctx, err))
		}
		return reply == int64(1), nil
	}, nil)
}
