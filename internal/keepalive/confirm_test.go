package keepalive

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"
)

// TestStopWaitsForConfirmsRenewal: promised (Lease, Stop): "Its methods
// are safe for concurrent use"; Stop "waits until no renewal is under way ... Once it returned, no
// renewal runs any more: the holder may release the lease in the store
// without a renewal racing the release". Confirm's round trip is a renewal
// ("asks the store first, as a renewal"), run on the caller's goroutine.
//
// Here Confirm's renewal is on the wire (the timer's renewals have failed
// fast, so the lease was not renewed within two thirds of it) when another
// goroutine calls Stop: Stop waits for it, as for the timer's, so no
// renewal lands after Stop returned to re-extend a lease its holder may
// release at once.
func TestStopWaitsForConfirmsRenewal(t *testing.T) {
	t.Parallel()
	const lease = 30 * time.Second
	var calls, after atomic.Int64
	var stopped, block atomic.Bool
	inside, release := make(chan struct{}), make(chan struct{})
	l := KeepFrom(context.Background(), time.Now().Add(-lease*7/10), lease, func(context.Context, time.Duration) (bool, error) {
		calls.Add(1)
		if !block.CompareAndSwap(true, false) {
			return false, errors.New("timeout") // the timer's renewals fail fast: not renewed
		}
		inside <- struct{}{}
		<-release
		if stopped.Load() {
			after.Add(1)
		}
		return true, nil
	})
	// The timer fires at once (the lease is 0.7 old) and fails; its retry
	// comes a twelfth of the lease (2.5 s) later.
	deadline := time.Now().Add(10 * time.Second)
	for calls.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no renewal from the timer")
		}
		time.Sleep(time.Millisecond)
	}
	block.Store(true)
	confirmed := make(chan error, 1)
	go func() { confirmed <- l.Confirm() }()
	<-inside // Confirm's renewal is under way
	returned := make(chan error, 1)
	go func() { err := l.Stop(); stopped.Store(true); returned <- err }()
	select {
	case <-returned:
		close(release)
		cerr := <-confirmed
		t.Fatalf("Stop returned while Confirm's renewal was under way; that renewal then answered after Stop (%d renewal(s) after Stop returned) and Confirm returned %v on the stopped lease", after.Load(), cerr)
	case <-time.After(200 * time.Millisecond):
	}
	close(release)
	<-returned
	<-confirmed
}

// TestConfirmRefusesAnAnswerOlderThanTheLease: promised (Confirm): a
// holder paused past its renewals "learns that the lease is gone before it
// acts rather than after".
//
// Here Confirm asks the store (the lease was last renewed 0.7 of it ago),
// the store answers "held" (it extends the lease to a lease from when it
// got the renewal), and the process is paused right after the answer
// arrived, for 1.5 leases, before Confirm returns: by the time the holder
// reads the answer, the lease that answer granted has run out and another
// holder may have taken it (effects TestPausedWhileConfirmingSendsNothing:
// it did). Confirm, which timed the renewal's send, does not take an
// answer older than two thirds of the lease as a go-ahead: it asks again,
// and a second stale answer loses the lease.
func TestConfirmRefusesAnAnswerOlderThanTheLease(t *testing.T) {
	t.Parallel()
	const lease = 300 * time.Millisecond
	var pause atomic.Bool
	l := KeepFrom(context.Background(), time.Now().Add(-lease*7/10), lease, func(context.Context, time.Duration) (bool, error) {
		if pause.Load() {
			time.Sleep(lease * 3 / 2) // the process paused after the store's answer arrived: the pause's length
		}
		return true, nil
	})
	defer l.Stop()
	pause.Store(true)
	start := time.Now()
	err := l.Confirm()
	if took := time.Since(start); err == nil && took >= lease {
		t.Fatalf("Confirm returned nil %v after it asked the store, past the lease of %v its answer granted; want ErrLost (or a fresh ask)", took.Round(time.Millisecond), lease)
	}
}
