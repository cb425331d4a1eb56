package sdkstore_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/sdkstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestFailuresCapability: the Redis layouts keep failures, the SQL layouts
// say they do not, and refuse Fail and Reopen with ErrNotSupported.
func TestFailuresCapability(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	p := redisPrefix(t, client)
	for _, tc := range []struct {
		name  string
		store stores.Store
		keeps bool
	}{
		{"PHPRedis", ok(t)(sdkstore.NewPHPRedis(client, sdkstore.WithPrefix(p+":idem:"))), true},
		{"GoRedis", ok(t)(sdkstore.NewGoRedis(client, sdkstore.WithPrefix(p+":idemp:"))), true},
		{"PHPPDO", ok(t)(sdkstore.NewPHPPDO(testenv.Postgres(t), sdkstore.PostgreSQL)), false},
		{"GoPostgres", ok(t)(sdkstore.NewGoPostgres(testenv.Postgres(t))), false},
	} {
		if got := tc.store.Capabilities().Failures; got != tc.keeps {
			t.Errorf("%s: Capabilities().Failures = %v, want %v", tc.name, got, tc.keeps)
		}
		if tc.keeps {
			continue
		}
		if err := tc.store.Fail(context.Background(), "k", 0, stores.Failure{Attempts: 1}); !errors.Is(err, stores.ErrNotSupported) {
			t.Errorf("%s: Fail = %v, want ErrNotSupported", tc.name, err)
		}
	}
}

// TestPHPRedisFailureKey: the PHP layout keeps a failing or ended record
// under a key of the kit's own beside the PHP SDK's, which the PHP SDK
// never reads and no record key of it can equal: "-fail:" after the prefix
// without its colon, or U+001E and "fail:" after a prefix without one.
func TestPHPRedisFailureKey(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	p := redisPrefix(t, client)
	for _, tc := range []struct{ prefix, want string }{
		{p + ":idem:", p + ":idem-fail:id-1"},
		{p + ":idem", p + ":idem\x1efail:id-1"},
	} {
		s := ok(t)(sdkstore.NewPHPRedis(client, sdkstore.WithPrefix(tc.prefix))).(*sdkstore.PHPRedisStore)
		if got := s.FailureKey("id-1"); got != tc.want {
			t.Fatalf("FailureKey with prefix %q = %q, want %q", tc.prefix, got, tc.want)
		}
		ctx := context.Background()
		if err := s.Fail(ctx, "id-1", 0, stores.Failure{Attempts: 2, FirstFailure: time.Now().Truncate(time.Millisecond)}); err != nil {
			t.Fatal(err)
		}
		if v, err := client.Get(ctx, tc.want).Result(); err != nil || !strings.HasPrefix(v, `f{"n":2,`) {
			t.Fatalf("failure key %q = %q, %v; want the failing record", tc.want, v, err)
		}
		if n, _ := client.Exists(ctx, s.RedisKey("id-1")).Result(); n != 0 {
			t.Fatal("Fail wrote the PHP SDK's key")
		}
	}
}

// TestMixedFleetFailuresOnRedis: on the Redis layouts the kit keeps a
// message's count and its end where the SDK never looks. An SDK consumer
// reads neither: it runs a message the kit counted, or ended, as it would
// any other, and once it succeeded its record is what both sides read: the
// kit skips the message, and its next claim drops the count or end it had
// kept. While the kit holds a claim that carries a count, a PHP consumer
// finds the message busy, as with any claim of the kit's.
func TestMixedFleetFailuresOnRedis(t *testing.T) {
	t.Parallel()
	for _, l := range layouts(t) {
		if !l.kit.Capabilities().Failures {
			continue
		}
		t.Run(l.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			f := newFleet(t, l)
			ids, _ := envelopes(t, 2)
			counted, ended := ids[0], ids[1]
			holder := stores.WithClaimToken(ctx, "kit-delivery")
			failure := stores.Failure{Attempts: 1, FirstFailure: time.Now().Truncate(time.Millisecond)}

			// The kit runs the first message, which fails; its claim carries
			// the count.
			if ok, _, err := l.kit.Claim(holder, counted, time.Minute); err != nil || !ok {
				t.Fatalf("kit claim = %v, %v", ok, err)
			}
			if err := l.kit.Fail(holder, counted, 0, failure); err != nil {
				t.Fatal(err)
			}
			if l.sdkSeesClaims {
				if ran, err := l.sdk.handle(ctx, counted, func() error { return f.run(counted) }); ran || !errors.Is(err, errParked) {
					t.Fatalf("a PHP consumer while the kit's claim carries a count: ran %v, %v; want parked", ran, err)
				}
			}
			if err := l.kit.Release(holder, counted); err != nil {
				t.Fatal(err)
			}
			if r, err := l.kit.Lookup(ctx, counted); err != nil || r.State != stores.StateFailing || r.Failure.Attempts != 1 {
				t.Fatalf("kit Lookup after the failure = %+v, %v; want failing with 1 run", r, err)
			}
			// The second ended (dead-lettered for good) on the kit.
			end := failure
			end.End = &stores.End{Reason: "failed", At: time.Now().Truncate(time.Millisecond)}
			if err := l.kit.Fail(ctx, ended, 0, end); err != nil {
				t.Fatal(err)
			}

			// The SDK consumer gets both, and runs both.
			for _, id := range ids {
				f.deliverSDK(ctx, id)
			}
			if n := f.bySDK.Load(); n != 2 {
				t.Fatalf("the SDK consumer ran %d of the 2 messages, want both (it reads no count, no end)", n)
			}
			for _, id := range ids {
				if r, err := l.kit.Lookup(ctx, id); err != nil || !r.Remembered() {
					t.Fatalf("kit Lookup of %s after the SDK ran it = %+v, %v; want remembered", id, r, err)
				}
				if got, found, err := l.kit.Claim(stores.WithClaimToken(ctx, "redelivery"), id, time.Minute); err != nil || got || !found.Remembered() {
					t.Fatalf("kit claim of %s after the SDK ran it = %v, %+v, %v; want the record", id, got, found, err)
				}
			}
			if err := f.effects.ExactlyOnce(ids); err != nil {
				t.Fatal(err)
			}
			// The kit's claim dropped what it had kept beside the records.
			client := testenv.Redis(t)
			for _, id := range ids {
				var kept string
				switch s := l.kit.(type) {
				case *sdkstore.PHPRedisStore:
					kept = s.FailureKey(id)
				case *sdkstore.GoRedisStore:
					kept = s.ClaimKey(id)
				}
				if n, err := client.Exists(ctx, kept).Result(); err != nil || n != 0 {
					t.Fatalf("%s: %q still held (%d, %v) after the kit found the SDK's record", id, kept, n, err)
				}
			}
		})
	}
}
