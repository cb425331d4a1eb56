package httpidempotency_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/middleware/httpidempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// errorLog keeps the errors a Guard logs, with their messages.
type errorLog struct {
	mu   sync.Mutex
	errs []error
	msgs []string
}

func (l *errorLog) Enabled(context.Context, slog.Level) bool { return true }

func (l *errorLog) Handle(_ context.Context, r slog.Record) error {
	r.Attrs(func(a slog.Attr) bool {
		if err, ok := a.Value.Any().(error); ok && a.Key == "error" {
			l.mu.Lock()
			l.errs, l.msgs = append(l.errs, err), append(l.msgs, r.Message)
			l.mu.Unlock()
		}
		return true
	})
	return nil
}

func (l *errorLog) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *errorLog) WithGroup(string) slog.Handler      { return l }

// requireDeadlineErrors fails t unless every error logged since from
// matches context.DeadlineExceeded, and some were: each is a store call
// that ran out of the Guard's store timeout.
func (l *errorLog) requireDeadlineErrors(t *testing.T, from int) int {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	bad := 0
	for i, err := range l.errs[from:] {
		if !errors.Is(err, context.DeadlineExceeded) {
			if bad++; bad <= 5 {
				t.Errorf("logged %q with %v; want the store call's context's error", l.msgs[from+i], err)
			}
		}
	}
	if len(l.errs) == from {
		t.Error("no store call's error was logged")
	}
	return len(l.errs)
}

func (l *errorLog) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.errs)
}

// dlTiers is a Guard's two tiers on servers reached through a proxy each:
// its own store (identity records, claims) and its response store.
type dlTiers struct {
	identity, responses stores.Store
	idProxy, respProxy  *testenv.FaultProxy
}

// dlRedisTiers returns the two tiers on Redis, on clients that do not
// honour contexts' deadlines and whose read timeout (2 s) is twenty times
// the Guard's store timeout.
func dlRedisTiers(t *testing.T) dlTiers {
	direct := testenv.Redis(t)
	prefix := randomName("hid") + ":"
	t.Cleanup(func() { _ = testenv.DropKeys(context.Background(), direct, prefix+"*") })
	client := func() (*redis.Client, *testenv.FaultProxy) {
		p := testenv.NewFaultProxy(t, direct.Options().Addr)
		o := direct.Options()
		o.Addr, o.ReadTimeout, o.WriteTimeout, o.ContextTimeoutEnabled = p.Addr(), 2*time.Second, 2*time.Second, false
		c := redis.NewClient(o)
		t.Cleanup(func() { _ = c.Close() })
		return c, p
	}
	idClient, idProxy := client()
	respClient, respProxy := client()
	return dlTiers{
		identity:  redisstore.New(idClient, redisstore.WithPrefix(prefix+"id:"), redisstore.WithTTL(time.Hour)),
		responses: redisstore.New(respClient, redisstore.WithPrefix(prefix+"resp:"), redisstore.WithTTL(10*time.Minute)),
		idProxy:   idProxy, respProxy: respProxy,
	}
}

// dlPostgresTiers returns the two tiers on PostgreSQL (pgx), each table
// on a pool of its own through a proxy of its own.
func dlPostgresTiers(t *testing.T) dlTiers {
	direct := testenv.Postgres(t)
	pool := func() (*sql.DB, *testenv.FaultProxy) {
		dsn, p := testenv.PostgresProxyDSN(t)
		db, err := sql.Open("pgx", dsn)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		return db, p
	}
	idDB, idProxy := pool()
	respDB, respProxy := pool()
	identity := newPostgresStore(t, idDB, "hid_", time.Hour)
	responses := newPostgresStore(t, respDB, "hresp_", 10*time.Minute)
	for _, table := range []string{identity.Table(), responses.Table()} {
		t.Cleanup(func() { dropTables(t, direct, table) }) // runs before the pools close
	}
	return dlTiers{identity: identity, responses: responses, idProxy: idProxy, respProxy: respProxy}
}

// stall makes p stop answering (stalled) or answer again.
func stall(p *testenv.FaultProxy, stalled bool) {
	p.Silent.Store(stalled)
	if stalled {
		p.Delay.Store(int64(time.Hour))
	} else {
		p.Delay.Store(0)
	}
}

// TestStoreCallsReturnByTheStoreTimeout: a Guard keeping responses in two
// tiers (WithResponseStore) on Redis (a client without
// ContextTimeoutEnabled) and on PostgreSQL, each tier behind a proxy, with
// a store timeout of 100ms. While the response store never answers, a
// request still runs and is answered (its full response could not be
// saved), and a retry of an earlier request gets the compact replay; while
// the Guard's own store never answers, a request gets 503. Every request
// is answered within its store calls' timeouts, never after the client's
// read timeout (2 s) or the store's query timeout (5 s), and every store
// error the Guard logs matches context.DeadlineExceeded, never a bare
// network timeout.
func TestStoreCallsReturnByTheStoreTimeout(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out many store timeouts")
	}
	for name, tiers := range map[string]func(t *testing.T) dlTiers{"redis": dlRedisTiers, "postgres": dlPostgresTiers} {
		t.Run(name, func(t *testing.T) {
			tiers := tiers(t)
			const storeTimeout = 100 * time.Millisecond
			log := &errorLog{}
			g, err := httpidempotency.New(tiers.identity, tenantOf, httpidempotency.WithStoreTimeout(storeTimeout),
				httpidempotency.WithResponseStore(tiers.responses), httpidempotency.WithLogger(slog.New(log)))
			if err != nil {
				t.Fatal(err)
			}
			h := g.Wrap(httpidempotency.Operation{Name: "orders.create", Expired: httpidempotency.ExpiredIsNew}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Location", "/orders/"+r.Header.Get("Idempotency-Key"))
				w.WriteHeader(http.StatusCreated)
				_, _ = w.Write([]byte(`{"ok":true}`))
			}))
			post := func(key string) (int, http.Header, time.Duration) {
				req := httptest.NewRequest(http.MethodPost, "/orders", nil)
				req.Header.Set("Authorization", "Bearer alice@acme")
				req.Header.Set("Idempotency-Key", `"`+key+`"`)
				rec := httptest.NewRecorder()
				start := time.Now()
				h.ServeHTTP(rec, req)
				return rec.Code, rec.Header(), time.Since(start)
			}
			// A request's store calls in turn: a Claim, the response and
			// the identity record (Remember tries up to 3 times, 150ms
			// apart), a Release; a second of slack for a loaded machine.
			const within = 6*storeTimeout + 150*time.Millisecond + time.Second
			const workers, rounds = 8, 3
			load := func(t *testing.T, key func(w, r int) string, check func(t *testing.T, code int, header http.Header)) {
				var wg sync.WaitGroup
				for w := range workers {
					wg.Go(func() {
						for r := range rounds {
							code, header, took := post(key(w, r))
							if took > within {
								t.Errorf("a request took %v with a store timeout of %v", took.Round(time.Millisecond), storeTimeout)
							}
							check(t, code, header)
						}
					})
				}
				wg.Wait()
			}
			done := func(w, r int) string { return fmt.Sprintf("done-%d-%d", w, r) }
			load(t, done, func(t *testing.T, code int, _ http.Header) { // both tiers answer
				if code != http.StatusCreated {
					t.Errorf("status %d; want 201", code)
				}
			})
			if n := log.count(); n != 0 {
				t.Fatalf("%d errors logged while the stores answered", n)
			}

			t.Run("response store stalled", func(t *testing.T) {
				stall(tiers.respProxy, true)
				defer stall(tiers.respProxy, false)
				load(t, func(w, r int) string { return fmt.Sprintf("new-%d-%d", w, r) }, func(t *testing.T, code int, _ http.Header) {
					if code != http.StatusCreated {
						t.Errorf("status %d; want 201 (its full response not saved)", code)
					}
				})
				load(t, done, func(t *testing.T, code int, header http.Header) {
					if code != http.StatusCreated || header.Get(httpidempotency.HeaderResponse) != httpidempotency.ResponseUnavailable {
						t.Errorf("a retry got %d, %s %q; want 201, the compact replay (%s)", code,
							httpidempotency.HeaderResponse, header.Get(httpidempotency.HeaderResponse), httpidempotency.ResponseUnavailable)
					}
				})
				log.requireDeadlineErrors(t, 0)
			})

			t.Run("own store stalled", func(t *testing.T) {
				from := log.count()
				stall(tiers.idProxy, true)
				defer stall(tiers.idProxy, false)
				load(t, func(w, r int) string { return fmt.Sprintf("down-%d-%d", w, r) }, func(t *testing.T, code int, _ http.Header) {
					if code != http.StatusServiceUnavailable {
						t.Errorf("status %d; want 503", code)
					}
				})
				log.requireDeadlineErrors(t, from)
			})

			// Both answer again: the same Guard serves.
			if code, _, _ := post("after"); code != http.StatusCreated {
				t.Fatalf("a request after the stores came back: status %d; want 201", code)
			}
		})
	}
}
