package stores

import (
	"context"
	"fmt"
	"time"
)

// SeenSet is the store contract of the BabelQueue SDKs: three calls keyed on
// an opaque key. A type of your own honouring it works with the middleware
// through [FromSeenSet].
type SeenSet interface {
	// Seen reports whether key was remembered and has not expired or been
	// forgotten.
	Seen(ctx context.Context, key string) (bool, error)
	// Remember records key as done. Remembering a key twice is not an
	// error.
	Remember(ctx context.Context, key string) error
	// Forget removes key, so that a later delivery runs again. Forgetting
	// an unknown key is not an error.
	Forget(ctx context.Context, key string) error
}

// FromSeenSet adapts s to the Store contract as a post-success seen-set:
// Lookup is s.Seen, Remember is s.Remember (fingerprints and values are not
// kept; without claims there is none to refuse), Forget is s.Forget, and
// Claim, Extend and Release are not supported
// (Capabilities().Claims is false), so two concurrent deliveries of one
// message may both run. Fail and Reopen are not supported either
// (Capabilities().Failures is false): failures are not counted across
// deliveries, and a message that ended is not known as such. ttl is the retention s keeps records for (0:
// forever); the middleware's replay horizon defaults to it.
//
// The middleware refuses such a store unless it is told to run without
// claims (idempotency.WithoutClaim), so that the weaker guarantee is a
// choice made in the code.
func FromSeenSet(s SeenSet, ttl time.Duration) Store {
	return seenSet{s: s, ttl: max(ttl, 0)}
}

type seenSet struct {
	s   SeenSet
	ttl time.Duration
}

func (a seenSet) Claim(context.Context, string, time.Duration) (bool, Record, error) {
	return false, Record{}, fmt.Errorf("stores: claim on a seen-set (%T): %w", a.s, ErrNotSupported)
}

func (a seenSet) Extend(context.Context, string, time.Duration) (bool, error) {
	return false, fmt.Errorf("stores: extend on a seen-set (%T): %w", a.s, ErrNotSupported)
}

func (a seenSet) Release(context.Context, string) error {
	return fmt.Errorf("stores: release on a seen-set (%T): %w", a.s, ErrNotSupported)
}

func (a seenSet) Fail(context.Context, string, uint64, Failure) error {
	return fmt.Errorf("stores: fail on a seen-set (%T): %w", a.s, ErrNotSupported)
}

func (a seenSet) Reopen(context.Context, string, string) (bool, error) {
	return false, fmt.Errorf("stores: reopen on a seen-set (%T): %w", a.s, ErrNotSupported)
}

func (a seenSet) Lookup(ctx context.Context, key string) (Record, error) {
	seen, err := a.s.Seen(ctx, key)
	if err != nil || !seen {
		return Record{}, err
	}
	return Record{State: StateRemembered}, nil
}

func (a seenSet) Remember(ctx context.Context, key string, _ uint64, _ []byte) error {
	return a.s.Remember(ctx, key)
}

func (a seenSet) Forget(ctx context.Context, key string) error { return a.s.Forget(ctx, key) }

func (a seenSet) Capabilities() Capabilities { return Capabilities{TTL: a.ttl} }
