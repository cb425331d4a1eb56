package idempotency

import (
	"sync"
	"sync/atomic"
	"time"
)

// runLengths remembers, per key, how long the last failed run of a
// message took in this process, while the message still has runs left,
// so that a later delivery does not start a run that cannot end before
// the broker's deadline (watermill-sql hands a nacked message back under
// the deadline of its first delivery, NATS JetStream's AckWait runs on):
// such a run would be cut short and counted, or run on past the deadline
// beside the message's next delivery.
//
// A delivery left with too little time is held instead (as long as fits)
// and handed back without running, once per failed run: the next delivery
// runs whatever it is left with, so a message never waits for ever on a
// length no delivery can give. Only runs that ended by themselves are
// remembered; their length fits a fresh delivery, as it did theirs. The
// table is bounded (maxRunLengths); an empty one costs the hot path one
// atomic load.
type runLengths struct {
	n  atomic.Int32 // entries in m
	mu sync.Mutex
	m  map[string]runLength
}

// runLength is the length of a message's last failed run, and whether a
// delivery was held for it already.
type runLength struct {
	took time.Duration
	held bool
}

// maxRunLengths bounds the messages remembered: past it, an arbitrary
// entry makes room (a message that stopped coming back to this process).
const maxRunLengths = 4096

// put remembers that the last failed run of key took took.
func (r *runLengths) put(key string, took time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.m == nil {
		r.m = make(map[string]runLength)
	}
	if _, ok := r.m[key]; !ok && len(r.m) >= maxRunLengths {
		for k := range r.m {
			delete(r.m, k)
			break
		}
	}
	r.m[key] = runLength{took: took}
	r.n.Store(int32(len(r.m)))
}

// forget drops what is remembered of key: it succeeded, or ended.
func (r *runLengths) forget(key string) {
	if r.n.Load() == 0 {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.m, key)
	r.n.Store(int32(len(r.m)))
}

// hold reports whether a delivery that ends at end (its hard limit; zero:
// none) must not start a run of key now, and notes that it was held: the
// last failed run of key took longer than is left, and no delivery was
// held for that run yet.
func (r *runLengths) hold(key string, end time.Time) bool {
	if end.IsZero() || r.n.Load() == 0 {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	l, ok := r.m[key]
	if !ok || l.held || !time.Now().Add(l.took).After(end) {
		return false
	}
	l.held = true
	r.m[key] = l
	return true
}
