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
				!strings.Contains(string(out), "--- FAIL: TestBrokenStore/Claimer/"+subtest) {
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
		func(t *testing.T) stores.Store { return &brokenStore{Store: memstore.New(), broken: broken} },
		storetest.WithTTLStore(func(t *testing.T, ttl time.Duration) stores.Store {
			if broken == "ignores-ttl" {
				ttl = 0
			}
			return &brokenStore{Store: memstore.New(memstore.WithTTL(ttl)), broken: broken}
		}))
}

// brokenStore is memstore with one rule of the contract broken.
type brokenStore struct {
	*memstore.Store
	broken string
	mu     sync.Mutex
	claims map[string]bool
}

func (b *brokenStore) Seen(ctx context.Context, key string) (bool, error) {
	if b.broken == "claim-is-seen" {
		b.mu.Lock()
		claimed := b.claims[key]
		b.mu.Unlock()
		if claimed {
			return true, nil
		}
	}
	return b.Store.Seen(ctx, key)
}

func (b *brokenStore) Forget(ctx context.Context, key string) error {
	if b.broken == "forget-is-noop" {
		return ctx.Err()
	}
	return b.Store.Forget(ctx, key)
}

func (b *brokenStore) Claim(ctx context.Context, key string, lease time.Duration) (bool, error) {
	if b.broken == "racy-claim" {
		seen, err := b.Store.Seen(ctx, key)
		if err != nil || seen {
			return false, err
		}
		time.Sleep(time.Millisecond) // check, then act: not atomic
		_ = b.Store.Forget(ctx, key)
		return b.Store.Claim(ctx, key, lease)
	}
	ok, err := b.Store.Claim(ctx, key, lease)
	if ok {
		b.mu.Lock()
		if b.claims == nil {
			b.claims = map[string]bool{}
		}
		b.claims[key] = true
		b.mu.Unlock()
	}
	return ok, err
}

func (b *brokenStore) Release(ctx context.Context, key string) error {
	if b.broken == "release-ignores-token" {
		return b.Store.Release(context.WithoutCancel(stores.WithClaimToken(ctx, "")), key)
	}
	return b.Store.Release(ctx, key)
}
