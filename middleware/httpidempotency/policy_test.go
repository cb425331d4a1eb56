package httpidempotency_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/middleware/httpidempotency"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestRequestsRefusedBeforeAnyRun: no key, an unusable key, two keys, no
// tenant, a body over the limit: each a problem, and the handler never
// runs.
func TestRequestsRefusedBeforeAnyRun(t *testing.T) {
	t.Parallel()
	api := newOrdersAPI(t, newBackend(t, "memory", 0), withOperation(func(op *httpidempotency.Operation) {
		op.MaxRequestBody = 1024
	}))
	body := orderBody(100, "EUR")
	cases := []struct {
		name    string
		req     request
		status  int
		problem string
	}{
		{"no key", request{auth: "alice@acme", body: body}, 400, httpidempotency.ProblemKeyMissing},
		{"empty quoted key", request{auth: "alice@acme", key: `""`, body: body}, 400, httpidempotency.ProblemKeyInvalid},
		{"key over 256 bytes", request{auth: "alice@acme", key: strings.Repeat("k", 257), body: body}, 400, httpidempotency.ProblemKeyInvalid},
		{"key of 8 KiB", request{auth: "alice@acme", key: strings.Repeat("k", 8<<10), body: body}, 400, httpidempotency.ProblemKeyInvalid},
		{"bad escape", request{auth: "alice@acme", key: `"a\b"`, body: body}, 400, httpidempotency.ProblemKeyInvalid},
		{"no closing quote", request{auth: "alice@acme", key: `"abc`, body: body}, 400, httpidempotency.ProblemKeyInvalid},
		{"not UTF-8", request{auth: "alice@acme", key: "k\xff", body: body}, 400, httpidempotency.ProblemKeyInvalid},
		{"no tenant", request{key: "k-1", body: body}, 401, httpidempotency.ProblemNoTenant},
		{"body over the limit", request{auth: "alice@acme", key: "k-1", body: `{"amount":1,"pad":"` + strings.Repeat("x", 2048) + `"}`}, 413, httpidempotency.ProblemBodyTooLarge},
	}
	for _, tc := range cases {
		r := api.post(t, tc.req)
		if r.status != tc.status || r.problemType(t) != tc.problem {
			t.Errorf("%s: %d %s, want %d %s", tc.name, r.status, r.body, tc.status, tc.problem)
		}
	}
	// Two Idempotency-Key headers.
	req, _ := http.NewRequest(http.MethodPost, api.server.URL+"/orders", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer alice@acme")
	req.Header.Add(httpidempotency.HeaderKey, "k-1")
	req.Header.Add(httpidempotency.HeaderKey, "k-2")
	resp, err := api.server.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != 400 {
		t.Errorf("two keys: %d, want 400", resp.StatusCode)
	}
	if runs := api.runs.Load(); runs != 0 {
		t.Fatalf("the handler ran %d times", runs)
	}
	// The quoted and the bare spelling are one key.
	first := api.post(t, request{auth: "alice@acme", key: `"k-\"1\""`, body: body})
	second := api.post(t, request{auth: "alice@acme", key: `k-"1"`, body: body})
	if first.status != 201 || second.header.Get(httpidempotency.HeaderReplayed) != "true" || string(first.body) != string(second.body) {
		t.Fatalf("quoted then bare: %d %s / %d %s", first.status, first.body, second.status, second.body)
	}
}

// TestKeyOptional: an operation with KeyOptional runs a request without a
// key every time, and one with a key once.
func TestKeyOptional(t *testing.T) {
	for _, name := range []string{"memory", "postgres-tx"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			api := newOrdersAPI(t, newBackend(t, name, 0), withOperation(func(op *httpidempotency.Operation) { op.KeyOptional = true }))
			for i := 0; i < 2; i++ {
				if r := api.post(t, request{auth: "alice@acme", body: orderBody(1, "EUR")}); r.status != 201 {
					t.Fatalf("no key: %d %s", r.status, r.body)
				}
				if r := api.post(t, request{auth: "alice@acme", key: "k", body: orderBody(1, "EUR")}); r.status != 201 {
					t.Fatalf("a key: %d %s", r.status, r.body)
				}
			}
			if runs := api.runs.Load(); runs != 3 {
				t.Fatalf("%d runs, want 3 (two without a key, one with)", runs)
			}
		})
	}
}

// TestExpiredIsNew: once the store's TTL let the record go, the key is a
// new request (a second order, as declared); before, a replay.
func TestExpiredIsNew(t *testing.T) {
	for _, name := range backendNames {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			const ttl = 400 * time.Millisecond
			api := newOrdersAPI(t, newBackend(t, name, ttl))
			req, first := withinWindow(t, api, ttl, "within the TTL")
			// Past the TTL the retry is a new order: asked until it is
			// (a replay meanwhile changes nothing).
			testenv.Eventually(t, "the key to be a new request past the TTL (it is still replayed)", func() bool {
				later := api.post(t, req)
				if later.header.Get(httpidempotency.HeaderReplayed) == "true" {
					return false
				}
				if later.status != 201 || later.order(t).OrderID == first.OrderID {
					t.Fatalf("after the TTL: %d %v %s", later.status, later.header, later.body)
				}
				return true
			})
		})
	}
}

// TestExpiredReject: a saved response past ExpiresAfter is refused with
// 422 key-expired while the store still holds the record; nothing runs.
func TestExpiredReject(t *testing.T) {
	for _, name := range backendNames {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			const window = 300 * time.Millisecond
			api := newOrdersAPI(t, newBackend(t, name, time.Hour), withOperation(func(op *httpidempotency.Operation) {
				op.Expired, op.ExpiresAfter = httpidempotency.ExpiredReject, window
			}))
			req, _ := withinWindow(t, api, window, "within the window")
			runs := api.runs.Load()
			testenv.Eventually(t, "the key to be refused past the window (it is still replayed)", func() bool {
				r := api.post(t, req)
				if r.header.Get(httpidempotency.HeaderReplayed) == "true" {
					return false
				}
				if r.status != 422 || r.problemType(t) != httpidempotency.ProblemKeyExpired {
					t.Fatalf("past the window: %d %s", r.status, r.body)
				}
				return true
			})
			if now := api.runs.Load(); now != runs {
				t.Fatalf("%d runs past the window, want none", now-runs)
			}
		})
	}
}

// TestExpiredResolve: a record the store lost (forgotten here, as an
// eviction would) is resolved through the business record: the retry gets
// the order made the first time, and no second order is made. A key the
// business record does not know runs.
func TestExpiredResolve(t *testing.T) {
	for _, name := range backendNames {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var api *ordersAPI
			api = newOrdersAPI(t, newBackend(t, name, 0), withOperation(func(op *httpidempotency.Operation) {
				op.Expired = httpidempotency.ExpiredResolve
				op.Resolve = func(ctx context.Context, r *http.Request, ref httpidempotency.Ref) (*httpidempotency.Response, error) {
					ids := api.orders(t, ref.Tenant, ref.Key)
					if len(ids) == 0 {
						return nil, nil
					}
					return &httpidempotency.Response{Status: http.StatusCreated,
						Header: http.Header{"Content-Type": {"application/json"}, "Location": {"/orders/" + ids[0]}},
						Body:   []byte(`{"order_id":"` + ids[0] + `"}`)}, nil
				}
			}))
			req := request{auth: "alice@acme", key: "k-1", body: orderBody(1, "EUR")}
			order := api.post(t, req).order(t)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if err := api.b.store.Forget(ctx, httpidempotency.RecordKey("acme", "orders.create", "k-1")); err != nil {
				t.Fatal(err)
			}
			r := api.post(t, req)
			if r.status != 201 || r.header.Get(httpidempotency.HeaderReplayed) != "true" || r.order(t).OrderID != order.OrderID {
				t.Fatalf("after the record was lost: %d %v %s", r.status, r.header, r.body)
			}
			api.revoked.Store("alice", true)
			if r := api.post(t, req); r.status != 403 {
				t.Fatalf("a resolved response to a caller without permission: %d %s", r.status, r.body)
			}
			if n := len(api.orders(t, "acme", "k-1")); n != 1 || api.runs.Load() != 1 {
				t.Fatalf("%d orders, %d runs; want 1, 1", n, api.runs.Load())
			}
		})
	}
}

// TestResponseOverTheLimit: in the claim mode the first caller gets its
// whole response and a retry a 500 naming the limit (the order is not made
// twice); in the transactional mode nothing commits and the caller gets
// that problem at once.
func TestResponseOverTheLimit(t *testing.T) {
	for _, name := range []string{"memory", "postgres-tx"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			api := newOrdersAPI(t, newBackend(t, name, 0), withOperation(func(op *httpidempotency.Operation) {
				op.MaxResponseBody = 4096
			}), withSetup(func(a *ordersAPI) { a.pad = 10000 }))
			req := request{auth: "alice@acme", key: "k-1", body: orderBody(1, "EUR")}
			first := api.post(t, req)
			if name == "postgres-tx" {
				if first.status != 500 || first.problemType(t) != httpidempotency.ProblemResponseTooLarge {
					t.Fatalf("transactional: %d %s", first.status, first.body)
				}
				if n := len(api.orders(t, "acme", "k-1")); n != 0 {
					t.Fatalf("%d orders committed, want 0", n)
				}
				return
			}
			if first.status != 201 || len(first.body) < 10000 {
				t.Fatalf("first: %d, %d bytes", first.status, len(first.body))
			}
			r := api.post(t, req)
			if r.status != 500 || r.problemType(t) != httpidempotency.ProblemResponseTooLarge {
				t.Fatalf("retry: %d %s", r.status, r.body)
			}
			if api.runs.Load() != 1 {
				t.Fatalf("%d runs", api.runs.Load())
			}
		})
	}
}

// TestStoreDownNothingRuns: a store that cannot be reached answers 503
// with Retry-After, and the handler does not run.
func TestStoreDownNothingRuns(t *testing.T) {
	t.Parallel()
	opts := *testenv.Redis(t).Options()
	proxy := testenv.NewFaultProxy(t, opts.Addr)
	opts.Addr = proxy.Addr()
	opts.MaxRetries = -1
	client := redis.NewClient(&opts)
	t.Cleanup(func() { _ = client.Close() })
	api := newOrdersAPI(t, backend{name: "redis", store: redisstore.New(client, redisstore.WithPrefix(randomName("hi")+":"))},
		withGuardOptions(httpidempotency.WithStoreTimeout(time.Second)))
	proxy.Cut() // the store's Redis is gone
	r := api.post(t, request{auth: "alice@acme", key: "k-1", body: orderBody(1, "EUR")})
	if r.status != 503 || r.problemType(t) != httpidempotency.ProblemStoreUnavailable || r.header.Get("Retry-After") == "" {
		t.Fatalf("%d %v %s", r.status, r.header, r.body)
	}
	if api.runs.Load() != 0 {
		t.Fatal("the handler ran")
	}
}

// TestOperationsMustDeclareTheirExpiry: an operation without an Expired
// policy, or with one the store cannot honour, is refused when it is
// wrapped.
func TestOperationsMustDeclareTheirExpiry(t *testing.T) {
	t.Parallel()
	b := newBackend(t, "memory", time.Minute)
	guard, err := httpidempotency.New(b.store, tenantOf)
	if err != nil {
		t.Fatal(err)
	}
	h := http.NotFoundHandler()
	for name, op := range map[string]httpidempotency.Operation{
		"no name":                 {Expired: httpidempotency.ExpiredIsNew},
		"no policy":               {Name: "x"},
		"reject without window":   {Name: "x", Expired: httpidempotency.ExpiredReject},
		"window beyond the TTL":   {Name: "x", Expired: httpidempotency.ExpiredReject, ExpiresAfter: time.Hour},
		"new with a window":       {Name: "x", Expired: httpidempotency.ExpiredIsNew, ExpiresAfter: time.Second},
		"resolve without Resolve": {Name: "x", Expired: httpidempotency.ExpiredResolve},
		"name with a separator":   {Name: "a\x1fb", Expired: httpidempotency.ExpiredIsNew},
		"response over the store": {Name: "x", Expired: httpidempotency.ExpiredIsNew, MaxResponseBody: 2 << 20},
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: Wrap accepted it", name)
				}
			}()
			guard.Wrap(op, h)
		}()
	}
	if _, err := httpidempotency.New(b.store, nil); err == nil {
		t.Error("New took no tenant function")
	}
	func() {
		defer func() {
			if recover() == nil {
				t.Error("WrapTx without WithTransaction")
			}
		}()
		guard.WrapTx(httpidempotency.Operation{Name: "x", Expired: httpidempotency.ExpiredIsNew}, nil)
	}()
}

// withinWindow posts a new key and its retry and checks that the retry
// is replayed, when both came within window of each other; when the
// machine was too slow for that (the check would say nothing), it starts
// again with a fresh key. It returns the request and the order made.
func withinWindow(t *testing.T, api *ordersAPI, window time.Duration, what string) (request, orderOut) {
	t.Helper()
	for attempt := 1; ; attempt++ {
		req := request{auth: "alice@acme", key: fmt.Sprintf("k-%d", attempt), body: orderBody(1, "EUR")}
		start := time.Now()
		first := api.post(t, req).order(t)
		again := api.post(t, req)
		if time.Since(start) >= window {
			if attempt == 20 {
				t.Fatalf("%s: 20 tries, none with both requests within %v of each other", what, window)
			}
			continue
		}
		if again.header.Get(httpidempotency.HeaderReplayed) != "true" {
			t.Fatalf("%s: %d %s", what, again.status, again.body)
		}
		return req, first
	}
}
