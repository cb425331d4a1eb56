package redislist_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/pubsub/redislist"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// laravelCopies counts the copies of the queue's jobs Redis holds: ready,
// reserved and delayed.
func laravelCopies(t *testing.T, php phpWorker) (ready, reserved, delayed int64) {
	t.Helper()
	ctx := context.Background()
	return php.client.LLen(ctx, php.queue).Val(), php.client.ZCard(ctx, php.queue+":reserved").Val(), php.client.ZCard(ctx, php.queue+":delayed").Val()
}

// twoCopies pushes one job twice on a fresh Laravel queue and subscribes
// to it with opts.
type twoCopies struct {
	client *redis.Client
	php    phpWorker
	name   string
	job    []byte
	sub    *redislist.Subscriber
	msgs   <-chan *message.Message
}

func pushTwoCopies(t *testing.T, opts ...redislist.Option) twoCopies {
	t.Helper()
	c := twoCopies{client: testenv.Redis(t)}
	c.name, c.php = laravelQueue(t, c.client)
	cleanupLaravel(t, c.client, c.php.queue)
	c.job = newEnvelope(t, c.name)
	c.php.push(t, c.job)
	c.php.push(t, c.job)
	_, c.sub = newPubSub(t, c.client, laravelOpts(opts...)...)
	var err error
	if c.msgs, err = c.sub.Subscribe(context.Background(), c.name); err != nil {
		t.Fatal(err)
	}
	return c
}

// TestLaravelIdenticalJobsInFlightStayApart: two byte-identical jobs on a
// Laravel queue (one message pushed twice, or a redrive put-back taken again
// before the original is acked) are two reservations. The ack of one leaves
// the other reserved, and Close puts it back; two nacks release both; a
// subscriber that stops without acking either leaves both to come back. They used to be one
// member of the reserved set: the ack removed both, and the copy the
// subscriber had reserved ahead was lost on Close (0 copies left), a
// subscriber that stopped kept one copy of two, and two nacks released one.
func TestLaravelIdenticalJobsInFlightStayApart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	t.Run("ack one, close", func(t *testing.T) {
		t.Parallel()
		c := pushTwoCopies(t, redislist.WithVisibilityTimeout(time.Minute))
		client, php, job, sub := c.client, c.php, c.job, c.sub
		first := receive(t, c.msgs)
		eventually(t, "the second copy reserved ahead", func() bool { r, _, _ := laravelCopies(t, php); return r == 0 })
		members := client.ZRange(ctx, php.queue+":reserved", 0, -1).Val()
		if len(members) != 2 {
			t.Errorf("%d reserved member(s) for two copies in flight, want 2", len(members))
		}
		// Taken back to a ready list, a member is a job Laravel's pop takes.
		scratch := phpWorker{client: client, queue: php.queue + "-scratch"}
		cleanupLaravel(t, client, scratch.queue)
		if len(members) == 0 {
			t.Fatal("nothing reserved")
		}
		scratch.push(t, []byte(members[0]))
		id, _ := envelope.ReadIdentity(job)
		if !scratch.work(t, func(popped []byte) {
			if e, err := envelope.Parse(popped); err != nil || e.Meta.ID != id.ID || e.Attempts != 1 {
				t.Errorf("Laravel's pop of the reserved member %s: %v, want the job with attempts 1", popped, err)
			}
		}) {
			t.Fatal("Laravel's pop did not take the reserved member")
		}
		first.Ack()
		time.Sleep(200 * time.Millisecond) // the ack goes out on its own
		if err := sub.Close(); err != nil {
			t.Fatal(err)
		}
		ready, reserved, delayed := laravelCopies(t, php)
		if ready != 1 || reserved != 0 || delayed != 0 {
			t.Fatalf("after one ack and Close: %d ready, %d reserved, %d delayed; want the other copy back on the ready list", ready, reserved, delayed)
		}
		if got := lrange(t, client, php.queue); got[0] != string(job) {
			t.Fatalf("given back %s, want the job as pushed", got[0])
		}
	})
	t.Run("nack both", func(t *testing.T) {
		t.Parallel()
		c := pushTwoCopies(t, redislist.WithReleaseDelay(time.Minute))
		php := c.php
		receive(t, c.msgs).Nack()
		receive(t, c.msgs).Nack()
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			ready, reserved, delayed := laravelCopies(t, php)
			if ready == 0 && reserved == 0 && delayed == 2 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("after two nacks: %d ready, %d reserved, %d delayed; want both copies released", ready, reserved, delayed)
			}
		}
	})
	t.Run("stop without ack", func(t *testing.T) {
		t.Parallel()
		opts := []redislist.Option{redislist.WithVisibilityTimeout(time.Second), redislist.WithCloseTimeout(10 * time.Millisecond)}
		c := pushTwoCopies(t, opts...)
		client, php, name := c.client, c.php, c.name
		id, _ := envelope.ReadIdentity(c.job)
		receive(t, c.msgs) // never acked
		eventually(t, "the second copy reserved ahead", func() bool { r, _, _ := laravelCopies(t, php); return r == 0 })
		_ = c.sub.Close()
		ready, reserved, _ := laravelCopies(t, php)
		if ready+reserved != 2 {
			t.Fatalf("after a stop without ack: %d ready, %d reserved; want both copies (one given back, one reserved)", ready, reserved)
		}
		_, sub := newPubSub(t, client, laravelOpts(opts...)...)
		msgs, err := sub.Subscribe(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		for i := range 2 {
			m := receive(t, msgs)
			if m.UUID != id.ID {
				t.Fatalf("copy %d delivered as %s %s, want %s", i, m.UUID, m.Payload, id.ID)
			}
			m.Ack()
		}
		eventually(t, "nothing left", func() bool { r, res, d := laravelCopies(t, php); return r+res+d == 0 })
	})
}
