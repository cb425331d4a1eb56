// Package memstore is the in-process reference implementation of
// [stores.Store]: claims, a TTL, fingerprints, values and failures (how
// often a message failed, and which ended).
//
// It suits tests, the broker-free example and single-process consumers. Its
// records live in the process: a restart forgets them, and two processes do
// not share them. Use redisstore or postgresstore for a fleet.
//
// With [WithTTL], memory stays bounded by the retention without a goroutine
// per entry, or any goroutine at all: expired records are removed, oldest
// first, by the writes that follow, at an amortised constant cost per write.
// Claims that ended (released, or replaced by a record) and records
// forgotten or replaced hold no memory beyond a bounded slack, whatever
// their lease or retention. A Store therefore has nothing to close.
package memstore

import (
	"bytes"
	"context"
	"fmt"
	"iter"
	"math"
	"sync"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
)

// Store is an in-memory store, safe for concurrent use. Build it with [New].
type Store struct {
	ttl time.Duration

	mu sync.RWMutex
	// Remembered records and in-flight claims live apart: a record is two
	// words, and lookups of remembered keys never touch claims.
	records  map[string]record
	claims   map[string]claim
	values   map[string][]byte // of the records that keep one
	failures map[string]failing
	// Expiry queues, in insertion order. Remembered records share one TTL,
	// so their queue is in expiry order; claims usually share one lease.
	recordQueue  expiryQueue
	claimQueue   expiryQueue
	failureQueue expiryQueue

	wall  func() time.Time // the wall clock (a test sets its own), read once
	start time.Time        // the wall clock when the store was made, with the monotonic clock
}

var _ stores.Store = (*Store)(nil)

// record is a remembered record; its value, if it keeps one, is in the
// store's values map (empty in most stores: records stay 16 bytes).
type record struct {
	expires     int64  // Unix nanoseconds; 0 means never
	fingerprint uint64 // of the remembered message; 0: none
}

type claim struct {
	expires int64    // Unix nanoseconds
	token   string   // the holder's token
	carried *failing // the failing record the claim took over; nil: none
}

// failing is a failing or ended record (Store.Fail): rare, so kept apart.
type failing struct {
	expires     int64 // Unix nanoseconds; 0 means never
	fingerprint uint64
	f           stores.Failure
}

// record describes f as a stores.Record.
func (f *failing) record() stores.Record {
	out := stores.Record{State: stores.StateFailing, Fingerprint: f.fingerprint, Failure: f.f}
	if f.f.End != nil {
		out.State = stores.StateEnded
		end := *f.f.End // the caller's copy
		out.Failure.End = &end
	}
	if f.expires != 0 {
		out.ExpiresAt = time.Unix(0, f.expires)
	}
	return out
}

func live(expires, now int64) bool { return expires == 0 || expires > now }

// now is the store's time, in Unix nanoseconds: the wall clock when the
// store was made plus the monotonic time since. A step of the wall clock
// (NTP, a resumed VM) neither lapses a live claim or record at once nor
// keeps a lapsed one alive: leases and TTLs run on the monotonic clock.
func (s *Store) now() int64 { return s.start.UnixNano() + int64(time.Since(s.start)) }

// after returns now + d in Unix nanoseconds, saturating at the largest time
// an int64 holds (the year 2262) instead of wrapping into the past.
func after(now int64, d time.Duration) int64 {
	if int64(d) > math.MaxInt64-now {
		return math.MaxInt64
	}
	return now + int64(d)
}

// Option configures a Store.
type Option func(*Store)

// WithTTL makes remembered keys expire after ttl. Zero (the default) keeps
// them until they are forgotten. A ttl reaching past the year 2262 keeps
// them until then.
func WithTTL(ttl time.Duration) Option { return func(s *Store) { s.ttl = ttl } }

// New returns an empty Store. It panics if the TTL is negative.
func New(opts ...Option) *Store {
	s := &Store{records: make(map[string]record), claims: make(map[string]claim), values: make(map[string][]byte),
		failures: make(map[string]failing), wall: time.Now}
	for _, opt := range opts {
		opt(s)
	}
	if s.ttl < 0 {
		panic(fmt.Sprintf("memstore: negative TTL %v", s.ttl))
	}
	s.start = s.wall()
	return s
}

// Capabilities reports claims, the TTL, all 64 bits of fingerprints,
// values of up to MaxValue bytes and failures.
func (s *Store) Capabilities() stores.Capabilities {
	return stores.Capabilities{Claims: true, TTL: s.ttl, Fingerprint: stores.KeepAllBits, MaxValue: MaxValue, Failures: true, Local: true}
}

// MaxValue is the longest value the Store keeps with a record: 1 MiB.
const MaxValue = 1 << 20

// Lookup returns the record held for key.
func (s *Store) Lookup(ctx context.Context, key string) (stores.Record, error) {
	if err := ctx.Err(); err != nil {
		return stores.Record{}, err
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	// The clock is read only for an entry found: a key never seen, the
	// common case, costs one map lookup.
	if r, ok := s.records[key]; ok && (r.expires == 0 || live(r.expires, s.now())) {
		return s.recordLocked(key, r), nil
	}
	if len(s.claims) > 0 { // none in a seen-set
		if c, ok := s.claims[key]; ok && live(c.expires, s.now()) {
			return inFlight(c), nil
		}
	}
	if len(s.failures) > 0 {
		if f, ok := s.failures[key]; ok && live(f.expires, s.now()) {
			return f.record(), nil
		}
	}
	return stores.Record{}, nil
}

// inFlight describes the live claim c, with the failures it carries.
func inFlight(c claim) stores.Record {
	out := stores.Record{State: stores.StateInFlight, ExpiresAt: time.Unix(0, c.expires)}
	if c.carried != nil {
		out.Fingerprint, out.Failure = c.carried.fingerprint, c.carried.record().Failure
	}
	return out
}

// recordLocked describes the remembered record r of key.
func (s *Store) recordLocked(key string, r record) stores.Record {
	out := stores.Record{State: stores.StateRemembered, Fingerprint: r.fingerprint}
	if r.expires != 0 {
		out.ExpiresAt = time.Unix(0, r.expires)
	}
	if len(s.values) > 0 {
		if v, ok := s.values[key]; ok {
			out.Value = bytes.Clone(v) // the caller may change it
		}
	}
	return out
}

// Remember records key with the fingerprint and value of its message,
// replacing the caller's own claim, a lapsed one or a record; another
// holder's live claim is left alone (ErrClaimTaken).
func (s *Store) Remember(ctx context.Context, key string, fingerprint uint64, value []byte) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if len(value) > MaxValue {
		return fmt.Errorf("memstore: remember: a value of %d bytes: %w (at most %d)", len(value), stores.ErrValueTooLarge, MaxValue)
	}
	now := s.now()
	var expires int64
	if s.ttl > 0 {
		expires = after(now, s.ttl)
	}
	s.mu.Lock()
	s.expireLocked(now)
	if len(s.claims) > 0 {
		if c, ok := s.claims[key]; ok {
			if live(c.expires, now) && c.token != stores.ClaimToken(ctx) {
				s.mu.Unlock()
				return fmt.Errorf("memstore: remember: %w", stores.ErrClaimTaken)
			}
			delete(s.claims, key)
		}
	}
	if len(s.failures) > 0 {
		delete(s.failures, key)
	}
	r := record{expires: expires, fingerprint: fingerprint}
	if value != nil {
		s.values[key] = append([]byte{}, value...)
	} else if len(s.values) > 0 {
		delete(s.values, key)
	}
	s.records[key] = r
	if expires != 0 {
		s.recordQueue.push(key, expires)
		if s.recordQueue.len() > 2*len(s.records)+compactSlack {
			s.recordQueue.compact(func(key string, at int64) bool { return s.records[key].expires == at })
		}
	}
	s.mu.Unlock()
	return nil
}

// Forget removes key, remembered or claimed.
func (s *Store) Forget(ctx context.Context, key string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	s.deleteRecordLocked(key)
	delete(s.claims, key)
	delete(s.failures, key)
	s.mu.Unlock()
	return nil
}

func (s *Store) deleteRecordLocked(key string) {
	if _, ok := s.records[key]; ok {
		if len(s.values) > 0 {
			delete(s.values, key)
		}
		delete(s.records, key)
	}
}

// Claim takes the in-flight claim on key for lease, for the holder named by
// [stores.ClaimToken] of ctx (the Store itself when ctx names none), or
// returns the record in its way. A live claim of the same holder reports
// true and keeps its lease. It returns an error if lease is not positive.
func (s *Store) Claim(ctx context.Context, key string, lease time.Duration) (bool, stores.Record, error) {
	if err := ctx.Err(); err != nil {
		return false, stores.Record{}, err
	}
	if lease <= 0 {
		return false, stores.Record{}, fmt.Errorf("memstore: claim lease must be positive, got %v", lease)
	}
	token := stores.ClaimToken(ctx)
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.expireLocked(now)
	if r, ok := s.records[key]; ok {
		if live(r.expires, now) {
			return false, s.recordLocked(key, r), nil
		}
		s.deleteRecordLocked(key)
	}
	// The failing record the claim takes over: the store's own, or the one
	// a lapsed claim carried. An ended one is not taken.
	var carried *failing
	if len(s.failures) > 0 {
		if f, ok := s.failures[key]; ok && live(f.expires, now) {
			if f.f.End != nil {
				return false, f.record(), nil
			}
			carried = new(failing) // only here: the hot path allocates nothing for it
			*carried = f
		}
	}
	c, ok := s.claims[key]
	if ok && live(c.expires, now) {
		if c.token != token {
			return false, inFlight(c), nil
		}
		if c.carried != nil {
			return true, c.carried.record(), nil
		}
		return true, stores.Record{}, nil
	}
	if ok && c.carried != nil && live(c.carried.expires, now) {
		carried = c.carried
	}
	delete(s.failures, key)
	expires := after(now, lease)
	s.claims[key] = claim{expires: expires, token: token, carried: carried}
	s.claimQueue.push(key, expires)
	if s.claimQueue.len() > 2*len(s.claims)+compactSlack {
		s.claimQueue.compact(func(key string, at int64) bool { return s.claims[key].expires == at })
	}
	if carried == nil {
		return true, stores.Record{}, nil
	}
	return true, carried.record(), nil
}

// Extend extends the caller's live claim on key (the Store's own when ctx
// names no holder) to lease from now; held is false when key holds no live
// claim of this holder. It returns an error if lease is not positive.
func (s *Store) Extend(ctx context.Context, key string, lease time.Duration) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	if lease <= 0 {
		return false, fmt.Errorf("memstore: extend lease must be positive, got %v", lease)
	}
	token := stores.ClaimToken(ctx)
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	c, ok := s.claims[key]
	if !ok || c.token != token || !live(c.expires, now) {
		return false, nil
	}
	c.expires = after(now, lease)
	s.claims[key] = c
	s.claimQueue.push(key, c.expires)
	if s.claimQueue.len() > 2*len(s.claims)+compactSlack {
		s.claimQueue.compact(func(key string, at int64) bool { return s.claims[key].expires == at })
	}
	return true, nil
}

// Release drops the caller's claim on key (the Store's own when ctx names
// no holder); see [stores.Store].
func (s *Store) Release(ctx context.Context, key string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	token := stores.ClaimToken(ctx)
	s.mu.Lock()
	if c, ok := s.claims[key]; ok && c.token == token {
		delete(s.claims, key)
		if c.carried != nil && live(c.carried.expires, s.now()) {
			s.putFailureLocked(key, *c.carried) // the count outlives the claim
		}
	}
	s.mu.Unlock()
	return nil
}

// Fail records that key's runs failed (and, with f.End, that it ended);
// see [stores.Store]. It returns an error matching stores.ErrClaimTaken,
// writing nothing, when another holder's live claim is on key, and writes
// nothing over a remembered record.
func (s *Store) Fail(ctx context.Context, key string, fingerprint uint64, f stores.Failure) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	now := s.now()
	var expires int64
	if s.ttl > 0 {
		expires = after(now, s.ttl)
	}
	if f.End != nil {
		end := *f.End // the store's own copy
		f.End = &end
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.expireLocked(now)
	if r, ok := s.records[key]; ok && live(r.expires, now) {
		return nil
	}
	rec := failing{expires: expires, fingerprint: fingerprint, f: f}
	if c, ok := s.claims[key]; ok && live(c.expires, now) {
		if c.token != stores.ClaimToken(ctx) {
			return fmt.Errorf("memstore: fail: %w", stores.ErrClaimTaken)
		}
		if f.End == nil { // the holder keeps its claim, which carries the count
			c.carried = &rec
			s.claims[key] = c
			return nil
		}
	}
	delete(s.claims, key)
	s.putFailureLocked(key, rec)
	return nil
}

// Reopen drops key's ended record when its marker is marker; see
// [stores.Store].
func (s *Store) Reopen(ctx context.Context, key string, marker string) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	f, ok := s.failures[key]
	if !ok || f.f.End == nil || f.f.End.Marker != marker || !live(f.expires, s.now()) {
		return false, nil
	}
	delete(s.failures, key)
	return true, nil
}

// putFailureLocked keeps f as key's failing or ended record.
func (s *Store) putFailureLocked(key string, f failing) {
	s.failures[key] = f
	if f.expires != 0 {
		s.failureQueue.push(key, f.expires)
		if s.failureQueue.len() > 2*len(s.failures)+compactSlack {
			s.failureQueue.compact(func(key string, at int64) bool { return s.failures[key].expires == at })
		}
	}
}

// Len returns the number of records held, claims included, counting expired
// ones that the next write has not yet removed.
func (s *Store) Len() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return len(s.records) + len(s.claims) + len(s.failures)
}

// expireLocked removes the records and claims whose time has come. A queued
// item whose entry was since replaced, forgotten or released is skipped.
func (s *Store) expireLocked(now int64) {
	for key, at := range s.recordQueue.popExpired(now) {
		if r, ok := s.records[key]; ok && r.expires == at {
			s.deleteRecordLocked(key)
		}
	}
	for key, at := range s.claimQueue.popExpired(now) {
		if c, ok := s.claims[key]; ok && c.expires == at {
			delete(s.claims, key)
			if c.carried != nil && live(c.carried.expires, now) {
				s.putFailureLocked(key, *c.carried) // a lapsed claim leaves the count it took over
			}
		}
	}
	for key, at := range s.failureQueue.popExpired(now) {
		if f, ok := s.failures[key]; ok && f.expires == at {
			delete(s.failures, key)
		}
	}
}

type queued struct {
	key string
	at  int64
}

// expiryQueue is a FIFO of (key, expiry) with amortised O(1) push and pop.
//
// An item outlives the entry it was queued for when that entry is released,
// forgotten or replaced before its time, and an item waits behind those
// queued before it, whose time may come later (a claim of a longer lease).
// So that such items never hold memory (and their keys) for as long as the
// longest lease or retention, a queue holding more than twice as many items
// as the entries they stand for, plus compactSlack, is compacted: the items
// of entries that are gone or replaced are dropped. Each compaction at
// least halves the queue, so its cost is amortised over the pushes that
// filled it.
type expiryQueue struct {
	items []queued
	head  int
}

// compactSlack is how many stale items a queue may hold beyond twice its
// live entries before it is compacted.
const compactSlack = 1024

func (q *expiryQueue) push(key string, at int64) {
	q.items = append(q.items, queued{key: key, at: at})
}

func (q *expiryQueue) len() int { return len(q.items) - q.head }

// compact keeps, in order, the items for which live reports that the entry
// they were queued for is still there with that expiry, and drops the rest.
func (q *expiryQueue) compact(live func(key string, at int64) bool) {
	n := 0
	for _, it := range q.items[q.head:] {
		if live(it.key, it.at) {
			q.items[n] = it
			n++
		}
	}
	clear(q.items[n:])
	q.items = q.items[:n]
	q.head = 0
}

// popExpired yields the items at the head whose time has come, popping
// them.
func (q *expiryQueue) popExpired(now int64) iter.Seq2[string, int64] {
	return func(yield func(string, int64) bool) {
		for q.head < len(q.items) && q.items[q.head].at <= now {
			it := q.items[q.head]
			q.items[q.head] = queued{}
			q.head++
			if !yield(it.key, it.at) {
				break
			}
		}
		// Reuse the popped half of the slice once it is most of it.
		if q.head >= 1024 && q.head*2 >= len(q.items) {
			n := copy(q.items, q.items[q.head:])
			clear(q.items[n:])
			q.items = q.items[:n]
			q.head = 0
		}
	}
}
