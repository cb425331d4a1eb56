// Package parkwait paces a delivery that finds its work held by another
// holder (a message claimed by another delivery, an effect held by another
// attempt): it looks again after growing pauses, 20ms doubling up to
// 250ms, until a deadline, after which the caller parks the delivery. One
// pacing for the idempotency middleware and for effects, so that a broker
// that hands a nacked message straight back runs its handler about once per
// wait, not thousands of times a second.
package parkwait

import (
	"context"
	"time"
)

// The pauses between two looks.
const (
	FirstPause = 20 * time.Millisecond
	MaxPause   = 250 * time.Millisecond
)

// Waiter paces the looks of one delivery until its deadline. The zero value
// is not usable: use Until.
type Waiter struct {
	deadline time.Time
	pause    time.Duration
}

// Until returns a Waiter whose wait ends at deadline.
func Until(deadline time.Time) *Waiter {
	return &Waiter{deadline: deadline, pause: FirstPause}
}

// Pause waits for the next pause (never past the deadline) and reports
// whether the caller should look again: false once the deadline has passed
// or when ctx is done first.
func (w *Waiter) Pause(ctx context.Context) bool {
	left := time.Until(w.deadline)
	if left <= 0 {
		return false
	}
	t := time.NewTimer(min(w.pause, left))
	defer t.Stop()
	w.pause = min(2*w.pause, MaxPause)
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
