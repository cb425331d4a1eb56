package redisstore

import (
	"context"
	"fmt"
	"time"

	"github.com/babelqueue/watermill-idempotency/internal/failrec"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// A message that failed is kept under its record's one Redis key, like
// every other state of it (the layout is internal/failrec's, shared with
// sdkstore's Redis layouts), so that every call stays one key and one
// script.

// claimCount claims rk, whose SET NX found a failing record or a claim
// that carries a count, for holder: one EVALSHA of a script that takes the
// failing record over, or reports what is in the way.
func (s *Store) claimCount(ctx context.Context, rk, holder string, lease time.Duration) (bool, stores.Record, error) {
	cmd, err := s.evalLate(ctx, s, failrec.ClaimScript, failrec.ClaimSource, rk, holder, lease.Milliseconds())
	if err != nil {
		s.gaveUp(ctx, err, rk, holder, lease)
		return false, stores.Record{}, fmt.Errorf("redisstore: claim: %w", err)
	}
	reply, _ := cmd.Val().([]any)
	if len(reply) == 0 {
		return false, stores.Record{}, fmt.Errorf("redisstore: claim: unexpected reply %v", cmd.Val())
	}
	claimed := reply[0] == int64(1)
	if len(reply) < 2 {
		return claimed, stores.Record{}, nil
	}
	v, _ := reply[1].(string)
	if claimed {
		return true, failrec.Parse(v), nil
	}
	return false, s.parseValue(v), nil
}

// Fail records that key's runs failed (and, with f.End, that it ended); see
// [stores.Store]: one EVALSHA of a script. Without an end, the caller's
// live claim stays, its lease kept, and carries the count. It returns an
// error matching stores.ErrClaimTaken, writing nothing, when another
// holder's live claim is on key, and writes nothing over a remembered
// record. The record expires with the store's TTL.
func (s *Store) Fail(ctx context.Context, key string, fingerprint uint64, f stores.Failure) error {
	kind := failrec.FailingMark
	if f.End != nil {
		kind = failrec.EndedMark
	}
	ttl := s.ttlArg
	if ttl == nil {
		ttl = noExpiry
	}
	cmd, err := s.eval(ctx, failrec.FailScript, failrec.FailSource, s.RedisKey(key), s.claimValue(ctx), kind,
		failrec.Value(keptFingerprint(fingerprint), f), ttl)
	switch {
	case err != nil:
		return fmt.Errorf("redisstore: fail: %w", err)
	case cmd.Val() == int64(0):
		return fmt.Errorf("redisstore: fail: %w", stores.ErrClaimTaken)
	}
	return nil
}

// Reopen drops key's ended record when its end's marker is marker, and
// reports whether it did; see [stores.Store]. One EVALSHA of a
// compare-and-delete script: of concurrent Reopens, one drops it.
func (s *Store) Reopen(ctx context.Context, key string, marker string) (bool, error) {
	cmd, err := s.eval(ctx, failrec.ReopenScript, failrec.ReopenSource, s.RedisKey(key), failrec.EndedPrefix(marker))
	if err != nil {
		return false, fmt.Errorf("redisstore: reopen: %w", err)
	}
	return cmd.Val() == int64(1), nil
}
