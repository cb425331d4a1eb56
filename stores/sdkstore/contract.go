package sdkstore

import (
	"context"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
)

// The stores.Store contract of every layout: Lookup is the layout's own
// reading of a record (what its SDK reads as done is remembered), Claim
// takes the layout's claim and, when it cannot, reads what stood in its
// way (one more round trip), and Remember writes the record as the SDK
// writes it. The layouts keep no fingerprint and no value: their SDKs have
// no place for either, so a meta.id reused for other content is skipped,
// not reported.

// layoutCapabilities are the capabilities of a layout keeping records for
// ttl: claims, failures where the layout keeps them, and neither
// fingerprints nor values.
func layoutCapabilities(ttl time.Duration, failures bool) stores.Capabilities {
	return stores.Capabilities{Claims: true, TTL: ttl, Failures: failures}
}

// claimOrFind takes the claim with claim, or reads the record in its way
// with inspect.
func claimOrFind(ctx context.Context, key string, lease time.Duration,
	claim func(context.Context, string, time.Duration) (bool, error),
	inspect func(context.Context, string) (stores.Record, error)) (bool, stores.Record, error) {
	claimed, err := claim(ctx, key, lease)
	if err != nil || claimed {
		return claimed, stores.Record{}, err
	}
	found, err := inspect(ctx, key)
	if err != nil {
		return false, stores.Record{}, err
	}
	if found.State == stores.StateUnknown { // gone since: in flight a moment ago
		found.State = stores.StateInFlight
	}
	return false, found, nil
}

// Capabilities reports claims, the TTL and failures (kept beside the PHP
// SDK's key); the layout keeps no fingerprint and no value.
func (s *PHPRedisStore) Capabilities() stores.Capabilities {
	return layoutCapabilities(s.cfg.ttl, true)
}

// Lookup reports key's record (see inspect).
func (s *PHPRedisStore) Lookup(ctx context.Context, key string) (stores.Record, error) {
	return watched(ctx, s.inline, "lookup", func(ctx context.Context) (stores.Record, error) {
		return s.inspect(ctx, key)
	}, nil)
}

// Remember writes key's record as the PHP SDK does; fingerprint and value
// are not kept.
func (s *PHPRedisStore) Remember(ctx context.Context, key string, _ uint64, _ []byte) error {
	return watched0(ctx, s.inline, "remember", func(ctx context.Context) error {
		return s.remember(ctx, key)
	})
}

// Capabilities reports claims, the TTL and failures (kept in the kit's
// claim key); the layout keeps no fingerprint and no value.
func (s *GoRedisStore) Capabilities() stores.Capabilities { return layoutCapabilities(s.cfg.ttl, true) }

// Lookup reports key's record (see inspect).
func (s *GoRedisStore) Lookup(ctx context.Context, key string) (stores.Record, error) {
	return watched(ctx, s.inline, "lookup", func(ctx context.Context) (stores.Record, error) {
		return s.inspect(ctx, key)
	}, nil)
}

// Remember writes key's record as the Go SDK does; fingerprint and value
// are not kept.
func (s *GoRedisStore) Remember(ctx context.Context, key string, _ uint64, _ []byte) error {
	return watched0(ctx, s.inline, "remember", func(ctx context.Context) error {
		return s.remember(ctx, key)
	})
}

// Capabilities reports claims; the PHP SDK keeps records until they are
// forgotten (no TTL), and the layout keeps no fingerprint, no value and no
// failures.
func (s *PHPPDOStore) Capabilities() stores.Capabilities { return layoutCapabilities(0, false) }

// Lookup reports key's record (see inspect).
func (s *PHPPDOStore) Lookup(ctx context.Context, key string) (stores.Record, error) {
	return s.inspect(ctx, key)
}

// Remember writes key's row as the PHP SDK does; fingerprint and value are
// not kept.
func (s *PHPPDOStore) Remember(ctx context.Context, key string, _ uint64, _ []byte) error {
	return s.remember(ctx, key)
}

// Claim takes the claim on key, or returns the record in its way.
func (s *PHPPDOStore) Claim(ctx context.Context, key string, lease time.Duration) (bool, stores.Record, error) {
	return claimOrFind(ctx, key, lease, s.claim, s.inspect)
}

// Capabilities reports claims and the TTL; the layout keeps no
// fingerprint, no value and no failures.
func (s *GoPostgresStore) Capabilities() stores.Capabilities {
	return layoutCapabilities(s.cfg.ttl, false)
}

// Lookup reports key's record (see inspect).
func (s *GoPostgresStore) Lookup(ctx context.Context, key string) (stores.Record, error) {
	return s.inspect(ctx, key)
}

// Remember writes key's row as the Go SDK does; fingerprint and value are
// not kept.
func (s *GoPostgresStore) Remember(ctx context.Context, key string, _ uint64, _ []byte) error {
	return s.remember(ctx, key)
}

// Claim takes the claim on key, or returns the record in its way.
func (s *GoPostgresStore) Claim(ctx context.Context, key string, lease time.Duration) (bool, stores.Record, error) {
	return claimOrFind(ctx, key, lease, s.claim, s.inspect)
}
