package httpidempotency_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/babelqueue/watermill-idempotency/middleware/httpidempotency"
)

// TestReusedKeyWithACollidingReducedFingerprintIs422: two orders whose
// request fingerprints agree modulo 9,998 (the reduced form redisstore
// keeps with a message record) are two intents: the second, under the
// first's key, is 422 on every store. On Redis it used to be replayed the
// first order's response (201, Idempotent-Replayed, amount 0), since the
// store kept the reduced form with the saved response too.
func TestReusedKeyWithACollidingReducedFingerprintIs422(t *testing.T) {
	eachBackend(t, func(t *testing.T, b backend) {
		guard, err := httpidempotency.New(b.store, func(*http.Request) (string, error) { return "acme", nil })
		if err != nil {
			t.Fatal(err)
		}
		runs := 0
		mux := http.NewServeMux()
		mux.Handle("POST /orders", guard.Wrap(httpidempotency.Operation{Name: "orders.create", Expired: httpidempotency.ExpiredIsNew},
			http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs++
				body, _ := io.ReadAll(r.Body)
				w.WriteHeader(http.StatusCreated)
				fmt.Fprintf(w, `{"order":%d,"request":%s}`, runs, body)
			})))
		send := func(body string) *httptest.ResponseRecorder {
			req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(body))
			req.Header.Set("Idempotency-Key", "order-key-1")
			rec := httptest.NewRecorder()
			mux.ServeHTTP(rec, req)
			return rec
		}
		if rec := send(`{"amount":0,"currency":"EUR"}`); rec.Code != http.StatusCreated {
			t.Fatalf("first request: %d %s", rec.Code, rec.Body)
		}
		rec := send(`{"amount":8175,"currency":"EUR"}`)
		if rec.Code != http.StatusUnprocessableEntity {
			t.Fatalf("the key reused for another amount: %d (Idempotent-Replayed %q) %s; want 422", rec.Code, rec.Header().Get(httpidempotency.HeaderReplayed), rec.Body)
		}
		if rec := send(`{"currency":"EUR","amount":0}`); rec.Code != http.StatusCreated || rec.Header().Get(httpidempotency.HeaderReplayed) != "true" {
			t.Fatalf("the first request again: %d (Idempotent-Replayed %q) %s; want its response replayed", rec.Code, rec.Header().Get(httpidempotency.HeaderReplayed), rec.Body)
		}
		if runs != 1 {
			t.Fatalf("the handler ran %d times, want 1", runs)
		}
	})
}
