package storetest_test

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/stores/storetest"
)

// The suite must fail on stores that break the contract. Each broken store
// below is run through Run in a child process, which must fail in the
// subtest that names the broken rule.
func TestSuiteCatchesBrokenStores(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the suite in child processes")
	}
	cases := map[string]string{
		"release-ignores-token": "StaleReleaseKeepsRetakenClaim",
		"claim-is-seen":         "ClaimIsNotSeen",
		"racy-claim":            "OneWinnerAmong64",
		"forget-is-noop":        "SeenRememberForget",
		"ignores-ttl":           "TTL",
		// A holder that claims its own claim again (its reply was lost).
		"claim-refuses-own-holder": "SameHolderClaimsAgain",
		// A Release naming no holder drops a delivery's claim.
		"unnamed-release-drops-any": "UnnamedReleaseKeepsNamedClaim",
		// Two instances (workers) are one holder when callers name none.
		"instances-share-holder": "InstancesAreHolders",
		// A retention beyond the year 2262 wraps into the past.
		"ttl-wraps": "HugeTTL",
		// Extend of a claim, whoever holds it.
		"extend-any-holder": "ExtendNeverAnothersClaim",
		// Extend of a lapsed claim brings it back.
		"extend-revives-lapsed": "LapsedClaimIsNotHeld",
		// Remember writes over any claim.
		"remember-over-any-claim": "RememberRefusesAnothersLiveClaim",
	}
	for broken, subtest := range cases {
		t.Run(broken, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestBrokenStore$", "-test.count=1")
			cmd.Env = append(os.Environ(), "STORETEST_BROKEN="+broken)
			out, err := cmd.CombinedOutput()
			if err == nil {
				t.Fatalf("the suite passed a store whose %s:\n%s", broken, out)
			}
			if !strings.Contains(string(out), "--- FAIL: TestBrokenStore/"+subtest) &&
				!strings.Contains(string(out), "--- FAIL: TestBrokenStore/Claims/"+subtest) {
				t.Fatalf("the suite failed, but not in %s:\n%s", subtest, out)
			}
		})
	}
}

func TestBrokenStore(t *testing.T) {
	broken := os.Getenv("STORETEST_BROKEN")
	if broken == "" {
		t.Skip("only run as a child of TestSuiteCatchesBrokenStores")
	}
	storetest.Run(t,
		func(t *testing.T) stores.Store {
			return &brokenStore{instance: newInstance(memstore.New()), broken: broken}
		},
		storetest.WithTTLStore(func(t *testing.T, ttl time.Duration) stores.Store {
			switch {
			case broken == "ignores-ttl":
				ttl = 0
			case broken == "ttl-wraps" && ttl > 100*365*24*time.Hour:
				ttl = time.Nanosecond
			}
			return &brokenStore{instance: newInstance(memstore.New(memstore.WithTTL(ttl))), broken: broken}
		}),
		storetest.WithSecondInstance(func(t *testing.T, s stores.Store) stores.Store {
			first := s.(*brokenStore)
			second := newInstance(first.Store)
			if broken == "instances-share-holder" {
				second.token = first.token
			}
			return &brokenStore{instance: second, broken: broken}
		}))
}

// TestSecondInstance runs the suite on two instances sharing one memstore,
// each a claim holder of its own, as two workers sharing a server are.
func TestSecondInstance(t *testing.T) {
	storetest.Run(t,
		func(t *testing.T) stores.Store { return newInstance(memstore.New()) },
		storetest.WithSecondInstance(func(t *testing.T, s stores.Store) stores.Store {
			return newInstance(s.(*instance).Store)
		}))
}

// instance is a view on a memstore that holds claims under a token of its
// own when the caller names none, as a store shared by several processes
// does.
type instance struct {
	*memstore.Store
	token string
}

func newInstance(s *memstore.Store) *instance {
	return &instance{Store: s, token: stores.NewClaimToken()}
}

func (i *instance) holder(ctx context.Context) context.Context {
	if stores.ClaimToken(ctx) == "" {
		return stores.WithClaimToken(ctx, i.token)
	}
	return ctx
}

func (i *instance) Claim(ctx context.Context, key string, lease time.Duration) (bool, stores.Record, error) {
	return i.Store.Claim(i.holder(ctx), key, lease)
}

func (i *instance) Release(ctx context.Context, key string) error {
	return i.Store.Release(i.holder(ctx), key)
}

func (i *instance) Extend(ctx context.Context, key string, lease time.Duration) (bool, error) {
	return i.Store.Extend(i.holder(ctx), key, lease)
}

func (i *instance) Remember(ctx context.Context, key string, fingerprint uint64, value []byte) error {
	return i.Store.Remember(i.holder(ctx), key, fingerprint, value)
}

// brokenStore is memstore with one rule of the contract broken.
type brokenStore struct {
	*instance
	broken string
	mu     sync.Mutex
	claims map[string]bool
}

func (b *brokenStore) Lookup(ctx context.Context, key string) (stores.Record, error) {
	if b.broken == "claim-is-seen" {
		b.mu.Lock()
		claimed := b.claims[key]
		b.mu.Unlock()
		if claimed {
			return stores.Record{State: stores.StateRemembered}, nil
		}
	}
	return b.Store.Lookup(ctx, key)
}

func (b *brokenStore) Forget(ctx context.Context, key string) error {
	if b.broken == "forget-is-noop" {
		return ctx.Err()
	}
	return b.Store.Forget(ctx, key)
}

func (b *brokenStore) Claim(ctx context.Context, key string, lease time.Duration) (bool, stores.Record, error) {
	if b.broken == "racy-claim" {
		r, err := b.Store.Lookup(ctx, key)
		if err != nil || r.Remembered() {
			return false, r, err
		}
		time.Sleep(time.Millisecond) // check, then act: not atomic
		_ = b.Store.Forget(ctx, key)
		return b.instance.Claim(ctx, key, lease)
	}
	if b.broken == "claim-refuses-own-holder" {
		if r, err := b.Store.Lookup(ctx, key); err != nil || r.State == stores.StateInFlight {
			return false, r, err
		}
	}
	ok, found, err := b.instance.Claim(ctx, key, lease)
	if ok {
		b.mu.Lock()
		if b.claims == nil {
			b.claims = map[string]bool{}
		}
		b.claims[key] = true
		b.mu.Unlock()
	}
	return ok, found, err
}

func (b *brokenStore) Release(ctx context.Context, key string) error {
	if b.broken == "release-ignores-token" || (b.broken == "unnamed-release-drops-any" && stores.ClaimToken(ctx) == "") {
		r, err := b.Store.Lookup(ctx, key)
		if err != nil || r.State != stores.StateInFlight {
			return err
		}
		return b.Forget(ctx, key) // whoever holds it
	}
	return b.instance.Release(ctx, key)
}

func (b *brokenStore) Extend(ctx context.Context, key string, lease time.Duration) (bool, error) {
	switch b.broken {
	case "extend-any-holder":
		r, err := b.Store.Lookup(ctx, key)
		if err != nil || r.State == stores.StateInFlight {
			return err == nil, err
		}
	case "extend-revives-lapsed":
		if held, err := b.instance.Extend(ctx, key, lease); err != nil || held {
			return held, err
		}
		if r, err := b.Store.Lookup(ctx, key); err != nil || r.State != stores.StateUnknown {
			return false, err
		}
		held, _, err := b.instance.Claim(ctx, key, lease) // as if the lapsed claim were still its
		return held, err
	}
	return b.instance.Extend(ctx, key, lease)
}

func (b *brokenStore) Remember(ctx context.Context, key string, fingerprint uint64, value []byte) error {
	if b.broken == "remember-over-any-claim" {
		if err := b.Store.Forget(ctx, key); err != nil {
			return err
		}
	}
	return b.instance.Remember(ctx, key, fingerprint, value)
}
