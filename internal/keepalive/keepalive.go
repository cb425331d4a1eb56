// Package keepalive keeps a lease alive while its holder works: the one
// mechanism behind every claim the kit holds (a message's claim, an effect
// attempt's lease, an API request's claim, a redrive run's lock).
//
// A lease here says "my holder is alive", not "my holder will be done
// within the lease": [Keep] renews it every third of the lease for as long
// as the holder works, however long that is, and the lease only bounds how
// long a dead holder (a crashed process, a dropped connection) goes
// unnoticed. When the lease is lost, because the store says another holder
// has it (or nobody does any more), or because no renewal got through
// before the lease ran out, the holder is told: the context [Lease.Context]
// ends with a cause matching [ErrLost], and [Lease.Stop] returns it.
//
// Time is measured on the process's monotonic clock, so a jump of the wall
// clock neither shortens nor stretches a lease. A process paused past its
// lease (SIGSTOP, a long GC pause, a suspended VM) cannot know whether
// another holder ran meanwhile; its next renewal asks the store, which is
// the authority: held means nobody else took the claim.
package keepalive

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// ErrLost is matched by the cause of a lease's context, and by Stop's
// result, when the lease was lost: taken by another holder, gone from the
// store, or not renewed before it ran out.
var ErrLost = errors.New("lease lost")

// RenewFunc extends the holder's lease to lease from now. It reports held
// false when the store holds no live lease of this holder any more (another
// holder took it, or it lapsed and was dropped), and an error when the
// store could not be asked. It must return by its context's deadline.
type RenewFunc func(ctx context.Context, lease time.Duration) (held bool, err error)

// MinLease is the shortest lease Keep renews: a third of it is the renewal
// period, and a store round trip must fit well inside that.
const MinLease = 3 * time.Millisecond

// Lease is a lease kept alive by Keep until Stop. Its methods are safe for
// concurrent use.
type Lease struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
	stop   chan struct{}
	done   chan struct{}
	once   sync.Once

	mu   sync.Mutex
	lost error // the cause, once lost
}

// Keep starts keeping a lease of length lease alive, taken just before the
// call (the lease is counted from the call's start, never later than the
// store counts it), by calling renew every third of lease until Stop.
//
// A renewal that fails is tried again at shorter intervals while the lease
// lasts; each try is bounded by what is left of the lease. The lease is lost
// when renew reports held false, or when no renewal succeeded within lease
// of the last one that did: the context of Context then ends, with a cause
// matching ErrLost that says why.
//
// The renewals run on a context detached from parent's cancellation (a
// message's context may end while its claim must still be held, as while
// its produced messages await the ack) but keep its values; Context is a
// child of parent and ends with it too. Stop must be called once the holder
// is done with the lease (it may be called more than once); it does not
// release the lease in the store: that is the holder's to do.
func Keep(parent context.Context, lease time.Duration, renew RenewFunc) *Lease {
	return KeepFrom(parent, time.Now(), lease, renew)
}

// KeepFrom is Keep for a lease taken at taken (read with time.Now just
// before the call that took it was sent, so that it carries the monotonic
// clock): the first renewal comes a third of the lease after taken, and the
// lease is lost when no renewal succeeded within lease of taken. A holder
// whose taking call was slow (a claim that waited on the store) thereby
// never counts its lease from later than the store does.
func KeepFrom(parent context.Context, taken time.Time, lease time.Duration, renew RenewFunc) *Lease {
	ctx, cancel := context.WithCancelCause(parent)
	l := &Lease{ctx: ctx, cancel: cancel, stop: make(chan struct{}), done: make(chan struct{})}
	lease = max(lease, MinLease)
	go l.run(context.WithoutCancel(parent), taken, lease, renew)
	return l
}

// Context returns the holder's context: a child of the parent given to
// Keep that ends when the lease is lost (with a cause matching ErrLost), when
// Stop is called, or when the parent ends.
func (l *Lease) Context() context.Context { return l.ctx }

// Lost returns the cause of the loss (matching ErrLost), or nil while the
// lease is held or when it was stopped before it was lost.
func (l *Lease) Lost() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.lost
}

// Stop stops renewing, waits until no renewal is under way, ends Context, and
// returns the cause of the loss if the lease was lost before (nil when it was
// held to the end).
func (l *Lease) Stop() error {
	l.once.Do(func() { close(l.stop) })
	<-l.done
	l.cancel(context.Canceled)
	return l.Lost()
}

func (l *Lease) run(ctx context.Context, renewed time.Time, lease time.Duration, renew RenewFunc) {
	defer close(l.done)
	period := lease / 3
	retry := max(lease/12, time.Millisecond)
	timer := time.NewTimer(max(period-time.Since(renewed), 0))
	defer timer.Stop()
	for {
		select {
		case <-l.stop:
			return
		case <-timer.C:
		}
		// A try is bounded by what is left of the lease, or by a period
		// when the timer fired late (a paused process, a starved
		// scheduler): the store, not this process's timer, tells whether
		// the lease is still held.
		at := time.Now()
		rctx, cancel := context.WithTimeout(ctx, max(lease-at.Sub(renewed), period))
		held, err := renew(rctx, lease)
		cancel()
		switch {
		case err == nil && held:
			renewed = at
			timer.Reset(period)
		case err == nil:
			l.lose(fmt.Errorf("%w: the store holds it for another holder, or no longer at all", ErrLost))
			return
		case time.Since(renewed) >= lease:
			l.lose(fmt.Errorf("%w: not renewed within its lease of %v: %w", ErrLost, lease, err))
			return
		default:
			timer.Reset(min(retry, lease-time.Since(renewed)))
		}
	}
}

func (l *Lease) lose(cause error) {
	l.mu.Lock()
	l.lost = cause
	l.mu.Unlock()
	l.cancel(cause)
}
