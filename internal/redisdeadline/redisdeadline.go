// Package redisdeadline makes a go-redis call return by its context's
// deadline on a client that does not end commands there itself.
//
// go-redis ends a command at its context's deadline only when the client
// was made with ContextTimeoutEnabled; otherwise it waits out its own read
// timeout (3 s by default), however soon the caller's deadline. Watch runs
// such a call in a goroutine of its own and returns at the deadline, the
// call going on until its answer or the client's timeout: the caller is
// then as unsure of what the call did as after a lost reply, and the
// answer that came too late can be handed to whoever must undo it.
package redisdeadline

import (
	"context"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

// Honoured reports whether client ends a command at its context's
// deadline (ContextTimeoutEnabled): calls on it need no watch.
func Honoured(client redis.UniversalClient) bool {
	switch c := client.(type) {
	case *redis.Client:
		return c.Options().ContextTimeoutEnabled
	case *redis.ClusterClient:
		return c.Options().ContextTimeoutEnabled
	case *redis.Ring:
		return c.Options().ContextTimeoutEnabled
	}
	return false
}

// Watch returns what run returns, or, when ctx ends first, what leave
// returns (the caller's error for having left). It runs run here when the
// client honours deadlines (inline) or ctx has none: the client's own
// timeouts bound it then. Otherwise run goes in a goroutine of its own
// and the caller returns by ctx's deadline; run then goes on until the
// client gives up, and late, if not nil, is handed its answer. An answer
// that comes in the same moment as ctx's end is kept, not handed to late.
func Watch[T any](ctx context.Context, inline bool, run func() (T, error), late func(T, error), leave func() error) (T, error) {
	if _, ok := ctx.Deadline(); inline || !ok {
		return run()
	}
	type answer struct {
		v   T
		err error
	}
	const waiting, answered, left = 0, 1, 2
	var state atomic.Int32
	done := make(chan answer, 1)
	go func() {
		v, err := run()
		if state.CompareAndSwap(waiting, answered) {
			done <- answer{v, err}
		} else if late != nil {
			late(v, err)
		}
	}()
	select {
	case a := <-done:
		return a.v, a.err
	case <-ctx.Done():
	}
	if state.CompareAndSwap(waiting, left) {
		var none T
		return none, leave()
	}
	a := <-done // answered in the same moment
	return a.v, a.err
}
