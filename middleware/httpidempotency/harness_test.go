package httpidempotency_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/middleware/httpidempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// backendNames are the stores every API test runs on: the three stores in
// the claim mode (Wrap), and PostgreSQL in the transactional mode (WrapTx).
var backendNames = []string{"memory", "redis", "postgres", "postgres-tx"}

// backend is a store for one test, and its database in the transactional
// mode.
type backend struct {
	name  string
	store stores.Store
	db    *sql.DB // postgres and postgres-tx
	tx    bool
}

func randomName(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// newBackend opens the named store with retention ttl (0: forever), empty
// and private to the test, removed when it ends.
func newBackend(t testing.TB, name string, ttl time.Duration) backend {
	t.Helper()
	switch name {
	case "memory":
		return backend{name: name, store: memstore.New(memstore.WithTTL(ttl))}
	case "redis":
		client := testenv.Redis(t) // removes the keys a test (not a benchmark) wrote
		prefix := randomName("hi") + ":"
		t.Cleanup(func() { _ = testenv.DropKeys(context.Background(), client, prefix+"*") })
		return backend{name: name, store: redisstore.New(client, redisstore.WithPrefix(prefix), redisstore.WithTTL(ttl))}
	case "postgres", "postgres-tx", "postgres-tx-rows":
		db := testenv.Postgres(t)
		db.SetMaxOpenConns(16)
		db.SetMaxIdleConns(16)
		var opts []postgresstore.Option
		if name == "postgres-tx-rows" {
			opts = append(opts, postgresstore.WithRowClaims()) // a claim that lapses and is taken over while its holder lives
		}
		return backend{name: name, store: newPostgresStore(t, db, "httpidem_", ttl, opts...), db: db, tx: name != "postgres"}
	}
	t.Fatalf("unknown backend %q", name)
	return backend{}
}

func dropTables(t testing.TB, db *sql.DB, tables ...string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, table := range tables {
		if _, err := db.ExecContext(ctx, `DROP TABLE IF EXISTS `+table); err != nil {
			t.Errorf("drop %s: %v", table, err)
		}
	}
}

// eachBackend runs fn on every backend, in parallel subtests of a test
// that runs in parallel with the others.
func eachBackend(t *testing.T, fn func(t *testing.T, b backend)) {
	t.Parallel() // the test itself, beside the others
	for _, name := range backendNames {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			fn(t, newBackend(t, name, 0))
		})
	}
}

// The test API authenticates "Authorization: Bearer SUBJECT@TENANT".
func tenantOf(r *http.Request) (string, error) {
	_, tenant, ok := strings.Cut(strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer "), "@")
	if !ok || tenant == "" {
		return "", errors.New("not authenticated")
	}
	return tenant, nil
}

func subjectOf(r *http.Request) string {
	subject, _, _ := strings.Cut(strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer "), "@")
	return subject
}

// ordersAPI is an orders endpoint guarded by the middleware: orders go to
// an in-process ledger in the claim mode, to a PostgreSQL table through the
// request's transaction in the transactional mode.
type ordersAPI struct {
	b      backend
	guard  *httpidempotency.Guard
	server *httptest.Server
	table  string // the orders table (postgres-tx)

	runs      atomic.Int64 // handler runs
	ended     atomic.Int64 // runs whose context had ended when they answered
	timeouts  atomic.Int64 // client attempts that timed out (retrying)
	conflicts atomic.Int64 // 409s clients got (retrying)
	failNext  atomic.Int32 // answer 500 before creating an order, this many times
	revoked   sync.Map     // subject → lost the permission to see orders

	mu     sync.Mutex
	ledger map[string][]string // tenant/key → order ids (claim mode)
	nextID int

	// Set before the first request.
	hold        chan struct{} // when set, a run waits on it after creating its order
	holding     chan struct{} // receives once per run that waits on hold
	afterCreate func(run int64) time.Duration
	pad         int // bytes of padding in the response body
	slowWrites  func(r *http.Request) time.Duration
}

type apiConfig struct {
	op         httpidempotency.Operation
	guardOpts  []httpidempotency.Option
	uniqueKeys bool // postgres-tx: the orders table has UNIQUE (tenant, idem_key)
	setup      func(a *ordersAPI)
}

type apiOption func(*apiConfig)

func withOperation(fn func(op *httpidempotency.Operation)) apiOption {
	return func(c *apiConfig) { fn(&c.op) }
}

func withGuardOptions(opts ...httpidempotency.Option) apiOption {
	return func(c *apiConfig) { c.guardOpts = append(c.guardOpts, opts...) }
}

func withSetup(fn func(a *ordersAPI)) apiOption { return func(c *apiConfig) { c.setup = fn } }

// newOrdersAPI serves POST /orders on a real HTTP server.
func newOrdersAPI(t *testing.T, b backend, opts ...apiOption) *ordersAPI {
	t.Helper()
	cfg := apiConfig{op: httpidempotency.Operation{
		Name:        "orders.create",
		SaveHeaders: []string{"Location"},
		Expired:     httpidempotency.ExpiredIsNew,
		Authorize:   nil,
	}}
	a := &ordersAPI{b: b, ledger: map[string][]string{}}
	cfg.op.Authorize = func(r *http.Request, saved *httpidempotency.Response) bool {
		_, gone := a.revoked.Load(subjectOf(r))
		return !gone
	}
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.setup != nil {
		cfg.setup(a)
	}
	guardOpts := append([]httpidempotency.Option{httpidempotency.WithSubject(subjectOf), httpidempotency.WithLogger(slog.New(slog.NewTextHandler(testWriter{t}, nil)))}, cfg.guardOpts...)
	if b.tx {
		guardOpts = append(guardOpts, httpidempotency.WithTransaction(b.db))
		a.table = randomName("orders_")
		ordersTables.add(t, a.table)
		unique := ""
		if cfg.uniqueKeys {
			unique = ", UNIQUE (tenant, idem_key)"
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := b.db.ExecContext(ctx, `CREATE TABLE `+a.table+` (id bigserial PRIMARY KEY, tenant text NOT NULL,
			idem_key text NOT NULL, amount bigint NOT NULL, currency text NOT NULL`+unique+`)`); err != nil {
			t.Fatal(err)
		}
		table := a.table // a test may point a.table at another API's table
		t.Cleanup(func() { dropTables(t, b.db, table) })
	}
	guard, err := httpidempotency.New(b.store, tenantOf, guardOpts...)
	if err != nil {
		t.Fatal(err)
	}
	a.guard = guard
	var h http.Handler
	if b.tx {
		h = guard.WrapTx(cfg.op, a.create)
	} else {
		h = guard.Wrap(cfg.op, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if err := a.create(w, r, nil); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
			}
		}))
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", a.slow(h))
	a.server = httptest.NewServer(mux)
	t.Cleanup(a.server.Close)
	return a
}

// slow delays the response of a run (a 201 not replayed) by
// slowWrites(r): a response that leaves the
// server after the order committed, so that the client's timeout fires
// after the commit.
func (a *ordersAPI) slow(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if a.slowWrites == nil {
			h.ServeHTTP(w, r)
			return
		}
		h.ServeHTTP(&delayedWriter{ResponseWriter: w, delay: a.slowWrites(r)}, r)
	})
}

type delayedWriter struct {
	http.ResponseWriter
	delay time.Duration
	once  bool
}

func (d *delayedWriter) WriteHeader(status int) {
	if !d.once && status == http.StatusCreated && d.Header().Get(httpidempotency.HeaderReplayed) == "" {
		d.once = true
		time.Sleep(d.delay)
	}
	d.ResponseWriter.WriteHeader(status)
}

type orderIn struct {
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
}

type orderOut struct {
	OrderID  string `json:"order_id"`
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
	Pad      string `json:"pad,omitempty"`
}

// create is the handler: an order per run, in the ledger or in the table
// through tx.
func (a *ordersAPI) create(w http.ResponseWriter, r *http.Request, tx *sql.Tx) error {
	run := a.runs.Add(1)
	var in orderIn
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
		http.Error(w, "bad order", http.StatusBadRequest)
		return nil
	}
	if a.failNext.Load() > 0 && a.failNext.Add(-1) >= 0 {
		http.Error(w, "the payment service is down", http.StatusInternalServerError)
		return nil
	}
	tenant, _ := tenantOf(r)
	key, _ := httpidempotency.ParseKey(r.Header)
	var id string
	if tx != nil {
		var n int64
		err := tx.QueryRowContext(r.Context(), `INSERT INTO `+a.table+` (tenant, idem_key, amount, currency) VALUES ($1, $2, $3, $4) RETURNING id`,
			tenant, key, in.Amount, in.Currency).Scan(&n)
		if err != nil {
			return err
		}
		id = "ord_" + strconv.FormatInt(n, 10)
	} else {
		a.mu.Lock()
		a.nextID++
		id = "ord_" + strconv.Itoa(a.nextID)
		a.ledger[tenant+"/"+key] = append(a.ledger[tenant+"/"+key], id)
		a.mu.Unlock()
	}
	if a.hold != nil {
		if a.holding != nil {
			a.holding <- struct{}{}
		}
		<-a.hold
	}
	if a.afterCreate != nil {
		time.Sleep(a.afterCreate(run))
	}
	if r.Context().Err() != nil {
		a.ended.Add(1)
	}
	out := orderOut{OrderID: id, Amount: in.Amount, Currency: in.Currency, Pad: strings.Repeat("x", a.pad)}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", "/orders/"+id)
	w.Header().Set("X-Not-Saved", "run-"+strconv.FormatInt(run, 10))
	w.WriteHeader(http.StatusCreated)
	return json.NewEncoder(w).Encode(out)
}

// orders returns the ids of the orders made for (tenant, key), committed.
func (a *ordersAPI) orders(t *testing.T, tenant, key string) []string {
	t.Helper()
	if !a.b.tx {
		a.mu.Lock()
		defer a.mu.Unlock()
		return append([]string(nil), a.ledger[tenant+"/"+key]...)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var ids []string
	for _, n := range testenv.Column[int64](ctx, t, a.b.db, `SELECT id FROM `+a.table+` WHERE tenant = $1 AND idem_key = $2 ORDER BY id`, tenant, key) {
		ids = append(ids, "ord_"+strconv.FormatInt(n, 10))
	}
	return ids
}

// reply is what a client got.
type reply struct {
	status int
	header http.Header
	body   []byte
}

func (r reply) order(t *testing.T) orderOut {
	t.Helper()
	var o orderOut
	if err := json.Unmarshal(r.body, &o); err != nil || o.OrderID == "" {
		t.Fatalf("not an order (status %d): %s", r.status, r.body)
	}
	return o
}

// problemType returns the name ending the problem's type.
func (r reply) problemType(t *testing.T) string {
	t.Helper()
	if ct := r.header.Get("Content-Type"); ct != "application/problem+json" {
		t.Fatalf("status %d, Content-Type %q, want a problem: %s", r.status, ct, r.body)
	}
	var p struct {
		Type   string `json:"type"`
		Status int    `json:"status"`
	}
	if err := json.Unmarshal(r.body, &p); err != nil {
		t.Fatalf("problem body %s: %v", r.body, err)
	}
	if p.Status != r.status {
		t.Fatalf("problem status %d in a %d response", p.Status, r.status)
	}
	return strings.TrimPrefix(p.Type, httpidempotency.DefaultProblemBase)
}

type request struct {
	auth, key, body string
	headers         map[string]string
}

// do sends one request.
func (a *ordersAPI) do(ctx context.Context, req request) (reply, error) {
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, a.server.URL+"/orders", strings.NewReader(req.body))
	if err != nil {
		return reply{}, err
	}
	hr.Header.Set("Content-Type", "application/json")
	if req.auth != "" {
		hr.Header.Set("Authorization", "Bearer "+req.auth)
	}
	if req.key != "" {
		hr.Header.Set(httpidempotency.HeaderKey, req.key)
	}
	for k, v := range req.headers {
		hr.Header.Set(k, v)
	}
	resp, err := a.server.Client().Do(hr)
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return reply{}, err
	}
	return reply{status: resp.StatusCode, header: resp.Header, body: body}, nil
}

func (a *ordersAPI) post(t *testing.T, req request) reply {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	r, err := a.do(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// retrying sends req until it gets an answer that is not 409 or 503 (after
// Retry-After) nor a timeout: the first attempt times out after first, the
// later ones after 10s. It returns the answer and the attempts made.
func (a *ordersAPI) retrying(ctx context.Context, req request, first time.Duration) (reply, int, error) {
	timeout := first
	for attempt := 1; ; attempt++ {
		actx, cancel := context.WithTimeout(ctx, timeout)
		r, err := a.do(actx, req)
		cancel()
		timeout = 10 * time.Second
		switch {
		case ctx.Err() != nil:
			return reply{}, attempt, fmt.Errorf("gave up after %d attempts: %w", attempt, ctx.Err())
		case err != nil: // timed out: retry at once
			a.timeouts.Add(1)
			continue
		case r.status == http.StatusConflict || r.status == http.StatusServiceUnavailable:
			if r.status == http.StatusConflict {
				a.conflicts.Add(1)
			}
			wait, _ := strconv.Atoi(r.header.Get("Retry-After"))
			if wait < 1 {
				return r, attempt, fmt.Errorf("status %d without Retry-After", r.status)
			}
			select {
			case <-time.After(time.Duration(wait) * time.Second):
			case <-ctx.Done():
			}
			continue
		}
		return r, attempt, nil
	}
}

func orderBody(amount int64, currency string) string {
	b, _ := json.Marshal(orderIn{Amount: amount, Currency: currency})
	return string(b)
}

// testWriter sends the guard's log to the test's.
type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

var errPaymentDeclined = errors.New("payment declined")
