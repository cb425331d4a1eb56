package effects_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"strings"
	"sync"
	"testing"
	"time"
)

// lossyProvider is a local HTTP server that charges every POST it reads and,
// for the first POST of each charge reference, loses the reply: it closes
// the connection after acting, before answering (a proxy's idle timeout, a
// server restart). charges counts what it did, by reference.
type lossyProvider struct {
	mu      sync.Mutex
	charges map[string]int
}

func (p *lossyProvider) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		w.WriteHeader(http.StatusNoContent)
		return
	}
	body, _ := io.ReadAll(r.Body)
	p.mu.Lock()
	p.charges[string(body)]++
	first := p.charges[string(body)] == 1
	p.mu.Unlock()
	if first {
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			_ = conn.Close() // charged; the reply lost
		}
		return
	}
	w.WriteHeader(http.StatusCreated)
}

// TestNetHTTPResendsAPOSTCarryingAnIdempotencyKey shows what the package
// documentation warns about: Go's http.Transport sends a POST again on its
// own, without the caller seeing the first failure, when the request
// carries an "Idempotency-Key" or "X-Idempotency-Key" header (it then
// counts as safe to replay), its body can be rewound (http.NewRequest sets
// GetBody for a bytes or strings reader), and the reused connection it went
// out on dies before the reply. To a provider that deduplicates keys, the
// resend is one more request with the same key; to one that ignores them,
// it is a second charge that no effect record saw. A header of another name,
// or GetBody set to nil, leaves the failure to the caller (to Do, which
// records the effect unknown and reconciles before it acts again).
func TestNetHTTPResendsAPOSTCarryingAnIdempotencyKey(t *testing.T) {
	t.Parallel()
	p := &lossyProvider{charges: map[string]int{}}
	srv := httptest.NewServer(p)
	t.Cleanup(srv.Close)
	for _, c := range []struct {
		name       string
		header     string
		keepRewind bool
		charges    int // how many times the provider charged
		callerErr  bool
	}{
		{"Idempotency-Key", "Idempotency-Key", true, 2, false},
		{"X-Idempotency-Key", "X-Idempotency-Key", true, 2, false},
		{"a name of the provider's own", "X-Charge-Reference", true, 1, true},
		{"Idempotency-Key without GetBody", "Idempotency-Key", false, 1, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			client := &http.Client{Transport: &http.Transport{}, Timeout: 10 * time.Second}
			t.Cleanup(client.CloseIdleConnections)
			ctx := context.Background()
			warmUp(t, client, srv.URL) // a kept-alive connection to reuse
			// The demonstration needs the POST to go out on the kept-alive
			// connection; the transport puts it back in its pool on a
			// goroutine of its own, so a POST may dial afresh instead: try
			// again with a new reference until the first connection it got
			// was a reused one.
			for try := 1; ; try++ {
				ref := fmt.Sprintf("charge-%s-%d", strings.ReplaceAll(c.name, " ", "-"), try)
				var reused []bool
				trace := &httptrace.ClientTrace{GotConn: func(info httptrace.GotConnInfo) { reused = append(reused, info.Reused) }}
				req, err := http.NewRequestWithContext(httptrace.WithClientTrace(ctx, trace), http.MethodPost, srv.URL, strings.NewReader(ref))
				if err != nil {
					t.Fatal(err)
				}
				req.Header.Set(c.header, ref)
				if !c.keepRewind {
					req.GetBody = nil
				}
				resp, err := client.Do(req) // one call
				if err == nil {
					_ = resp.Body.Close()
				}
				if len(reused) == 0 || !reused[0] {
					if try == 50 {
						t.Fatalf("50 POSTs went out on a fresh connection, none on the kept-alive one")
					}
					warmUp(t, client, srv.URL)
					continue
				}
				p.mu.Lock()
				charges := p.charges[ref]
				p.mu.Unlock()
				if charges != c.charges || (err != nil) != c.callerErr {
					t.Fatalf("one call to Do (connections: reused %v): the provider charged %d times, the caller got %v; want %d charges, an error %v", reused, charges, err, c.charges, c.callerErr)
				}
				t.Logf("one call to Do (connections: reused %v): %d charges, caller's error: %v", reused, charges, err)
				break
			}
		})
	}
}

// warmUp sends a GET, so that client keeps a connection to url alive.
func warmUp(t *testing.T, client *http.Client, url string) {
	t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
}
