// Package stores defines the contract between the idempotency middleware and
// the place it remembers which messages already took effect.
//
// The required contract is [Store]: three methods keyed on an opaque key
// (the middleware passes a key scoped by handler, see
// middleware/idempotency). Any type honouring them works with the
// middleware. A store may also implement the optional capabilities the
// middleware detects: [Claimer] (an atomic in-flight claim with a lease),
// [Expiring] (remembered keys expire after a retention period),
// [TxRememberer] (the record is written in the handler's own database
// transaction), [Fingerprinter] (a fingerprint of the content is kept to
// catch a reused id) and [Inspector] (operators see a key's state).
//
// Shipped implementations live in their own packages: memstore (in-process,
// the reference), redisstore and postgresstore. Package storetest proves any
// implementation, including your own, against this contract.
package stores

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/base64"
	"time"
)

// Store remembers keys whose effect has happened. Implementations must be
// safe for concurrent use. A call whose context is done returns an error.
type Store interface {
	// Seen reports whether key was remembered (committed) and has not expired
	// or been forgotten. A key that is only claimed is not seen.
	Seen(ctx context.Context, key string) (bool, error)
	// Remember records key as done, replacing any claim on it. Remembering
	// a key twice is not an error.
	Remember(ctx context.Context, key string) error
	// Forget removes key, remembered or claimed, so that a later delivery
	// runs again. Forgetting an unknown key is not an error.
	Forget(ctx context.Context, key string) error
}

// Claimer is implemented by stores that can take an atomic in-flight claim on
// a key, so that two concurrent deliveries of one message never both run.
//
// The holder of a claim is identified by the token in the context
// ([WithClaimToken]): Release drops a claim only when the caller's token is
// the one that took it, so a delivery whose lease ran out can never drop the
// claim another delivery took after it. A call whose context names no holder
// acts for the store instance it is made on, a holder of its own (a random
// token per instance, see [NewClaimToken]): two instances, on two workers,
// never release each other's claims. Calls without a token on one instance
// are one holder, and do not exclude each other; give each concurrent
// caller a token of its own (the middleware gives one to every delivery).
type Claimer interface {
	// Claim takes the claim on key for lease and reports whether it did. It
	// fails (false, nil) while the key is remembered, or claimed by another
	// holder under a lease that has not passed. A live claim of the caller's
	// own holder reports true and keeps its lease: a claim sent again after
	// its reply was lost finds the claim its first sending took. A claim
	// whose lease has passed can be taken again. Leases of any length are
	// accepted: one beyond what the store can represent lasts as long as it
	// can, never wraps into the past.
	Claim(ctx context.Context, key string, lease time.Duration) (bool, error)
	// Release drops the caller's uncommitted claim on key, so a redelivery
	// can run at once. It never drops a remembered key nor a claim taken by
	// another holder. Releasing a claim that is not held is not an error.
	Release(ctx context.Context, key string) error
}

// ClaimReporter is implemented by claimers that tell, in the same call and
// cheaper than a Claim followed by a Seen, why a claim was not taken: the
// key is remembered (with the kept fingerprint, 0 when none) or claimed by
// another delivery. The middleware then needs no Seen after a failed Claim.
type ClaimReporter interface {
	// ClaimOrSeen takes the claim on key for lease as Claim does; when it
	// cannot, seen reports that key is remembered rather than in flight. A
	// store may report seen false for a key remembered a moment ago by a
	// concurrent delivery (the caller then parks it and looks again later).
	ClaimOrSeen(ctx context.Context, key string, lease time.Duration) (claimed, seen bool, fingerprint uint64, err error)
}

// Expiring is implemented by stores whose remembered keys expire.
type Expiring interface {
	// TTL returns how long a remembered key is kept; 0 means forever. A
	// retention beyond what the store can represent means as long as it
	// can: it never wraps into a record born expired.
	TTL() time.Duration
}

// TxRememberer is implemented by stores that can write a record inside the
// caller's database transaction, so that the record and the handler's own
// writes commit or roll back together (the consumer inbox).
type TxRememberer interface {
	// RememberTx records key in tx and reports whether this transaction
	// recorded it (true) or found it remembered already (false: a
	// duplicate). While another transaction holds an uncommitted record of
	// the same key, RememberTx waits for it: if it commits, the result is
	// false; if it rolls back, this transaction records the key.
	RememberTx(ctx context.Context, tx *sql.Tx, key string) (bool, error)
}

// Fingerprinter is implemented by stores that keep a fingerprint of a
// message's content (envelope.Fingerprint) with its record, so that a
// meta.id reused for a different message is caught instead of skipped. The middleware uses it instead of Seen and Remember, with no extra
// round trip. Stores without it keep working; the check is then skipped.
//
// A store that wraps another by embedding it (to add logging, metrics or
// faults) inherits these methods: the middleware then calls them, not the
// wrapper's Seen and Remember. Such a wrapper must override them too, or hide
// them by not embedding. The same goes for ClaimReporter and Claim.
type Fingerprinter interface {
	// SeenFingerprint is Seen, also returning the fingerprint kept with the
	// record (0 when none was kept).
	SeenFingerprint(ctx context.Context, key string) (seen bool, fingerprint uint64, err error)
	// RememberFingerprint is Remember, keeping fingerprint with the record.
	RememberFingerprint(ctx context.Context, key string, fingerprint uint64) error
	// KeptFingerprint returns fingerprint in the form the store keeps it (a
	// store may keep fewer bits), to compare with what SeenFingerprint
	// returns. It returns 0 only for 0.
	KeptFingerprint(fingerprint uint64) uint64
}

// TxFingerprinter is a TxRememberer that keeps fingerprints too.
type TxFingerprinter interface {
	TxRememberer
	Fingerprinter
	// RememberTxFingerprint is RememberTx keeping fingerprint; for a
	// duplicate it also returns the fingerprint kept with the existing
	// record (0: none).
	RememberTxFingerprint(ctx context.Context, tx *sql.Tx, key string, fingerprint uint64) (recorded bool, kept uint64, err error)
}

// State is what a store holds for a key.
type State int

// The states of a key.
const (
	StateUnknown    State = iota // no live record: never seen, forgotten, expired or released
	StateInFlight                // claimed by a delivery that has not finished
	StateRemembered              // its effect happened
)

// String returns "unknown", "in flight" or "remembered".
func (s State) String() string {
	switch s {
	case StateInFlight:
		return "in flight"
	case StateRemembered:
		return "remembered"
	}
	return "unknown"
}

// Record describes what a store holds for a key.
type Record struct {
	State State
	// ExpiresAt is when the record or claim lapses; zero when it does not.
	ExpiresAt time.Time
}

// Inspector is implemented by stores that can report a key's record for
// operators (the inspect command).
type Inspector interface {
	Inspect(ctx context.Context, key string) (Record, error)
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

// WithClaimToken returns a copy of ctx that names the holder of the claims
// taken with it. The middleware gives every delivery a token of its own;
// callers of [Claimer] outside the middleware should do the same.
func WithClaimToken(ctx context.Context, token string) context.Context {
	return context.WithValue(ctx, claimTokenKey{}, token)
}

// ClaimToken returns the claim holder's token carried by ctx, or "" when
// ctx names none (the store instance is then the holder).
func ClaimToken(ctx context.Context) string {
	token, _ := ctx.Value(claimTokenKey{}).(string)
	return token
}

// NewClaimToken returns a random token (96 bits, 16 characters of base64url)
// for a holder of claims that has no name of its own: a store instance
// acting for the callers whose context names no holder.
func NewClaimToken() string {
	var b [12]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand)
	return base64.RawURLEncoding.EncodeToString(b[:])
}
