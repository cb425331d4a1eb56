package idempotency

import (
	"math/rand/v2"
	"time"
)

// Retries is a message's retry budget (WithRetries): how many times it may
// run again after a failed run, how long to wait before each, and until
// when, counted in the store across deliveries, processes and restarts.
// The zero value of a field takes its default.
type Retries struct {
	// Max is how many times a message may run again after a failed run:
	// it runs at most 1+Max times in all. Zero: it runs once.
	Max int
	// Backoff is the wait before the first retry (default 100ms); each
	// later wait doubles, up to MaxBackoff.
	Backoff time.Duration
	// MaxBackoff bounds a wait (default 10s).
	MaxBackoff time.Duration
	// Jitter is the part of each wait drawn at random, so that messages
	// that failed together do not all come back together: a wait of d is
	// between (1-Jitter)×d and d. Zero takes the default, 0.5; a negative
	// value turns jitter off.
	Jitter float64
	// Deadline bounds the retries in time: no run starts later than
	// Deadline after the message's first failed run (0: no bound). A
	// message that would wait past it fails for good at once.
	Deadline time.Duration
	// Retryable reports whether a run that failed with err may run again
	// (default: it is not a permanent rejection, IsPermanent). A failure
	// it refuses ends the message at once.
	Retryable func(err error) bool
}

// withDefaults returns r with every zero field at its default.
func (r Retries) withDefaults() Retries {
	if r.Backoff == 0 {
		r.Backoff = 100 * time.Millisecond
	}
	if r.MaxBackoff == 0 {
		r.MaxBackoff = 10 * time.Second
	}
	r.MaxBackoff = max(r.MaxBackoff, r.Backoff)
	switch {
	case r.Jitter == 0:
		r.Jitter = 0.5
	case r.Jitter < 0:
		r.Jitter = 0
	}
	r.Jitter = min(r.Jitter, 1)
	if r.Retryable == nil {
		r.Retryable = func(err error) bool { return !IsPermanent(err) }
	}
	return r
}

// wait returns the wait before the retry that follows failed runs in all
// (1 for the first retry): Backoff doubled failed-1 times, at most
// MaxBackoff, less a random part of up to Jitter of it.
func (r Retries) wait(failed int) time.Duration {
	d := r.longest(failed)
	if r.Jitter > 0 {
		d -= time.Duration(rand.Float64() * r.Jitter * float64(d))
	}
	return d
}

// longest is the longest wait wait(failed) returns: the wait without its
// jitter.
func (r Retries) longest(failed int) time.Duration {
	d := r.Backoff
	for i := 1; i < failed && d < r.MaxBackoff; i++ {
		d *= 2
	}
	return min(d, r.MaxBackoff)
}

// WithRetries gives every message a retry budget counted in the store, not
// per delivery: a message whose run fails runs again in place, after a
// growing wait with jitter, at most 1+r.Max times in all, whatever the
// broker does (redeliveries after a lost ack, a deadline, a rebalance, a
// restart or a crash count against the same budget), and no later than
// r.Deadline after its first failed run. A panic in the handler is a
// failed run like an error (recovered, with its stack in the error). The
// claim is kept from one run to the next, so no other delivery runs the
// message in between.
//
// When the budget is spent, or a run fails with an error r.Retryable
// refuses (a permanent rejection, by default), the delivery fails with an
// error matching ErrExhausted (or the permanent error), which is final: put
// the dead-letter middleware (package deadletter) outside the guard and
// the message goes to its dead-letter topic once. The guard holds the
// message's claim until the router acked that, then remembers the
// message's end in the store: a redelivery of it is acked without running
// and without a second dead letter, until an operator redrives it (the
// redrive marks the message, and the marked copy runs again with a fresh
// budget) or forgets it.
//
// Retries in place stay inside the time the broker lets one delivery last
// (WithDeliveryLimit, or a deadline on the message's context): when the
// next run would not fit, the delivery ends with ErrRetryLater (transient:
// nacked, never dead-lettered) and the next delivery goes on with the
// budget the store kept, after the rest of its wait.
//
// It replaces Watermill's Retry middleware in the production wiring; a
// Retry kept outside the guard would only retry what the guard says is
// worth it (see Retryable). Without WithRetries the guard lets the claim go
// after every failed run and writes the end only once the router acked the
// dead-lettered delivery: a copy delivered in between (a duplicate the
// producer sent while the dead letter was published) runs again. It needs a store that keeps failures
// (stores.Capabilities.Failures); with one that does not (a three-method
// seen-set), the budget is counted within one delivery only.
func WithRetries(r Retries) Option {
	return func(c *config) { c.retries, c.retriesSet = r, true }
}

// WithDeliveryLimit tells the guard how long the broker lets one delivery
// last before it takes the message back or cancels its context: NATS
// JetStream's AckWait (watermill-nats's AckWaitTimeout), a Redis Streams
// consumer group's claim of idle entries (watermill-redisstream's
// MaxIdleTime), a queue's visibility timeout. The guard keeps what it
// decides on its own inside it: the wait for a copy in flight elsewhere
// (WithParkWait), the waits between retries and the retries themselves
// (WithRetries), ending the delivery cleanly with ErrRetryLater when the
// next run would not fit. A deadline on the message's context
// (watermill-sql's AckDeadline sets one) is taken into account without
// this option. The handler's own run is never cut short by the guard: a
// handler that may run longer than the broker's deadline needs the broker
// configured for it (the broker pages under docs/brokers say how).
func WithDeliveryLimit(d time.Duration) Option {
	return func(c *config) { c.deliveryLimit = d }
}
