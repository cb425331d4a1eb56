package redisstore

import (
	"context"
	"runtime"
	"sync"

	"github.com/redis/go-redis/v9"
)

// batcher sends the commands of concurrent callers together, in one
// pipeline. A caller that finds nothing in flight sends its command at once,
// alone. Callers arriving while a command or pipeline is in flight queue,
// and the first of them leads the next pipeline, carrying every queued
// command, as soon as the current one returns; before it collects them it
// yields the processor once, so that deliveries already running can add
// their commands (under load that makes pipelines larger and round trips
// fewer, at the cost of a scheduler pass; at low load nothing is queued and
// nothing waits). It starts no goroutine and sets no timer, and a command
// costs no allocation of its own beyond what go-redis needs.
type batcher struct {
	client redis.UniversalClient
	calls  sync.Pool // of *call

	mu      sync.Mutex
	queue   []*call
	leading bool
}

// call is a queued command. The leader of the pipeline that carried it
// sends false on wake once it ran; the leader of the one before sends true
// when this caller must lead the next pipeline instead.
type call struct {
	cmd  redis.Cmder
	wake chan bool // buffered: the sender never waits
}

// do runs cmd, alone or with the commands of concurrent callers. The
// pipeline runs without the callers' cancellation (a command queued by one
// caller must not fail because another's context ended); the client's read
// and write timeouts bound it.
func (b *batcher) do(ctx context.Context, cmd redis.Cmder) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	b.mu.Lock()
	if !b.leading { // nothing in flight: lead at once, alone
		b.leading = true
		b.mu.Unlock()
		_ = b.client.Process(context.WithoutCancel(ctx), cmd)
		b.handOver(nil, nil)
		return cmd.Err()
	}
	c, _ := b.calls.Get().(*call)
	if c == nil {
		c = &call{wake: make(chan bool, 1)}
	}
	c.cmd = cmd
	b.queue = append(b.queue, c)
	b.mu.Unlock()
	if lead := <-c.wake; !lead { // carried by another caller's pipeline
		c.cmd = nil
		b.calls.Put(c)
		return cmd.Err()
	}
	runtime.Gosched()
	b.mu.Lock()
	batch := b.queue
	b.queue = nil
	b.mu.Unlock()

	pctx := context.WithoutCancel(ctx)
	if len(batch) == 1 {
		_ = b.client.Process(pctx, cmd)
	} else {
		pipe := b.client.Pipeline()
		for _, q := range batch {
			_ = pipe.Process(pctx, q.cmd)
		}
		_, _ = pipe.Exec(pctx) // each command carries its own error
	}
	b.handOver(batch, c)
	c.cmd = nil
	b.calls.Put(c)
	return cmd.Err()
}

// handOver ends a pipeline: it wakes the callers whose commands it carried,
// but leader, and passes the lead to the first caller queued meanwhile, if
// any.
func (b *batcher) handOver(batch []*call, leader *call) {
	for _, q := range batch {
		if q != leader {
			q.wake <- false
		}
	}
	b.mu.Lock()
	if len(b.queue) > 0 {
		b.queue[0].wake <- true // hand over: leading stays true
	} else {
		b.leading = false
	}
	b.mu.Unlock()
}
