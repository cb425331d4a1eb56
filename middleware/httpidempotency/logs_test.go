package httpidempotency_test

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/babelqueue/watermill-idempotency/middleware/httpidempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestLogsThroughTheDefaultAtEachLine: a Guard built without WithLogger
// logs through slog.Default() as it is when the line is written, not as it
// was when the Guard was built; WithLogger(nil) is silent. It replaces the
// process's slog default: not parallel.
func TestLogsThroughTheDefaultAtEachLine(t *testing.T) {
	badTenant := func(*http.Request) (string, error) { return "tenant\x07with-a-bell", nil }
	op := httpidempotency.Operation{Name: "logs.default", Expired: httpidempotency.ExpiredIsNew}
	ok := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusCreated) })
	loud, err := httpidempotency.New(memstore.New(), badTenant)
	if err != nil {
		t.Fatal(err)
	}
	quiet, err := httpidempotency.New(memstore.New(), badTenant, httpidempotency.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	logs := testenv.CaptureSlog(t)
	for _, g := range []*httpidempotency.Guard{loud, quiet} {
		req := httptest.NewRequest(http.MethodPost, "/orders", nil)
		req.Header.Set("Idempotency-Key", "k-1")
		rec := httptest.NewRecorder()
		g.Wrap(op, ok).ServeHTTP(rec, req)
		if rec.Code != http.StatusInternalServerError {
			t.Fatalf("status %d, want 500 for an unusable tenant", rec.Code)
		}
	}
	lines := logs.Where(t, "operation", op.Name)
	if len(lines) != 1 || lines[0]["level"] != "ERROR" {
		t.Fatalf("want one error line (from the Guard without WithLogger), got:\n%s", logs)
	}
}
