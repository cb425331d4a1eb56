package main

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/middleware/httpidempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestInspectIdentityRecords: the compact identity record a Guard with
// two tiers keeps (httpidempotency.WithResponseStore) is shown with its
// status and reference, not as unreadable.
func TestInspectIdentityRecords(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	prefix := "t" + testenv.RandomHex(4) + ":"
	store := redisstore.New(client, redisstore.WithPrefix(prefix), redisstore.WithTTL(time.Hour))
	guard, err := httpidempotency.New(store, func(*http.Request) (string, error) { return "acme", nil },
		httpidempotency.WithResponseStore(memstore.New(memstore.WithTTL(time.Minute))))
	if err != nil {
		t.Fatal(err)
	}
	h := guard.Wrap(httpidempotency.Operation{Name: "orders.create", Expired: httpidempotency.ExpiredIsNew},
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Location", "/orders/ord_9")
			w.WriteHeader(http.StatusCreated)
		}))
	req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{}`)).WithContext(context.Background())
	req.Header.Set(httpidempotency.HeaderKey, "k-1")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code != http.StatusCreated {
		t.Fatalf("request: %d %s", rec.Code, rec.Body)
	}
	flags := []string{"--store", "redis", "--redis-url", redisURL(), "--prefix", prefix, "--api-tenant", "acme", "--operation", "orders.create"}
	r := run1(t, append(append([]string{"inspect"}, flags...), "k-1")...)
	if out := strings.Join(strings.Fields(r.stdout), " "); r.code != 0 || !strings.Contains(out, "201 (identity record /orders/ord_9, saved") {
		t.Fatalf("inspect: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	r = run1(t, append(append([]string{"inspect", "--output", "json"}, flags...), "k-1")...)
	var doc struct {
		Records []struct {
			Response *struct {
				Status    int
				Reference string
			}
		}
	}
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil || len(doc.Records) != 1 || doc.Records[0].Response == nil ||
		doc.Records[0].Response.Status != 201 || doc.Records[0].Response.Reference != "/orders/ord_9" {
		t.Fatalf("inspect --output json: exit %d, %v\n%s%s", r.code, err, r.stdout, r.stderr)
	}
}
