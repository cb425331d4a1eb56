package httpidempotency_test

import (
	"context"
	"database/sql"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/middleware/httpidempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// vanishing is a real response store whose records lapse exactly between
// the guard's look at the identity record and its look at the response:
// every Lookup forgets the key first.
type vanishing struct{ stores.Store }

func (v vanishing) Lookup(ctx context.Context, key string) (stores.Record, error) {
	if err := v.Store.Forget(ctx, key); err != nil {
		return stores.Record{}, err
	}
	return v.Store.Lookup(ctx, key)
}

// A retry landing as the response tier lapses (the response gone between
// the identity lookup and the response lookup) gets the compact replay,
// never a second run; another body then is still 422.
func TestTiersResponseLapsesMidRetry(t *testing.T) {
	eachTiered(t, time.Hour, 0, func(t *testing.T, b tiered) {
		api := newOrdersAPI(t, b.backend, withGuardOptions(httpidempotency.WithResponseStore(vanishing{b.responses})))
		req := request{auth: "u1@acme", key: "k-" + testenv.RandomHex(4), body: orderBody(500, "EUR")}
		first := api.post(t, req)
		if first.status != http.StatusCreated {
			t.Fatalf("first: %d %s", first.status, first.body)
		}
		requireCompact(t, api.post(t, req), first, httpidempotency.ResponseExpired)
		other := req
		other.body = orderBody(501, "EUR")
		if r := api.post(t, other); r.status != http.StatusUnprocessableEntity || r.problemType(t) != httpidempotency.ProblemKeyReused {
			t.Fatalf("another body: %d %s", r.status, r.body)
		}
		api.requireRuns(t, 1)
	})
}

// Two tenants using one key get a record each in both tiers: each retry
// gets its own tenant's response, full or compact, and a caller that may
// no longer see the response gets 403 from the compact tier too.
func TestTiersTenantIsolation(t *testing.T) {
	eachTiered(t, time.Hour, 0, func(t *testing.T, b tiered) {
		api := newOrdersAPI(t, b.backend, withGuardOptions(httpidempotency.WithResponseStore(b.responses)))
		key := "shared-" + testenv.RandomHex(4)
		reqA := request{auth: "ua@acme", key: key, body: orderBody(700, "EUR")}
		reqB := request{auth: "ub@globex", key: key, body: orderBody(700, "EUR")}
		firstA, firstB := api.post(t, reqA), api.post(t, reqB)
		if firstA.status != http.StatusCreated || firstB.status != http.StatusCreated || firstB.header.Get(httpidempotency.HeaderReplayed) != "" {
			t.Fatalf("first requests: %d %s / %d %v %s", firstA.status, firstA.body, firstB.status, firstB.header, firstB.body)
		}
		if firstA.header.Get("Location") == firstB.header.Get("Location") {
			t.Fatalf("two tenants got one order: %s", firstA.header.Get("Location"))
		}
		requireFull(t, api.post(t, reqA), firstA)
		requireFull(t, api.post(t, reqB), firstB)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		// The response tier lapses for acme only: globex keeps its full one.
		if err := b.responses.Forget(ctx, httpidempotency.RecordKey("acme", "orders.create", key)); err != nil {
			t.Fatal(err)
		}
		requireCompact(t, api.post(t, reqA), firstA, httpidempotency.ResponseExpired)
		requireFull(t, api.post(t, reqB), firstB)
		api.revoked.Store("ua", true)
		if r := api.post(t, reqA); r.status != http.StatusForbidden || r.problemType(t) != httpidempotency.ProblemReplayForbidden {
			t.Fatalf("a revoked caller from the compact tier: %d %s", r.status, r.body)
		}
		api.requireRuns(t, 2)
	})
}

// proxiedResponses is a redisstore on the real Redis behind a fault proxy,
// with the response lifetime ttl.
func proxiedResponses(t *testing.T, ttl time.Duration) (*redisstore.Store, *testenv.FaultProxy) {
	t.Helper()
	direct := testenv.Redis(t)
	proxy := testenv.NewFaultProxy(t, direct.Options().Addr)
	client := redis.NewClient(&redis.Options{Addr: proxy.Addr(), DB: direct.Options().DB, MaxRetries: -1,
		DialTimeout: 2 * time.Second, ReadTimeout: 2 * time.Second, WriteTimeout: 2 * time.Second})
	t.Cleanup(func() { _ = client.Close() })
	prefix := randomName("htf") + ":"
	// Registered after the proxy's, so run before it closes: then again
	// once it has, in case a reply it held landed late.
	t.Cleanup(func() { _ = testenv.DropKeys(context.Background(), direct, prefix+"*") })
	return redisstore.New(client, redisstore.WithPrefix(prefix), redisstore.WithTTL(ttl)), proxy
}

// The response store down or slow: the first request still gets its
// response (the identity record is written); a retry gets the compact
// replay (ResponseExpired when the response was never saved,
// ResponseUnavailable when it cannot be read now), never a second run; a
// changed body is 422 whatever the response store does.
func TestTiersResponseStoreDown(t *testing.T) {
	for _, name := range []string{"memory", "redis", "postgres", "postgres-tx"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := newTiered(t, name, time.Hour, 0)
			responses, proxy := proxiedResponses(t, time.Hour)
			api := newOrdersAPI(t, b.backend, withGuardOptions(httpidempotency.WithResponseStore(responses),
				httpidempotency.WithStoreTimeout(time.Second)))

			// Down while the first request saves its response.
			proxy.Cut()
			req := request{auth: "u1@acme", key: "down-" + testenv.RandomHex(4), body: orderBody(10, "EUR")}
			first := api.post(t, req)
			if first.status != http.StatusCreated || first.header.Get(httpidempotency.HeaderReplayed) != "" {
				t.Fatalf("first with the response store down: %d %s", first.status, first.body)
			}
			requireCompact(t, api.post(t, req), first, httpidempotency.ResponseUnavailable)
			proxy.Restore()
			requireCompact(t, api.post(t, req), first, httpidempotency.ResponseExpired) // never saved
			api.requireRuns(t, 1)

			// Saved, then down (and then slow) when a retry reads it.
			req2 := request{auth: "u1@acme", key: "read-" + testenv.RandomHex(4), body: orderBody(20, "EUR")}
			first2 := api.post(t, req2)
			untilFull(t, api, req2, first2)
			proxy.Cut()
			requireCompact(t, api.post(t, req2), first2, httpidempotency.ResponseUnavailable)
			other := req2
			other.body = orderBody(21, "EUR")
			if r := api.post(t, other); r.status != http.StatusUnprocessableEntity {
				t.Fatalf("another body with the response store down: %d %s", r.status, r.body)
			}
			proxy.Restore()
			proxy.Delay.Store(int64(4 * time.Second))
			start := time.Now()
			requireCompact(t, api.post(t, req2), first2, httpidempotency.ResponseUnavailable)
			if took := time.Since(start); took > 3500*time.Millisecond {
				t.Fatalf("a slow response store held the retry %v (store timeout 1s)", took)
			}
			proxy.Delay.Store(0)
			untilFull(t, api, req2, first2)
			api.requireRuns(t, 2)
		})
	}
}

// untilFull retries req until it gets the full replay of first, for as long
// as it gets the compact replay with ResponseUnavailable (a response store
// slower than the store timeout on a loaded machine), for 20s at most.
func untilFull(t *testing.T, api *ordersAPI, req request, first reply) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		r := api.post(t, req)
		if r.header.Get(httpidempotency.HeaderResponse) == "" || time.Now().After(deadline) {
			requireFull(t, r, first)
			return
		}
		requireCompact(t, r, first, httpidempotency.ResponseUnavailable)
		time.Sleep(100 * time.Millisecond)
	}
}

// failingWrites is a real response store whose Remember fails while fail
// is set (a response store down for one request's write).
type failingWrites struct {
	stores.Store
	fail *atomic.Bool
}

var errResponseStoreDown = errors.New("the response store is down")

func (f failingWrites) Remember(ctx context.Context, key string, fp uint64, value []byte) error {
	if f.fail.Load() {
		return errResponseStoreDown
	}
	return f.Store.Remember(ctx, key, fp, value)
}

// A server killed between the two writes (the response saved, the
// identity record not: its claim lapses) leaves a response behind. The
// retry runs again, as with one tier; if that run's response cannot be
// saved, a later retry gets the compact replay of that run, never the
// response the crashed run left.
func TestTiersCrashBetweenWrites(t *testing.T) {
	eachTiered(t, time.Hour, 0, func(t *testing.T, b tiered) {
		fail := new(atomic.Bool)
		api := newOrdersAPI(t, b.backend, withGuardOptions(httpidempotency.WithResponseStore(failingWrites{b.responses, fail})))
		req := request{auth: "u1@acme", key: "crash-" + testenv.RandomHex(4), body: orderBody(30, "EUR")}
		rk := httpidempotency.RecordKey("acme", "orders.create", req.key)
		crashed := api.post(t, req)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		// What the crash leaves: the response, no identity record (its
		// claim lapsed).
		if err := b.store.Forget(ctx, rk); err != nil {
			t.Fatal(err)
		}
		fail.Store(true)
		rerun := api.post(t, req)
		fail.Store(false)
		if rerun.status != http.StatusCreated || rerun.header.Get(httpidempotency.HeaderReplayed) != "" ||
			rerun.header.Get("Location") == crashed.header.Get("Location") {
			t.Fatalf("the run after the crash: %d %v %s (the crashed run's: %v)", rerun.status, rerun.header, rerun.body, crashed.header)
		}
		requireCompact(t, api.post(t, req), rerun, httpidempotency.ResponseExpired)
		api.requireRuns(t, 2)
	})
}

// Records saved by a Guard with one tier are replayed in full by a Guard
// with two over the same store (an upgrade), and the identity records of
// a Guard with two tiers are answered compactly by one that no longer has
// them (a downgrade of its configuration).
func TestTiersBackwardCompatible(t *testing.T) {
	for _, name := range []string{"memory", "redis", "postgres", "postgres-tx"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := newTiered(t, name, time.Hour, 0)
			one := newOrdersAPI(t, b.backend)
			two := newOrdersAPI(t, b.backend, withGuardOptions(httpidempotency.WithResponseStore(b.responses)))
			if b.tx {
				two.table = one.table // one orders table, for orders()
			}
			req := request{auth: "u1@acme", key: "old-" + testenv.RandomHex(4), body: orderBody(40, "EUR")}
			first := one.post(t, req)
			requireFull(t, two.post(t, req), first)
			two.requireRuns(t, 0)

			req2 := request{auth: "u1@acme", key: "new-" + testenv.RandomHex(4), body: orderBody(41, "EUR")}
			first2 := two.post(t, req2)
			requireFull(t, two.post(t, req2), first2)
			requireCompact(t, one.post(t, req2), first2, httpidempotency.ResponseExpired)
			one.requireRuns(t, 1)
		})
	}
}

// In the transactional mode, a response store that is a TxStore but
// cannot write in the handler's transaction (on another database: its
// statement fails there) does not fail the request: the response is
// written outside the transaction, and the transaction still commits.
func TestTiersTxResponseStoreElsewhere(t *testing.T) {
	t.Parallel()
	b := newBackend(t, "postgres-tx", 0)
	responses := newPostgresStore(t, b.db, "httpresp_", time.Hour)
	var broken atomic.Bool
	broken.Store(true)
	api := newOrdersAPI(t, b, withGuardOptions(httpidempotency.WithResponseStore(txBroken{responses, &broken})))
	req := request{auth: "u1@acme", key: "else-" + testenv.RandomHex(4), body: orderBody(50, "EUR")}
	first := api.post(t, req)
	if first.status != http.StatusCreated {
		t.Fatalf("first: %d %s", first.status, first.body)
	}
	requireFull(t, api.post(t, req), first)
	api.requireRuns(t, 1)
	if ids := api.orders(t, "acme", req.key); len(ids) != 1 {
		t.Fatalf("orders %v", ids)
	}
}

// txBroken is a real postgresstore whose RememberTx sends a statement the
// database refuses while broken is set, as a store on another database
// does inside this one's transaction.
type txBroken struct {
	*postgresstore.Store
	broken *atomic.Bool
}

func (s txBroken) RememberTx(ctx context.Context, tx *sql.Tx, key string, fp uint64, value []byte) (bool, stores.Record, error) {
	if s.broken.Load() {
		_, err := tx.ExecContext(ctx, "SELECT * FROM httpidempotency_no_such_table")
		return false, stores.Record{}, err
	}
	return s.Store.RememberTx(ctx, tx, key, fp, value)
}

// New and Wrap refuse tiers that cannot hold: the response store keeping
// records forever, longer than the identity store, or being the same
// store; an ExpiresAfter shorter than the response lifetime; Compact
// without tiers.
func TestTiersChecks(t *testing.T) {
	t.Parallel()
	tenant := func(*http.Request) (string, error) { return "acme", nil }
	for _, c := range []struct {
		name          string
		store, second stores.Store
		same          bool
		want          string
	}{
		{"response store forever", memstore.New(memstore.WithTTL(time.Hour)), memstore.New(), false, "forever"},
		{"response store outlives identities", memstore.New(memstore.WithTTL(time.Hour)), memstore.New(memstore.WithTTL(2 * time.Hour)), false, "longer than the identity store"},
		{"one store for both", memstore.New(memstore.WithTTL(time.Hour)), nil, true, "two stores"},
		{"nil", memstore.New(), nil, false, "nil"},
	} {
		second := c.second
		if c.same {
			second = c.store
		}
		_, err := httpidempotency.New(c.store, tenant, httpidempotency.WithResponseStore(second))
		if !errors.Is(err, httpidempotency.ErrInvalidOption) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want ErrInvalidOption about %q", c.name, err, c.want)
		}
	}
	for _, ttl := range []time.Duration{0, 24 * time.Hour} { // forever, or as long as the responses
		if _, err := httpidempotency.New(memstore.New(memstore.WithTTL(ttl)), tenant,
			httpidempotency.WithResponseStore(memstore.New(memstore.WithTTL(24*time.Hour)))); err != nil {
			t.Errorf("identity TTL %v: %v", ttl, err)
		}
	}
	g, _ := httpidempotency.New(memstore.New(memstore.WithTTL(30*24*time.Hour)), tenant,
		httpidempotency.WithResponseStore(memstore.New(memstore.WithTTL(24*time.Hour))))
	requirePanic(t, "shorter than the response store's TTL", func() {
		g.Wrap(httpidempotency.Operation{Name: "x", Expired: httpidempotency.ExpiredReject, ExpiresAfter: time.Hour}, http.NotFoundHandler())
	})
	g.Wrap(httpidempotency.Operation{Name: "x", Expired: httpidempotency.ExpiredReject, ExpiresAfter: 7 * 24 * time.Hour}, http.NotFoundHandler())
	one, _ := httpidempotency.New(memstore.New(), tenant)
	requirePanic(t, "WithResponseStore only", func() {
		one.Wrap(httpidempotency.Operation{Name: "x", Expired: httpidempotency.ExpiredIsNew,
			Compact: func(*http.Request, httpidempotency.Identity) (*httpidempotency.Response, error) { return nil, nil }}, http.NotFoundHandler())
	})
}

func requirePanic(t *testing.T, want string, fn func()) {
	t.Helper()
	defer func() {
		p := recover()
		if s, _ := p.(string); !strings.Contains(s, want) {
			t.Errorf("panic %v, want one about %q", p, want)
		}
	}()
	fn()
}
