// Package storetest is a contract test suite for implementations of
// [stores.Store] and [stores.TxStore]. Every store shipped with this module
// passes it; run it on your own store to prove it works with the
// idempotency middleware:
//
//	func TestContract(t *testing.T) {
//		storetest.Run(t, func(t *testing.T) stores.Store { return mystore.New(…) },
//			storetest.WithTTLStore(func(t *testing.T, ttl time.Duration) stores.Store {
//				return mystore.New(…, mystore.WithTTL(ttl))
//			}),
//			storetest.WithSecondInstance(func(t *testing.T, s stores.Store) stores.Store {
//				return mystore.New(…) // a second worker on s's database
//			}))
//	}
//
// The suite covers every capability the store declares
// ([stores.Store.Capabilities]): lookups, remembering and forgetting, keys
// of every shape, done contexts and concurrent use; claims (one winner
// among racing claimers, the record a failed claim finds, lease expiry,
// release semantics, holders, extension by the holder only, and Remember
// refusing another holder's live claim); failures (counts that outlive
// deliveries and claims, ends that are not claimed, reopening an end on
// purpose); kept fingerprints and values; expiry, with
// retentions and leases of any length; and, for a [stores.TxStore] (given
// its database with [WithTxDB]), records written in the caller's
// transaction, which commit and roll back with it and make a concurrent
// transaction wait. A store that declares no claims must refuse them with
// stores.ErrNotSupported.
//
// Each subtest runs in parallel with the others (but the two that expect a
// claim of the short lease to be held a moment later, which run alone, so
// that the racing claims of the others cannot stretch that moment), asks
// newStore for a fresh store and uses keys unique to the run, so a store
// backed by a shared server may return views on one database. A store shared by a fleet should
// also pass [WithSecondInstance], which proves that two of its instances,
// like two workers, are distinct claim holders.
//
// [RunEffects] does the same for a [stores.EffectStore], the records of
// external effects (package effects).
package storetest

import (
	"bytes"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
)

// Option configures Run.
type Option func(*config)

type config struct {
	newTTLStore func(t *testing.T, ttl time.Duration) stores.Store
	second      func(t *testing.T, s stores.Store) stores.Store
	lease       time.Duration
	txDB        *sql.DB
}

// WithTTLStore lets Run test expiry: newStore must return a store whose
// remembered keys expire after ttl (a fraction of a second).
func WithTTLStore(newStore func(t *testing.T, ttl time.Duration) stores.Store) Option {
	return func(c *config) { c.newTTLStore = newStore }
}

// WithSecondInstance lets Run test a store shared by several processes:
// second must return another instance of the store s (built as a second
// worker would build it, with its own client or pool if you like) that
// shares s's records. The suite then checks that a claim taken without a
// holder token on one instance is held by that instance: the other neither
// takes it nor drops it, and a worker whose lease lapsed cannot release the
// claim the other worker took after it. Without this option the check is
// skipped; a store that keeps its records in the process (memstore) has no
// second instance to give.
func WithSecondInstance(second func(t *testing.T, s stores.Store) stores.Store) Option {
	return func(c *config) { c.second = second }
}

// WithShortLease sets the lease the suite uses when it waits for a claim to
// expire (default 200ms). Raise it for a store whose clock resolution is
// coarser.
func WithShortLease(lease time.Duration) Option {
	return func(c *config) { c.lease = lease }
}

// WithTxDB gives the database a stores.TxStore writes its records in, so
// that Run can test RememberTx in transactions of its own. Run fails for a
// TxStore without it.
func WithTxDB(db *sql.DB) Option {
	return func(c *config) { c.txDB = db }
}

// Run runs the contract suite against the stores newStore returns.
func Run(t *testing.T, newStore func(t *testing.T) stores.Store, opts ...Option) {
	c := config{lease: 200 * time.Millisecond}
	for _, opt := range opts {
		opt(&c)
	}
	k := keys{run: randomHex(6)}
	caps := newStore(t).Capabilities()
	run := func(name string, test func(t *testing.T)) {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			test(t)
		})
	}
	// alone runs a subtest that times the short lease before its parallel
	// siblings start.
	alone := func(name string, test func(t *testing.T)) { t.Run(name, test) }

	run("Capabilities", func(t *testing.T) { testCapabilities(t, newStore(t)) })
	run("SeenRememberForget", func(t *testing.T) { testSeenRememberForget(t, newStore(t), k) })
	run("KeysAreDistinct", func(t *testing.T) { testKeysAreDistinct(t, newStore(t), k) })
	run("OddKeys", func(t *testing.T) { testOddKeys(t, newStore(t), k) })
	run("ConcurrentRemember", func(t *testing.T) { testConcurrentRemember(t, newStore(t), k) })
	run("DoneContext", func(t *testing.T) { testDoneContext(t, newStore(t), k) })
	run("Lookup", func(t *testing.T) { testLookup(t, newStore(t), k) })
	if !caps.Claims {
		run("ClaimsRefused", func(t *testing.T) { testClaimsRefused(t, newStore(t), k) })
	} else {
		t.Run("Claims", func(t *testing.T) {
			run("ClaimIsNotSeen", func(t *testing.T) { testClaimIsNotSeen(t, newStore(t), k) })
			run("ClaimFindsTheRecord", func(t *testing.T) { testClaimFinds(t, newStore(t), k, c.lease) })
			run("OneWinnerAmong64", func(t *testing.T) { testOneWinner(t, newStore(t), k) })
			alone("LeaseExpires", func(t *testing.T) { testLeaseExpires(t, newStore(t), k, c.lease) })
			run("OneWinnerOfLapsedClaim", func(t *testing.T) { testOneWinnerOfLapsed(t, newStore(t), k, c.lease) })
			run("ReleaseKeepsRemembered", func(t *testing.T) { testReleaseKeepsRemembered(t, newStore(t), k) })
			run("StaleReleaseKeepsRetakenClaim", func(t *testing.T) { testStaleRelease(t, newStore(t), k, c.lease) })
			run("SameHolderClaimsAgain", func(t *testing.T) { testSameHolder(t, newStore(t), k) })
			run("UnnamedReleaseKeepsNamedClaim", func(t *testing.T) { testUnnamedRelease(t, newStore(t), k) })
			alone("InstancesAreHolders", func(t *testing.T) {
				if c.second == nil {
					t.Skip("no WithSecondInstance given")
				}
				s := newStore(t)
				testInstancesAreHolders(t, s, c.second(t, s), k, c.lease)
			})
			run("HugeLease", func(t *testing.T) { testHugeLease(t, newStore(t), k) })
			alone("ExtendKeepsTheHoldersClaim", func(t *testing.T) { testExtendKeeps(t, newStore(t), k, c.lease) })
			run("ExtendNeverAnothersClaim", func(t *testing.T) { testExtendNeverAnothers(t, newStore(t), k) })
			run("ExtendNeverARecord", func(t *testing.T) { testExtendNeverARecord(t, newStore(t), k) })
			run("LapsedClaimIsNotHeld", func(t *testing.T) { testLapsedNotHeld(t, newStore(t), k, c.lease) })
			run("RememberRefusesAnothersLiveClaim", func(t *testing.T) { testRememberRefuses(t, newStore(t), k, c.lease) })
			run("ForgetDropsClaim", func(t *testing.T) { testForgetDropsClaim(t, newStore(t), k) })
		})
	}
	runFailures(t, newStore, c, k, run)
	if caps.Fingerprint != nil {
		run("Fingerprints", func(t *testing.T) { testFingerprints(t, newStore(t), k) })
	}
	if caps.MaxValue > 0 {
		run("Values", func(t *testing.T) { testValues(t, newStore(t), k) })
	}
	run("TTL", func(t *testing.T) {
		if c.newTTLStore == nil {
			t.Skip("no WithTTLStore given")
		}
		testTTL(t, c.newTTLStore, k)
	})
	run("HugeTTL", func(t *testing.T) {
		if c.newTTLStore == nil {
			t.Skip("no WithTTLStore given")
		}
		testHugeTTL(t, c.newTTLStore, k)
	})
	if _, ok := newStore(t).(stores.TxStore); ok {
		t.Run("Transactions", func(t *testing.T) {
			if c.txDB == nil {
				t.Fatal("the store is a stores.TxStore: give Run its database with WithTxDB")
			}
			tx := func(t *testing.T) stores.TxStore { return newStore(t).(stores.TxStore) }
			run("CommitAndRollback", func(t *testing.T) { testTxCommitRollback(t, tx(t), c.txDB, k) })
			run("DuplicateFindsTheRecord", func(t *testing.T) { testTxDuplicate(t, tx(t), c.txDB, k) })
			run("WaitsForTheOtherTransaction", func(t *testing.T) { testTxWaits(t, tx(t), c.txDB, k) })
			run("OverAClaim", func(t *testing.T) { testTxOverClaim(t, tx(t), c.txDB, k) })
			run("OverFailures", func(t *testing.T) { testTxOverFailures(t, tx(t), c.txDB, k) })
		})
	}
}

// keys makes keys unique to one run of the suite.
type keys struct{ run string }

func (k keys) of(t *testing.T, name string) string {
	return fmt.Sprintf("storetest:%s:%s:%s", k.run, t.Name(), name)
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// clockGrain is how much earlier than the client's clock says a lifetime
// can end on the server: Redis counts a key's expiry in whole milliseconds
// of its own clock, so a lifetime set at 1000.9ms of it runs from 1000ms.
const clockGrain = 2 * time.Millisecond

// surelyWithin reports whether less than d has passed since from, by a
// margin no store's clock granularity can eat: a lifetime of d that began
// no earlier than from has surely not ended yet.
func surelyWithin(from time.Time, d time.Duration) bool {
	return time.Since(from) < d-clockGrain
}

func ctxWithTimeout(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func wantSeen(t *testing.T, s stores.Store, ctx context.Context, key string, want bool, when string) {
	t.Helper()
	got, err := stores.Seen(ctx, s, key)
	if err != nil {
		t.Fatalf("Lookup(%q) %s: %v", key, when, err)
	}
	if got != want {
		t.Fatalf("Lookup(%q) %s: remembered %v, want %v", key, when, got, want)
	}
}

// remember remembers key with no fingerprint and no value.
func remember(ctx context.Context, s stores.Store, key string) error {
	return s.Remember(ctx, key, 0, nil)
}

func lookup(t *testing.T, s stores.Store, ctx context.Context, key string, when string) stores.Record {
	t.Helper()
	r, err := s.Lookup(ctx, key)
	if err != nil {
		t.Fatalf("Lookup(%q) %s: %v", key, when, err)
	}
	return r
}

func must(t *testing.T, err error, what string) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

func claim(t *testing.T, c stores.Store, ctx context.Context, key string, lease time.Duration, want bool, when string) {
	t.Helper()
	got, _, err := c.Claim(ctx, key, lease)
	if err != nil {
		t.Fatalf("Claim(%q) %s: %v", key, when, err)
	}
	if got != want {
		t.Fatalf("Claim(%q) %s = %v, want %v", key, when, got, want)
	}
}

func testSeenRememberForget(t *testing.T, s stores.Store, k keys) {
	ctx := ctxWithTimeout(t)
	key := k.of(t, "a")
	wantSeen(t, s, ctx, key, false, "before Remember")
	must(t, remember(ctx, s, key), "Remember")
	wantSeen(t, s, ctx, key, true, "after Remember")
	must(t, remember(ctx, s, key), "Remember twice")
	wantSeen(t, s, ctx, key, true, "after a second Remember")
	must(t, s.Forget(ctx, key), "Forget")
	wantSeen(t, s, ctx, key, false, "after Forget")
	must(t, s.Forget(ctx, key), "Forget of an unknown key")
	must(t, remember(ctx, s, key), "Remember after Forget")
	wantSeen(t, s, ctx, key, true, "after Remember again")
}

func testKeysAreDistinct(t *testing.T, s stores.Store, k keys) {
	ctx := ctxWithTimeout(t)
	base := k.of(t, "Order-1")
	must(t, remember(ctx, s, base), "Remember")
	for _, twin := range []string{base + " ", base[:len(base)-1], strings.ToLower(base), base + "\x00", base + "1"} {
		wantSeen(t, s, ctx, twin, false, "for a near twin of a remembered key")
	}
	must(t, s.Forget(ctx, base+"1"), "Forget of a near twin")
	wantSeen(t, s, ctx, base, true, "after forgetting its near twin")
}

func testOddKeys(t *testing.T, s stores.Store, k keys) {
	ctx := ctxWithTimeout(t)
	prefix := k.of(t, "")
	odd := []string{
		"ключ-🔑-鍵-مفتاح",
		"a:b:c", "a\x1fb", "a/b\\c", "{hash-tag}x", "with space", "*?[]", "'; DROP TABLE x; --", `"quoted"`, "%s%d",
		"line\nbreak", "tab\tkey",
		strings.Repeat("x", 256-len(prefix)),
		strings.Repeat("é", (256-len(prefix))/2),
	}
	for _, o := range odd {
		key := prefix + o
		wantSeen(t, s, ctx, key, false, "before Remember")
		must(t, remember(ctx, s, key), fmt.Sprintf("Remember(%q)", key))
	}
	for _, o := range odd {
		wantSeen(t, s, ctx, prefix+o, true, "after Remember")
	}
	must(t, s.Forget(ctx, prefix+odd[0]), "Forget")
	wantSeen(t, s, ctx, prefix+odd[0], false, "after Forget")
	wantSeen(t, s, ctx, prefix+odd[1], true, "after forgetting another odd key")
}

func testConcurrentRemember(t *testing.T, s stores.Store, k keys) {
	ctx := ctxWithTimeout(t) // for the writes; each check below has its own
	const workers, each = 64, 8
	var wg sync.WaitGroup
	errs := make(chan error, workers*each)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				if err := remember(ctx, s, k.of(t, fmt.Sprintf("%d-%d", w, i))); err != nil {
					errs <- err
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("concurrent Remember: %v", err)
	}
	for w := range workers {
		for i := range each {
			// 512 lookups one after the other outlast one 10 s deadline on
			// a loaded machine: a deadline each.
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			wantSeen(t, s, ctx, k.of(t, fmt.Sprintf("%d-%d", w, i)), true, "after concurrent Remember")
			cancel()
		}
	}
}

func testDoneContext(t *testing.T, s stores.Store, k keys) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	key := k.of(t, "a")
	if _, err := s.Lookup(ctx, key); err == nil {
		t.Error("Lookup with a canceled context returned no error")
	}
	if err := remember(ctx, s, key); err == nil {
		t.Error("Remember with a canceled context returned no error")
	}
	if err := s.Forget(ctx, key); err == nil {
		t.Error("Forget with a canceled context returned no error")
	}
	if _, _, err := s.Claim(ctx, key, time.Minute); err == nil {
		t.Error("Claim with a canceled context returned no error")
	}
	if err := s.Release(ctx, key); err == nil {
		t.Error("Release with a canceled context returned no error")
	}
	wantSeen(t, s, ctxWithTimeout(t), key, false, "after a canceled Remember")
	if s.Capabilities().Claims {
		// A delivery handed out again past its deadline claims with a
		// done context: it leaves nothing that keeps the next one out.
		claim(t, s, stores.WithClaimToken(ctxWithTimeout(t), "after-a-canceled-claim"), key, time.Minute, true, "after a canceled Claim")
	}
}

func testClaimIsNotSeen(t *testing.T, s stores.Store, k keys) {
	c := s
	ctx := stores.WithClaimToken(ctxWithTimeout(t), "holder-a")
	key := k.of(t, "a")
	claim(t, c, ctx, key, time.Minute, true, "of a new key")
	wantSeen(t, s, ctx, key, false, "while only claimed")
	claim(t, c, stores.WithClaimToken(ctx, "holder-b"), key, time.Minute, false, "while claimed by another holder")
	claim(t, c, ctx, key, time.Minute, true, "again by its holder")
	must(t, c.Release(ctx, key), "Release")
	claim(t, c, stores.WithClaimToken(ctx, "holder-b"), key, time.Minute, true, "after the holder released it")
	must(t, remember(stores.WithClaimToken(ctx, "holder-b"), s, key), "Remember over a claim by its holder")
	wantSeen(t, s, ctx, key, true, "after Remember over a claim")
	claim(t, c, stores.WithClaimToken(ctx, "holder-c"), key, time.Minute, false, "of a remembered key")
}

func testOneWinner(t *testing.T, s stores.Store, k keys) {
	key := k.of(t, "contended")
	if wins := raceClaims(t, s, key); wins != 1 {
		t.Fatalf("%d of %d racing claims won, want exactly 1", wins, racers)
	}
}

// testOneWinnerOfLapsed races claimers for keys whose claims lapsed (their
// holder died): for each, exactly one takes it over. Three rounds, since a
// store that lets two racers in may not show it every time.
func testOneWinnerOfLapsed(t *testing.T, s stores.Store, k keys, lease time.Duration) {
	c := s
	lapsed := []string{k.of(t, "lapsed-1"), k.of(t, "lapsed-2"), k.of(t, "lapsed-3")}
	for _, key := range lapsed {
		claim(t, c, stores.WithClaimToken(ctxWithTimeout(t), "dead-worker"), key, lease, true, "by a worker about to die")
	}
	raceClaims(t, c, k.of(t, "warm-up")) // so that the racers below start together (warm connection pools)
	time.Sleep(2*lease + 50*time.Millisecond)
	for _, key := range lapsed {
		if wins := raceClaims(t, c, key); wins != 1 {
			t.Fatalf("%d of %d racing claims took over a lapsed claim, want exactly 1", wins, racers)
		}
	}
}

const racers = 64

// raceClaims starts racers claims of key at once and returns how many won.
func raceClaims(t *testing.T, c stores.Store, key string) int32 {
	t.Helper()
	ctx := ctxWithTimeout(t)
	var wins atomic.Int32
	errs := make([]error, racers)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range racers {
		wg.Go(func() {
			<-start
			ok, _, err := c.Claim(stores.WithClaimToken(ctx, fmt.Sprintf("racer-%d", i)), key, time.Minute)
			if err != nil {
				errs[i] = fmt.Errorf("racer-%d: %w", i, err)
				return
			}
			if ok {
				wins.Add(1)
			}
		})
	}
	close(start)
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("racing claims of %q failed with an error (%d won):\n%v", key, wins.Load(), err)
	}
	return wins.Load()
}

func testLeaseExpires(t *testing.T, s stores.Store, k keys, lease time.Duration) {
	c := s
	ctx := ctxWithTimeout(t)
	key := k.of(t, "a")
	// The claim is taken with a long lease first, so that "within the
	// lease" holds however slow the machine; then taken again by its holder
	// with the short lease (a holder's repeated claim keeps its claim), which
	// is what must pass.
	claim(t, c, stores.WithClaimToken(ctx, "dead-worker"), key, time.Minute, true, "by a worker about to die")
	claim(t, c, stores.WithClaimToken(ctx, "other"), key, time.Minute, false, "within the lease")
	if held, err := c.Extend(stores.WithClaimToken(ctx, "dead-worker"), key, lease); err != nil || !held {
		t.Fatalf("Extend(%q) to a short lease by its holder = %v, %v; want held", key, held, err)
	}
	time.Sleep(2*lease + 50*time.Millisecond)
	claim(t, c, stores.WithClaimToken(ctx, "other"), key, time.Minute, true, "after the lease passed")
	wantSeen(t, s, ctx, key, false, "after re-claiming an expired claim")
}

func testReleaseKeepsRemembered(t *testing.T, s stores.Store, k keys) {
	c := s
	ctx := stores.WithClaimToken(ctxWithTimeout(t), "holder-a")
	key := k.of(t, "a")
	claim(t, c, ctx, key, time.Minute, true, "of a new key")
	must(t, remember(ctx, s, key), "Remember")
	must(t, c.Release(ctx, key), "Release by the holder after Remember")
	wantSeen(t, s, ctx, key, true, "after the holder's Release")
	must(t, c.Release(context.Background(), key), "anonymous Release")
	wantSeen(t, s, ctx, key, true, "after an anonymous Release")
	must(t, c.Release(ctx, k.of(t, "never-claimed")), "Release of an unknown key")
}

func testStaleRelease(t *testing.T, s stores.Store, k keys, lease time.Duration) {
	c := s
	base := ctxWithTimeout(t)
	slow := stores.WithClaimToken(base, "slow")
	fresh := stores.WithClaimToken(base, "fresh")
	probe := stores.WithClaimToken(base, "probe")
	key := k.of(t, "a")
	claim(t, c, slow, key, lease, true, "by the slow delivery")
	time.Sleep(2*lease + 50*time.Millisecond)
	claim(t, c, fresh, key, time.Minute, true, "by a fresh delivery after the slow one's lease passed")
	must(t, c.Release(slow, key), "Release by the slow delivery")
	claim(t, c, probe, key, time.Minute, false, "after a stale Release (the fresh claim must survive)")
	must(t, c.Release(fresh, key), "Release by the fresh delivery")
	claim(t, c, probe, key, time.Minute, true, "after the holder released")
}

func testForgetDropsClaim(t *testing.T, s stores.Store, k keys) {
	c := s
	ctx := stores.WithClaimToken(ctxWithTimeout(t), "holder")
	key := k.of(t, "a")
	claim(t, c, ctx, key, time.Minute, true, "of a new key")
	must(t, s.Forget(ctx, key), "Forget")
	claim(t, c, ctx, key, time.Minute, true, "after Forget")
}

func testTTL(t *testing.T, newStore func(t *testing.T, ttl time.Duration) stores.Store, k keys) {
	const ttl = 400 * time.Millisecond
	s := newStore(t, ttl)
	if got := s.Capabilities().TTL; got != ttl {
		t.Fatalf("Capabilities().TTL = %v, want %v", got, ttl)
	}
	ctx := ctxWithTimeout(t)
	// The checks depend on when each record was written: a slow machine
	// can make a round too late to tell, and then it runs again with fresh
	// keys (a few times at most; every check that is made must hold).
	var key string
	for round := 1; ; round++ {
		key = k.of(t, fmt.Sprintf("a%d", round))
		renewed := k.of(t, fmt.Sprintf("renewed%d", round))
		sent := time.Now() // key expires no earlier than sent + ttl
		must(t, remember(ctx, s, key), "Remember")
		written := time.Now() // key expires by written + ttl
		must(t, remember(ctx, s, renewed), "Remember")
		if time.Since(sent) < ttl/2 {
			seen, err := stores.Seen(ctx, s, key)
			must(t, err, "Lookup")
			// Only a Lookup answered before sent + ttl was surely made
			// within the TTL (a loaded machine can stall it past that).
			if !seen && surelyWithin(sent, ttl) {
				t.Fatalf("Seen(%q) within the TTL = false, want true", key)
			}
		}
		time.Sleep(time.Until(written.Add(ttl / 2)))
		renewing := time.Now() // renewed expires no earlier than renewing + ttl
		must(t, remember(ctx, s, renewed), "Remember again (renews the TTL)")
		time.Sleep(time.Until(written.Add(ttl + 100*time.Millisecond)))
		wantSeen(t, s, ctx, key, false, "after the TTL")
		checked := time.Now()
		seen, err := stores.Seen(ctx, s, renewed)
		must(t, err, "Lookup")
		if time.Since(renewing) >= ttl-20*time.Millisecond || checked.Sub(renewing) >= ttl-20*time.Millisecond {
			if round < 5 {
				continue // too late to tell: the renewed record may have expired too
			}
			t.Skipf("the machine is too slow to check a %v TTL (5 rounds)", ttl)
		}
		if !seen {
			t.Fatalf("Seen(%q) after the first TTL when remembered again half way = false, want true", renewed)
		}
		break
	}
	if s.Capabilities().Claims {
		claim(t, s, ctx, key, time.Minute, true, "of an expired key")
	}
	must(t, s.Forget(ctx, key), "Forget of an expired key")
}

func testCapabilities(t *testing.T, s stores.Store) {
	caps := s.Capabilities()
	if caps.KeptFingerprint(0) != 0 {
		t.Errorf("Capabilities().Fingerprint(0) = %d, want 0", caps.KeptFingerprint(0))
	}
	for _, fp := range []uint64{1, 0xdeadbeefcafe, 1<<64 - 1} {
		if caps.Fingerprint != nil && caps.Fingerprint(fp) == 0 {
			t.Errorf("Capabilities().Fingerprint(%x) = 0, want a kept fingerprint", fp)
		}
	}
	if caps.TTL < 0 || caps.MaxValue < 0 {
		t.Errorf("Capabilities() = %+v: negative TTL or MaxValue", caps)
	}
	if again := s.Capabilities(); again.Claims != caps.Claims || again.TTL != caps.TTL || again.MaxValue != caps.MaxValue {
		t.Errorf("Capabilities() changed between two calls: %+v, then %+v", caps, again)
	}
}

// testLookup: Lookup tells unknown, in flight and remembered apart, with an
// expiry within the lease or the retention where the store tells one.
func testLookup(t *testing.T, s stores.Store, k keys) {
	ctx := ctxWithTimeout(t)
	caps := s.Capabilities()
	want := func(key string, state stores.State, within time.Duration, when string) {
		t.Helper()
		r := lookup(t, s, ctx, key, when)
		if r.State != state {
			t.Fatalf("Lookup(%q) %s = %v, want %v", key, when, r.State, state)
		}
		switch {
		case within == 0 && !r.ExpiresAt.IsZero():
			t.Fatalf("Lookup(%q) %s: expires %v, want no expiry", key, when, r.ExpiresAt)
		case within > 0 && !r.ExpiresAt.IsZero() &&
			(r.ExpiresAt.Before(time.Now()) || r.ExpiresAt.After(time.Now().Add(within+time.Second))):
			t.Fatalf("Lookup(%q) %s: expiry %v is not within %v", key, when, r.ExpiresAt, within)
		}
	}
	key := k.of(t, "a")
	want(key, stores.StateUnknown, 0, "of an unknown key")
	if caps.Claims {
		claim(t, s, ctx, key, time.Minute, true, "of a new key")
		want(key, stores.StateInFlight, time.Minute, "while claimed")
	}
	must(t, remember(ctx, s, key), "Remember")
	want(key, stores.StateRemembered, caps.TTL, "after Remember")
	must(t, s.Forget(ctx, key), "Forget")
	want(key, stores.StateUnknown, 0, "after Forget")
}

// testClaimsRefused: a store that declares no claims refuses them, and
// their renewal.
func testClaimsRefused(t *testing.T, s stores.Store, k keys) {
	ctx := ctxWithTimeout(t)
	key := k.of(t, "a")
	if claimed, _, err := s.Claim(ctx, key, time.Minute); !errors.Is(err, stores.ErrNotSupported) || claimed {
		t.Fatalf("Claim on a store without claims = %v, %v; want an error matching stores.ErrNotSupported", claimed, err)
	}
	if held, err := s.Extend(ctx, key, time.Minute); !errors.Is(err, stores.ErrNotSupported) || held {
		t.Fatalf("Extend on a store without claims = %v, %v; want an error matching stores.ErrNotSupported", held, err)
	}
	wantSeen(t, s, ctx, key, false, "after a refused Claim")
}

// testClaimFinds: a claim that fails returns the record in its way, with
// its fingerprint and value.
func testClaimFinds(t *testing.T, s stores.Store, k keys, lease time.Duration) {
	ctx := ctxWithTimeout(t)
	caps := s.Capabilities()
	want := func(ctx context.Context, key string, l time.Duration, claimed bool, state stores.State, fp uint64, when string) stores.Record {
		t.Helper()
		c, found, err := s.Claim(ctx, key, l)
		if err != nil {
			t.Fatalf("Claim(%q) %s: %v", key, when, err)
		}
		if c != claimed || found.State != state || found.Fingerprint != fp {
			t.Fatalf("Claim(%q) %s = claimed %v, found %v with fingerprint %d; want %v, %v, %d", key, when, c, found.State, found.Fingerprint, claimed, state, fp)
		}
		return found
	}
	a, b := stores.WithClaimToken(ctx, "a"), stores.WithClaimToken(ctx, "b")
	key := k.of(t, "new")
	want(a, key, time.Minute, true, stores.StateUnknown, 0, "of a new key")
	if found := want(b, key, time.Minute, false, stores.StateInFlight, 0, "of a key claimed by another delivery"); !found.ExpiresAt.IsZero() &&
		(found.ExpiresAt.Before(time.Now()) || found.ExpiresAt.After(time.Now().Add(time.Minute+time.Second))) {
		t.Fatalf("Claim(%q) of a claimed key: the claim expires %v, not within its lease", key, found.ExpiresAt)
	}
	must(t, remember(a, s, key), "Remember by the holder")
	want(b, key, time.Minute, false, stores.StateRemembered, 0, "of a remembered key")
	if caps.Fingerprint != nil {
		fpKey := k.of(t, "fingerprinted")
		must(t, s.Remember(ctx, fpKey, 0xfeed, nil), "Remember with a fingerprint")
		want(b, fpKey, time.Minute, false, stores.StateRemembered, caps.Fingerprint(0xfeed), "of a key remembered with a fingerprint")
	}
	if caps.MaxValue > 0 {
		valued := k.of(t, "valued")
		must(t, s.Remember(ctx, valued, 0, []byte("the saved answer")), "Remember with a value")
		if found := want(b, valued, time.Minute, false, stores.StateRemembered, 0, "of a key remembered with a value"); string(found.Value) != "the saved answer" {
			t.Fatalf("Claim(%q) of a key remembered with a value found %q, want %q", valued, found.Value, "the saved answer")
		}
	}
	lapsed := k.of(t, "lapsed")
	want(a, lapsed, lease, true, stores.StateUnknown, 0, "of a new key, short lease")
	time.Sleep(2*lease + 50*time.Millisecond)
	want(b, lapsed, time.Minute, true, stores.StateUnknown, 0, "after the lease lapsed")
	// It is a claim like any other: Release and the contract still hold.
	wantSeen(t, s, ctx, lapsed, false, "while claimed")
	must(t, s.Release(b, lapsed), "Release")
	want(a, lapsed, time.Minute, true, stores.StateUnknown, 0, "after the holder released it")
}

// testFingerprints: a fingerprint is kept with its record in the store's
// form, and a later Remember replaces it.
func testFingerprints(t *testing.T, s stores.Store, k keys) {
	ctx := ctxWithTimeout(t)
	caps := s.Capabilities()
	want := func(key string, state stores.State, fp uint64, when string) {
		t.Helper()
		r := lookup(t, s, ctx, key, when)
		if r.State != state || r.Fingerprint != fp {
			t.Fatalf("Lookup(%q) %s = %v with fingerprint %d; want %v, %d", key, when, r.State, r.Fingerprint, state, fp)
		}
	}
	for _, fp := range []uint64{1, 0xdeadbeefcafe, 1<<64 - 1} {
		key := k.of(t, fmt.Sprintf("fp-%x", fp))
		want(key, stores.StateUnknown, 0, "of an unknown key")
		must(t, s.Remember(ctx, key, fp, nil), "Remember with a fingerprint")
		want(key, stores.StateRemembered, caps.Fingerprint(fp), "after Remember with a fingerprint")
		must(t, remember(ctx, s, key), "Remember over it")
		want(key, stores.StateRemembered, 0, "after a Remember without one (no fingerprint kept)")
	}
	if caps.Claims {
		key := k.of(t, "claimed")
		claim(t, s, ctx, key, time.Minute, true, "of a new key")
		want(key, stores.StateInFlight, 0, "while only claimed")
	}
}

// testValues: a value is kept byte for byte with its record, replaced or
// dropped by a later Remember, and one over MaxValue is refused.
func testValues(t *testing.T, s stores.Store, k keys) {
	ctx := ctxWithTimeout(t)
	caps := s.Capabilities()
	want := func(key string, value []byte, fp uint64, when string) {
		t.Helper()
		r := lookup(t, s, ctx, key, when)
		if !r.Remembered() || !bytes.Equal(r.Value, value) || (value == nil) != (r.Value == nil) || r.Fingerprint != fp {
			t.Fatalf("Lookup(%q) %s = %v, value of %d bytes %.64q (nil %v), fingerprint %d; want remembered, %d bytes %.64q (nil %v), %d",
				key, when, r.State, len(r.Value), r.Value, r.Value == nil, r.Fingerprint, len(value), value, value == nil, fp)
		}
	}
	binary := make([]byte, 256)
	for i := range binary {
		binary[i] = byte(i)
	}
	big := bytes.Repeat([]byte("0123456789abcdef"), min(caps.MaxValue, 1<<20)/16)
	const whole uint64 = 0xfeedfacecafebeef // beyond any reduced form
	for name, value := range map[string][]byte{
		"text": []byte(`{"status":201,"body":"ok"}`), "binary": binary, "colons": []byte("a:b:c:"),
		"largest": big, "empty": {},
	} {
		key := k.of(t, name)
		must(t, s.Remember(ctx, key, whole, value), "Remember with a value ("+name+")")
		want(key, value, whole, "after Remember with a value ("+name+")")
	}
	// A record with a value is compared on all 64 bits: content whose
	// fingerprint the store's reduced form cannot tell from the record's
	// does not match it.
	twin := whole ^ 1
	for d := uint64(1); d < 1<<16; d++ {
		if caps.KeptFingerprint(whole+d) == caps.KeptFingerprint(whole) {
			twin = whole + d
			break
		}
	}
	r := lookup(t, s, ctx, k.of(t, "text"), "of a record with a value")
	if !caps.Matches(r.Fingerprint, whole) || caps.Matches(r.Fingerprint, twin) {
		t.Fatalf("a record with a value kept fingerprint %x: Matches(%x) = %v, Matches(%x) = %v; want true, false (a record with a value keeps all 64 bits)",
			r.Fingerprint, whole, caps.Matches(r.Fingerprint, whole), twin, caps.Matches(r.Fingerprint, twin))
	}
	key := k.of(t, "replaced")
	must(t, s.Remember(ctx, key, 0, []byte("first")), "Remember with a value")
	must(t, s.Remember(ctx, key, 0, []byte("second")), "Remember with another value")
	want(key, []byte("second"), 0, "after a second Remember with a value")
	must(t, remember(ctx, s, key), "Remember without a value")
	want(key, nil, 0, "after a Remember without a value")

	tooLarge := k.of(t, "too-large")
	if err := s.Remember(ctx, tooLarge, 0, make([]byte, caps.MaxValue+1)); !errors.Is(err, stores.ErrValueTooLarge) {
		t.Fatalf("Remember with a value of MaxValue+1 bytes: %v, want an error matching stores.ErrValueTooLarge", err)
	}
	wantSeen(t, s, ctx, tooLarge, false, "after a refused Remember")
}

// testSameHolder: a holder that claims its own live claim again (its client
// sent the command again after losing the reply) is told it holds it, while
// every other holder is still kept out.
func testSameHolder(t *testing.T, s stores.Store, k keys) {
	c := s
	base := ctxWithTimeout(t)
	a, b := stores.WithClaimToken(base, "holder-a"), stores.WithClaimToken(base, "holder-b")
	key := k.of(t, "a")
	claim(t, c, a, key, time.Minute, true, "of a new key")
	claim(t, c, a, key, time.Minute, true, "again by the same holder (its reply was lost)")
	claim(t, c, b, key, time.Minute, false, "by another holder after the holder claimed twice")
	wantSeen(t, s, base, key, false, "while claimed twice by one holder")
	if _, found, err := c.Claim(b, key, time.Minute); err != nil || found.State != stores.StateInFlight {
		t.Fatalf("Claim by another holder found %v, %v; want in flight", found.State, err)
	}
	must(t, c.Release(a, key), "Release by the holder")
	claim(t, c, b, key, time.Minute, true, "after the holder released it")
	must(t, remember(b, s, key), "Remember")
	claim(t, c, b, key, time.Minute, false, "of a remembered key, by the holder that remembered it")
}

// testUnnamedRelease: a Release that names no holder acts for the store
// instance, not for every holder: it leaves a delivery's claim alone.
func testUnnamedRelease(t *testing.T, s stores.Store, k keys) {
	c := s
	base := ctxWithTimeout(t)
	named := stores.WithClaimToken(base, "delivery")
	key := k.of(t, "a")
	claim(t, c, named, key, time.Minute, true, "by a named holder")
	must(t, c.Release(base, key), "Release naming no holder")
	claim(t, c, stores.WithClaimToken(base, "probe"), key, time.Minute, false, "after a Release naming no holder (the named claim must survive)")
	claim(t, c, base, key, time.Minute, false, "naming no holder, while a named holder has it")
	must(t, c.Release(named, key), "Release by the named holder")
	claim(t, c, base, key, time.Minute, true, "naming no holder, after the named holder released")
	claim(t, c, named, key, time.Minute, false, "by the named holder while the instance holds it")
	must(t, c.Release(base, key), "Release naming no holder, of the instance's claim")
	claim(t, c, named, key, time.Minute, true, "after the instance released its claim")
}

// testInstancesAreHolders: two instances of one store (two workers) claim
// without naming a holder. Each instance is a holder of its own: the worker
// whose lease lapsed cannot release the claim the other took after it.
func testInstancesAreHolders(t *testing.T, first, second stores.Store, k keys, lease time.Duration) {
	one, two := first, second
	ctx := ctxWithTimeout(t)
	// The first checks hold while the first instance's lease runs: a round
	// that a loaded machine stretched past it tells nothing, and runs again
	// with a fresh key (a few times at most).
	var key string
	for round := 1; ; round++ {
		key = k.of(t, fmt.Sprintf("a%d", round))
		sent := time.Now() // the first's claim lapses no earlier than sent + lease
		claim(t, one, ctx, key, lease, true, "on the first instance")
		took, _, err := two.Claim(ctx, key, time.Minute)
		must(t, err, "Claim on the second instance while the first holds it")
		must(t, two.Release(ctx, key), "Release on the second instance of the first's claim")
		tookAfterRelease, _, err := two.Claim(ctx, key, time.Minute)
		must(t, err, "Claim on the second instance after it released what it did not hold")
		if time.Since(sent) >= lease {
			if round < 5 {
				continue
			}
			t.Skipf("the machine is too slow to check a %v lease (5 rounds)", lease)
		}
		if took || tookAfterRelease {
			t.Fatalf("Claim(%q) on the second instance while the first holds it = %v, after it released what it did not hold = %v; want false, false", key, took, tookAfterRelease)
		}
		break
	}
	time.Sleep(2*lease + 50*time.Millisecond)
	claim(t, two, ctx, key, time.Minute, true, "on the second instance after the first's lease lapsed")
	must(t, one.Release(ctx, key), "late Release on the first instance")
	claim(t, one, ctx, key, time.Minute, false, "on the first instance after its late Release (the second's claim must survive)")
	claim(t, one, stores.WithClaimToken(ctx, "probe"), key, time.Minute, false, "by a named holder after the late Release")
	must(t, two.Release(ctx, key), "Release on the second instance")
	claim(t, one, ctx, key, time.Minute, true, "on the first instance after the second released")
	must(t, remember(ctx, first, key), "Remember on the first instance")
	wantSeen(t, second, ctx, key, true, "on the second instance after the first remembered it")
	must(t, two.Release(ctx, key), "Release on the second instance of a remembered key")
	wantSeen(t, first, ctx, key, true, "after a Release of a remembered key")
}

// Durations beyond what a store can represent: 250 years (past the year
// 2262, where Unix nanoseconds end) and the largest time.Duration.
var hugeDurations = []time.Duration{250 * 365 * 24 * time.Hour, time.Duration(1<<63 - 1)}

// testHugeLease: a lease of any length holds, and never wraps into a claim
// born lapsed.
func testHugeLease(t *testing.T, s stores.Store, k keys) {
	c := s
	ctx := ctxWithTimeout(t)
	for _, lease := range hugeDurations {
		key := k.of(t, lease.String())
		claim(t, c, stores.WithClaimToken(ctx, "a"), key, lease, true, fmt.Sprintf("for %v", lease))
		claim(t, c, stores.WithClaimToken(ctx, "b"), key, time.Minute, false, fmt.Sprintf("by another holder within a lease of %v", lease))
		if r := lookup(t, s, ctx, key, "after a huge claim"); r.State != stores.StateInFlight || (!r.ExpiresAt.IsZero() && r.ExpiresAt.Before(time.Now().AddDate(200, 0, 0))) {
			t.Fatalf("Lookup(%q) after a claim for %v = %v expiring %v, want in flight for centuries", key, lease, r.State, r.ExpiresAt)
		}
		must(t, c.Release(stores.WithClaimToken(ctx, "a"), key), "Release")
	}
}

// testHugeTTL: a retention of any length keeps records, and never wraps into
// a record born expired.
func testHugeTTL(t *testing.T, newStore func(t *testing.T, ttl time.Duration) stores.Store, k keys) {
	for _, ttl := range hugeDurations {
		s := newStore(t, ttl)
		ctx := ctxWithTimeout(t)
		key := k.of(t, ttl.String())
		must(t, remember(ctx, s, key), fmt.Sprintf("Remember under a TTL of %v", ttl))
		wantSeen(t, s, ctx, key, true, fmt.Sprintf("under a TTL of %v", ttl))
		if s.Capabilities().Claims {
			claim(t, s, ctx, key, time.Minute, false, fmt.Sprintf("of a key remembered under a TTL of %v", ttl))
		}
		if r := lookup(t, s, ctx, key, "under a huge TTL"); r.State != stores.StateRemembered || (!r.ExpiresAt.IsZero() && r.ExpiresAt.Before(time.Now().AddDate(200, 0, 0))) {
			t.Fatalf("Lookup(%q) under a TTL of %v = %v expiring %v, want remembered for centuries", key, ttl, r.State, r.ExpiresAt)
		}
		must(t, s.Forget(ctx, key), "Forget")
	}
}

// extend calls Extend and fails unless it reports want.
func extend(t *testing.T, s stores.Store, ctx context.Context, key string, lease time.Duration, want bool, when string) {
	t.Helper()
	held, err := s.Extend(ctx, key, lease)
	if err != nil {
		t.Fatalf("Extend(%q, %v) %s: %v", key, lease, when, err)
	}
	if held != want {
		t.Fatalf("Extend(%q, %v) %s = %v, want %v", key, lease, when, held, want)
	}
}

// testExtendKeeps: the holder's Extend sets its claim's lease from now, so
// a claim renewed before it runs out outlives its first lease; and a
// short lease given to Extend is honoured too (the claim lapses with it).
//
// The Extend must come back within the short lease for its answer to
// count: on a machine so loaded that it came back later, the claim may
// rightly have lapsed, and the test starts again on a new key (at most
// three times).
func testExtendKeeps(t *testing.T, s stores.Store, k keys, lease time.Duration) {
	base := ctxWithTimeout(t)
	a, b := stores.WithClaimToken(base, "holder-a"), stores.WithClaimToken(base, "holder-b")
	var key string
	for attempt := 1; ; attempt++ {
		key = k.of(t, fmt.Sprintf("a%d", attempt))
		start := time.Now()
		claim(t, s, a, key, lease, true, "of a new key, for the short lease")
		held, err := s.Extend(a, key, time.Minute)
		if err != nil {
			t.Fatalf("Extend(%q, 1m) by the holder: %v", key, err)
		}
		if held {
			break
		}
		if took := time.Since(start); took < lease || attempt == 3 {
			t.Fatalf("Extend(%q, 1m) by the holder %v after its claim of %v began = false, want true", key, took, lease)
		}
		t.Logf("attempt %d: the claim and its Extend took longer than the lease of %v; again", attempt, lease)
	}
	time.Sleep(2*lease + 50*time.Millisecond)
	claim(t, s, b, key, time.Minute, false, "by another holder after the first lease, which the holder extended, would have passed")
	if r := lookup(t, s, base, key, "after the extension"); r.State != stores.StateInFlight ||
		(!r.ExpiresAt.IsZero() && time.Until(r.ExpiresAt) < 30*time.Second) {
		t.Fatalf("Lookup(%q) after a claim extended by a minute = %v expiring in %v, want in flight for about a minute",
			key, r.State, time.Until(r.ExpiresAt))
	}
	extend(t, s, a, key, time.Minute, true, "again by the holder")
	extend(t, s, a, key, lease, true, "by the holder, to the short lease")
	time.Sleep(2*lease + 50*time.Millisecond)
	claim(t, s, b, key, time.Minute, true, "by another holder after the short lease the holder extended to passed")
}

// testExtendNeverAnothers: only the holder extends a claim: another
// holder, and a caller naming none, get held false and change nothing.
func testExtendNeverAnothers(t *testing.T, s stores.Store, k keys) {
	base := ctxWithTimeout(t)
	a, b := stores.WithClaimToken(base, "holder-a"), stores.WithClaimToken(base, "holder-b")
	key := k.of(t, "a")
	claim(t, s, a, key, time.Minute, true, "of a new key")
	extend(t, s, b, key, time.Minute, false, "by another holder")
	extend(t, s, base, key, time.Minute, false, "naming no holder")
	claim(t, s, b, key, time.Minute, false, "by the other holder after its Extend")
	must(t, s.Release(a, key), "Release by the holder")
	extend(t, s, a, key, time.Minute, false, "by the holder after it released")
	if r := lookup(t, s, base, key, "after Extend of a released claim"); r.State != stores.StateUnknown {
		t.Fatalf("Lookup(%q) after an Extend of a released claim = %v, want unknown (Extend must not claim)", key, r.State)
	}
	claim(t, s, base, key, time.Minute, true, "naming no holder, after the holder released")
	extend(t, s, a, key, time.Minute, false, "by a named holder of the instance's claim")
	extend(t, s, base, key, time.Minute, true, "naming no holder, of the instance's own claim")
	must(t, s.Release(base, key), "Release naming no holder")
	extend(t, s, a, k.of(t, "never-claimed"), time.Minute, false, "of a key never claimed")
	if r := lookup(t, s, base, k.of(t, "never-claimed"), "after Extend of a key never claimed"); r.State != stores.StateUnknown {
		t.Fatalf("Lookup after an Extend of a key never claimed = %v, want unknown", r.State)
	}
}

// testExtendNeverARecord: a remembered key holds no claim to extend, not
// even for the holder whose claim the record replaced.
func testExtendNeverARecord(t *testing.T, s stores.Store, k keys) {
	base := ctxWithTimeout(t)
	a := stores.WithClaimToken(base, "holder-a")
	key := k.of(t, "a")
	claim(t, s, a, key, time.Minute, true, "of a new key")
	must(t, remember(a, s, key), "Remember by the holder")
	extend(t, s, a, key, time.Minute, false, "by the holder after it remembered the key")
	extend(t, s, base, key, time.Minute, false, "naming no holder, of a remembered key")
	wantSeen(t, s, base, key, true, "after Extend of a remembered key")
	plain := k.of(t, "remembered-without-claim")
	must(t, remember(base, s, plain), "Remember without a claim")
	extend(t, s, base, plain, time.Minute, false, "naming no holder, of a key remembered without a claim")
	wantSeen(t, s, base, plain, true, "after Extend of a key remembered without a claim")
}

// testLapsedNotHeld: a claim whose lease passed is not held any more, by
// every store alike (one that drops lapsed claims cannot tell one from
// none): Extend reports false and does not bring it back.
func testLapsedNotHeld(t *testing.T, s stores.Store, k keys, lease time.Duration) {
	base := ctxWithTimeout(t)
	a, b := stores.WithClaimToken(base, "holder-a"), stores.WithClaimToken(base, "holder-b")
	key := k.of(t, "a")
	claim(t, s, a, key, lease, true, "of a new key, for the short lease")
	time.Sleep(2*lease + 50*time.Millisecond)
	extend(t, s, a, key, time.Minute, false, "by the holder after its lease passed")
	claim(t, s, b, key, time.Minute, true, "by another holder after the lapsed claim's Extend")
	extend(t, s, a, key, time.Minute, false, "by the first holder of the claim another holder took over")
	claim(t, s, a, key, time.Minute, false, "by the first holder after its Extend failed")
}

// testRememberRefuses: Remember never writes over another holder's live
// claim (ErrClaimTaken, nothing written), but replaces the caller's own
// claim, a lapsed one, a record, or nothing.
func testRememberRefuses(t *testing.T, s stores.Store, k keys, lease time.Duration) {
	base := ctxWithTimeout(t)
	a, b := stores.WithClaimToken(base, "holder-a"), stores.WithClaimToken(base, "holder-b")
	key := k.of(t, "a")
	claim(t, s, a, key, time.Minute, true, "of a new key")
	if err := remember(b, s, key); !errors.Is(err, stores.ErrClaimTaken) {
		t.Fatalf("Remember by another holder over a live claim = %v, want an error matching stores.ErrClaimTaken", err)
	}
	if err := remember(base, s, key); !errors.Is(err, stores.ErrClaimTaken) {
		t.Fatalf("Remember naming no holder over a delivery's live claim = %v, want an error matching stores.ErrClaimTaken", err)
	}
	if r := lookup(t, s, base, key, "after refused Remembers"); r.State != stores.StateInFlight {
		t.Fatalf("Lookup(%q) after Remembers refused over a live claim = %v, want in flight (nothing written)", key, r.State)
	}
	extend(t, s, a, key, time.Minute, true, "by the holder after the refused Remembers")
	must(t, remember(a, s, key), "Remember by the holder")
	wantSeen(t, s, base, key, true, "after the holder remembered")
	must(t, remember(b, s, key), "Remember by another holder over a record")
	wantSeen(t, s, base, key, true, "after a second Remember")

	lapsed := k.of(t, "lapsed")
	claim(t, s, a, lapsed, lease, true, "of a new key, for the short lease")
	time.Sleep(2*lease + 50*time.Millisecond)
	must(t, remember(b, s, lapsed), "Remember by another holder over a lapsed claim")
	wantSeen(t, s, base, lapsed, true, "after a Remember over a lapsed claim")
	extend(t, s, a, lapsed, time.Minute, false, "by the lapsed claim's holder after another remembered the key")
}
