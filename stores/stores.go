// Package stores defines the contract between the idempotency middleware and
// the place it keeps the records of messages whose effect happened.
//
// The contract is one interface, [Store]: every call returns what a
// decision needs in one round trip (a claim taken, or the record that stood
// in its way with its fingerprint, kept value and expiry).
//
// A claim is a lease that says "my holder is alive", not "my holder will
// be done within the lease": its holder renews it with [Store.Extend] while
// it works (the middleware does, every third of the lease), so the lease
// only bounds how long a dead holder goes unnoticed. A holder that lost its
// claim (not renewed in time, and taken by another) finds out from Extend,
// and its Remember is refused ([ErrClaimTaken]) rather than written over
// the claim of the delivery that now runs the key.
//
// A store also keeps what became of a message that did not succeed
// ([Store.Fail]): how often it failed, across deliveries, processes and
// restarts, so that a retry budget is one per message and not one per
// delivery; and whether it ended (dead-lettered for good), so that a
// redelivery of it is acknowledged without running and without a second
// dead letter, until an operator sends it back on purpose
// ([Store.Reopen]). What a store
// cannot do it says through [Store.Capabilities], never through optional
// interfaces found by type assertion. One more interface, [TxStore], is for
// stores that can write a record inside the caller's database transaction
// (the consumer inbox).
//
// A store of your own that knows only the three calls of the BabelQueue
// contract (Seen, Remember, Forget: see [SeenSet]) plugs in through
// [FromSeenSet], as a post-success seen-set without claims.
//
// Shipped implementations live in their own packages: memstore (in-process,
// the reference), redisstore, postgresstore and sdkstore (the BabelQueue
// SDKs' layouts). Package storetest proves any implementation, your own
// included, against this contract.
package stores

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/base64"
	"errors"
	"time"
)

// Store keeps the records of keys whose effect happened, and the in-flight
// claims of keys being handled. Implementations are safe for concurrent
// use; a call whose context is done returns an error.
//
// The holder of a claim is named by the token in the context
// ([WithClaimToken]): Release drops a claim only when the caller's token is
// the one that took it, so a delivery whose lease ran out can never drop the
// claim another delivery took after it. A call whose context names no
// holder acts for the store instance it is made on, a holder of its own (a
// random token per instance, see [NewClaimToken]): two instances, on two
// workers, never release each other's claims. Calls without a token on one
// instance are one holder and do not exclude each other; give each
// concurrent caller a token of its own (the middleware gives one to every
// delivery).
type Store interface {
	// Claim takes the in-flight claim on key for lease and reports whether
	// it did. When it did not, found is the record in its way: remembered
	// (with the kept fingerprint and value) or in flight under another
	// holder's lease. A store may report StateUnknown for a key remembered
	// or released a moment ago by a concurrent call; the caller then looks
	// again later.
	//
	// A live claim of the caller's own holder reports true and keeps its
	// lease: a claim sent again after its reply was lost finds the claim its
	// first sending took. A claim whose lease has passed can be taken again.
	// Leases of any length are accepted: one beyond what the store can
	// represent lasts as long as it can, never wraps into the past. A store
	// without claims (Capabilities().Claims false) returns an error matching
	// ErrNotSupported.
	//
	// A failing record (see Fail) is claimed: found is then that record,
	// its Failure telling how often the key failed before, and the claim
	// keeps it. Otherwise a claim taken returns found empty. An ended
	// record is not claimed: found is the end.
	Claim(ctx context.Context, key string, lease time.Duration) (claimed bool, found Record, err error)

	// Lookup returns the record held for key: remembered (with its
	// fingerprint and value), in flight, or StateUnknown when there is no
	// live record (never seen, forgotten, expired or released). ExpiresAt
	// is filled where the store can tell it in the same round trip.
	Lookup(ctx context.Context, key string) (Record, error)

	// Remember records key as done and keeps fingerprint (the message's
	// content fingerprint, 0 for none) and value (nil for none) with it, in
	// the form Capabilities says. It replaces the caller's own claim (the
	// holder of ctx, as for Claim), a lapsed claim, a record, or nothing
	// (the seen-set's path), but never another holder's live claim: it
	// then writes nothing and returns an error matching ErrClaimTaken (the
	// caller lost its claim, and another delivery now runs the key).
	// Remembering a key twice is not an error: the last call's fingerprint
	// and value win. A store that keeps values refuses one longer than
	// Capabilities().MaxValue with an error matching ErrValueTooLarge, and
	// writes nothing; one that keeps none (MaxValue 0) ignores value.
	Remember(ctx context.Context, key string, fingerprint uint64, value []byte) error

	// Extend extends the caller's live claim on key (the holder of ctx, as
	// for Claim) to lease from now, and reports whether it did. held is
	// false, and nothing is written, when key holds no live claim of this
	// holder: another holder's claim, a remembered record, nothing, or a
	// claim of this holder whose lease has passed (a store that drops
	// lapsed claims cannot tell one from none, so no store counts it
	// held). It is how a holder keeps its claim alive while it works:
	// renewed well before its lease runs out, a claim lasts as long as its
	// holder, and the lease only bounds how long a dead holder goes
	// unnoticed. Leases are accepted as by Claim. A store without claims
	// returns an error matching ErrNotSupported.
	Extend(ctx context.Context, key string, lease time.Duration) (held bool, err error)

	// Release drops the caller's uncommitted claim on key, so a redelivery
	// can run at once. It never drops a remembered key nor a claim taken by
	// another holder. Releasing a claim that is not held is not an error.
	Release(ctx context.Context, key string) error

	// Forget removes key, remembered, claimed, failing or ended, so that a
	// later delivery runs again. Forgetting an unknown key is not an error.
	Forget(ctx context.Context, key string) error

	// Fail records that key's runs failed, with the fingerprint of its
	// message (0 for none): f.Attempts failed runs in all (this one
	// included), the first at f.FirstFailure, the next not before
	// f.NotBefore; and, when f.End is set, that the message ended there
	// (dead-lettered for good).
	//
	// Without an end, the caller's own live claim (the holder of ctx, as
	// for Claim) stays held and carries the count from then on: the
	// holder may run the key again without a window in which another
	// takes it, and a holder that dies leaves the count behind when its
	// claim lapses. Where the caller holds no claim (a lapsed one, a
	// failing or ended record, nothing: the seen-set's and the
	// transactional mode's path) a failing record is written. With an end,
	// the caller's claim is dropped and the ended record written. Either
	// record lasts as long as a remembered one (Capabilities().TTL).
	//
	// It never replaces another holder's live claim: it then writes
	// nothing and returns an error matching ErrClaimTaken. It never
	// replaces a remembered record either: the effect happened, and that
	// is what the key keeps (nil is returned, nothing written).
	//
	// A failing record is claimed like no record at all: Claim takes it,
	// keeps its fields with the claim and returns them in found; Release
	// of a claim that carries a count leaves the failing record behind.
	// An ended record is not claimed: Claim returns it in found, until
	// Reopen or Forget drops it. Lookup reports a failing or ended record,
	// and a claim that carries a count as in flight with the count. A
	// store without failures (Capabilities().Failures false) returns an
	// error matching ErrNotSupported.
	Fail(ctx context.Context, key string, fingerprint uint64, f Failure) error

	// Reopen drops key's ended record when its End.Marker is marker, and
	// reports whether it did: a message an operator sent back on purpose
	// (a redrive) runs again with a fresh count, while a redelivery of
	// the very message that ended stays ended. Two deliveries of one
	// redriven message cannot both reopen: the second finds nothing to
	// drop. Nothing else is ever dropped. A store without failures returns
	// an error matching ErrNotSupported.
	Reopen(ctx context.Context, key string, marker string) (reopened bool, err error)

	// Capabilities tells what the store can do and keep. It is constant for
	// a store's lifetime and costs no I/O.
	Capabilities() Capabilities
}

// Capabilities tells what a [Store] can do and what it keeps with a record.
type Capabilities struct {
	// Claims reports that Claim, Extend and Release work. A store without them is a
	// post-success seen-set: two concurrent deliveries of one message may
	// both run.
	Claims bool
	// TTL is how long a remembered key is kept; 0 means forever. A
	// retention beyond what the store can represent means as long as it
	// can: it never wraps into a record born expired.
	TTL time.Duration
	// Fingerprint maps a content fingerprint to the form the store keeps it
	// in with a record that keeps no value (a store may keep fewer bits
	// there, where a record costs the least), to compare with the
	// fingerprint a Lookup or Claim returns. It returns 0 only for 0. A
	// record that keeps a value (a saved answer replayed to whoever reuses
	// the key) keeps all 64 bits, whatever Fingerprint says: fewer would
	// hand one caller another's answer. Compare with Matches, which takes
	// either form. Nil when the store keeps no fingerprints: a meta.id
	// reused for other content then goes unnoticed.
	Fingerprint func(uint64) uint64
	// MaxValue is the longest value, in bytes, Remember keeps with a
	// record; 0 when the store keeps no values.
	MaxValue int
	// Failures reports that Fail and Reopen work: the store keeps how
	// often a message failed across deliveries, and which messages ended
	// (dead-lettered for good), so that a redelivery neither runs a spent
	// message again nor dead-letters it twice. A store without them (a
	// three-method seen-set) counts nothing across deliveries.
	Failures bool
	// Local reports that the store's records live in this process and die
	// with it (an in-memory store): a claim cannot outlive the process of
	// its holder, so a holder need not keep it alive. The middleware then
	// claims for as long as the delivery holds the claim (a lease the store
	// saturates at its longest) and renews nothing: the claim is released
	// or replaced by the record when the delivery ends, and goes with the
	// process if it dies.
	Local bool
}

// KeptFingerprint returns fingerprint as c keeps it, or 0 when c keeps no
// fingerprints.
func (c Capabilities) KeptFingerprint(fingerprint uint64) uint64 {
	if c.Fingerprint == nil {
		return 0
	}
	return c.Fingerprint(fingerprint)
}

// Matches reports whether kept, the fingerprint a Lookup, Claim or
// RememberTx returned with a record, can be that of content with
// fingerprint: kept is fingerprint itself (a record with a value, or a
// store that keeps all 64 bits) or its reduced form (Fingerprint). It
// reports true when either is 0: there is nothing to compare. Content other
// than the record's matches a record with a value only when its 64-bit
// fingerprint is the record's or the record's fingerprint happens to be its
// reduced form (for a reduced form of 2 to 9999, 1 in 2^64/9998, about 5 in
// 10^16); it matches a record without a value when the reduced forms agree.
func (c Capabilities) Matches(kept, fingerprint uint64) bool {
	if kept == 0 || fingerprint == 0 || kept == fingerprint {
		return true
	}
	return c.Fingerprint != nil && kept == c.Fingerprint(fingerprint)
}

// KeepAllBits is Capabilities.Fingerprint of a store that keeps all 64 bits.
func KeepAllBits(fingerprint uint64) uint64 { return fingerprint }

// TxStore is a Store that can also write a record inside the caller's
// database transaction, so that the record and the handler's own writes
// commit or roll back together (the consumer inbox).
type TxStore interface {
	Store
	// RememberTx records key in tx with fingerprint (0: none) and value
	// (nil: none; refused over Capabilities().MaxValue as Remember does),
	// and reports whether this transaction recorded it (true) or found it
	// remembered already (false: a duplicate, with the record found). While
	// another transaction holds an uncommitted record of the same key,
	// RememberTx waits for it: if it commits, the result is false; if it
	// rolls back, this transaction records the key. A live claim of
	// another holder (a delivery running the key under Claim) is not taken
	// over, as by Remember: the result is false with found in flight (no
	// error; the caller rolls back). The caller's own
	// claim (the holder of ctx, as for Claim), a lapsed claim or an expired
	// record is replaced by the record.
	RememberTx(ctx context.Context, tx *sql.Tx, key string, fingerprint uint64, value []byte) (recorded bool, found Record, err error)
}

// Errors of the contract.
var (
	// ErrNotSupported is matched by a call a store cannot serve (Claim on a
	// seen-set).
	ErrNotSupported = errors.New("not supported by this store")
	// ErrValueTooLarge is matched when Remember is given a value longer
	// than the store keeps.
	ErrValueTooLarge = errors.New("value too large for this store")
	// ErrClaimTaken is matched by the error of a Remember that found
	// another holder's live claim on its key and wrote nothing: the caller
	// had lost its claim (its lease passed) and another delivery took it.
	ErrClaimTaken = errors.New("the key is claimed by another holder")
)

// State is what a store holds for a key.
type State int

// The states of a key.
const (
	StateUnknown    State = iota // no live record: never seen, forgotten, expired or released
	StateInFlight                // claimed by a delivery that has not finished
	StateRemembered              // its effect happened
	StateFailing                 // its runs failed, none holds it now: Record.Failure says how often
	StateEnded                   // it ended without success (dead-lettered for good): Record.Failure.End says how
)

// String returns "unknown", "in flight", "remembered", "failing" or
// "ended".
func (s State) String() string {
	switch s {
	case StateInFlight:
		return "in flight"
	case StateRemembered:
		return "remembered"
	case StateFailing:
		return "failing"
	case StateEnded:
		return "ended"
	}
	return "unknown"
}

// Record describes what a store holds for a key.
type Record struct {
	State State
	// ExpiresAt is when the record or claim lapses; zero when it does not,
	// or when the store could not tell in the same round trip.
	ExpiresAt time.Time
	// Fingerprint is the fingerprint kept with a remembered key: all 64
	// bits with a value, else in the store's form
	// (Capabilities.Fingerprint); 0 when none was kept. Compare it with
	// Capabilities.Matches.
	Fingerprint uint64
	// Value is the value kept with a remembered key; nil when none was.
	// It is the caller's: a store never hands two callers one slice.
	Value []byte
	// Failure is what a failing or ended record keeps (see Store.Fail),
	// and what a claim taken over a failing record carried on: how often
	// the key's runs failed, since when, and (ended) how it ended. Its
	// Fingerprint is in Fingerprint above. Zero for every other record.
	Failure Failure
}

// Failure is how often a key's runs failed, across deliveries, processes
// and restarts, and, once it ended, how (see Store.Fail).
type Failure struct {
	// Attempts is the number of failed runs recorded.
	Attempts int
	// FirstFailure is when the first of them failed (to the millisecond).
	FirstFailure time.Time
	// NotBefore is when the next run may start at the earliest (the
	// backoff); zero: at once.
	NotBefore time.Time
	// End is set when the message ended without success: dead-lettered
	// for good after its last run, rejected, or refused.
	End *End
}

// End is how a message ended without success.
type End struct {
	// Reason is the dead_letter reason ("failed", "rejected", "conflict",
	// "too_old", …).
	Reason string
	// At is when it ended (to the millisecond).
	At time.Time
	// Topic is the dead-letter topic its last delivery was moved to; ""
	// when not known.
	Topic string
	// Marker is the redrive marker of the delivery that ended ("" for a
	// message never redriven): a redelivery of that very delivery carries
	// it again, a later redrive another (see Store.Reopen).
	Marker string
}

// Remembered reports whether r is a remembered record.
func (r Record) Remembered() bool { return r.State == StateRemembered }

// Ended reports whether r is an ended record.
func (r Record) Ended() bool { return r.State == StateEnded }

// Seen reports whether key is remembered in s: the BabelQueue contract's
// Seen, on any Store.
func Seen(ctx context.Context, s Store, key string) (bool, error) {
	r, err := s.Lookup(ctx, key)
	return r.Remembered(), err
}

type txKey struct{}

// WithTx returns a copy of ctx carrying the transaction a handler must do its
// writes in (see TxFromContext).
func WithTx(ctx context.Context, tx *sql.Tx) context.Context {
	return context.WithValue(ctx, txKey{}, tx)
}

// TxFromContext returns the transaction carried by ctx. Under the
// idempotency middleware's transactional mode, a handler does its writes
// through it so that they commit together with the message's record.
func TxFromContext(ctx context.Context) (*sql.Tx, bool) {
	tx, ok := ctx.Value(txKey{}).(*sql.Tx)
	return tx, ok && tx != nil
}

type claimTokenKey struct{}

// tokenContext carries a claim holder's token: one allocation, where
// context.WithValue would box the string in a second one.
type tokenContext struct {
	context.Context
	token string
}

func (c *tokenContext) Value(key any) any {
	if key == (claimTokenKey{}) {
		return c
	}
	return c.Context.Value(key)
}

// WithClaimToken returns a copy of ctx that names the holder of the claims
// taken with it. The middleware gives every delivery a token of its own;
// callers of Claim outside the middleware should do the same.
func WithClaimToken(ctx context.Context, token string) context.Context {
	return &tokenContext{Context: ctx, token: token}
}

// ClaimToken returns the claim holder's token carried by ctx, or "" when
// ctx names none (the store instance is then the holder).
func ClaimToken(ctx context.Context) string {
	if c, ok := ctx.Value(claimTokenKey{}).(*tokenContext); ok {
		return c.token
	}
	return ""
}

// NewClaimToken returns a random token (96 bits, 16 characters of base64url)
// for a holder of claims that has no name of its own: a store instance
// acting for the callers whose context names no holder.
func NewClaimToken() string {
	var b [12]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand)
	return base64.RawURLEncoding.EncodeToString(b[:])
}
