// Package memstore is the in-process reference implementation of
// [stores.Store], [stores.Claimer] and [stores.Expiring].
//
// It suits tests, the broker-free example and single-process consumers. Its
// records live in the process: a restart forgets them, and two processes do
// not share them. Use redisstore or postgresstore for a fleet.
//
// With [WithTTL], memory stays bounded by the retention without a goroutine
// per entry, or any goroutine at all: expired records are removed, oldest
// first, by the writes that follow, at an amortised constant cost per write.
// A Store therefore has nothing to close.
package memstore

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
)

// Store is an in-memory store, safe for concurrent use. Build it with [New].
type Store struct {
	ttl time.Duration

	mu      sync.RWMutex
	entries map[string]entry
	// Expiry queues, in insertion order. Remembered records share one TTL,
	// so their queue is in expiry order; claims usually share one lease.
	remembered expiryQueue
	claims     expiryQueue
}

var (
	_ stores.Store         = (*Store)(nil)
	_ stores.Claimer       = (*Store)(nil)
	_ stores.Expiring      = (*Store)(nil)
	_ stores.Inspector     = (*Store)(nil)
	_ stores.Fingerprinter = (*Store)(nil)
)

type entry struct {
	expires     int64  // Unix nanoseconds; 0 means never
	token       string // the claim holder's token
	claimed     bool   // a claim, not a remembered record
	fingerprint uint64 // of the remembered message; 0: none
}

func (e entry) live(now int64) bool { return e.expires == 0 || e.expires > now }

// Option configures a Store.
type Option func(*Store)

// WithTTL makes remembered keys expire after ttl. Zero (the default) keeps
// them until they are forgotten.
func WithTTL(ttl time.Duration) Option { return func(s *Store) { s.ttl = ttl } }

// New returns an empty Store. It panics if the TTL is negative.
func New(opts ...Option) *Store {
	s := &Store{entries: make(map[string]entry)}
	for _, opt := range opts {
		opt(s)
	}
	if s.ttl < 0 {
		panic(fmt.Sprintf("memstore: negative TTL %v", s.ttl))
	}
	return s
}

// TTL returns the retention of remembered keys; 0 means forever.
func (s *Store) TTL() time.Duration { return s.ttl }

// Seen reports whether key is remembered and not expired.
func (s *Store) Seen(ctx context.Context, key string) (bool, error) {
	seen, _, err := s.SeenFingerprint(ctx, key)
	return seen, err
}

// SeenFingerprint is Seen, also returning the fingerprint kept with key.
func (s *Store) SeenFingerprint(ctx context.Context, key string) (bool, uint64, error) {
	if err := ctx.Err(); err != nil {
		return false, 0, err
	}
	s.mu.RLock()
	e, ok := s.entries[key]
	s.mu.RUnlock()
	if !ok || e.claimed || (e.expires != 0 && !e.live(time.Now().UnixNano())) {
		return false, 0, nil
	}
	return true, e.fingerprint, nil
}

// Remember records key, replacing any claim on it.
func (s *Store) Remember(ctx context.Context, key string) error {
	return s.RememberFingerprint(ctx, key, 0)
}

// RememberFingerprint records key with the fingerprint of its message.
func (s *Store) RememberFingerprint(ctx context.Context, key string, fingerprint uint64) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	now := time.Now().UnixNano()
	var expires int64
	if s.ttl > 0 {
		expires = now + int64(s.ttl)
	}
	s.mu.Lock()
	s.expireLocked(now)
	s.entries[key] = entry{expires: expires, fingerprint: fingerprint}
	if expires != 0 {
		s.remembered.push(key, expires)
	}
	s.mu.Unlock()
	return nil
}

// KeptFingerprint returns fingerprint: the store keeps all 64 bits.
func (s *Store) KeptFingerprint(fingerprint uint64) uint64 { return fingerprint }

// Forget removes key, remembered or claimed.
func (s *Store) Forget(ctx context.Context, key string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	delete(s.entries, key)
	s.mu.Unlock()
	return nil
}

// Claim takes the in-flight claim on key for lease, for the holder named by
// [stores.ClaimToken] of ctx. It returns an error if lease is not positive.
func (s *Store) Claim(ctx context.Context, key string, lease time.Duration) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	if lease <= 0 {
		return false, fmt.Errorf("memstore: claim lease must be positive, got %v", lease)
	}
	token := stores.ClaimToken(ctx)
	now := time.Now().UnixNano()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.expireLocked(now)
	if e, ok := s.entries[key]; ok && e.live(now) {
		return false, nil
	}
	expires := now + int64(lease)
	s.entries[key] = entry{expires: expires, token: token, claimed: true}
	s.claims.push(key, expires)
	return true, nil
}

// Release drops the caller's claim on key; see [stores.Claimer].
func (s *Store) Release(ctx context.Context, key string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	token := stores.ClaimToken(ctx)
	s.mu.Lock()
	if e, ok := s.entries[key]; ok && e.claimed && (token == "" || e.token == token) {
		delete(s.entries, key)
	}
	s.mu.Unlock()
	return nil
}

// Inspect reports the record held for key.
func (s *Store) Inspect(ctx context.Context, key string) (stores.Record, error) {
	if err := ctx.Err(); err != nil {
		return stores.Record{}, err
	}
	now := time.Now().UnixNano()
	s.mu.RLock()
	e, ok := s.entries[key]
	s.mu.RUnlock()
	if !ok || !e.live(now) {
		return stores.Record{}, nil
	}
	r := stores.Record{State: stores.StateRemembered}
	if e.claimed {
		r.State = stores.StateInFlight
	}
	if e.expires != 0 {
		r.ExpiresAt = time.Unix(0, e.expires)
	}
	return r, nil
}

// Len returns the number of records held, claims included, counting expired
// ones that the next write has not yet removed.
func (s *Store) Len() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return len(s.entries)
}

// expireLocked removes the records whose time has come. A queued item whose
// record was since replaced, forgotten or released is skipped.
func (s *Store) expireLocked(now int64) {
	s.remembered.popExpired(now, s.entries)
	s.claims.popExpired(now, s.entries)
}

type queued struct {
	key string
	at  int64
}

// expiryQueue is a FIFO of (key, expiry) with amortised O(1) push and pop.
type expiryQueue struct {
	items []queued
	head  int
}

func (q *expiryQueue) push(key string, at int64) {
	q.items = append(q.items, queued{key: key, at: at})
}

// popExpired pops items from the head while their time has come, deleting
// each one's record from entries unless the record changed since.
func (q *expiryQueue) popExpired(now int64, entries map[string]entry) {
	for q.head < len(q.items) && q.items[q.head].at <= now {
		it := q.items[q.head]
		q.items[q.head] = queued{}
		q.head++
		if e, ok := entries[it.key]; ok && e.expires == it.at {
			delete(entries, it.key)
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
