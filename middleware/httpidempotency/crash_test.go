package httpidempotency_test

import (
	"bufio"
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/middleware/httpidempotency"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// crashLease is the lease of the server killed in TestServerKilledMidRequest:
// a claim of a killed server lapses after it.
const crashLease = time.Second

// TestServerKilledMidRequest: an orders API in the transactional mode runs
// as a child process and is SIGKILLed again and again while 20 clients
// create 10 orders each, retrying every request (after a refused
// connection, a timeout, a 409 or a 503) until it is answered. A request
// killed before its commit leaves nothing but a claim that lapses; one
// killed after it is answered from its record. Every key ends with exactly
// one order, and every client got that order's id.
func TestServerKilledMidRequest(t *testing.T) {
	if testing.Short() {
		t.Skip("kills and restarts a server for several seconds")
	}
	t.Parallel()
	b := newBackend(t, "postgres-tx", 0)
	store := b.store.(*postgresstore.Store)
	orders := randomName("orders_")
	ordersTables.add(t, orders)
	ctx, cancel := context.WithTimeout(context.Background(), 180*time.Second)
	defer cancel()
	if _, err := b.db.ExecContext(ctx, `CREATE TABLE `+orders+` (id bigserial PRIMARY KEY, tenant text NOT NULL,
		idem_key text NOT NULL, amount bigint NOT NULL, currency text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dropTables(t, b.db, orders) })

	var url atomic.Value // the running server's base URL
	var kills atomic.Int32
	var mu sync.Mutex
	var current *exec.Cmd
	start := func() {
		cmd := exec.Command(os.Args[0], "-test.run=^TestKilledServerProcess$", "-test.count=1")
		cmd.Env = append(os.Environ(), "HTTPIDEM_SERVER_STORE="+store.Table(), "HTTPIDEM_SERVER_ORDERS="+orders)
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		line, err := bufio.NewReader(out).ReadString('\n')
		if err != nil || !strings.HasPrefix(line, "listening ") {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			t.Fatalf("the server did not start: %q %v", line, err)
		}
		go func() { _, _ = bufio.NewReader(out).WriteTo(discard{}) }()
		url.Store("http://" + strings.TrimSpace(strings.TrimPrefix(line, "listening ")))
		mu.Lock()
		current = cmd
		mu.Unlock()
	}
	start()
	defer func() {
		mu.Lock()
		defer mu.Unlock()
		_ = current.Process.Kill()
		_ = current.Wait()
	}()

	const clients, perClient = 20, 10
	type result struct{ key, id string }
	results := make(chan result, clients*perClient)
	errs := make(chan error, clients)
	var conflicts, refused, timeouts, answered atomic.Int64
	var wg sync.WaitGroup
	for c := 0; c < clients; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			client := &http.Client{Timeout: 3 * time.Second}
			for k := 0; k < perClient; k++ {
				key := fmt.Sprintf("c%d-k%d", c, k)
				for {
					if ctx.Err() != nil {
						errs <- fmt.Errorf("%s: not answered in time", key)
						return
					}
					req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url.Load().(string)+"/orders", strings.NewReader(orderBody(int64(100+k), "EUR")))
					req.Header.Set("Authorization", "Bearer u@acme")
					req.Header.Set(httpidempotency.HeaderKey, key)
					resp, err := client.Do(req)
					if err != nil {
						if os.IsTimeout(err) {
							timeouts.Add(1)
						} else {
							refused.Add(1)
						}
						time.Sleep(20 * time.Millisecond)
						continue
					}
					r := readReply(resp)
					answered.Add(1)
					switch r.status {
					case http.StatusCreated:
						results <- result{key, r.order(t).OrderID}
					case http.StatusConflict, http.StatusServiceUnavailable:
						conflicts.Add(1)
						wait, _ := strconv.Atoi(r.header.Get("Retry-After"))
						time.Sleep(time.Duration(wait) * time.Second)
						continue
					default:
						errs <- fmt.Errorf("%s: %d %s", key, r.status, r.body)
						return
					}
					break
				}
			}
		}()
	}
	clientsDone := make(chan struct{})
	go func() { wg.Wait(); close(clientsDone) }()
	// Kill the server every 150-450 ms while the clients work, once it
	// answered something since it started: on a slow machine a server
	// killed before its first answer would only make the clients wait.
killing:
	for seen := answered.Load(); ; {
		select {
		case <-clientsDone:
			break killing
		case <-time.After(time.Duration(150+rand.IntN(300)) * time.Millisecond):
		}
		if answered.Load() == seen {
			continue
		}
		seen = answered.Load()
		mu.Lock()
		_ = current.Process.Signal(syscall.SIGKILL)
		_ = current.Wait()
		mu.Unlock()
		kills.Add(1)
		start()
	}
	close(results)
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	got := map[string]string{}
	for r := range results {
		got[r.key] = r.id
	}
	if len(got) != clients*perClient {
		t.Fatalf("%d keys answered, want %d", len(got), clients*perClient)
	}
	rows, err := b.db.QueryContext(ctx, `SELECT idem_key, count(*), min(id) FROM `+orders+` GROUP BY idem_key`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	made := 0
	for rows.Next() {
		var key string
		var n, id int64
		if err := rows.Scan(&key, &n, &id); err != nil {
			t.Fatal(err)
		}
		made++
		if n != 1 {
			t.Errorf("key %s: %d orders", key, n)
		}
		if want := "ord_" + strconv.FormatInt(id, 10); got[key] != want {
			t.Errorf("key %s: the client got %s, the order is %s", key, got[key], want)
		}
	}
	if made != clients*perClient {
		t.Fatalf("%d keys have orders, want %d", made, clients*perClient)
	}
	if kills.Load() < 5 {
		t.Fatalf("only %d kills: the test proved little", kills.Load())
	}
	t.Logf("%d orders for %d keys; server SIGKILLed %d times; clients met %d refused connections, %d timeouts, %d 409/503",
		made, clients*perClient, kills.Load(), refused.Load(), timeouts.Load(), conflicts.Load())
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

func readReply(resp *http.Response) reply {
	defer resp.Body.Close()
	var body strings.Builder
	_, _ = bufio.NewReader(resp.Body).WriteTo(&body)
	return reply{status: resp.StatusCode, header: resp.Header, body: []byte(body.String())}
}

// TestKilledServerProcess is the server TestServerKilledMidRequest kills:
// the orders API in the transactional mode, whose runs take 0-150 ms
// after their insert and whose responses leave 0-100 ms after the commit,
// so that kills land inside transactions and between a commit and its
// response.
func TestKilledServerProcess(t *testing.T) {
	table, orders := os.Getenv("HTTPIDEM_SERVER_STORE"), os.Getenv("HTTPIDEM_SERVER_ORDERS")
	if table == "" {
		t.Skip("only run as a child of TestServerKilledMidRequest")
	}
	db := testenv.Postgres(t)
	db.SetMaxOpenConns(32)
	db.SetMaxIdleConns(32)
	store, err := postgresstore.New(db, postgresstore.WithTable(table), postgresstore.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	guard, err := httpidempotency.New(store, tenantOf, httpidempotency.WithTransaction(db),
		httpidempotency.WithLease(crashLease), httpidempotency.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	api := &ordersAPI{table: orders}
	api.afterCreate = func(int64) time.Duration { return time.Duration(rand.IntN(150)) * time.Millisecond }
	// A response leaves 0-100 ms after its commit: kills land there too.
	api.slowWrites = func(*http.Request) time.Duration { return time.Duration(rand.IntN(100)) * time.Millisecond }
	mux := http.NewServeMux()
	mux.Handle("POST /orders", api.slow(guard.WrapTx(httpidempotency.Operation{Name: "orders.create", Expired: httpidempotency.ExpiredIsNew}, api.create)))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	fmt.Printf("listening %s\n", ln.Addr())
	_ = http.Serve(ln, mux) // until killed
}
