package redisstore

import (
	"context"
	"sync"

	"github.com/redis/go-redis/v9"
)

// batcher sends the commands of concurrent callers together, in one
// pipeline. A caller that finds nothing in flight sends its command at once,
// alone (and allocates nothing for it). Callers arriving while a command or
// pipeline is in flight queue, and the first of them leads the next
// pipeline, carrying every queued command, as soon as the current one
// returns. At low load every command goes alone and without delay; under
// load, round trips are shared. It starts no goroutine and sets no timer.
type batcher struct {
	client redis.UniversalClient

	mu      sync.Mutex
	queue   []*call
	leading bool
}

type call struct {
	cmd  redis.Cmder
	done chan struct{} // closed once cmd ran
	lead chan struct{} // closed when this caller must lead the next pipeline
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
	c := &call{cmd: cmd, done: make(chan struct{}), lead: make(chan struct{})}
	b.queue = append(b.queue, c)
	b.mu.Unlock()
	select {
	case <-c.done:
		return cmd.Err()
	case <-c.lead:
	}
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
	return cmd.Err()
}

// handOver ends a pipeline: it wakes the callers whose commands it carried,
// but leader, and passes the lead to the first caller queued meanwhile, if
// any.
func (b *batcher) handOver(batch []*call, leader *call) {
	for _, q := range batch {
		if q != leader {
			close(q.done)
		}
	}
	b.mu.Lock()
	if len(b.queue) > 0 {
		close(b.queue[0].lead) // hand over: leading stays true
	} else {
		b.leading = false
	}
	b.mu.Unlock()
}
