package sdkstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
)

// TestUnnamedCallsAndSDKClaims: a kit caller that names no claim holder
// acts for its store instance, on every layout. While an SDK consumer holds
// a message's claim (its handler is running), such a caller's Release
// leaves that claim alone and its Claim is refused; the SDK consumer then
// records the message and the kit reads it as done. On the PHP layouts the
// SDK consumer also reads the instance's claim as in flight, and the
// instance's Release lets it run.
func TestUnnamedCallsAndSDKClaims(t *testing.T) {
	t.Parallel()
	for _, l := range layouts(t) {
		t.Run(l.name, func(t *testing.T) {
			t.Parallel() // keys and tables of its own
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			kit := l.kit
			ids, _ := envelopes(t, 2)
			if l.sdkSeesClaims {
				id := ids[0]
				if ok, _, err := kit.Claim(ctx, id, time.Minute); err != nil || !ok {
					t.Fatalf("Claim naming no holder = %v, %v; want true", ok, err)
				}
				if ran, err := l.sdk.handle(ctx, id, func() error { return nil }); ran || !errors.Is(err, errParked) {
					t.Fatalf("SDK delivery while the kit instance holds the claim: ran %v, %v; want parked", ran, err)
				}
				if err := kit.Release(ctx, id); err != nil {
					t.Fatal(err)
				}
				if ran, err := l.sdk.handle(ctx, id, func() error { return nil }); !ran || err != nil {
					t.Fatalf("SDK delivery after the kit instance released its claim: ran %v, %v; want run", ran, err)
				}
			}
			id := ids[1]
			ran, err := l.sdk.handle(ctx, id, func() error {
				// The SDK consumer holds the message's claim now.
				if err := kit.Release(ctx, id); err != nil {
					return err
				}
				if ok, _, err := kit.Claim(ctx, id, time.Minute); err != nil || ok {
					t.Errorf("kit Claim naming no holder while an SDK consumer holds the message, after a Release naming none = %v, %v; want false", ok, err)
				}
				return nil
			})
			if !ran || err != nil {
				t.Fatalf("SDK delivery: ran %v, %v", ran, err)
			}
			if seen, err := stores.Seen(ctx, l.kit, id); err != nil || !seen {
				t.Fatalf("kit Seen of the message the SDK consumer recorded = %v, %v; want true", seen, err)
			}
		})
	}
}
