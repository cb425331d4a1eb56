package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/effects"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// seedInFlight records four charges an operator may find: pk-live
// (pending, its holder's lease running: a call may be under way),
// pk-landing (unknown, its request may still land), pk-lapsed (pending,
// its holder's lease passed: the attempt died) and pk-landed (unknown, its
// lease passed). It returns them as the store reads them.
func seedInFlight(t *testing.T, s stores.EffectStore) map[string]stores.Effect {
	t.Helper()
	ctx := stores.WithClaimToken(context.Background(), "worker-1")
	for key, lease := range map[string]time.Duration{"pk-live": time.Minute, "pk-landing": time.Minute, "pk-lapsed": time.Millisecond, "pk-landed": time.Millisecond} {
		if _, _, err := s.Begin(ctx, stores.EffectIntent{Key: key, Name: "charge", Scope: "billing", MessageID: "m-" + key}, lease); err != nil {
			t.Fatal(err)
		}
		if key == "pk-landing" || key == "pk-landed" {
			if _, _, err := s.Transition(ctx, key, stores.EffectTransition{From: stores.EffectPending, To: stores.EffectUnknown, Note: "read tcp: i/o timeout", Evidence: "call"}); err != nil {
				t.Fatal(err)
			}
		}
	}
	out := map[string]stores.Effect{}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		for _, key := range []string{"pk-live", "pk-landing", "pk-lapsed", "pk-landed"} {
			e, err := s.Lookup(ctx, key)
			if err != nil {
				t.Fatal(err)
			}
			out[key] = e
		}
		if out["pk-lapsed"].LeaseLapsed && !out["pk-landed"].Landing {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the 1ms leases did not pass: %+v", out)
		}
	}
	if out["pk-live"].LeaseLapsed || !out["pk-landing"].Landing {
		t.Fatalf("the minute's leases passed: %+v", out)
	}
	return out
}

// TestEffectsListShowsLiveAndLanding: effects list tells an effect an
// attempt may still act on (LEASE live: pending within its holder's lease;
// landing: unknown, its request may still land) from one waiting for
// someone (lapsed, or "-"), with the lease's end in UNTIL; --output json
// says the same ("lease", "lease_until"); on Redis and PostgreSQL.
func TestEffectsListShowsLiveAndLanding(t *testing.T) {
	t.Parallel()
	for name, c := range effectStoresUnderTest(t) {
		t.Run(name, func(t *testing.T) {
			seeded := seedInFlight(t, c.store)
			r := run1(t, append([]string{"effects", "list"}, c.flags...)...)
			lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
			if r.code != 0 || len(lines) != 5 {
				t.Fatalf("effects list: exit %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			header := strings.Fields(lines[0])
			if strings.Join(header, " ") != "PROVIDER-KEY STATE LEASE AGE ATTEMPTS EFFECT HANDLER MESSAGE-ID EVIDENCE RESULT UNTIL NOTE" {
				t.Fatalf("header %q", lines[0])
			}
			want := map[string][2]string{
				"pk-live":    {"live", seeded["pk-live"].LeaseUntil.UTC().Format(effects.TimeFormat)},
				"pk-landing": {"landing", seeded["pk-landing"].LeaseUntil.UTC().Format(effects.TimeFormat)},
				"pk-lapsed":  {"lapsed", seeded["pk-lapsed"].LeaseUntil.UTC().Format(effects.TimeFormat)},
				"pk-landed":  {"-", "-"},
			}
			for _, line := range lines[1:] {
				f := strings.Fields(line)
				if w, ok := want[f[0]]; !ok || f[2] != w[0] || f[10] != w[1] {
					t.Errorf("%s: LEASE %q UNTIL %q, want %q", f[0], f[2], f[10], w)
				}
			}
			if !strings.Contains(r.stderr, "2 of them in flight") {
				t.Errorf("stderr does not count the effects in flight: %q", r.stderr)
			}

			r = run1(t, append([]string{"effects", "list", "--output", "json"}, c.flags...)...)
			var doc effectsJSON
			if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil || r.code != 0 || len(doc.Effects) != 4 {
				t.Fatalf("exit %d, %v\n%s%s", r.code, err, r.stdout, r.stderr)
			}
			for _, e := range doc.Effects {
				w := want[e.ProviderKey]
				until := "-"
				if e.LeaseUntil != nil {
					until = (*e.LeaseUntil)
					if at, err := time.Parse(time.RFC3339Nano, until); err == nil {
						until = at.UTC().Format(effects.TimeFormat)
					}
				}
				wantLease := w[0]
				if wantLease == "-" {
					wantLease = "none"
				}
				if e.Lease != wantLease || until != w[1] || e.LeaseLapsed != (e.ProviderKey == "pk-lapsed") {
					t.Errorf("%s: lease %q until %q (lapsed %v), want %q until %q", e.ProviderKey, e.Lease, until, e.LeaseLapsed, wantLease, w[1])
				}
			}
		})
	}
}

// TestEffectsResolveWaitsForTheAttempts: effects resolve refuses an
// effect an attempt may still act on (live, landing), saying until when
// and that --force overrides it (exit 3), resolves the others, and with
// --force resolves them too; on Redis and PostgreSQL.
func TestEffectsResolveWaitsForTheAttempts(t *testing.T) {
	t.Parallel()
	for name, c := range effectStoresUnderTest(t) {
		t.Run(name, func(t *testing.T) {
			seeded := seedInFlight(t, c.store)
			resolve := func(extra ...string) result {
				t.Helper()
				return run1(t, append(append([]string{"effects", "resolve", "--state", "failed", "--note", "ops: not in the ledger"}, c.flags...), extra...)...)
			}
			r := resolve("pk-live", "pk-landing", "pk-lapsed", "pk-landed")
			if r.code != 3 {
				t.Fatalf("resolving effects in flight: exit %d, want 3\n%s%s", r.code, r.stdout, r.stderr)
			}
			for _, key := range []string{"pk-live", "pk-landing"} {
				until := seeded[key].LeaseUntil.UTC().Format(effects.TimeFormat)
				if !strings.Contains(r.stderr, key+": not resolved: effect in flight") || !strings.Contains(r.stderr, "until "+until) || !strings.Contains(r.stderr, "--force") {
					t.Errorf("%s: stderr does not say it is in flight until %s, and --force: %q", key, until, r.stderr)
				}
				if e, _ := c.store.Lookup(context.Background(), key); e.State.Final() {
					t.Errorf("%s was resolved: %s", key, e.State)
				}
			}
			for _, key := range []string{"pk-lapsed", "pk-landed"} {
				if e, _ := c.store.Lookup(context.Background(), key); e.State != stores.EffectFailed || !strings.Contains(r.stdout, key+": failed by operator") {
					t.Errorf("%s: %s; stdout %q", key, e.State, r.stdout)
				}
			}
			if r := resolve("--force", "pk-live", "pk-landing"); r.code != 0 {
				t.Fatalf("--force: exit %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			for _, key := range []string{"pk-live", "pk-landing"} {
				if e, _ := c.store.Lookup(context.Background(), key); e.State != stores.EffectFailed || e.Evidence != effects.EvidenceOperator {
					t.Errorf("%s after --force: %s by %q", key, e.State, e.Evidence)
				}
			}
		})
	}
}

// TestEffectsShowJSON: effects show --output json writes one JSON object
// with every field of the effects found, and the keys missing (exit 3
// when one is); on Redis and PostgreSQL.
func TestEffectsShowJSON(t *testing.T) {
	t.Parallel()
	for name, c := range effectStoresUnderTest(t) {
		t.Run(name, func(t *testing.T) {
			seeded := seedInFlight(t, c.store)
			if _, _, err := c.store.Transition(context.Background(), "pk-landed", stores.EffectTransition{To: stores.EffectSucceeded, Result: []byte("ch_1"), Evidence: "lookup"}); err != nil {
				t.Fatal(err)
			}
			r := run1(t, append([]string{"effects", "show", "--output", "json"}, append(c.flags, "pk-live", "pk-landed", "pk-none")...)...)
			var doc effectsShowJSON
			if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil || r.code != 3 || len(doc.Effects) != 2 || strings.Join(doc.Missing, ",") != "pk-none" {
				t.Fatalf("effects show --output json: exit %d, %v\n%s%s", r.code, err, r.stdout, r.stderr)
			}
			live, done := doc.Effects[0], doc.Effects[1]
			if live.ProviderKey != "pk-live" || live.State != "pending" || live.Lease != "live" || live.Holder != "worker-1" || live.LeaseUntil == nil ||
				live.Effect != "charge" || live.Handler != "billing" || live.MessageID != "m-pk-live" || live.Attempts != 1 || live.Result != nil || live.CreatedAt == nil {
				t.Errorf("the live effect: %+v", live)
			}
			if at, err := time.Parse(time.RFC3339Nano, *live.LeaseUntil); err != nil || !at.Equal(seeded["pk-live"].LeaseUntil) {
				t.Errorf("lease_until %q, want %v", *live.LeaseUntil, seeded["pk-live"].LeaseUntil)
			}
			if done.ProviderKey != "pk-landed" || done.State != "succeeded" || done.Result == nil || *done.Result != "ch_1" || done.Evidence != "lookup" ||
				done.Lease != "none" || done.LeaseUntil != nil || done.ResultDropped || done.Note != "read tcp: i/o timeout" {
				t.Errorf("the succeeded effect: %+v", done)
			}
			if r := run1(t, append([]string{"effects", "show"}, append(c.flags, "pk-live")...)...); r.code != 0 || !strings.Contains(r.stdout, "lease:          live") {
				t.Errorf("effects show (text): exit %d\n%s%s", r.code, r.stdout, r.stderr)
			}
		})
	}
}
