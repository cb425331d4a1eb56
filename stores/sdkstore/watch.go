package sdkstore

import (
	"context"
	"fmt"
	"time"

	"github.com/babelqueue/watermill-idempotency/internal/ctxerr"
	"github.com/babelqueue/watermill-idempotency/internal/redisdeadline"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// watched runs call, a call of a Redis layout named op, and returns its
// answer, its error matching ctx's once ctx is done (ctxerr.Match). On a
// client that does not end commands at their context's deadline (inline
// false), a call whose ctx has a deadline returns by that deadline
// (redisdeadline.Watch): call then goes on until its answer or the
// client's timeout, the caller gets ctx's error, as unsure of what call
// did as after a lost reply, and late (when not nil) is handed the answer
// that came too late. call is given the context to run under: ctx, or,
// when its caller may leave it, ctx without its cancellation (its values
// kept), so that a call its caller left still runs every command it has
// to (a claim that landed is looked at, and given back, by commands that
// would fail at once under a context that ended), each bounded by the
// client's timeouts.
func watched[T any](ctx context.Context, inline bool, op string, call func(context.Context) (T, error), late func(T, error)) (T, error) {
	runCtx := ctx
	if _, ok := ctx.Deadline(); ok && !inline {
		runCtx = context.WithoutCancel(ctx) // run in a goroutine its caller may leave
	}
	v, err := redisdeadline.Watch(ctx, inline, func() (T, error) { return call(runCtx) }, late, func() error { return fmt.Errorf("sdkstore: %s: %w", op, ctx.Err()) })
	return v, ctxerr.Match(ctx, err)
}

// watched0 is watched for a call that returns only an error.
func watched0(ctx context.Context, inline bool, op string, call func(context.Context) error) error {
	_, err := watched(ctx, inline, op, func(ctx context.Context) (struct{}, error) { return struct{}{}, call(ctx) }, nil)
	return err
}

// lateRelease bounds the release of a claim taken for a caller that had
// left (see watchedClaim).
const lateRelease = 5 * time.Second

// watchedClaim is watched for a Claim: a claim its caller left before it
// was taken is released (release, under the caller's holder, within
// lateRelease), so that the key is free again at once rather than after
// the lease.
func watchedClaim(ctx context.Context, inline bool, call func(context.Context) (bool, stores.Record, error), release func(context.Context) error) (bool, stores.Record, error) {
	type claimed struct {
		ok    bool
		found stores.Record
	}
	a, err := watched(ctx, inline, "claim", func(ctx context.Context) (claimed, error) {
		ok, found, err := call(ctx)
		return claimed{ok, found}, err
	}, func(a claimed, err error) {
		if err == nil && a.ok {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), lateRelease)
			defer cancel()
			_ = release(rctx)
		}
	})
	return a.ok, a.found, err
}
