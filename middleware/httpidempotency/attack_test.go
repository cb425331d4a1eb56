package httpidempotency_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/middleware/httpidempotency"
)

// These tests play an API client with bad intentions.

// TestAttackHugeBodyIsNotRead: a 64 MiB body, announced or streamed
// without a length, is refused with 413 after at most the limit is read;
// the handler never runs, and the server stays up.
func TestAttackHugeBodyIsNotRead(t *testing.T) {
	t.Parallel()
	api := newOrdersAPI(t, newBackend(t, "memory", 0), withOperation(func(op *httpidempotency.Operation) {
		op.MaxRequestBody = 64 << 10
	}))
	for _, chunked := range []bool{false, true} {
		var sent atomic.Int64
		body := &countingReader{r: io.LimitReader(zeros{}, 64<<20), n: &sent}
		req, _ := http.NewRequest(http.MethodPost, api.server.URL+"/orders", body)
		if !chunked {
			req.ContentLength = 64 << 20
		}
		req.Header.Set("Authorization", "Bearer mallory@acme")
		req.Header.Set(httpidempotency.HeaderKey, "huge")
		resp, err := api.server.Client().Do(req)
		if err != nil {
			// The server may close the connection while the client still
			// writes: the refusal is then seen as a broken write.
			t.Logf("chunked %v: %v after %d bytes", chunked, err, sent.Load())
		} else {
			r := readReply(resp)
			if r.status != http.StatusRequestEntityTooLarge || r.problemType(t) != httpidempotency.ProblemBodyTooLarge {
				t.Fatalf("chunked %v: %d %s", chunked, r.status, r.body)
			}
		}
		if sent.Load() > 8<<20 {
			t.Fatalf("chunked %v: the client got to send %d bytes of a 64 MiB body", chunked, sent.Load())
		}
	}
	if api.runs.Load() != 0 {
		t.Fatal("the handler ran")
	}
	if r := api.post(t, request{auth: "alice@acme", key: "after", body: orderBody(1, "EUR")}); r.status != 201 {
		t.Fatalf("the server after the attack: %d %s", r.status, r.body)
	}
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

type countingReader struct {
	r io.Reader
	n *atomic.Int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n.Add(int64(n))
	return n, err
}

// TestAttackRacingRetriesWithOtherBodies: 20 clients race one key, each
// with another amount, and retry: one order is made, its own client gets
// it, and every other client ends with 422; none is given the order made
// for another body.
func TestAttackRacingRetriesWithOtherBodies(t *testing.T) {
	eachBackend(t, func(t *testing.T, b backend) {
		api := newOrdersAPI(t, b, withSetup(func(a *ordersAPI) {
			a.afterCreate = func(int64) time.Duration { return 100 * time.Millisecond }
		}))
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		const clients = 20
		var wg sync.WaitGroup
		statuses := make([]reply, clients)
		for c := 0; c < clients; c++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r, _, err := api.retrying(ctx, request{auth: "mallory@acme", key: "race", body: orderBody(int64(1000+c), "EUR")}, 10*time.Second)
				if err != nil {
					t.Error(err)
				}
				statuses[c] = r
			}()
		}
		wg.Wait()
		orders := api.orders(t, "acme", "race")
		if len(orders) != 1 {
			t.Fatalf("%d orders %v, want 1", len(orders), orders)
		}
		won := 0
		for c, r := range statuses {
			switch r.status {
			case http.StatusCreated:
				won++
				if o := r.order(t); o.OrderID != orders[0] || o.Amount != int64(1000+c) {
					t.Fatalf("client %d (amount %d) got %s", c, 1000+c, r.body)
				}
			case http.StatusUnprocessableEntity:
			default:
				t.Fatalf("client %d: %d %s", c, r.status, r.body)
			}
		}
		if won != 1 {
			t.Fatalf("%d clients got the order", won)
		}
	})
}

// TestAttackAnotherUsersKey: in one tenant, mallory sends the key and the
// body alice used. With an Authorize hook comparing the saved Subject,
// mallory gets 403 and not alice's response.
func TestAttackAnotherUsersKey(t *testing.T) {
	t.Parallel()
	api := newOrdersAPI(t, newBackend(t, "memory", 0), withOperation(func(op *httpidempotency.Operation) {
		op.Authorize = func(r *http.Request, saved *httpidempotency.Response) bool { return saved.Subject == subjectOf(r) }
	}))
	order := api.post(t, request{auth: "alice@acme", key: "k-1", body: orderBody(1, "EUR")}).order(t)
	r := api.post(t, request{auth: "mallory@acme", key: "k-1", body: orderBody(1, "EUR")})
	if r.status != http.StatusForbidden || strings.Contains(string(r.body), order.OrderID) {
		t.Fatalf("mallory: %d %s", r.status, r.body)
	}
	if again := api.post(t, request{auth: "alice@acme", key: "k-1", body: orderBody(1, "EUR")}).order(t); again != order {
		t.Fatalf("alice: %v", again)
	}
}

// TestAttackTenantAndKeyCannotMeet: parts of a record key cannot be
// forged from another: a key holding the separator is refused (400), a
// tenant holding it too (500, and logged: the tenant function is the
// server's), so "acme" + "x\x1fk" never reaches "acme\x1fx" + "k".
func TestAttackTenantAndKeyCannotMeet(t *testing.T) {
	t.Parallel()
	b := newBackend(t, "memory", 0)
	tenant := "acme"
	guard, err := httpidempotency.New(b.store, func(*http.Request) (string, error) { return tenant, nil }, httpidempotency.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	runs := 0
	h := guard.Wrap(httpidempotency.Operation{Name: "orders.create", Expired: httpidempotency.ExpiredIsNew},
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { runs++; w.WriteHeader(201) }))
	send := func(key string) int {
		req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader("{}"))
		req.Header.Set(httpidempotency.HeaderKey, key)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec.Code
	}
	if code := send("x\x1fk"); code != 400 {
		t.Fatalf("a key with the separator: %d", code)
	}
	tenant = "acme\x1fx"
	if code := send("k"); code != 500 {
		t.Fatalf("a tenant with the separator: %d", code)
	}
	if runs != 0 {
		t.Fatalf("%d runs", runs)
	}
}
