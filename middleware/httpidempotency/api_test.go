package httpidempotency_test

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/middleware/httpidempotency"
)

// TestFirstRequestThenReplay: the first request runs and is answered 201;
// its retry gets the same status, saved headers and body, marked as a
// replay, without running the handler; a header the operation does not
// save is not replayed.
func TestFirstRequestThenReplay(t *testing.T) {
	eachBackend(t, func(t *testing.T, b backend) {
		api := newOrdersAPI(t, b)
		req := request{auth: "alice@acme", key: "k-1", body: orderBody(1299, "EUR")}
		first := api.post(t, req)
		if first.status != http.StatusCreated || first.header.Get(httpidempotency.HeaderReplayed) != "" {
			t.Fatalf("first: %d %v %s", first.status, first.header, first.body)
		}
		order := first.order(t)
		for i := 0; i < 3; i++ {
			again := api.post(t, req)
			if again.status != http.StatusCreated || string(again.body) != string(first.body) {
				t.Fatalf("retry %d: %d %s, want 201 %s", i, again.status, again.body, first.body)
			}
			if again.header.Get(httpidempotency.HeaderReplayed) != "true" ||
				again.header.Get("Location") != "/orders/"+order.OrderID ||
				again.header.Get("Content-Type") != "application/json" || again.header.Get("X-Not-Saved") != "" {
				t.Fatalf("retry %d headers: %v", i, again.header)
			}
		}
		if runs := api.runs.Load(); runs != 1 {
			t.Fatalf("the handler ran %d times, want 1", runs)
		}
		if got := api.orders(t, "acme", "k-1"); len(got) != 1 || got[0] != order.OrderID {
			t.Fatalf("orders %v, want [%s]", got, order.OrderID)
		}
	})
}

// TestAnotherIntentIs422: the key with another amount, another currency,
// another declared header is 422 with a problem naming the reuse; the same
// JSON spelled otherwise (member order, white space, number spelling) is
// the same intent and replays.
func TestAnotherIntentIs422(t *testing.T) {
	eachBackend(t, func(t *testing.T, b backend) {
		api := newOrdersAPI(t, b, withOperation(func(op *httpidempotency.Operation) {
			op.Headers = []string{"X-Account"}
		}))
		req := request{auth: "alice@acme", key: "k-1", body: `{"amount": 1299, "currency": "EUR"}`,
			headers: map[string]string{"X-Account": "acc-1", "X-Trace": "t1"}}
		first := api.post(t, req)
		if first.status != http.StatusCreated {
			t.Fatalf("first: %d %s", first.status, first.body)
		}
		same := req
		same.body = "{\n  \"currency\":\"EUR\",\"amount\":1.299e3}"
		same.headers = map[string]string{"X-Account": "acc-1", "X-Trace": "another trace"}
		if r := api.post(t, same); r.status != http.StatusCreated || r.header.Get(httpidempotency.HeaderReplayed) != "true" {
			t.Fatalf("the same order spelled otherwise: %d %s", r.status, r.body)
		}
		for name, other := range map[string]request{
			"currency":  {auth: req.auth, key: req.key, body: orderBody(1299, "USD"), headers: req.headers},
			"amount":    {auth: req.auth, key: req.key, body: orderBody(1300, "EUR"), headers: req.headers},
			"header":    {auth: req.auth, key: req.key, body: req.body, headers: map[string]string{"X-Account": "acc-2"}},
			"no header": {auth: req.auth, key: req.key, body: req.body},
		} {
			r := api.post(t, other)
			if r.status != http.StatusUnprocessableEntity || r.problemType(t) != httpidempotency.ProblemKeyReused {
				t.Fatalf("another %s: %d %s", name, r.status, r.body)
			}
		}
		if runs := api.runs.Load(); runs != 1 {
			t.Fatalf("the handler ran %d times, want 1", runs)
		}
	})
}

// TestTwoTenantsOneKey: two tenants choosing the same key get an order
// each, and each retry gets its own tenant's order.
func TestTwoTenantsOneKey(t *testing.T) {
	eachBackend(t, func(t *testing.T, b backend) {
		api := newOrdersAPI(t, b)
		acme := api.post(t, request{auth: "alice@acme", key: "shared", body: orderBody(100, "EUR")}).order(t)
		globex := api.post(t, request{auth: "bob@globex", key: "shared", body: orderBody(100, "EUR")}).order(t)
		if acme.OrderID == globex.OrderID {
			t.Fatalf("one order %s for two tenants", acme.OrderID)
		}
		if again := api.post(t, request{auth: "bob@globex", key: "shared", body: orderBody(100, "EUR")}).order(t); again != globex {
			t.Fatalf("globex's retry got %v, want %v", again, globex)
		}
		// Another tenant, another body: a new order, not a 422 (it never
		// learns that acme used the key).
		if r := api.post(t, request{auth: "carol@initech", key: "shared", body: orderBody(5, "USD")}); r.status != http.StatusCreated ||
			r.header.Get(httpidempotency.HeaderReplayed) != "" {
			t.Fatalf("third tenant: %d %s", r.status, r.body)
		}
		if n1, n2 := len(api.orders(t, "acme", "shared")), len(api.orders(t, "globex", "shared")); n1 != 1 || n2 != 1 {
			t.Fatalf("orders: acme %d, globex %d", n1, n2)
		}
	})
}

// TestLostPermissionGetsNoSavedResponse: a caller whose permission was
// revoked after the first request gets 403 on a retry, without the saved
// response.
func TestLostPermissionGetsNoSavedResponse(t *testing.T) {
	eachBackend(t, func(t *testing.T, b backend) {
		api := newOrdersAPI(t, b)
		req := request{auth: "alice@acme", key: "k-1", body: orderBody(100, "EUR")}
		order := api.post(t, req).order(t)
		api.revoked.Store("alice", true)
		r := api.post(t, req)
		if r.status != http.StatusForbidden || r.problemType(t) != httpidempotency.ProblemReplayForbidden {
			t.Fatalf("revoked caller: %d %s", r.status, r.body)
		}
		if containsString(string(r.body), order.OrderID) || r.header.Get("Location") != "" {
			t.Fatalf("the saved response leaked: %v %s", r.header, r.body)
		}
		api.revoked.Delete("alice")
		if again := api.post(t, req).order(t); again != order {
			t.Fatalf("after the permission came back: %v, want %v", again, order)
		}
	})
}

func containsString(s, sub string) bool {
	return len(sub) > 0 && len(s) >= len(sub) && (s == sub || indexOf(s, sub) >= 0)
}

func indexOf(s, sub string) int {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return i
		}
	}
	return -1
}

// TestRetryWhileRunningIs409: while the first request runs, a retry gets
// 409 with Retry-After and the handler does not run again; once the first
// is answered, the retry gets its response.
func TestRetryWhileRunningIs409(t *testing.T) {
	eachBackend(t, func(t *testing.T, b backend) {
		api := newOrdersAPI(t, b, withSetup(func(a *ordersAPI) {
			a.hold, a.holding = make(chan struct{}), make(chan struct{}, 1)
		}))
		req := request{auth: "alice@acme", key: "k-1", body: orderBody(100, "EUR")}
		done := make(chan reply, 1)
		go func() {
			r, _ := api.do(context.Background(), req)
			done <- r
		}()
		<-api.holding
		for i := 0; i < 3; i++ {
			r := api.post(t, req)
			if r.status != http.StatusConflict || r.problemType(t) != httpidempotency.ProblemInProgress || r.header.Get("Retry-After") != "1" {
				t.Fatalf("retry while running: %d %v %s", r.status, r.header, r.body)
			}
		}
		close(api.hold)
		first := <-done
		if again := api.post(t, req); again.status != http.StatusCreated || string(again.body) != string(first.body) {
			t.Fatalf("after the first: %d %s, want %s", again.status, again.body, first.body)
		}
		if runs := api.runs.Load(); runs != 1 {
			t.Fatalf("the handler ran %d times, want 1", runs)
		}
	})
}

// TestFailedRunIsNotSaved: a 5xx is sent and not saved, and the key is
// freed: the retry runs and its 201 is what later retries get.
func TestFailedRunIsNotSaved(t *testing.T) {
	eachBackend(t, func(t *testing.T, b backend) {
		api := newOrdersAPI(t, b)
		api.failNext.Store(1)
		req := request{auth: "alice@acme", key: "k-1", body: orderBody(100, "EUR")}
		if r := api.post(t, req); r.status != http.StatusInternalServerError {
			t.Fatalf("first: %d %s, want the handler's 500", r.status, r.body)
		}
		second := api.post(t, req)
		if second.status != http.StatusCreated || second.header.Get(httpidempotency.HeaderReplayed) != "" {
			t.Fatalf("second: %d %s, want a run", second.status, second.body)
		}
		if third := api.post(t, req); string(third.body) != string(second.body) || third.header.Get(httpidempotency.HeaderReplayed) != "true" {
			t.Fatalf("third: %d %s, want the second's replayed", third.status, third.body)
		}
		if n := len(api.orders(t, "acme", "k-1")); n != 1 {
			t.Fatalf("%d orders, want 1", n)
		}
	})
}

// TestConcurrentClientsRetryingOneKey: 50 clients send one order with one
// key at once and retry it (on 409 after Retry-After, and after their
// first attempt timed out, which it does after the server committed the
// order): exactly one order per (tenant, key), and every client gets that
// order's id. Two tenants do it at the same time with the same key.
func TestConcurrentClientsRetryingOneKey(t *testing.T) {
	eachBackend(t, func(t *testing.T, b backend) {
		api := newOrdersAPI(t, b, withSetup(func(a *ordersAPI) {
			// The first run of each tenant takes 300 ms between creating
			// the order and committing it (the clients arriving then get
			// 409), then holds its response for 2 s; the clients' first
			// attempts time out after 1 s, so the first run's client times
			// out after the server committed, even on a loaded machine.
			a.slowWrites = func(r *http.Request) time.Duration { return 2 * time.Second }
			a.afterCreate = func(int64) time.Duration { return 300 * time.Millisecond }
		}))
		const clients = 50
		tenants := []string{"acme", "globex"}
		// A round shows both retries only when some client's first attempt
		// arrived while the first run was between its order and its commit
		// (409) and the first run's client timed out (a timeout). On a
		// loaded machine every first attempt may time out before the server
		// answers anything: that round still must give one order per
		// tenant, and the next round, with a fresh key, tries again.
		var attempts int
		var timeouts, conflicts int64
		for round := 1; ; round++ {
			key := fmt.Sprintf("order-42-%d", round)
			timeoutsBefore, conflictsBefore := api.timeouts.Load(), api.conflicts.Load()
			attempts = clientsRetryingOneKey(t, api, tenants, clients, key)
			timeouts, conflicts = api.timeouts.Load()-timeoutsBefore, api.conflicts.Load()-conflictsBefore
			if timeouts > 0 && conflicts > 0 {
				break
			}
			if round == 3 {
				t.Fatalf("%d timeouts, %d 409s in round %d: the test did not retry both ways in 3 rounds", timeouts, conflicts, round)
			}
			t.Logf("round %d: %d timeouts, %d 409s (a loaded machine): again with a fresh key", round, timeouts, conflicts)
		}
		t.Logf("%d clients × %d tenants: %d requests (%d timed out, %d got 409), %d handler runs, one order per tenant and key",
			clients, len(tenants), attempts, timeouts, conflicts, api.runs.Load())
	})
}

// clientsRetryingOneKey has clients per tenant send one order with key at
// once, retrying, and checks that each tenant got one order, whose id every
// client got. It returns the requests made.
func clientsRetryingOneKey(t *testing.T, api *ordersAPI, tenants []string, clients int, key string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	got := make([][]string, len(tenants))
	var mu sync.Mutex
	var wg sync.WaitGroup
	errs := make(chan error, clients*len(tenants))
	attempts := 0
	for ti, tenant := range tenants {
		for c := 0; c < clients; c++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r, n, err := api.retrying(ctx, request{auth: fmt.Sprintf("u%d@%s", c, tenant), key: key, body: orderBody(4200, "EUR")}, time.Second)
				if err == nil && r.status != http.StatusCreated {
					err = fmt.Errorf("status %d: %s", r.status, r.body)
				}
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				got[ti] = append(got[ti], r.order(t).OrderID)
				attempts += n
				mu.Unlock()
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for ti, tenant := range tenants {
		orders := api.orders(t, tenant, key)
		if len(orders) != 1 {
			t.Fatalf("%s: %d orders %v, want 1", tenant, len(orders), orders)
		}
		for _, id := range got[ti] {
			if id != orders[0] {
				t.Fatalf("%s: a client got order %s, the order is %s", tenant, id, orders[0])
			}
		}
	}
	return attempts
}
