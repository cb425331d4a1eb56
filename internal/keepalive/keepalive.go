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
// A [Keeper] keeps any number of leases on one timer: when it fires, every
// lease whose renewal is due soon is renewed at once, each renewal in a
// goroutine of its own, so that a store that sends concurrent calls
// together (a pipeline, a statement over arrays) carries the renewals of
// thousands of claims in a round trip or two, a few times a lease, however
// many claims are held. A holder keeping many leases (a Guard, a runner of
// effects) owns one Keeper; [Keep] and [KeepFrom] keep a single lease on a
// Keeper of its own.
//
// Time is measured on the process's monotonic clock, so a jump of the wall
// clock neither shortens nor stretches a lease. A process paused past its
// lease (SIGSTOP, a long GC pause, a suspended VM) cannot know whether
// another holder ran meanwhile; its next renewal asks the store, which is
// the authority: held means nobody else took the claim.
package keepalive

import (
	"container/heap"
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

// Lease is a lease kept alive by a Keeper until Stop. Its methods are safe
// for concurrent use.
//
// It holds no goroutine nor timer of its own: it waits in its Keeper's
// queue, and each renewal runs in a short-lived goroutine the Keeper starts
// when it is due, so a lease costs a handful of allocations and nothing
// while it waits, whatever the number of leases kept.
type Lease struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
	parent context.Context // the renewals' values
	renew  RenewFunc
	lease  time.Duration
	keeper *Keeper

	// Guarded by keeper.mu: the lease's place in the keeper's queue.
	due   time.Time // when its next renewal is due
	early time.Time // the earliest it may be sent with the renewals of others
	index int       // its index in keeper.queue; -1 when not queued

	mu      sync.Mutex
	renewed time.Time     // when the last renewal that held was sent (the taking, at first)
	running int           // renewals under way (the keeper's, Confirm's)
	stopped bool          // Stop was called: no renewal starts any more
	idle    chan struct{} // closed when the renewal under way ends, for a Stop waiting on it
	lost    error         // the cause, once lost
}

// Keep starts keeping a lease of length lease alive, taken just before the
// call, on a Keeper of its own; see Keeper.Keep.
func Keep(parent context.Context, lease time.Duration, renew RenewFunc) *Lease {
	return new(Keeper).KeepFrom(parent, time.Now(), lease, renew)
}

// KeepFrom keeps a lease taken at taken alive on a Keeper of its own; see
// Keeper.KeepFrom. A holder of many leases shares one Keeper instead, so
// that their renewals go to the store together.
func KeepFrom(parent context.Context, taken time.Time, lease time.Duration, renew RenewFunc) *Lease {
	return new(Keeper).KeepFrom(parent, taken, lease, renew)
}

// Keeper keeps leases alive on one timer. Its zero value is ready to use;
// it must not be copied after first use. Its methods are safe for
// concurrent use.
//
// It queues its leases by when their next renewal is due and sets its
// timer for the earliest. When the timer fires, every lease whose renewal
// is due is renewed, and with it every lease whose renewal would be due
// within half of the wait it was scheduled for (half a renewal period, a
// sixth of the lease, for a renewal that follows one that held): those are
// renewed early rather than each at its own instant. Each renewal runs in
// a goroutine of its own, so a renewal that waits on the store delays no
// other, and a store that sends concurrent calls together carries them in
// one or two round trips. A lease renewed with a tick keeps that tick's
// rhythm afterwards, so the leases of a busy holder settle into a few ticks
// a period, and the round trips per second stay bounded whatever the
// number of leases. Renewing early never shortens a lease: it is renewed
// at most every third of the lease and at least every sixth. A retry after
// a failed renewal keeps its own time (it is never sent early), so a store
// that fails is not asked more often than one lease alone would ask it.
//
// A Keeper holds no goroutine: when no lease is kept its timer is stopped,
// so it needs no Close.
type Keeper struct {
	mu    sync.Mutex
	queue queue       // the leases waiting for their next renewal, earliest due first
	timer *time.Timer // made at the first lease; stopped while queue is empty
	at    time.Time   // when timer is set to fire; zero while it is stopped
	ticks uint64      // the timer's firings that started renewals, for tests
}

// Keep starts keeping a lease of length lease alive, taken just before the
// call (the lease is counted from the call's start, never later than the
// store counts it), by calling renew every third of lease until Stop. The
// period runs from when a renewal is sent, so a store that takes longer
// than a third of the lease to answer is asked again as soon as it
// answered (after a twelfth of the lease at least): the lease holds while
// a renewal's round trip stays under about half the lease. A renewal may
// be sent up to half a period early, together with the renewals of the
// Keeper's other leases.
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
func (k *Keeper) Keep(parent context.Context, lease time.Duration, renew RenewFunc) *Lease {
	return k.KeepFrom(parent, time.Now(), lease, renew)
}

// KeepFrom is Keep for a lease taken at taken (read with time.Now just
// before the call that took it was sent, so that it carries the monotonic
// clock): the first renewal comes a third of the lease after taken, and the
// lease is lost when no renewal succeeded within lease of taken. A holder
// whose taking call was slow (a claim that waited on the store) thereby
// never counts its lease from later than the store does.
func (k *Keeper) KeepFrom(parent context.Context, taken time.Time, lease time.Duration, renew RenewFunc) *Lease {
	ctx, cancel := context.WithCancelCause(parent)
	lease = max(lease, MinLease)
	l := &Lease{ctx: ctx, cancel: cancel, parent: parent, renew: renew, lease: lease, keeper: k, renewed: taken, index: -1}
	wait := max(lease/3-time.Since(taken), 0)
	k.schedule(l, wait, wait/2)
	return l
}

// schedule queues l for a renewal due after wait, which may be sent up to
// early before that, and sets the timer if that renewal is now the first.
func (k *Keeper) schedule(l *Lease, wait, early time.Duration) {
	now := time.Now()
	k.mu.Lock()
	defer k.mu.Unlock()
	l.due, l.early = now.Add(wait), now.Add(wait-early)
	heap.Push(&k.queue, l)
	switch {
	case k.timer == nil:
		k.timer = time.AfterFunc(wait, k.tick)
		k.at = l.due
	case k.at.IsZero() || l.due.Before(k.at):
		k.timer.Reset(wait)
		k.at = l.due
	}
}

// remove takes l out of the queue, if it is there, and stops the timer
// when no lease is left.
func (k *Keeper) remove(l *Lease) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if l.index >= 0 {
		heap.Remove(&k.queue, l.index)
	}
	if len(k.queue) == 0 && !k.at.IsZero() {
		k.timer.Stop()
		k.at = time.Time{}
	}
}

// tick is the timer's callback: it starts the renewal of every lease due,
// and of every lease that may be renewed early with them, each in a
// goroutine of its own, and sets the timer for the next one due.
func (k *Keeper) tick() {
	k.mu.Lock()
	defer k.mu.Unlock()
	now := time.Now()
	// The queue is ordered by due, and a lease's early is never after its
	// due: every lease due is taken before the first that is not.
	if len(k.queue) > 0 && !k.queue[0].early.After(now) {
		k.ticks++
	}
	for len(k.queue) > 0 && !k.queue[0].early.After(now) {
		l := heap.Pop(&k.queue).(*Lease)
		go l.fire()
	}
	if len(k.queue) == 0 {
		k.timer.Stop() // a Reset by schedule may have raced this tick
		k.at = time.Time{}
		return
	}
	k.at = k.queue[0].due
	k.timer.Reset(k.at.Sub(now))
}

// queue is a min-heap of leases by due (container/heap).
type queue []*Lease

func (q queue) Len() int           { return len(q) }
func (q queue) Less(i, j int) bool { return q[i].due.Before(q[j].due) }
func (q queue) Swap(i, j int) {
	q[i], q[j] = q[j], q[i]
	q[i].index, q[j].index = i, j
}

// Push appends x, a *Lease.
func (q *queue) Push(x any) {
	l := x.(*Lease)
	l.index = len(*q)
	*q = append(*q, l)
}

// Pop removes and returns the last lease.
func (q *queue) Pop() any {
	old := *q
	l := old[len(old)-1]
	old[len(old)-1] = nil
	*q = old[:len(old)-1]
	l.index = -1
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
// held to the end). Once it returned, no renewal runs any more: the holder
// may release the lease in the store without a renewal racing the release.
func (l *Lease) Stop() error {
	l.mu.Lock()
	l.stopped = true
	l.keeper.remove(l)
	var wait chan struct{}
	if l.running > 0 {
		if l.idle == nil {
			l.idle = make(chan struct{})
		}
		wait = l.idle
	}
	l.mu.Unlock()
	if wait != nil {
		<-wait
	}
	l.cancel(context.Canceled)
	return l.Lost()
}

// Confirm is for a holder about to do what only the lease's holder may
// (send a request that cannot be taken back): it returns nil at once when
// the lease was renewed recently (within two thirds of the lease), and
// otherwise asks the store first, as a renewal, so that a holder paused or
// starved past its renewals (SIGSTOP, a long GC pause) learns that the
// lease is gone before it acts rather than after. A "held" answer counts
// only when it came back within two thirds of the lease after it was sent
// (the lease it granted still has a third to run); a staler one, as from a
// holder paused while the answer was on its way, is asked again once, and
// a second stale answer loses the lease.
//
// It returns an error matching ErrLost when the store holds the lease for
// nobody or another holder, when the lease ran out without a renewal, when
// no fresh answer came, or when the lease was lost or stopped before; a
// store that cannot be asked leaves the lease as held while it has not
// run out. Like a renewal of the keeper's, Confirm's is waited for by Stop.
func (l *Lease) Confirm() error {
	l.mu.Lock()
	lost, renewed := l.lost, l.renewed
	switch {
	case lost != nil:
		l.mu.Unlock()
		return lost
	case l.stopped:
		l.mu.Unlock()
		return fmt.Errorf("%w: stopped", ErrLost)
	case time.Since(renewed) < l.lease*2/3:
		l.mu.Unlock()
		return nil
	}
	l.running++
	l.mu.Unlock()

	fresh := time.Time{} // when the renewal that got a fresh "held" was sent
	for asks := 1; ; asks++ {
		at, held, err := l.ask(renewed, l.lease/12)
		switch {
		case err == nil && held && time.Since(at) < l.lease*2/3:
			fresh = at
		case err == nil && held && asks < 2:
			continue // answered too late to act on: ask again
		case err == nil && held:
			lost = fmt.Errorf("%w: no answer of the store within two thirds of the lease of %v", ErrLost, l.lease)
		default:
			lost = l.lossOf(held, err, renewed)
		}
		break
	}
	return l.settle(fresh, lost, -1, 0)
}

// ask sends one renewal, bounded by what is left of the lease counted from
// renewed, or by floor when less is left, and returns when it was sent.
func (l *Lease) ask(renewed time.Time, floor time.Duration) (at time.Time, held bool, err error) {
	at = time.Now()
	rctx, cancel := context.WithTimeout(context.WithoutCancel(l.parent), max(l.lease-at.Sub(renewed), floor))
	defer cancel()
	held, err = l.renew(rctx, l.lease)
	return at, held, err
}

// lossOf is the loss a renewal's answer means for a lease last renewed at
// renewed, or nil: the store holds it for nobody or another holder, or the
// store could not be asked and the lease has run out.
func (l *Lease) lossOf(held bool, err error, renewed time.Time) error {
	switch {
	case err == nil && !held:
		return fmt.Errorf("%w: the store holds it for another holder, or no longer at all", ErrLost)
	case err != nil && time.Since(renewed) >= l.lease:
		return fmt.Errorf("%w: not renewed within its lease of %v: %w", ErrLost, l.lease, err)
	}
	return nil
}

// settle ends a renewal under way: it keeps renewed if it is later than
// the lease's last renewal, keeps the first loss (here, by the keeper's
// renewal or by Confirm: lost for good), queues the next renewal after
// next, possibly early by early (when next is not negative, the lease held
// and not stopped), and ends the context if the lease is lost. It returns
// the loss.
func (l *Lease) settle(renewed time.Time, lost error, next, early time.Duration) error {
	l.mu.Lock()
	l.doneRunningLocked()
	if renewed.After(l.renewed) {
		l.renewed = renewed
	}
	if l.lost == nil {
		l.lost = lost
	}
	lost = l.lost
	if next >= 0 && !l.stopped && lost == nil {
		l.keeper.schedule(l, next, early)
	}
	l.mu.Unlock()
	if lost != nil {
		l.cancel(lost)
	}
	return lost
}

// doneRunningLocked ends one renewal under way, and lets a Stop waiting for
// the last one go on. l.mu is held.
func (l *Lease) doneRunningLocked() {
	l.running--
	if l.running == 0 && l.idle != nil {
		close(l.idle)
		l.idle = nil
	}
}

// fire runs one renewal, in a goroutine the keeper started for it, and
// queues the next one.
func (l *Lease) fire() {
	l.mu.Lock()
	if l.stopped || l.lost != nil {
		l.mu.Unlock()
		return
	}
	l.running++
	renewed := l.renewed
	l.mu.Unlock()

	// A try is bounded by what is left of the lease, or by a period when
	// the keeper's timer fired late (a paused process, a starved
	// scheduler): the store, not this process's timer, tells whether the
	// lease is still held.
	period := l.lease / 3
	at, held, err := l.ask(renewed, period)

	var lost error
	next, early := time.Duration(-1), time.Duration(0)
	if err == nil && held {
		// The next renewal is due a period after this one was sent, not
		// after it came back: scheduled from the answer, renewals on a
		// store slower than a third of the lease fall behind it, each one
		// given less time than the store takes, and a claim the store
		// still holds is given up. A floor keeps a store slower than the
		// period from being asked back to back.
		// It may be sent up to half of its wait early, with other leases'.
		renewed, next = at, max(period-time.Since(at), l.lease/12)
		early = next / 2
	} else if lost = l.lossOf(held, err, renewed); lost == nil {
		next = min(max(l.lease/12, time.Millisecond), l.lease-time.Since(renewed)) // try again while the lease lasts
	}
	l.settle(renewed, lost, next, early)
}
