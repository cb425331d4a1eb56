package redislist_test

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/pubsub/redislist"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// phpWorker does what a Laravel queue worker does on a Redis connection:
// migrate due delayed jobs and lapsed reservations, pop with "attempts" one
// higher into the reserved set, and delete the reserved member when the job
// succeeds. Written here from Laravel's documented layout, independently of
// the package's scripts.
type phpWorker struct {
	client redis.UniversalClient
	queue  string // queues:<name>
}

var (
	phpMigrate = redis.NewScript(`
local val = redis.call('zrangebyscore', KEYS[1], '-inf', ARGV[1])
if #val > 0 then
  redis.call('zremrangebyrank', KEYS[1], 0, #val - 1)
  for i = 1, #val do
    redis.call('rpush', KEYS[2], val[i])
    redis.call('rpush', KEYS[3], 1)
  end
end
return #val`)
	phpPop = redis.NewScript(`
local job = redis.call('lpop', KEYS[1])
local reserved = false
if job ~= false then
  reserved = cjson.decode(job)
  reserved['attempts'] = reserved['attempts'] + 1
  reserved = cjson.encode(reserved)
  redis.call('zadd', KEYS[2], ARGV[1], reserved)
  redis.call('lpop', KEYS[3])
end
return {job, reserved}`)
	phpPush = redis.NewScript(`
redis.call('rpush', KEYS[1], ARGV[1])
redis.call('rpush', KEYS[2], 1)`)
)

func (w phpWorker) push(t testing.TB, job []byte) {
	t.Helper()
	if err := phpPush.Run(context.Background(), w.client, []string{w.queue, w.queue + ":notify"}, job).Err(); err != nil && !errors.Is(err, redis.Nil) {
		t.Fatal(err)
	}
}

// work pops one job and, when there is one, passes it to handle and deletes
// its reservation. It reports whether there was a job.
func (w phpWorker) work(t testing.TB, handle func(job []byte)) bool {
	t.Helper()
	ctx := context.Background()
	now := time.Now().Unix()
	for _, from := range []string{w.queue + ":delayed", w.queue + ":reserved"} {
		if err := phpMigrate.Run(ctx, w.client, []string{from, w.queue, w.queue + ":notify"}, now).Err(); err != nil {
			t.Error(err)
			return false
		}
	}
	res, err := phpPop.Run(ctx, w.client, []string{w.queue, w.queue + ":reserved", w.queue + ":notify"}, now+60).Slice()
	if err != nil {
		t.Error(err)
		return false
	}
	job, ok := res[0].(string)
	if !ok {
		return false
	}
	handle([]byte(job))
	if err := w.client.ZRem(ctx, w.queue+":reserved", res[1]).Err(); err != nil {
		t.Error(err)
	}
	return true
}

func laravelQueue(t testing.TB, client redis.UniversalClient) (name string, w phpWorker) {
	prefix := keyPrefix(t, client)
	return prefix + "default", phpWorker{client: client, queue: "queues:" + prefix + "default"}
}

func cleanupLaravel(t testing.TB, client redis.UniversalClient, queue string) {
	t.Cleanup(func() {
		client.Del(context.Background(), queue, queue+":reserved", queue+":delayed", queue+":notify")
	})
}

func laravelOpts(opts ...redislist.Option) []redislist.Option {
	return append([]redislist.Option{redislist.WithLayout(redislist.LayoutLaravel)}, opts...)
}

// TestLaravelLayout: Publish writes Laravel's ready and notify lists; the
// pop reserves the job with attempts one higher until now + retry_after and
// hands over the job as pushed; Ack deletes the reservation.
func TestLaravelLayout(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	name, php := laravelQueue(t, client)
	cleanupLaravel(t, client, php.queue)
	ctx := context.Background()
	pub, sub := newPubSub(t, client, laravelOpts(redislist.WithVisibilityTimeout(90*time.Second))...)
	body := newEnvelope(t, name)
	if err := pub.Publish(name, message.NewMessage("x", body)); err != nil {
		t.Fatal(err)
	}
	if got := lrange(t, client, php.queue); len(got) != 1 || got[0] != string(body) {
		t.Fatalf("ready list %q, want the envelope byte for byte", got)
	}
	if got := lrange(t, client, php.queue+":notify"); len(got) != 1 || got[0] != "1" {
		t.Fatalf("notify list %q, want [1]", got)
	}

	msgs, err := sub.Subscribe(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	m := receive(t, msgs)
	id, _ := envelope.ReadIdentity(body)
	if !bytes.Equal(m.Payload, body) || m.UUID != id.ID {
		t.Fatalf("delivered %s %q, want the job as pushed with meta.id", m.UUID, m.Payload)
	}
	reserved, err := client.ZRangeWithScores(ctx, php.queue+":reserved", 0, -1).Result()
	if err != nil || len(reserved) != 1 {
		t.Fatalf("reserved set %v %v, want one member", reserved, err)
	}
	e, err := envelope.Parse([]byte(reserved[0].Member.(string)))
	if err != nil || e.Attempts != 1 || e.Meta.ID != id.ID {
		t.Fatalf("reserved member %v (%v), want the job with attempts 1", reserved[0].Member, err)
	}
	if d := int64(reserved[0].Score) - time.Now().Unix(); d < 88 || d > 91 {
		t.Fatalf("reserved until now + %d s, want now + 90 s", d)
	}
	if n := client.LLen(ctx, php.queue+":notify").Val(); n != 0 {
		t.Fatalf("notify list has %d entries after the pop, want 0", n)
	}
	m.Ack()
	eventually(t, "ack to delete the reservation", func() bool {
		n, _ := client.Exists(ctx, php.queue, php.queue+":reserved", php.queue+":delayed").Result()
		return n == 0
	})
}

// TestLaravelNackReleasesToDelayed: a nack moves the job to the delayed
// set with attempts one higher, due after the release delay, and it is
// delivered again then, its data intact.
func TestLaravelNackReleasesToDelayed(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	name, php := laravelQueue(t, client)
	cleanupLaravel(t, client, php.queue)
	ctx := context.Background()
	_, sub := newPubSub(t, client, laravelOpts(redislist.WithReleaseDelay(2*time.Second))...)
	body := newEnvelope(t, name)
	php.push(t, body)
	msgs, err := sub.Subscribe(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	m := receive(t, msgs)
	nacked := time.Now()
	m.Nack()
	eventually(t, "the job in the delayed set", func() bool { return client.ZCard(ctx, php.queue+":delayed").Val() == 1 })
	if client.ZCard(ctx, php.queue+":reserved").Val() != 0 {
		t.Fatal("the reservation is still there after the release")
	}
	again := receive(t, msgs)
	if waited := time.Since(nacked); waited < time.Second {
		t.Fatalf("delivered again after %v, want the 2 s release delay", waited)
	}
	e, err := envelope.Parse(again.Payload)
	if err != nil || e.Attempts != 1 || !bytes.Contains(again.Payload, []byte(`"big":123456789012345678901`)) {
		t.Fatalf("released job %s (%v), want attempts 1 and the data exact", again.Payload, err)
	}
	again.Ack()
}

// TestLaravelReservationOfADeadWorkerIsMigrated: a job whose reservation
// passed its deadline goes back to the ready list, attempts counted, and is
// delivered again.
func TestLaravelReservationOfADeadWorkerIsMigrated(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	name, php := laravelQueue(t, client)
	cleanupLaravel(t, client, php.queue)
	ctx := context.Background()
	_, dying := newPubSub(t, client, laravelOpts(redislist.WithVisibilityTimeout(time.Second), redislist.WithCloseTimeout(10*time.Millisecond))...)
	body := newEnvelope(t, name)
	php.push(t, body)
	msgs, _ := dying.Subscribe(ctx, name)
	first := receive(t, msgs)
	_ = dying.Close() // no ack
	_, sub := newPubSub(t, client, laravelOpts(redislist.WithVisibilityTimeout(time.Second))...)
	msgs, _ = sub.Subscribe(ctx, name)
	again := receive(t, msgs)
	e, err := envelope.Parse(again.Payload)
	if err != nil || again.UUID != first.UUID || e.Attempts != 1 {
		t.Fatalf("migrated job %s %s (%v), want %s with attempts 1", again.UUID, again.Payload, err, first.UUID)
	}
	again.Ack()
}

// TestLaravelAndGoWorkersShareOneQueue: a PHP worker and two Go consumers
// drain one queue fed from both sides; every job is handled exactly once
// and nothing is left behind.
func TestLaravelAndGoWorkersShareOneQueue(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	name, php := laravelQueue(t, client)
	cleanupLaravel(t, client, php.queue)
	ctx := context.Background()
	pub, sub := newPubSub(t, client, laravelOpts()...)
	const n = 600
	want := make(map[string]bool, n)
	for i := range n {
		body := newEnvelope(t, name)
		id, _ := envelope.ReadIdentity(body)
		want[id.ID] = true
		if i%2 == 0 {
			php.push(t, body)
		} else if err := pub.Publish(name, message.NewMessage("x", body)); err != nil {
			t.Fatal(err)
		}
	}
	var mu sync.Mutex
	handled := map[string]int{}
	record := func(payload []byte) {
		id, _ := envelope.ReadIdentity(payload)
		mu.Lock()
		handled[id.ID]++
		mu.Unlock()
	}
	total := func() int {
		mu.Lock()
		defer mu.Unlock()
		s := 0
		for _, c := range handled {
			s += c
		}
		return s
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if !php.work(t, record) {
				time.Sleep(5 * time.Millisecond)
			}
		}
	}()
	for range 2 {
		msgs, err := sub.Subscribe(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for m := range msgs {
				record(m.Payload)
				m.Ack()
			}
		}()
	}
	eventually(t, "every job handled", func() bool { return total() >= n })
	time.Sleep(200 * time.Millisecond)
	close(stop)
	_ = sub.Close()
	wg.Wait()
	for id := range want {
		if handled[id] != 1 {
			t.Errorf("job %s handled %d times, want 1", id, handled[id])
		}
	}
	if total() != n {
		t.Fatalf("%d handlings of %d jobs", total(), n)
	}
	if k, _ := client.Exists(ctx, php.queue, php.queue+":reserved", php.queue+":delayed").Result(); k != 0 {
		t.Fatalf("%d of the queue's keys left behind", k)
	}
}

// TestLaravelOnRedisCluster: on a cluster client the keys take Laravel's
// own hash tag, queues:{<name>}.
func TestLaravelOnRedisCluster(t *testing.T) {
	t.Parallel()
	client := testenv.RedisCluster(t)
	name := "bqtest-" + testenv.RandomHex(6)
	queue := "queues:{" + name + "}"
	cleanupLaravel(t, client, queue)
	pub, sub := newPubSub(t, client, laravelOpts()...)
	body := newEnvelope(t, name)
	if err := pub.Publish(name, message.NewMessage("x", body)); err != nil {
		t.Fatal(err)
	}
	if got := lrange(t, client, queue); len(got) != 1 {
		t.Fatalf("%s holds %q, want the job", queue, got)
	}
	msgs, _ := sub.Subscribe(context.Background(), name)
	m := receive(t, msgs)
	m.Nack()
	m = receive(t, msgs)
	if e, _ := envelope.Parse(m.Payload); e.Attempts != 1 {
		t.Fatalf("attempts %d, want 1", e.Attempts)
	}
	m.Ack()
}
