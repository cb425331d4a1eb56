package httpidempotency_test

import (
	"context"
	"database/sql"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/middleware/httpidempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
)

// otherServer is a transaction of another server that made order id for
// the key and writes the key's record, as WrapTx does, uncommitted.
func otherServer(t *testing.T, api *ordersAPI, id string, order bool) *sql.Tx {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	tx, err := api.b.db.BeginTx(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback() })
	if order {
		if _, err := tx.ExecContext(ctx, `INSERT INTO `+api.table+` (id, tenant, idem_key, amount, currency) VALUES ($1, 'acme', 'k-1', 1, 'EUR')`, id); err != nil {
			t.Fatal(err)
		}
	}
	return tx
}

func rememberInTx(t *testing.T, api *ordersAPI, tx *sql.Tx, id string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	value := httpidempotency.EncodeResponse(&httpidempotency.Response{Status: 201, SavedAt: time.Now(),
		Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"order_id":"ord_` + id + `"}`)})
	// The other server took the key over (the request's lease lapsed): its
	// claim holder is now the key's.
	key := httpidempotency.RecordKey("acme", "orders.create", "k-1")
	if pg, ok := api.b.store.(*postgresstore.Store); ok {
		if _, err := api.b.db.ExecContext(ctx, `UPDATE `+pg.Table()+` SET claim = 'other-server' WHERE key = $1 AND claim IS NOT NULL`, postgresstore.RowKey(key)); err != nil {
			t.Fatal(err)
		}
	}
	recorded, _, err := api.b.store.(stores.TxStore).RememberTx(stores.WithClaimToken(ctx, "other-server"), tx, key, 0, value)
	if err != nil || !recorded {
		t.Fatalf("the other server's record: %v, %v", recorded, err)
	}
}

// TestTxConcurrentWriterOfTheKey: while a request runs, another server's
// transaction writes the key's record (it took the key over after a lapsed
// lease). The request's own record waits for that transaction: when it
// commits, the request rolls back its order and replays the other's
// response; when it rolls back, the key is still the other server's
// (claimed): the request rolls back its order and answers 409. One order
// at most either way, never two.
func TestTxConcurrentWriterOfTheKey(t *testing.T) {
	for _, commit := range []bool{true, false} {
		name := "other-commits"
		if !commit {
			name = "other-rolls-back"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			// Claims of rows: another server takes a lapsed claim over while
			// its holder still runs (a session claim lives as long as its
			// holder, and another server's record is in flight meanwhile).
			api := newOrdersAPI(t, newBackend(t, "postgres-tx-rows", 0), withSetup(func(a *ordersAPI) {
				a.hold, a.holding = make(chan struct{}), make(chan struct{}, 1)
			}))
			var released sync.Once
			release := func() { released.Do(func() { close(api.hold) }) }
			t.Cleanup(release) // a failure below must not leave the request, and the server's Close, waiting
			req := request{auth: "alice@acme", key: "k-1", body: orderBody(1, "EUR")}
			done := make(chan reply, 1)
			go func() {
				r, _ := api.do(context.Background(), req)
				done <- r
			}()
			<-api.holding // the request made its order, uncommitted
			other := otherServer(t, api, "9001", true)
			rememberInTx(t, api, other, "9001")
			release() // the request's record now waits for the other transaction
			time.Sleep(300 * time.Millisecond)
			var err error
			if commit {
				err = other.Commit()
			} else {
				err = other.Rollback()
			}
			if err != nil {
				t.Fatal(err)
			}
			r := <-done
			orders := api.orders(t, "acme", "k-1")
			if !commit {
				if len(orders) != 0 || r.status != http.StatusConflict {
					t.Fatalf("other rolled back: orders %v; the request got %d %s, want none and 409", orders, r.status, r.body)
				}
				return
			}
			if len(orders) != 1 || r.status != 201 || r.order(t).OrderID != orders[0] {
				t.Fatalf("orders %v; the request got %d %s", orders, r.status, r.body)
			}
			if replayed := r.header.Get(httpidempotency.HeaderReplayed) == "true"; !replayed || orders[0] != "ord_9001" {
				t.Fatalf("other committed: the request got %s (replayed %v)", r.body, replayed)
			}
		})
	}
}

// TestTxUniquenessConflictReplaysTheWinner: the orders table has its own
// UNIQUE (tenant, idem_key). Another server's transaction inserted the
// order for the key first; the request's insert waits on it and, once that
// transaction commits with its record, fails with a uniqueness conflict.
// The request rolls back, looks at the key again and replays the
// committed response: one order.
func TestTxUniquenessConflictReplaysTheWinner(t *testing.T) {
	t.Parallel()
	// Claims of rows: the other server took the key over from a lapsed
	// claim (a session claim would keep the key the request's).
	api := newOrdersAPI(t, newBackend(t, "postgres-tx-rows", 0), func(c *apiConfig) { c.uniqueKeys = true })
	other := otherServer(t, api, "9001", true)
	req := request{auth: "alice@acme", key: "k-1", body: orderBody(1, "EUR")}
	done := make(chan reply, 1)
	go func() {
		r, _ := api.do(context.Background(), req)
		done <- r
	}()
	time.Sleep(300 * time.Millisecond) // the request claimed the key; its insert waits
	rememberInTx(t, api, other, "9001")
	if err := other.Commit(); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.status != 201 || r.order(t).OrderID != "ord_9001" || r.header.Get(httpidempotency.HeaderReplayed) != "true" {
		t.Fatalf("%d %v %s, want the other's order replayed", r.status, r.header, r.body)
	}
	if orders := api.orders(t, "acme", "k-1"); len(orders) != 1 {
		t.Fatalf("orders %v", orders)
	}
}

// TestTxHandlerErrorRollsBack: a handler error rolls back its order and
// frees the key; the retry runs and commits one order.
func TestTxHandlerErrorRollsBack(t *testing.T) {
	t.Parallel()
	b := newBackend(t, "postgres-tx", 0)
	var api *ordersAPI
	failing := true
	api = newOrdersAPI(t, b)
	h := api.guard.WrapTx(httpidempotency.Operation{Name: "orders.create", Expired: httpidempotency.ExpiredIsNew},
		func(w http.ResponseWriter, r *http.Request, tx *sql.Tx) error {
			if err := api.create(w, r, tx); err != nil {
				return err
			}
			if failing {
				failing = false
				return errPaymentDeclined
			}
			return nil
		})
	mux := http.NewServeMux()
	mux.Handle("POST /orders", h)
	api.server.Config.Handler = mux
	req := request{auth: "alice@acme", key: "k-1", body: orderBody(1, "EUR")}
	if r := api.post(t, req); r.status != 500 || r.problemType(t) != httpidempotency.ProblemHandlerFailed {
		t.Fatalf("first: %d %s", r.status, r.body)
	}
	if n := len(api.orders(t, "acme", "k-1")); n != 0 {
		t.Fatalf("%d orders after the rollback", n)
	}
	second := api.post(t, req)
	if second.status != 201 {
		t.Fatalf("second: %d %s", second.status, second.body)
	}
	if orders := api.orders(t, "acme", "k-1"); len(orders) != 1 || orders[0] != second.order(t).OrderID {
		t.Fatalf("orders %v", orders)
	}
}
