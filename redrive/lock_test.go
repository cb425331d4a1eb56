package redrive_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/redrive"
)

// TestRunLockIsExclusiveAndLapses: one run at a time holds the lock of a
// stream and group; a release frees it at once, a run that died frees it
// when its lease lapses, and a run whose key was taken from it sees its
// context cancelled with ErrLockLost.
func TestRunLockIsExclusiveAndLapses(t *testing.T) {
	t.Parallel()
	d := newDeadLetters(t)
	key := redrive.RedisStreamLockKey(d.dlq, "redrive")
	t.Cleanup(func() { d.client.Del(context.Background(), key) })
	ctx := context.Background()
	const lease = time.Second

	_, release, err := redrive.LockRedisStream(ctx, d.client, d.dlq, "redrive", lease)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * lease / 2) // renewed meanwhile
	if _, _, err := redrive.LockRedisStream(ctx, d.client, d.dlq, "redrive", lease); !errors.Is(err, redrive.ErrRunInProgress) {
		t.Fatalf("a second lock while the first is held: %v, want ErrRunInProgress", err)
	}
	if _, other, err := redrive.LockRedisStream(ctx, d.client, d.dlq, "another-group", lease); err != nil {
		t.Fatalf("another group: %v", err)
	} else {
		other()
	}
	release()
	if n, _ := d.client.Exists(ctx, key).Result(); n != 0 {
		t.Fatal("release left the key")
	}

	// A run that dies stops renewing; its lease lapses.
	dying, die := context.WithCancel(ctx)
	if _, _, err := redrive.LockRedisStream(dying, d.client, d.dlq, "redrive", lease); err != nil {
		t.Fatal(err)
	}
	die()
	if _, _, err := redrive.LockRedisStream(ctx, d.client, d.dlq, "redrive", lease); !errors.Is(err, redrive.ErrRunInProgress) {
		t.Fatalf("right after the holder died: %v, want ErrRunInProgress until the lease lapses", err)
	}
	time.Sleep(lease + 50*time.Millisecond)
	locked, release, err := redrive.LockRedisStream(ctx, d.client, d.dlq, "redrive", lease)
	if err != nil {
		t.Fatalf("after the dead holder's lease lapsed: %v", err)
	}
	defer release()

	// The key taken away: the holder's context ends with ErrLockLost.
	d.client.Set(ctx, key, "someone else", time.Minute)
	select {
	case <-locked.Done():
		if !errors.Is(context.Cause(locked), redrive.ErrLockLost) {
			t.Fatalf("cause %v, want ErrLockLost", context.Cause(locked))
		}
	case <-time.After(2 * lease):
		t.Fatal("the holder did not notice it lost the lock")
	}
	release()
	if v, _ := d.client.Get(ctx, key).Result(); v != "someone else" {
		t.Fatalf("release deleted a lock it no longer held (key holds %q)", v)
	}
}

// TestLockedRunAfterACrashedRun: a run holding the lock dies mid-run,
// leaving the entries its subscriber had read pending in the group. The
// next run gets the lock once the dead run's lease lapsed, and with it
// every dead letter the dead run had not moved: each reaches its queue.
func TestLockedRunAfterACrashedRun(t *testing.T) {
	t.Parallel()
	d := newDeadLetters(t)
	t.Cleanup(func() { d.client.Del(context.Background(), redrive.RedisStreamLockKey(d.dlq, "redrive")) })
	const n, lease = 6, time.Second
	for range n {
		d.add(watermill.NewUUID(), envelope.ReasonFailed, time.Now().UnixMilli())
	}
	subscriber := func() *redisstream.Subscriber {
		sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
			Client: redis.NewClient(d.client.Options()), ConsumerGroup: "redrive", Consumer: "c", OldestId: "0",
			BlockTime: 50 * time.Millisecond, DisableIndefiniteInitialBlock: true, MaxIdleTime: time.Millisecond, ClaimInterval: time.Hour,
		}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		return sub
	}
	// The first run dies after two moves (acked), holding what its
	// subscriber read ahead: no release, its subscriber gone.
	dying, die := context.WithCancel(context.Background())
	locked, _, err := redrive.LockRedisStream(dying, d.client, d.dlq, "redrive", lease)
	if err != nil {
		t.Fatal(err)
	}
	sub := subscriber()
	report, err := redrive.Run(locked, sub, d.pub, d.dlq, redrive.WithMax(2))
	time.Sleep(100 * time.Millisecond) // the acks reach Redis
	die()
	_ = sub.Close()
	if err != nil || report.Moved != 2 {
		t.Fatalf("first run: moved %d, %v", report.Moved, err)
	}
	pending, _ := d.client.XPending(context.Background(), d.dlq, "redrive").Result()
	t.Logf("the dead run left %d entries pending", pending.Count)

	ctx := context.Background()
	var release func()
	deadline := time.Now().Add(10 * lease)
	for {
		locked, release, err = redrive.LockRedisStream(ctx, d.client, d.dlq, "redrive", lease)
		if err == nil || !errors.Is(err, redrive.ErrRunInProgress) || time.Now().After(deadline) {
			break
		}
		time.Sleep(lease / 10)
	}
	if err != nil {
		t.Fatal(err)
	}
	sub = subscriber()
	report, err = redrive.Run(locked, sub, d.pub, d.dlq, redrive.WithIdleTimeout(500*time.Millisecond))
	time.Sleep(100 * time.Millisecond) // let the last ack reach Redis
	_ = sub.Close()
	release()
	if err != nil || report.Moved != n-2 {
		t.Fatalf("second run: moved %d, %v; want the %d the dead run left", report.Moved, err, n-2)
	}
	if got := d.len(d.topic); got != n {
		t.Fatalf("%d on the queue, want %d", got, n)
	}
	if pending, _ := d.client.XPending(ctx, d.dlq, "redrive").Result(); pending.Count != 0 {
		t.Fatalf("%d entries left pending", pending.Count)
	}
}
