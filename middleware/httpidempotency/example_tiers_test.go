package httpidempotency_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/babelqueue/watermill-idempotency/middleware/httpidempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// Two retention tiers: full responses for a day, compact identities for 30
// days. A retry gets the full response while it is kept, then the compact
// replay (the original status and Location); another intent is 422 for the
// whole 30 days. With Redis or PostgreSQL, the two stores are
// redisstore.New(c, redisstore.WithPrefix("api-resp:"),
// redisstore.WithTTL(24*time.Hour)) or postgresstore.New(db,
// postgresstore.WithTable("api_responses"),
// postgresstore.WithTTL(24*time.Hour)) beside the identity store.
func ExampleWithResponseStore() {
	identities := memstore.New(memstore.WithTTL(30 * 24 * time.Hour))
	responses := memstore.New(memstore.WithTTL(24 * time.Hour))
	guard, err := httpidempotency.New(identities, func(*http.Request) (string, error) { return "acme", nil },
		httpidempotency.WithResponseStore(responses))
	if err != nil {
		panic(err)
	}
	orders := 0
	handler := guard.Wrap(httpidempotency.Operation{Name: "orders.create", SaveHeaders: []string{"Location"}, Expired: httpidempotency.ExpiredIsNew},
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			orders++
			w.Header().Set("Location", fmt.Sprintf("/orders/%d", orders))
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, `{"order_id":%d,"lines":["…the whole order…"]}`, orders)
		}))
	send := func(body string) {
		req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(body))
		req.Header.Set("Idempotency-Key", "8e03978e")
		rec := httptest.NewRecorder()
		handler.ServeHTTP(rec, req)
		fmt.Println(rec.Code, rec.Header().Get("Location"), rec.Header().Get("Idempotent-Replayed"),
			rec.Header().Get("Idempotency-Response"), strings.TrimSpace(rec.Body.String()))
	}
	send(`{"amount":1299}`)
	send(`{"amount":1299}`) // within the response lifetime: the full response
	// A day later the response tier has let the response go (here: forgotten).
	_ = responses.Forget(context.Background(), httpidempotency.RecordKey("acme", "orders.create", "8e03978e"))
	send(`{"amount":1299}`) // the compact replay
	send(`{"amount":5}`)    // another intent, within the identity lifetime
	fmt.Println("orders made:", orders)
	// Output:
	// 201 /orders/1   {"order_id":1,"lines":["…the whole order…"]}
	// 201 /orders/1 true  {"order_id":1,"lines":["…the whole order…"]}
	// 201 /orders/1 true expired {"status":201,"location":"/orders/1","response":"expired","operation":"orders.create"}
	// 422    {"type":"https://github.com/babelqueue/watermill-idempotency/blob/main/docs/api-idempotency.md#key-reused","title":"Idempotency-Key is already used","status":422,"detail":"This Idempotency-Key was used with another request for this operation (another body, path or declared header). A key stands for one request: send a new one with a new key."}
	// orders made: 1
}
