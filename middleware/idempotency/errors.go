package idempotency

import (
	"errors"
	"fmt"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/internal/keepalive"
)

// Errors returned by the middleware. Branch on them with errors.Is.
var (
	// ErrPermanent is matched by every rejection that no retry can cure: an
	// unsupported schema version, an unusable meta.id, a reused id, a
	// message older than the replay horizon, a message without identity
	// under WithRequireIdentity, a sensitive field that cannot be
	// decrypted. Send such messages
	// to a dead-letter topic straight away; see IsPermanent.
	ErrPermanent = errors.New("permanent rejection")

	// ErrInvalidID is matched when meta.id is present but unusable as a key
	// (over MaxIDBytes, invalid UTF-8, control characters). It also matches
	// ErrPermanent.
	ErrInvalidID = fmt.Errorf("unusable meta.id (%w)", ErrPermanent)

	// ErrUnsupportedSchemaVersion is matched when meta.schema_version is
	// present and not 1. It also matches ErrPermanent and
	// envelope.ErrUnsupportedSchemaVersion.
	ErrUnsupportedSchemaVersion = fmt.Errorf("%w (%w)", envelope.ErrUnsupportedSchemaVersion, ErrPermanent)

	// ErrConflict is matched when a delivery's meta.id is remembered with a
	// different content fingerprint (job and data): one id reused for two
	// different messages. The delivery is rejected, not skipped. It also
	// matches ErrPermanent. Only stores that keep fingerprints
	// (stores.Capabilities.Fingerprint) can tell.
	ErrConflict = fmt.Errorf("meta.id reused for a different message (%w)", ErrPermanent)

	// ErrTooOld is matched when a delivery's meta.created_at is older than
	// the replay horizon: its record may have expired, so running it again
	// could repeat its effect. It also matches ErrPermanent.
	ErrTooOld = fmt.Errorf("message older than the replay horizon (%w)", ErrPermanent)

	// ErrUndecryptable is matched when a value at a path given to
	// WithSensitiveFields cannot be read with its Cipher: a wrong key, a
	// tampered value, a string the producer did not encrypt. The error
	// names the path, never the value. It also matches ErrPermanent.
	ErrUndecryptable = fmt.Errorf("a sensitive field cannot be decrypted (%w)", ErrPermanent)

	// ErrInFlight is matched when a delivery is parked: another delivery
	// of the same message held the claim for longer than WithParkWait and
	// may still fail. It is retryable: the router nacks and the broker redelivers.
	ErrInFlight = errors.New("message is being handled by another delivery")

	// ErrClaimLost is matched by the cause of a handler's context
	// (context.Cause(msg.Context())) when its delivery lost its claim while
	// the handler ran: another delivery took it, or it could not be renewed
	// before its lease ran out. The OutcomeClaimLost event's error matches
	// it too.
	ErrClaimLost = keepalive.ErrLost

	// ErrExhausted is matched when a message failed for good: its last run
	// under WithRetries failed, or its retries' deadline passed, or a
	// delivery found its budget spent already (an earlier delivery's dead
	// letter could not be published). It is final: neither retryable nor
	// transient, so the dead-letter middleware moves the message (reason
	// "failed") and, once the router acked that, the message's end is
	// remembered. The handler's last error is wrapped too; Attempts tells
	// how many runs failed in all.
	ErrExhausted = errors.New("message retry budget exhausted")

	// ErrRetryLater is matched when a delivery ended before the broker's
	// own deadline (WithDeliveryLimit, or a deadline on the message's
	// context) with runs of its budget left: the next run would not have
	// fitted. It is transient: the router nacks, the broker redelivers,
	// and the next delivery goes on with the count the store kept. The
	// handler's last error is wrapped too.
	ErrRetryLater = errors.New("message failed; retried on a later delivery")

	// ErrStore is matched when the store could not be read or claimed. The
	// delivery is not handled and is retried; the store's own error is
	// wrapped too.
	ErrStore = errors.New("idempotency store unavailable")

	// ErrNoIdentity is matched when WithRequireIdentity rejects a message
	// that has no usable identity. It also matches ErrPermanent.
	ErrNoIdentity = fmt.Errorf("message without identity (%w)", ErrPermanent)

	// ErrNoClaims is returned by New for a store that cannot claim
	// (stores.Capabilities.Claims false) unless WithoutClaim is given.
	ErrNoClaims = errors.New("store cannot claim")

	// ErrNotTxStore is returned by New when WithTransaction is given for a
	// store that is not a stores.TxStore, or WithPgxTransaction for one that
	// is not a PgxTxStore.
	ErrNotTxStore = errors.New("store cannot record in a transaction (not a stores.TxStore)")
)

// IsPermanent reports whether err is a rejection that retrying cannot fix.
// Use it as the filter of Watermill's PoisonQueueWithFilter, and negated in
// Retry.ShouldRetry, so that such messages go straight to a dead-letter
// topic instead of being retried.
func IsPermanent(err error) bool { return errors.Is(err, ErrPermanent) }

// IsTransient reports whether err is a failure the kit knows will pass: the
// store could not be read or claimed (ErrStore), another delivery of the
// message holds its claim (ErrInFlight), the delivery lost its claim to
// another (ErrClaimLost), or it ended before the broker's deadline with
// runs left (ErrRetryLater). The delivery must go back to the broker to be
// redelivered, never to a dead-letter topic nor be acked. The deadletter
// middleware leaves such errors alone; Retry may retry a store failure
// (see Retryable); give Watermill's PoisonQueueWithFilter a filter that
// refuses them (IsPermanent does).
func IsTransient(err error) bool {
	return errors.Is(err, ErrStore) || errors.Is(err, ErrInFlight) || errors.Is(err, ErrClaimLost) || errors.Is(err, ErrRetryLater)
}

// IsFinal reports whether err ends its message: a permanent rejection
// (IsPermanent) or a spent budget (ErrExhausted). Such a message goes to a
// dead-letter topic; once the router acked that, its end is remembered
// and a redelivery of it is acked without running.
func IsFinal(err error) bool {
	return errors.Is(err, ErrPermanent) || errors.Is(err, ErrExhausted)
}

// Retryable reports whether a failed delivery is worth running again at
// once, in place: it is neither a permanent rejection (IsPermanent) nor a
// parked copy (ErrInFlight). A parked copy already waited WithParkWait for
// the other delivery; retried in place, it would wait that long again on
// every retry, holding its place in the subscriber, so it goes back to the
// broker instead. Use it as Watermill's Retry.ShouldRetry:
//
//	ShouldRetry: func(p middleware.RetryParams) bool { return idempotency.Retryable(p.Err) },
//
// Under WithRetries the guard retries in place itself, counting runs
// across deliveries; Watermill's Retry is then not needed, and where it
// is kept, Retryable refuses what the guard decided (ErrExhausted,
// ErrRetryLater, ErrClaimLost).
func Retryable(err error) bool {
	return !IsPermanent(err) && !errors.Is(err, ErrInFlight) && !errors.Is(err, ErrExhausted) &&
		!errors.Is(err, ErrRetryLater) && !errors.Is(err, ErrClaimLost)
}

// Attempts returns how many runs of the message failed in all, across
// deliveries, when err is the guard's error after a failed run under
// WithRetries (ErrExhausted, ErrRetryLater); false otherwise. The
// dead-letter middleware reports it in dead_letter.attempts.
func Attempts(err error) (int, bool) {
	var f *failedError
	if errors.As(err, &f) {
		return f.attempts, true
	}
	return 0, false
}

// failedError is the guard's error after a failed run under WithRetries:
// its kind (ErrExhausted or ErrRetryLater), the runs that failed in all,
// and the handler's last error.
type failedError struct {
	kind     error
	attempts int
	why      string
	err      error
}

func (e *failedError) Error() string {
	kind := "rejected"
	if e.kind != nil {
		kind = e.kind.Error()
	}
	return fmt.Sprintf("idempotency: %s after %d failed run(s)%s: %v", kind, e.attempts, e.why, e.err)
}

func (e *failedError) Unwrap() []error {
	if e.kind == nil { // a permanent failure: the handler's error says so
		return []error{e.err}
	}
	return []error{e.kind, e.err}
}
