package redrive

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/internal/keepalive"
)

// Errors of the run lock.
var (
	// ErrRunInProgress is returned by LockRedisStream when another run
	// holds the lock of the stream and group.
	ErrRunInProgress = errors.New("redrive: another redrive run holds the lock")
	// ErrLockLost is the cause of the lock's context when the lease could
	// not be renewed in time, or another holder took the key: the run
	// stops, its message nacked.
	ErrLockLost = errors.New("redrive: the run lock was lost")
)

// RedisStreamLockKey is the key of the run lock of a Redis stream and a
// consumer group: <stream>:bq-redrive-lock:<group>.
func RedisStreamLockKey(stream, group string) string {
	return stream + ":bq-redrive-lock:" + group
}

var (
	// renewLockScript extends the lease when the key still holds the token.
	renewLockScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
`)
	// releaseLockScript deletes the key when it still holds the token.
	releaseLockScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
`)
)

// LockRedisStream takes the run lock of a Redis stream and a consumer
// group, for one redrive run at a time: two runs in one group, each
// claiming what the group has pending when it starts (MaxIdleTime of a
// millisecond, see the package doc), would take the messages the other has
// read and not yet acked, and move them twice.
//
// The lock is the key RedisStreamLockKey(stream, group), set only when
// absent (SET NX) with a lease, and renewed every third of the lease while
// the run lasts (by the kit's one keep-alive mechanism, which every claim
// of the kit uses: time on the monotonic clock, failed renewals tried again
// while the lease lasts). When another run holds it, LockRedisStream returns an
// error matching ErrRunInProgress. The returned context is ctx, cancelled
// with the cause ErrLockLost when the lease could not be renewed before it
// ran out (Redis unreachable for that long) or the key no longer holds
// this run's token: give it to Run, which then stops. Call release when
// the run is over and its subscriber closed: it stops the renewal and
// deletes the key (if it is still this run's). A run that dies without
// releasing leaves the key to expire: a later run gets the lock at most
// lease later, and with it what the dead run left pending.
func LockRedisStream(ctx context.Context, client redis.UniversalClient, stream, group string, lease time.Duration) (context.Context, func(), error) {
	if lease < 3*time.Millisecond {
		return nil, nil, fmt.Errorf("redrive: lock lease %v: want at least 3ms", lease)
	}
	key := RedisStreamLockKey(stream, group)
	token := watermill.NewUUID()
	taken := time.Now()
	ok, err := client.SetNX(ctx, key, token, lease).Result()
	if err != nil {
		return nil, nil, fmt.Errorf("redrive: take the run lock %s: %w", key, err)
	}
	if !ok {
		held, _ := client.PTTL(ctx, key).Result()
		return nil, nil, fmt.Errorf("%w (Redis key %s, expires in %v unless that run renews it)", ErrRunInProgress, key, held.Round(time.Millisecond))
	}
	kept := keepalive.KeepFrom(ctx, taken, lease, func(rctx context.Context, lease time.Duration) (bool, error) {
		n, err := renewLockScript.Run(rctx, client, []string{key}, token, lease.Milliseconds()).Int()
		return n == 1, err
	})
	locked, lose := context.WithCancelCause(ctx)
	// The run's context ends with the lease's, with a cause matching
	// ErrLockLost when the lease was lost.
	stopWatch := context.AfterFunc(kept.Context(), func() {
		if err := kept.Lost(); err != nil {
			lose(fmt.Errorf("%w: Redis key %s: %w", ErrLockLost, key, err))
		}
	})
	// A run whose context ended is over: its lock is renewed no more, and
	// lapses unless released.
	stopOnEnd := context.AfterFunc(ctx, func() { _ = kept.Stop() })
	var once sync.Once
	release := func() {
		once.Do(func() {
			stopOnEnd()
			stopWatch()
			if err := kept.Stop(); err != nil {
				lose(fmt.Errorf("%w: Redis key %s: %w", ErrLockLost, key, err))
			}
			lose(context.Canceled)
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			_ = releaseLockScript.Run(rctx, client, []string{key}, token).Err()
		})
	}
	return locked, release, nil
}
