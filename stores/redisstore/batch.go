package redisstore

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/internal/redisdeadline"
)

// batcher sends the commands of concurrent callers together, in one
// pipeline, and makes every caller wait for its own context only.
//
// A command that finds nothing in flight is sent at once (a command never
// waits for company): by its caller, under its own context, when the client
// honours contexts' deadlines (go-redis's ContextTimeoutEnabled) or the
// context has no deadline (the client's own timeouts bound it then, as
// Watermill's message contexts, which can be cancelled but have no
// deadline); otherwise by a drain goroutine while the caller waits for the
// answer or its context, whichever comes first. Commands arriving
// while a round trip is in flight queue, and the drain goroutine sends all
// that queued in one pipeline as soon as it returns. Before it collects them
// it yields the processor once, so that deliveries already running can add
// their commands (under load that makes pipelines larger and round trips
// fewer). The drain goroutine ends when the queue is empty; at most one
// runs per Store.
//
// A caller whose context
// ends while its command is queued takes it out of the queue (it is never
// sent); one whose command is already on the wire returns at once, and the
// drain goroutine hands the answer, which no other caller can see (each
// caller has a command of its own), to the caller's lateAnswer if it gave
// one (a claim's: what it took is released), and discards it otherwise. A pipeline runs under the latest
// deadline of the callers it carries and without their cancellation, so a
// command never fails because another caller's context ended; the client's
// read and write timeouts bound it.
//
// A panic inside the client (a hook's, say) fails the commands of that
// round trip with ErrClientPanic and leaves the batcher serving.
type batcher struct {
	client redis.UniversalClient
	inline bool      // the client ends a command at its context's deadline
	calls  sync.Pool // of *call

	mu      sync.Mutex
	queue   []*call
	spare   []*call // the previous batch's slice, reused for the next queue
	leading bool    // the drain goroutine runs
}

// The states of a call, guarded by batcher.mu.
const (
	queued    = iota // in the queue
	sent             // taken by the drain goroutine into a pipeline
	abandoned        // sent, and its caller left (its context ended)
	finished         // answered: done was signalled
)

// call is a queued command.
type call struct {
	ctx   context.Context
	cmd   redis.Cmder
	late  lateAnswer // told the answer if the caller leaves while cmd is on the wire; nil: none
	state int
	done  chan struct{} // buffered: signalled once the command is answered
}

// lateAnswer is told the answer of a command whose caller left (its
// context ended) while the command was on the wire, and which may have
// taken something the caller must give back: a claim. It must not block.
type lateAnswer interface {
	lateAnswer(ctx context.Context, cmd redis.Cmder)
}

// abandonedError is the error of a caller that left while its command was
// on the wire, when it gave a lateAnswer: that is told the command's
// answer. It matches the context's error.
type abandonedError struct{ err error }

func (e *abandonedError) Error() string { return e.err.Error() }
func (e *abandonedError) Unwrap() error { return e.err }

// leave is the error of a caller that left while its command was on the
// wire: ctx's, marked abandoned when someone will be told the answer
// (told).
func leave(ctx context.Context, told bool) error {
	if !told {
		return ctx.Err()
	}
	return &abandonedError{err: ctx.Err()}
}

// do runs cmd, alone or with the commands of concurrent callers, and returns
// its error, or ctx's if ctx ends first; in that case cmd must not be read
// (late, if not nil, is told its answer when it comes, if it was sent).
func (b *batcher) do(ctx context.Context, cmd redis.Cmder, late lateAnswer) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	inline := b.inline || noDeadline(ctx)
	b.mu.Lock()
	if inline && !b.leading { // nothing in flight: send it at once, alone
		b.leading = true
		b.mu.Unlock()
		err := processAlone(ctx, b.client, cmd)
		b.mu.Lock()
		if len(b.queue) > 0 {
			go b.drain() // leading stays true
		} else {
			b.leading = false
		}
		b.mu.Unlock()
		return err
	}
	c, _ := b.calls.Get().(*call)
	if c == nil {
		c = &call{done: make(chan struct{}, 1)}
	}
	c.ctx, c.cmd, c.late, c.state = ctx, cmd, late, queued
	b.queue = append(b.queue, c)
	if !b.leading {
		b.leading = true
		go b.drain()
	}
	b.mu.Unlock()

	select {
	case <-c.done:
		b.recycle(c)
		return cmd.Err()
	case <-ctx.Done():
	}
	b.mu.Lock()
	switch c.state {
	case queued: // never sent: take it out
		for i, q := range b.queue {
			if q == c {
				b.queue = append(b.queue[:i], b.queue[i+1:]...)
				break
			}
		}
		b.mu.Unlock()
		b.recycle(c)
		return ctx.Err()
	case sent: // on the wire: the drain goroutine recycles it
		c.state = abandoned
		b.mu.Unlock()
		return leave(ctx, late != nil)
	}
	b.mu.Unlock() // answered meanwhile
	<-c.done
	b.recycle(c)
	return cmd.Err()
}

func (b *batcher) recycle(c *call) {
	c.ctx, c.cmd, c.late = nil, nil, nil
	b.calls.Put(c)
}

// drain sends the queued commands, one round trip at a time, until the
// queue is empty.
func (b *batcher) drain() {
	for first := true; ; first = false {
		if !first {
			runtime.Gosched() // let running deliveries add their commands
		}
		b.mu.Lock()
		batch := b.queue
		b.queue = b.spare[:0]
		for _, c := range batch {
			c.state = sent
		}
		b.mu.Unlock()

		if len(batch) > 0 {
			b.process(batch)
		}

		b.mu.Lock()
		for i, c := range batch {
			if c.state == abandoned {
				if c.late != nil {
					c.late.lateAnswer(c.ctx, c.cmd)
				}
				b.recycle(c)
			} else {
				c.state = finished
				c.done <- struct{}{}
			}
			batch[i] = nil
		}
		b.spare = batch
		if len(b.queue) == 0 {
			b.leading = false
			b.mu.Unlock()
			return
		}
		b.mu.Unlock()
	}
}

// process sends batch in one pipeline (or a lone command on its own) under
// the latest of its callers' deadlines, without their cancellation. The
// first caller's context lends its values (for tracing hooks).
func (b *batcher) process(batch []*call) {
	ctx := context.WithoutCancel(batch[0].ctx)
	var latest time.Time
	for _, c := range batch {
		d, ok := c.ctx.Deadline()
		if !ok {
			latest = time.Time{}
			break
		}
		if d.After(latest) {
			latest = d
		}
	}
	if !latest.IsZero() {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, latest)
		defer cancel()
	}
	defer func() {
		if r := recover(); r != nil {
			err := panicError(r)
			for _, c := range batch {
				c.cmd.SetErr(err)
			}
		}
	}()
	if len(batch) == 1 {
		_ = b.client.Process(ctx, batch[0].cmd)
		return
	}
	pipe := b.client.Pipeline()
	for _, c := range batch {
		_ = pipe.Process(ctx, c.cmd)
	}
	_, _ = pipe.Exec(ctx) // each command carries its own error
}

// processAlone runs cmd under ctx, turning a panic inside the client into
// the command's error.
func processAlone(ctx context.Context, client redis.UniversalClient, cmd redis.Cmder) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = panicError(r)
			cmd.SetErr(err)
		}
	}()
	return client.Process(ctx, cmd)
}

func panicError(r any) error {
	return fmt.Errorf("%w: %v", ErrClientPanic, r)
}

// processOwn runs cmd on its own (WithoutPipelining) and returns its error,
// or ctx's if ctx ends first (watched); in that case cmd must not be read,
// and late, if not nil, is told its answer when it comes.
func processOwn(ctx context.Context, client redis.UniversalClient, inline bool, cmd redis.Cmder, late lateAnswer) error {
	var told func()
	if late != nil {
		told = func() { late.lateAnswer(ctx, cmd) }
	}
	_, err := watched(ctx, inline, func() (struct{}, error) { return struct{}{}, processAlone(ctx, client, cmd) }, told)
	return err
}

// watched returns what run returns, or ctx's error if ctx ends first
// (redisdeadline.Watch); in that case run goes on until the client gives
// up, and late, if not nil, is called once it returned.
func watched[T any](ctx context.Context, inline bool, run func() (T, error), late func()) (T, error) {
	var told func(T, error)
	if late != nil {
		told = func(T, error) { late() }
	}
	return redisdeadline.Watch(ctx, inline, run, told, func() error { return leave(ctx, late != nil) })
}

// noDeadline reports whether ctx has no deadline: the client's own
// timeouts bound a command then, so the caller can send it itself.
func noDeadline(ctx context.Context) bool {
	_, ok := ctx.Deadline()
	return !ok
}
