package httpidempotency_test

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/babelqueue/watermill-idempotency/middleware/httpidempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// A POST /orders endpoint: the first request with a key runs, its retry is
// answered from the saved response, and the key with another body is 422.
func Example() {
	// The tenant comes from the authenticated caller (here a header an
	// authentication middleware in front would have verified).
	tenantOf := func(r *http.Request) (string, error) {
		if t := r.Header.Get("X-Authenticated-Tenant"); t != "" {
			return t, nil
		}
		return "", errors.New("not authenticated")
	}
	guard, err := httpidempotency.New(memstore.New(), tenantOf)
	if err != nil {
		panic(err)
	}
	orders := 0
	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		orders++
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", orders))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"order_id":%d}`, orders)
	})
	mux := http.NewServeMux()
	mux.Handle("POST /orders", guard.Wrap(httpidempotency.Operation{
		Name:        "orders.create",
		SaveHeaders: []string{"Location"},
		Expired:     httpidempotency.ExpiredIsNew, // replayed while the store keeps the record
	}, createOrder))

	send := func(body string) {
		req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(body))
		req.Header.Set("X-Authenticated-Tenant", "acme")
		req.Header.Set("Idempotency-Key", `"8e03978e-40d5-43e8-bc93-6894a57f9324"`)
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, req)
		b, _ := io.ReadAll(rec.Body)
		fmt.Println(rec.Code, rec.Header().Get("Idempotent-Replayed"), strings.TrimSpace(string(b)))
	}
	send(`{"amount":1299,"currency":"EUR"}`)
	send(`{"currency":"EUR", "amount":1299}`) // the same order, spelled otherwise
	send(`{"amount":1299,"currency":"USD"}`)  // another intent
	fmt.Println("orders made:", orders)
	// Output:
	// 201  {"order_id":1}
	// 201 true {"order_id":1}
	// 422  {"type":"https://github.com/babelqueue/watermill-idempotency/blob/main/docs/api-idempotency.md#key-reused","title":"Idempotency-Key is already used","status":422,"detail":"This Idempotency-Key was used with another request for this operation (another body, path or declared header). A key stands for one request: send a new one with a new key."}
	// orders made: 1
}

// Guard.Middleware fits routers that take func(http.Handler) http.Handler
// (chi's r.With(...).Post, gorilla/mux's Use; echo.WrapMiddleware).
func ExampleGuard_Middleware() {
	guard, _ := httpidempotency.New(memstore.New(), func(r *http.Request) (string, error) { return "acme", nil })
	idempotent := guard.Middleware(httpidempotency.Operation{Name: "payments.create", Expired: httpidempotency.ExpiredIsNew})
	handler := idempotent(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	}))
	for i := 0; i < 2; i++ {
		req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", "pay-1")
		rec := httptest.NewRecorder()
		handler.ServeHTTP(rec, req)
		fmt.Printf("%d replayed=%q\n", rec.Code, rec.Header().Get("Idempotent-Replayed"))
	}
	// Output:
	// 201 replayed=""
	// 201 replayed="true"
}
