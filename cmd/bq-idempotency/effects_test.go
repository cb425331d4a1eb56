package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/effects"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// seedEffects records three charges: two unknown (the older first), one
// succeeded; it returns the provider keys of the unknown ones and of the
// succeeded one. Their attempts' leases were a millisecond: nothing is in
// flight (an unknown effect within its lease is landing, and not resolved
// without --force: TestEffectsResolveWaitsForTheAttempts).
func seedEffects(t *testing.T, s stores.EffectStore) (unknown []string, done string) {
	t.Helper()
	ctx := context.Background()
	for i, id := range []string{"m-1", "m-2", "m-3"} {
		key := effects.ProviderKey("charge", id, "charge")
		if _, _, err := s.Begin(ctx, stores.EffectIntent{Key: key, Name: "charge", Scope: "charge", MessageID: id}, time.Millisecond); err != nil {
			t.Fatal(err)
		}
		to, note := stores.EffectUnknown, "read tcp: i/o timeout"
		if i == 2 {
			to, note, done = stores.EffectSucceeded, "", key
		} else {
			unknown = append(unknown, key)
		}
		if _, _, err := s.Transition(ctx, key, stores.EffectTransition{To: to, Note: note, Evidence: "call"}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return unknown, done
}

// effectStore is an effect store of the test's own and the flags that
// point the command at it.
type effectStore struct {
	store stores.EffectStore
	flags []string
}

// effectStoresUnderTest returns an effect store of the test's own on Redis
// and on PostgreSQL, by the --store the command takes.
func effectStoresUnderTest(t *testing.T) map[string]effectStore {
	t.Helper()
	prefix := "cli" + testenv.RandomHex(5)
	pg := testenv.PostgresEffects(t, testenv.Postgres(t))
	table, _ := pg.Tables()
	table = strings.Trim(table, `"`)
	return map[string]effectStore{
		"redis":    {redisstore.NewEffects(testenv.Redis(t), redisstore.WithEffectsPrefix(prefix)), []string{"--redis-url", redisURL(), "--prefix", prefix}},
		"postgres": {pg, []string{"--store", "postgres", "--postgres-dsn", postgresDSN(), "--table", table}},
	}
}

// TestEffectsListAndResolve: the operator lists unknown charges, oldest
// first, resolves one by its provider key and one by handler, effect and
// message id, with notes; resolving a final effect exits 1; on Redis and
// PostgreSQL.
func TestEffectsListAndResolve(t *testing.T) {
	t.Parallel()
	for name, c := range effectStoresUnderTest(t) {
		t.Run(name, func(t *testing.T) {
			unknown, done := seedEffects(t, c.store)
			list := func(extra ...string) result {
				t.Helper()
				return run1(t, append(append([]string{"effects", "list"}, c.flags...), extra...)...)
			}
			r := list()
			if r.code != 0 || strings.Count(r.stdout, " unknown ") != 2 || strings.Contains(r.stdout, done) ||
				strings.Index(r.stdout, unknown[0]) > strings.Index(r.stdout, unknown[1]) || !strings.Contains(r.stdout, "read tcp: i/o timeout") ||
				!strings.Contains(r.stderr, "2 effect(s)") {
				t.Fatalf("effects list: %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			if r := list("--state", "succeeded"); r.code != 0 || !strings.Contains(r.stdout, done) || strings.Contains(r.stdout, unknown[0]) {
				t.Fatalf("effects list --state succeeded: %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			if r := list("--min-age", "1h"); r.code != 0 || strings.Contains(r.stdout, unknown[0]) {
				t.Fatalf("effects list --min-age 1h: %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			// A list cut at --limit says so; a whole one does not.
			if r := list("--limit", "1"); r.code != 0 || !strings.Contains(r.stdout, unknown[0]) || strings.Contains(r.stdout, unknown[1]) ||
				!strings.Contains(r.stderr, "1 effect(s), the oldest first; more match (--limit)") {
				t.Fatalf("effects list --limit 1 of 2: %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			if r := list("--limit", "1", "--output", "json"); r.code != 0 || !strings.Contains(r.stdout, `"more":true`) {
				t.Fatalf("effects list --limit 1 --output json of 2: %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			if r := list("--limit", "2", "--output", "json"); r.code != 0 || !strings.Contains(r.stdout, `"more":false`) {
				t.Fatalf("effects list --limit 2 --output json of 2: %d\n%s%s", r.code, r.stdout, r.stderr)
			}

			resolve := func(extra ...string) result {
				t.Helper()
				return run1(t, append(append([]string{"effects", "resolve"}, c.flags...), extra...)...)
			}
			if r := resolve("--state", "succeeded", "--result", "ch_42", "--note", "found in the dashboard by ops", unknown[0]); r.code != 0 || !strings.Contains(r.stdout, "succeeded by operator") {
				t.Fatalf("resolve by key: %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			if r := resolve("--state", "failed", "--note", "not in the provider's ledger", "--handler", "charge", "--effect", "charge", "m-2"); r.code != 0 {
				t.Fatalf("resolve by message id: %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			if r := resolve("--state", "failed", "--note", "again", done); r.code != 3 || !strings.Contains(r.stderr, "succeeded already") {
				t.Fatalf("resolving a final effect: %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			ctx := context.Background()
			if e, _ := c.store.Lookup(ctx, unknown[0]); e.State != stores.EffectSucceeded || string(e.Result) != "ch_42" || e.Evidence != effects.EvidenceOperator || e.Note != "found in the dashboard by ops" {
				t.Fatalf("after resolve: %+v", e)
			}
			if e, _ := c.store.Lookup(ctx, unknown[1]); e.State != stores.EffectFailed || e.Note != "not in the provider's ledger" {
				t.Fatalf("after resolve by id: %+v", e)
			}
			if r := list(); r.code != 0 || !strings.Contains(r.stderr, "0 effect(s)") {
				t.Fatalf("after resolving: %d\n%s%s", r.code, r.stdout, r.stderr)
			}
		})
	}
}

func TestEffectsUsageErrors(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{"effects", "resolve", "k"},
		{"effects", "resolve", "--state", "unknown", "--note", "x", "k"},
		{"effects", "resolve", "--state", "succeeded", "k"},
		{"effects", "resolve", "--state", "failed", "--note", "x", "--result", "ch", "k"},
		{"effects", "resolve", "--state", "failed", "--note", "x", "--handler", "charge", "k"},
		{"effects", "resolve", "--state", "failed", "--note", "x"},
		{"effects", "list", "--state", "refunded"},
		{"effects", "list", "--store", "mysql"},
		{"effects", "list", "--prefix", "has space"},
		{"effects", "list", "--store", "postgres", "--prefix", "x"},
		{"effects", "list", "extra"},
	} {
		if r := run1(t, args...); r.code != 2 || strings.Count(r.stderr, "\n") > 2 {
			t.Errorf("%v: exit %d, stderr %q; want a usage error", args, r.code, r.stderr)
		}
	}
	if r := run1(t, "help", "effects", "resolve"); r.code != 0 || !strings.Contains(r.stdout, "--note") {
		t.Fatalf("help effects resolve: %d %s", r.code, r.stdout)
	}
}

// TestEffectsShowResultDropped: list and show tell a succeeded effect
// whose result was dropped (the store's result lifetime) from one whose
// result is kept; show exits 3 for an effect that does not exist; on
// Redis and PostgreSQL.
func TestEffectsShowResultDropped(t *testing.T) {
	t.Parallel()
	prefix := "cli" + testenv.RandomHex(5)
	pg := testenv.PostgresEffects(t, testenv.Postgres(t), postgresstore.WithEffectsTTL(time.Hour), postgresstore.WithResultTTL(100*time.Millisecond))
	table, _ := pg.Tables()
	for name, c := range map[string]effectStore{
		"redis": {redisstore.NewEffects(testenv.Redis(t), redisstore.WithEffectsPrefix(prefix), redisstore.WithEffectsTTL(time.Hour),
			redisstore.WithResultTTL(100*time.Millisecond)), []string{"--redis-url", redisURL(), "--prefix", prefix}},
		"postgres": {pg, []string{"--store", "postgres", "--postgres-dsn", postgresDSN(), "--table", strings.Trim(table, `"`)}},
	} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			for _, key := range []string{"pk-paid", "pk-unsure"} {
				if _, _, err := c.store.Begin(ctx, stores.EffectIntent{Key: key, Name: "charge", Scope: "billing", MessageID: "m-1"}, time.Minute); err != nil {
					t.Fatal(err)
				}
			}
			if _, _, err := c.store.Transition(ctx, "pk-paid", stores.EffectTransition{To: stores.EffectSucceeded, Result: []byte("ch_1"), Evidence: "call"}); err != nil {
				t.Fatal(err)
			}
			show := func(args ...string) result {
				t.Helper()
				return run1(t, append(append([]string{"effects", "show"}, c.flags...), args...)...)
			}
			if r := show("pk-paid"); r.code != 0 || (!strings.Contains(r.stdout, `result:         "ch_1"`) && !strings.Contains(r.stdout, "dropped")) {
				t.Fatalf("effects show within the result's lifetime: %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			deadline := time.Now().Add(5 * time.Second)
			for e, _ := c.store.Lookup(ctx, "pk-paid"); !e.ResultDropped; e, _ = c.store.Lookup(ctx, "pk-paid") {
				if time.Now().After(deadline) {
					t.Fatalf("the result outlived its lifetime by 5s: %+v", e)
				}
				time.Sleep(20 * time.Millisecond)
			}
			r := show("pk-paid", "pk-none")
			if r.code != 3 || !strings.Contains(r.stdout, "state:          succeeded") || !strings.Contains(r.stdout, "result:         dropped") ||
				strings.Contains(r.stdout, "ch_1") || !strings.Contains(r.stderr, "pk-none: no such effect") {
				t.Fatalf("effects show after the result was dropped: %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			r = run1(t, append(append([]string{"effects", "list"}, c.flags...), "--state", "succeeded")...)
			if lines := strings.Split(strings.TrimSpace(r.stdout), "\n"); r.code != 0 || len(lines) != 2 || strings.Fields(lines[1])[9] != "dropped" {
				t.Fatalf("effects list: %d\n%s%s", r.code, r.stdout, r.stderr)
			}
		})
	}
}
