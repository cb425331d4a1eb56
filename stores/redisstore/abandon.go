package redisstore

import (
	"context"
	"errors"
	"net"
	"time"

	"github.com/redis/go-redis/v9"
)

// A claim whose caller gave up on it (its context ended while the command
// was on the wire, or the command failed in a way that leaves open whether
// the server ran it) may have been taken all the same. Nobody holds it: the
// caller got an error, and its delivery is gone (the middleware fails it
// for a redelivery). Left alone it would park every redelivery of the
// message for the whole lease, though nothing runs it. So the store
// releases it: when the answer of an abandoned command comes back and says
// the claim was taken (or cannot say), and, when no answer will come (the
// client cut the call itself), at once. The release names the claim's
// holder, so it never drops another holder's claim, and is bounded by
// abandonedReleaseTimeout (or the lease, if shorter: the claim lapses by
// then anyway).

// abandonedReleaseTimeout bounds the release of a claim whose caller gave
// up on it.
const abandonedReleaseTimeout = 10 * time.Second

// lateAnswer is told the answer of a claim command whose caller left while
// it was on the wire: SET NX PX GET, SET NX PX, or the script claiming a
// failing record. It releases the claim when the command took it (or its
// answer cannot tell).
func (s *Store) lateAnswer(ctx context.Context, cmd redis.Cmder) {
	rk, holder, lease, ok := claimArgs(cmd)
	if ok && claimTook(cmd, holder) {
		go s.releaseAbandoned(ctx, rk, holder, lease)
	}
}

// gaveUp is called with the error of a claim command on rk for holder: when
// the command may have taken the claim and no answer will tell (the caller
// did not leave it to lateAnswer), the claim is released.
func (s *Store) gaveUp(ctx context.Context, err error, rk, holder string, lease time.Duration) {
	var left *abandonedError
	if errors.As(err, &left) || !mayHaveRun(err) {
		return
	}
	go s.releaseAbandoned(ctx, rk, holder, lease)
}

// releaseAbandoned releases holder's claim on rk, bounded by
// abandonedReleaseTimeout or lease, whichever is shorter, detached from
// ctx's cancellation (whose values it keeps, for tracing hooks).
func (s *Store) releaseAbandoned(ctx context.Context, rk, holder string, lease time.Duration) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), min(lease, abandonedReleaseTimeout))
	defer cancel()
	_, _ = s.eval(ctx, releaseScript, releaseSource, rk, holder) // best effort: the claim lapses with its lease otherwise
}

// claimArgs returns the Redis key, the claim value and the lease of a
// claim command: SET key value PX lease NX …, or EVALSHA hash 1 key value
// lease.
func claimArgs(cmd redis.Cmder) (rk, holder string, lease time.Duration, ok bool) {
	args := cmd.Args()
	at, px := 1, 4 // SET
	if _, script := cmd.(*redis.Cmd); script {
		at, px = 3, 5
	}
	if len(args) <= px {
		return "", "", 0, false
	}
	rk, ok1 := args[at].(string)
	holder, ok2 := args[at+1].(string)
	ms, ok3 := args[px].(int64)
	return rk, holder, time.Duration(ms) * time.Millisecond, ok1 && ok2 && ok3
}

// claimTook reports whether the claim command cmd (for holder) took the
// claim, or may have: its answer failed in a way that leaves open whether
// the server ran it.
func claimTook(cmd redis.Cmder, holder string) bool {
	err := cmd.Err()
	switch c := cmd.(type) {
	case *redis.StringCmd: // SET NX PX GET: nothing was there, or the holder's own claim
		if errors.Is(err, redis.Nil) {
			return true
		}
		if err != nil {
			return mayHaveRun(err)
		}
		return c.Val() == holder
	case *redis.BoolCmd: // SET NX PX
		if err != nil {
			return mayHaveRun(err)
		}
		return c.Val()
	case *redis.Cmd: // the script claiming a failing record
		if err != nil {
			return !errors.Is(err, redis.Nil) && mayHaveRun(err)
		}
		reply, _ := c.Val().([]any)
		return len(reply) > 0 && reply[0] == int64(1)
	}
	return false
}

// mayHaveRun reports whether a command that failed with err may have run
// on the server all the same: its reply was lost, late or cut off (a
// timeout, a connection closed under it, a context that ended), as opposed
// to an error reply of the server or a connection never made.
func mayHaveRun(err error) bool {
	var rerr redis.Error
	var op *net.OpError
	switch {
	case err == nil, errors.Is(err, redis.Nil), errors.As(err, &rerr),
		errors.Is(err, redis.ErrPoolTimeout), errors.Is(err, redis.ErrPoolExhausted), errors.Is(err, redis.ErrClosed):
		return false
	case errors.As(err, &op) && op.Op == "dial":
		return false
	}
	return true
}
