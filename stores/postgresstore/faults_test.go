package postgresstore_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestCallsReturnByTheirDeadline: against a PostgreSQL that accepts
// connections and never answers (pooled connections stall, new ones get no
// reply), every call returns its error at its own context's deadline,
// though the store's query timeout is far longer.
func TestCallsReturnByTheirDeadline(t *testing.T) {
	for name, opts := range map[string][]postgresstore.Option{"session claims": nil, "claims of rows": {postgresstore.WithRowClaims()}} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			callsReturnByTheirDeadline(t, opts...)
		})
	}
}

func callsReturnByTheirDeadline(t *testing.T, opts ...postgresstore.Option) {
	direct := testenv.Postgres(t)
	table := newStore(t, direct).Table()
	db, proxy := proxiedPostgres(t)
	db.SetMaxIdleConns(8)
	store, err := postgresstore.New(db, append([]postgresstore.Option{postgresstore.WithTable(table), postgresstore.WithQueryTimeout(30 * time.Second)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = store.Close() })
	if err := store.Remember(context.Background(), "warm-up", 0, nil); err != nil { // a pooled connection (and the session)
		t.Fatal(err)
	}
	proxy.Silent.Store(true)
	proxy.Delay.Store(int64(time.Hour))

	const callers, deadline = 8, 200 * time.Millisecond
	calls := []func(ctx context.Context, key string) error{
		func(ctx context.Context, key string) error { _, err := stores.Seen(ctx, store, key); return err },
		func(ctx context.Context, key string) error { return store.Remember(ctx, key, 0, nil) },
		func(ctx context.Context, key string) error {
			_, _, err := store.Claim(ctx, key, time.Minute)
			return err
		},
		func(ctx context.Context, key string) error { return store.Forget(ctx, key) },
		func(ctx context.Context, key string) error { _, err := store.Lookup(ctx, key); return err },
	}
	if !store.SessionClaims() {
		// A Release of a claim of rows is a statement; with session claims
		// one of a claim not held here has nothing to send.
		calls = append(calls, func(ctx context.Context, key string) error { return store.Release(ctx, key) })
	}
	testenv.RequireDeadlines(t, callers, len(calls), deadline, func(ctx context.Context, c, i int) error {
		return calls[i](stores.WithClaimToken(ctx, "d"), "k-"+strconv.Itoa(c*len(calls)+i))
	})
}

// TestWarnsOfAPoolThatKeepsReconnecting: with one idle connection kept
// for 16 concurrent callers, many statements need a new connection; the
// store logs a warning saying what to raise. With the idle connections
// sized to the callers, it stays silent. The statements go one by one
// (WithoutGrouping): grouped ones need too few connections to churn a pool.
//
// The callers go in rounds, the 16 statements of a round at once (a batch
// of deliveries), so that every round ends with 16 connections coming back
// to one idle slot, however fast the machine. Callers that each paused a
// little between their statements instead churned the pool only while a
// statement took about as long as a pause: on a loaded machine statements
// took 35 ms against 2 ms pauses, each connection that came back was taken
// again at once, and 5 to 7 statements in 100 closed one (the warning
// wants one in 16): the warning rightly stayed silent and the test failed.
func TestWarnsOfAPoolThatKeepsReconnecting(t *testing.T) {
	if testing.Short() {
		t.Skip("thousands of calls to churn a pool")
	}
	t.Parallel()
	table := newStore(t, testenv.Postgres(t)).Table()
	for _, tc := range []struct {
		idle int
		warn bool
	}{{1, true}, {32, false}} {
		t.Run(fmt.Sprintf("idle=%d", tc.idle), func(t *testing.T) {
			db := testenv.Postgres(t)
			db.SetMaxOpenConns(32)
			db.SetMaxIdleConns(tc.idle)
			var logs syncBuffer
			store, err := postgresstore.New(db, postgresstore.WithTable(table), postgresstore.WithoutGrouping(),
				postgresstore.WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute) // a thousand connections opened: a minute on a loaded machine
			defer cancel()
			warned := func() bool { return strings.Contains(logs.String(), "SetMaxIdleConns") }
			// Rounds until it warns, or 160 of them (the store looks at
			// the pool after every 1,024 statements: twice).
			for i := 0; i < 160 && !warned() && !t.Failed(); i++ {
				var wg sync.WaitGroup
				for c := range 16 {
					wg.Go(func() {
						if _, err := stores.Seen(ctx, store, fmt.Sprintf("k-%d-%d", c, i)); err != nil {
							t.Error(err)
						}
					})
				}
				wg.Wait()
			}
			t.Logf("max idle closed: %d; log: %q", db.Stats().MaxIdleClosed, logs.String())
			if warned() != tc.warn {
				t.Fatalf("warned = %v, want %v", warned(), tc.warn)
			}
		})
	}
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
