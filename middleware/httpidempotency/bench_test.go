package httpidempotency_test

import (
	"database/sql"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/babelqueue/watermill-idempotency/middleware/httpidempotency"
)

// BenchmarkMiddleware is the middleware's cost per request against the
// same handler without it, on each store, one request at a time:
//
//   - bare: the handler alone (in the transactional mode: in a transaction
//     of its own, begun and committed, as it would be without the kit);
//   - first: a new key each time (claim, run, save);
//   - replay: the same key each time (answered from the record).
//
// go test -run '^$' -bench BenchmarkMiddleware ./middleware/httpidempotency
func BenchmarkMiddleware(b *testing.B) {
	for _, name := range backendNames {
		b.Run(name, func(b *testing.B) {
			bk := newBackend(b, name, 0)
			opts := []httpidempotency.Option{httpidempotency.WithLogger(nil)}
			if bk.tx {
				opts = append(opts, httpidempotency.WithTransaction(bk.db))
			}
			guard, err := httpidempotency.New(bk.store, func(*http.Request) (string, error) { return "acme", nil }, opts...)
			if err != nil {
				b.Fatal(err)
			}
			op := httpidempotency.Operation{Name: "orders.create", SaveHeaders: []string{"Location"}, Expired: httpidempotency.ExpiredIsNew}
			respond := func(w http.ResponseWriter) {
				w.Header().Set("Content-Type", "application/json")
				w.Header().Set("Location", "/orders/42")
				w.WriteHeader(http.StatusCreated)
				_, _ = w.Write([]byte(`{"order_id":"ord_42","amount":1299,"currency":"EUR"}`))
			}
			var bare, guarded http.Handler
			if bk.tx {
				bare = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					tx, err := bk.db.BeginTx(r.Context(), nil)
					if err != nil {
						b.Fatal(err)
					}
					respond(w)
					if err := tx.Commit(); err != nil {
						b.Fatal(err)
					}
				})
				guarded = guard.WrapTx(op, func(w http.ResponseWriter, r *http.Request, tx *sql.Tx) error { respond(w); return nil })
			} else {
				h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { respond(w) })
				bare, guarded = h, guard.Wrap(op, h)
			}
			body := `{"amount":1299,"currency":"EUR","customer":"c-1","lines":[{"sku":"A-1","qty":2},{"sku":"B-7","qty":1}]}`
			serve := func(b *testing.B, h http.Handler, key string) {
				req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set(httpidempotency.HeaderKey, key)
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, req)
				if rec.Code != http.StatusCreated {
					b.Fatalf("%d %s", rec.Code, rec.Body)
				}
			}
			prefix := randomName("k")
			b.Run("bare", func(b *testing.B) {
				for i := 0; i < b.N; i++ {
					serve(b, bare, "x")
				}
			})
			b.Run("first", func(b *testing.B) {
				for i := 0; i < b.N; i++ {
					serve(b, guarded, prefix+strconv.Itoa(i))
				}
			})
			b.Run("replay", func(b *testing.B) {
				serve(b, guarded, prefix+"replayed")
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					serve(b, guarded, prefix+"replayed")
				}
			})
		})
	}
}
