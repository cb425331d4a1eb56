package httpidempotency_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/middleware/httpidempotency"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
)

// sent is what a client got, or the error it met.
type sent struct {
	r   reply
	err error
}

// startRunning sends req in the background and returns once its handler
// runs (the first run of the API); its answer comes on the channel.
func (a *ordersAPI) startRunning(t *testing.T, req request) <-chan sent {
	t.Helper()
	first := make(chan sent, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		r, err := a.do(ctx, req)
		first <- sent{r, err}
	}()
	deadline := time.Now().Add(10 * time.Second)
	for a.runs.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the first request's handler never ran")
		}
		time.Sleep(5 * time.Millisecond)
	}
	return first
}

// TestRequestLongerThanItsLease is a request whose handler runs three
// times its lease (1s, a 3s handler), and a retry with its key at +1.5s,
// once the lease it began with has passed. The claim is renewed while the
// handler runs: the retry gets 409 (the first still runs), the first caller
// gets its own order, and a retry after it the replay of that order: one
// order, one run. On every store, Wrap and WrapTx.
func TestRequestLongerThanItsLease(t *testing.T) {
	if testing.Short() {
		t.Skip("a 3s handler: not with -short")
	}
	const lease = time.Second
	eachBackend(t, func(t *testing.T, b backend) {
		a := newOrdersAPI(t, b, withGuardOptions(httpidempotency.WithLease(lease)), withSetup(func(a *ordersAPI) {
			a.afterCreate = func(run int64) time.Duration {
				if run == 1 {
					return 3 * lease
				}
				return 0
			}
		}))
		req := request{auth: "alice@acme", key: randomName("k-"), body: orderBody(1299, "EUR")}
		start := time.Now()
		first := a.startRunning(t, req)
		time.Sleep(time.Until(start.Add(lease * 3 / 2))) // the lease the first began with has passed
		retry := a.post(t, req)
		if retry.status != http.StatusConflict || retry.problemType(t) != httpidempotency.ProblemInProgress {
			t.Fatalf("a retry at +%v while the first runs: %d %s; want 409 in progress", time.Since(start).Round(time.Millisecond), retry.status, retry.body)
		}
		got := <-first
		if got.err != nil {
			t.Fatalf("the first caller: %v", got.err)
		}
		if got.r.status != http.StatusCreated {
			t.Fatalf("the first caller after %v: %d %s; want 201 with its order", time.Since(start).Round(time.Millisecond), got.r.status, got.r.body)
		}
		mine := got.r.order(t)
		replay := a.post(t, req)
		if replay.status != http.StatusCreated || replay.header.Get(httpidempotency.HeaderReplayed) != "true" || replay.order(t).OrderID != mine.OrderID {
			t.Fatalf("a retry after the first ended: %d (replayed %q) %s; want the replay of %s", replay.status,
				replay.header.Get(httpidempotency.HeaderReplayed), replay.body, mine.OrderID)
		}
		if orders := a.orders(t, "acme", req.key); len(orders) != 1 || orders[0] != mine.OrderID {
			t.Fatalf("orders made: %v; want only %s", orders, mine.OrderID)
		}
		if runs := a.runs.Load(); runs != 1 {
			t.Fatalf("%d handler runs, want 1", runs)
		}
	})
}

// TestClaimLostMidRequest: while the first request's handler runs, its
// claim is taken from it (an operator forgets the key, and a retry claims
// it and runs). The first request's renewal finds the key no longer its
// own: its handler's context ends, and its response is not saved over the
// retry's claim, so every later retry replays the retry's order. In the
// transactional mode the first request's transaction rolls back with its
// context (503, nothing committed): one order. With Wrap the first run's
// order was made outside any transaction and stays: two orders, the
// documented limit of a claim that is lost.
func TestClaimLostMidRequest(t *testing.T) {
	// A second: renewed every third of it, a claim survives a stall of
	// several hundred milliseconds (a loaded -race CI run missed a 300ms
	// lease once: the session claim lapsed before its renewal, and the
	// first request lost it without anyone taking it).
	const lease = time.Second
	eachBackend(t, func(t *testing.T, b backend) {
		a := newOrdersAPI(t, b, withGuardOptions(httpidempotency.WithLease(lease)), withSetup(func(a *ordersAPI) {
			a.afterCreate = func(run int64) time.Duration {
				if run == 1 {
					return 5 * lease
				}
				return 0
			}
		}))
		req := request{auth: "alice@acme", key: randomName("k-"), body: orderBody(1299, "EUR")}
		first := a.startRunning(t, req)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := b.store.Forget(ctx, httpidempotency.RecordKey("acme", "orders.create", req.key)); err != nil {
			t.Fatal(err)
		}
		retry := a.post(t, req)
		if pg, ok := b.store.(*postgresstore.Store); ok && pg.SessionClaims() {
			// A session claim is an advisory lock of the first request's
			// session, which Forget (a row's delete) cannot take: the retry
			// is told to come back, the first request runs to its end, and
			// its order is the only one.
			if retry.status != http.StatusConflict || retry.problemType(t) != httpidempotency.ProblemInProgress {
				t.Fatalf("a retry after Forget, the first holding a session claim: %d %s; want 409 in progress", retry.status, retry.body)
			}
			got := <-first
			if got.err != nil || got.r.status != http.StatusCreated {
				t.Fatalf("the first request, its session claim kept: %v %d %s; want 201", got.err, got.r.status, got.r.body)
			}
			if orders := a.orders(t, "acme", req.key); len(orders) != 1 || orders[0] != got.r.order(t).OrderID {
				t.Fatalf("orders %v; want only the first request's", orders)
			}
			return
		}
		if retry.status != http.StatusCreated || retry.header.Get(httpidempotency.HeaderReplayed) != "" {
			t.Fatalf("the retry that took the key over: %d %s; want 201, its own run", retry.status, retry.body)
		}
		theirs := retry.order(t)
		got := <-first
		if got.err != nil {
			t.Fatalf("the first caller: %v", got.err)
		}
		if n := a.ended.Load(); n != 1 {
			t.Fatalf("%d runs answered with their context ended; want the first one's, ended by its lost claim", n)
		}
		orders := a.orders(t, "acme", req.key)
		if b.tx {
			if got.r.status != http.StatusServiceUnavailable || got.r.problemType(t) != httpidempotency.ProblemTransactionFailed {
				t.Fatalf("the first request, its claim lost: %d %s; want 503, nothing committed", got.r.status, got.r.body)
			}
			if len(orders) != 1 || orders[0] != theirs.OrderID {
				t.Fatalf("orders %v; want only the retry's %s", orders, theirs.OrderID)
			}
		} else if got.r.status != http.StatusCreated || len(orders) != 2 {
			t.Fatalf("the first request, its claim lost: %d %s, orders %v; want its own order sent, two orders", got.r.status, got.r.body, orders)
		}
		again := a.post(t, req)
		if again.header.Get(httpidempotency.HeaderReplayed) != "true" || again.order(t).OrderID != theirs.OrderID {
			t.Fatalf("a later retry: %d (replayed %q) %s; want the replay of %s, the holder's, not the lost request's",
				again.status, again.header.Get(httpidempotency.HeaderReplayed), again.body, theirs.OrderID)
		}
	})
}
