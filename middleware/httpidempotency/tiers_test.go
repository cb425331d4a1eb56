package httpidempotency_test

import (
	"context"
	"database/sql"
	"encoding/json"
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

// tieredNames are the stores the two-tier tests run on: both tiers on the
// same kind of server, PostgreSQL also in the transactional mode (both
// tiers written in the handler's transaction).
var tieredNames = []string{"memory", "redis", "redis-cluster", "postgres", "postgres-tx"}

// tiered is a backend whose guard keeps identities in b.store and full
// responses in responses.
type tiered struct {
	backend
	responses stores.Store
}

// newTiered opens the named pair of stores: the identity store with
// retention idTTL (0: forever), the response store with respTTL.
func newTiered(t *testing.T, name string, respTTL, idTTL time.Duration) tiered {
	t.Helper()
	switch name {
	case "memory":
		return tiered{backend{name: name, store: memstore.New(memstore.WithTTL(idTTL))}, memstore.New(memstore.WithTTL(respTTL))}
	case "redis", "redis-cluster":
		var client redis.UniversalClient
		if name == "redis" {
			client = testenv.Redis(t)
		} else {
			client = testenv.RedisCluster(t)
		}
		prefix := randomName("ht") + ":"
		t.Cleanup(func() { _ = testenv.DropKeys(context.Background(), client, prefix+"*") })
		return tiered{
			backend{name: name, store: redisstore.New(client, redisstore.WithPrefix(prefix+"id:"), redisstore.WithTTL(idTTL))},
			redisstore.New(client, redisstore.WithPrefix(prefix+"resp:"), redisstore.WithTTL(respTTL)),
		}
	case "postgres", "postgres-tx":
		b := newBackend(t, name, idTTL)
		return tiered{b, newPostgresStore(t, b.db, "httpresp_", respTTL)}
	}
	t.Fatalf("unknown backend %q", name)
	return tiered{}
}

// newPostgresStore makes a postgresstore on a table of its own, dropped
// when the test ends.
func newPostgresStore(t testing.TB, db *sql.DB, prefix string, ttl time.Duration, opts ...postgresstore.Option) *postgresstore.Store {
	t.Helper()
	table := randomName(prefix)
	s, err := postgresstore.New(db, append([]postgresstore.Option{postgresstore.WithTable(table), postgresstore.WithTTL(ttl), postgresstore.WithLogger(nil)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dropTables(t, db, table) })
	return s
}

// eachTiered runs fn on every pair of stores, in parallel subtests.
func eachTiered(t *testing.T, respTTL, idTTL time.Duration, fn func(t *testing.T, b tiered)) {
	t.Parallel() // the test itself, beside the others
	for _, name := range tieredNames {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			fn(t, newTiered(t, name, respTTL, idTTL))
		})
	}
}

// waitGone polls s until it holds no record of key, or fails the test.
func waitGone(t *testing.T, s stores.Store, key string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		r, err := s.Lookup(ctx, key)
		cancel()
		if err == nil && r.State == stores.StateUnknown {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the record of %q is still there after %v (state %v, error %v)", key, within, r.State, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// compactOf reads the default compact replay's body.
func compactOf(t *testing.T, r reply) (status int, location, why string) {
	t.Helper()
	var v struct {
		Status   int    `json:"status"`
		Location string `json:"location"`
		Response string `json:"response"`
	}
	if err := json.Unmarshal(r.body, &v); err != nil {
		t.Fatalf("not a compact replay (status %d): %s", r.status, r.body)
	}
	return v.Status, v.Location, v.Response
}

// requireCompact checks that r is the compact replay of first, for why.
func requireCompact(t *testing.T, r, first reply, why string) {
	t.Helper()
	if r.status != first.status || r.header.Get(httpidempotency.HeaderReplayed) != "true" ||
		r.header.Get(httpidempotency.HeaderResponse) != why || r.header.Get("Location") != first.header.Get("Location") {
		t.Fatalf("want the compact replay (%d, Location %q, %s: %s), got %d %v %s", first.status, first.header.Get("Location"),
			httpidempotency.HeaderResponse, why, r.status, r.header, r.body)
	}
	status, location, got := compactOf(t, r)
	if status != first.status || location != first.header.Get("Location") || got != why {
		t.Fatalf("compact body %s, want status %d, location %q, response %q", r.body, first.status, first.header.Get("Location"), why)
	}
}

// requireFull checks that r is the full replay of first.
func requireFull(t *testing.T, r, first reply) {
	t.Helper()
	if r.status != first.status || r.header.Get(httpidempotency.HeaderReplayed) != "true" || string(r.body) != string(first.body) ||
		r.header.Get(httpidempotency.HeaderResponse) != "" || r.header.Get("Location") != first.header.Get("Location") {
		t.Fatalf("want the full replay of %d %s, got %d %v %s", first.status, first.body, r.status, r.header, r.body)
	}
}

func (a *ordersAPI) requireRuns(t *testing.T, want int64) {
	t.Helper()
	if got := a.runs.Load(); got != want {
		t.Fatalf("the handler ran %d times, want %d", got, want)
	}
}

// A retry within the response lifetime gets the full response; after it,
// within the identity lifetime, the compact replay with the original
// status and Location (the handler ran once); another body then is 422;
// after the identity lifetime, the Expired policy (ExpiredIsNew: a new
// request).
func TestTiersLifetimes(t *testing.T) {
	eachTiered(t, 3*time.Second, 9*time.Second, func(t *testing.T, b tiered) {
		api := newOrdersAPI(t, b.backend, withGuardOptions(httpidempotency.WithResponseStore(b.responses)))
		req := request{auth: "u1@acme", key: "k-" + testenv.RandomHex(4), body: orderBody(1299, "EUR")}
		rk := httpidempotency.RecordKey("acme", "orders.create", req.key)
		first := api.post(t, req)
		if first.status != http.StatusCreated || first.header.Get(httpidempotency.HeaderReplayed) != "" {
			t.Fatalf("first: %d %v %s", first.status, first.header, first.body)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if r, err := b.responses.Lookup(ctx, rk); err != nil || r.State != stores.StateRemembered {
			t.Fatalf("the response store holds no response right after the run: %v %v", r.State, err)
		}
		requireFull(t, api.post(t, req), first)

		waitGone(t, b.responses, rk, 20*time.Second)
		requireCompact(t, api.post(t, req), first, httpidempotency.ResponseExpired)
		api.requireRuns(t, 1)
		if ids := api.orders(t, "acme", req.key); len(ids) != 1 {
			t.Fatalf("orders %v, want one", ids)
		}
		other := req
		other.body = orderBody(1299, "USD")
		if r := api.post(t, other); r.status != http.StatusUnprocessableEntity || r.problemType(t) != httpidempotency.ProblemKeyReused {
			t.Fatalf("another body after the response tier lapsed: %d %s", r.status, r.body)
		}

		waitGone(t, b.store, rk, 30*time.Second)
		again := api.post(t, req)
		if again.status != http.StatusCreated || again.header.Get(httpidempotency.HeaderReplayed) != "" {
			t.Fatalf("past the identity lifetime (ExpiredIsNew) want a new run, got %d %v %s", again.status, again.header, again.body)
		}
		api.requireRuns(t, 2)
	})
}

// An Operation's Compact builds the answer once the full response lapsed
// (here: the order re-read by its reference), and goes through Authorize;
// Reference declares what the identity record keeps.
func TestTiersCompactHook(t *testing.T) {
	eachTiered(t, time.Hour, 0, func(t *testing.T, b tiered) {
		var seen atomic.Value
		api := newOrdersAPI(t, b.backend, withGuardOptions(httpidempotency.WithResponseStore(b.responses)),
			withOperation(func(op *httpidempotency.Operation) {
				op.Reference = func(status int, h http.Header, body []byte) string {
					return strings.TrimPrefix(h.Get("Location"), "/orders/")
				}
				op.Compact = func(r *http.Request, id httpidempotency.Identity) (*httpidempotency.Response, error) {
					seen.Store(id)
					return &httpidempotency.Response{Status: http.StatusOK,
						Header: http.Header{"Content-Type": {"application/json"}, "Location": {"/orders/" + id.Reference}},
						Body:   []byte(`{"order_id":"` + id.Reference + `","reread":true}`)}, nil
				}
			}))
		req := request{auth: "u1@acme", key: "hook-" + testenv.RandomHex(4), body: orderBody(60, "EUR")}
		first := api.post(t, req)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := b.responses.Forget(ctx, httpidempotency.RecordKey("acme", "orders.create", req.key)); err != nil {
			t.Fatal(err)
		}
		r := api.post(t, req)
		want := first.order(t).OrderID
		if r.status != http.StatusOK || r.header.Get(httpidempotency.HeaderReplayed) != "true" ||
			r.header.Get(httpidempotency.HeaderResponse) != httpidempotency.ResponseExpired ||
			string(r.body) != `{"order_id":"`+want+`","reread":true}` {
			t.Fatalf("the operation's compact answer: %d %v %s", r.status, r.header, r.body)
		}
		id, _ := seen.Load().(httpidempotency.Identity)
		if id.Status != http.StatusCreated || id.Reference != want || id.Subject != "u1" || id.Ref.Tenant != "acme" || id.Ref.Key != req.key || id.SavedAt.IsZero() {
			t.Fatalf("Compact saw %+v", id)
		}
		api.revoked.Store("u1", true)
		if r := api.post(t, req); r.status != http.StatusForbidden {
			t.Fatalf("a revoked caller: %d %s", r.status, r.body)
		}
		api.requireRuns(t, 1)
	})
}

// With ExpiredReject, ExpiresAfter is counted from the identity record:
// a retry gets the full response, then the compact one, then 422
// (ProblemKeyExpired) once ExpiresAfter passed, while the identity store
// still holds the record; never a second run.
func TestTiersExpiredReject(t *testing.T) {
	eachTiered(t, time.Second, time.Hour, func(t *testing.T, b tiered) {
		api := newOrdersAPI(t, b.backend, withGuardOptions(httpidempotency.WithResponseStore(b.responses)),
			withOperation(func(op *httpidempotency.Operation) {
				op.Expired, op.ExpiresAfter = httpidempotency.ExpiredReject, 3*time.Second
			}))
		req := request{auth: "u1@acme", key: "rej-" + testenv.RandomHex(4), body: orderBody(70, "EUR")}
		first := api.post(t, req)
		compact := false
		deadline := time.Now().Add(30 * time.Second)
		for {
			r := api.post(t, req)
			if r.status == http.StatusUnprocessableEntity {
				if p := r.problemType(t); p != httpidempotency.ProblemKeyExpired || !compact {
					t.Fatalf("422 %s after a compact replay: %v", p, compact)
				}
				break
			}
			if r.header.Get(httpidempotency.HeaderResponse) != "" {
				requireCompact(t, r, first, httpidempotency.ResponseExpired)
				compact = true
			} else {
				if compact {
					t.Fatalf("a full replay after a compact one: %s", r.body)
				}
				requireFull(t, r, first)
			}
			if time.Now().After(deadline) {
				t.Fatal("no 422 after 30s (ExpiresAfter 3s)")
			}
			time.Sleep(100 * time.Millisecond)
		}
		api.requireRuns(t, 1)
	})
}

// A response over what is saved is replayed compactly (its status and
// Location), not as a body-less 500.
func TestTiersOversizedResponse(t *testing.T) {
	for _, name := range []string{"memory", "redis", "postgres"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := newTiered(t, name, time.Hour, 0)
			api := newOrdersAPI(t, b.backend, withGuardOptions(httpidempotency.WithResponseStore(b.responses)),
				withOperation(func(op *httpidempotency.Operation) { op.MaxResponseBody = 1024 }),
				withSetup(func(a *ordersAPI) { a.pad = 4096 }))
			req := request{auth: "u1@acme", key: "big-" + testenv.RandomHex(4), body: orderBody(80, "EUR")}
			first := api.post(t, req)
			if first.status != http.StatusCreated || len(first.body) < 4096 {
				t.Fatalf("first: %d, %d bytes", first.status, len(first.body))
			}
			requireCompact(t, api.post(t, req), first, httpidempotency.ResponseExpired)
			api.requireRuns(t, 1)
		})
	}
}
