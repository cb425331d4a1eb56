// Package conformance runs the vendored cross-SDK conformance suite
// (testdata/conformance) against the idempotency middleware with any store.
// It is internal: the store packages' tests use it; users run
// stores/storetest on their own stores.
package conformance

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// Dir returns the vendored suite's folder.
func Dir() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "testdata", "conformance")
}

// AddFixtureSeeds adds every fixture envelope of the suite to f's seed
// corpus.
func AddFixtureSeeds(f *testing.F) {
	f.Helper()
	files, _ := filepath.Glob(filepath.Join(Dir(), "fixtures", "*.json"))
	for _, name := range files {
		b, err := os.ReadFile(name)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
}

// Fixture returns the bytes of a fixture file, e.g. "order-created.json".
func Fixture(t testing.TB, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(Dir(), "fixtures", name))
	if err != nil {
		t.Fatalf("read conformance fixture: %v", err)
	}
	return b
}

type delivery struct {
	MetaID       string `json:"meta_id"`
	ExpectEffect string `json:"expect_effect"`
	Outcome      string `json:"outcome"`
	ForgetBefore bool   `json:"forget_before"`
}

type manifest struct {
	Idempotency struct {
		DedupKey struct {
			EnvelopeFile string `json:"envelope_file"`
			KeyField     string `json:"key_field"`
			ExpectedKey  string `json:"expected_key"`
		} `json:"dedup_key"`
		Sequences struct {
			Cases []struct {
				Name            string     `json:"name"`
				Deliveries      []delivery `json:"deliveries"`
				ExpectedEffects int        `json:"expected_effects"`
			} `json:"cases"`
		} `json:"sequences"`
	} `json:"idempotency"`
}

func load(t *testing.T) manifest {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(Dir(), "manifest.json"))
	if err != nil {
		t.Fatalf("read vendored conformance manifest: %v", err)
	}
	var m manifest
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatalf("decode manifest: %v", err)
	}
	if len(m.Idempotency.Sequences.Cases) == 0 || m.Idempotency.DedupKey.ExpectedKey == "" {
		t.Fatal("manifest has no idempotency block")
	}
	return m
}

var errThrow = errors.New("conformance: handler throws")

// RunIdempotency runs the suite's idempotency.sequences and dedup_key
// blocks through idempotency.Middleware, with a fresh store from newStore
// for each case. Messages are handled by direct calls (no handler name), so
// store keys are meta.id verbatim. idPrefix is prepended to every meta.id
// of the sequences so that runs sharing a server do not see each other.
func RunIdempotency(t *testing.T, idPrefix string, newStore func(t *testing.T) stores.Store) {
	m := load(t)
	for _, c := range m.Idempotency.Sequences.Cases {
		t.Run(c.Name, func(t *testing.T) {
			store := newStore(t)
			ctx := context.Background()
			effects, invoked := 0, false
			var outcome string
			handler := idempotency.Middleware(store)(func(msg *message.Message) ([]*message.Message, error) {
				// The suite counts every handler run as an effect, the
				// failed ones included (it fired before throwing).
				invoked = true
				effects++
				if outcome == "throw" {
					return nil, errThrow
				}
				return nil, nil
			})
			for i, d := range c.Deliveries {
				id := d.MetaID
				if id != "" {
					id = idPrefix + id
				}
				if d.ForgetBefore {
					if err := store.Forget(ctx, idempotency.Key("", id)); err != nil {
						t.Fatalf("delivery %d: Forget: %v", i, err)
					}
				}
				invoked, outcome = false, d.Outcome
				_, err := handler(newMessage(t, id))
				switch d.ExpectEffect {
				case "run":
					if !invoked {
						t.Fatalf("delivery %d (%q): handler did not run, want run", i, d.MetaID)
					}
					if (d.Outcome == "throw") != errors.Is(err, errThrow) {
						t.Fatalf("delivery %d (%q): err = %v for outcome %q", i, d.MetaID, err, d.Outcome)
					}
				case "skip":
					if invoked || err != nil {
						t.Fatalf("delivery %d (%q): invoked=%v err=%v, want a skip acked with no error", i, d.MetaID, invoked, err)
					}
				default:
					t.Fatalf("unknown expect_effect %q", d.ExpectEffect)
				}
			}
			if effects != c.ExpectedEffects {
				t.Fatalf("effects = %d, want %d", effects, c.ExpectedEffects)
			}
		})
	}
	t.Run("dedup_key", func(t *testing.T) {
		k := m.Idempotency.DedupKey
		if k.KeyField != "meta.id" {
			t.Fatalf("suite keys on %q; this kit keys on meta.id", k.KeyField)
		}
		store := newStore(t)
		ctx := context.Background()
		_ = store.Forget(ctx, k.ExpectedKey)
		payload := Fixture(t, filepath.Base(k.EnvelopeFile))
		runs := 0
		handler := idempotency.Middleware(store)(func(*message.Message) ([]*message.Message, error) {
			runs++
			return nil, nil
		})
		for range 2 {
			if _, err := handler(message.NewMessage(watermill.NewUUID(), payload)); err != nil {
				t.Fatal(err)
			}
		}
		seen, err := stores.Seen(ctx, store, k.ExpectedKey)
		if err != nil || !seen || runs != 1 {
			t.Fatalf("after two deliveries of %s: runs=%d, Seen(%q)=%v err=%v; want 1 run, key remembered",
				k.EnvelopeFile, runs, k.ExpectedKey, seen, err)
		}
		// trace_id is not the key: a second message of the same trace runs.
		e, err := envelope.Parse(payload)
		if err != nil {
			t.Fatal(err)
		}
		e.Meta.ID += "-sibling"
		sibling, _ := e.Marshal()
		if _, err := handler(message.NewMessage(watermill.NewUUID(), sibling)); err != nil || runs != 2 {
			t.Fatalf("a message sharing the trace_id but not meta.id: runs=%d err=%v, want it to run", runs, err)
		}
		_ = store.Forget(ctx, k.ExpectedKey)
		_ = store.Forget(ctx, e.Meta.ID)
	})
}

// newMessage wraps an envelope with the given meta.id ("" for none).
func newMessage(t *testing.T, id string) *message.Message {
	t.Helper()
	e, err := envelope.New("urn:babel:conformance:delivery", map[string]any{"n": 1})
	if err != nil {
		t.Fatal(err)
	}
	e.Meta.ID = id
	payload, err := e.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	return message.NewMessage(watermill.NewUUID(), payload)
}

// RunIntentChecks checks the content check (a reused id is a conflict, not a
// duplicate) through idempotency.Middleware with a store
// from newStore (with claims and without, WithoutClaim): a redelivery whose data has its
// members reordered, other white space and a different attempts count is
// skipped as a duplicate; the same meta.id with different data is rejected
// with a permanent idempotency.ErrConflict and the handler does not run. A
// store that keeps no fingerprints must still skip the redelivery; the
// conflict check is skipped for it.
func RunIntentChecks(t *testing.T, idPrefix string, newStore func(t *testing.T) stores.Store) {
	for _, claim := range []bool{false, true} {
		t.Run(map[bool]string{false: "seen", true: "claim"}[claim], func(t *testing.T) {
			store := newStore(t)
			var opts []idempotency.Option
			switch {
			case claim && !store.Capabilities().Claims:
				t.Skipf("%T cannot claim", store)
			case claim:
				opts = append(opts, idempotency.WithClaim(time.Minute))
			default:
				opts = append(opts, idempotency.WithoutClaim())
			}
			var outcomes []idempotency.Outcome
			opts = append(opts, idempotency.WithObserver(idempotency.ObserverFunc(func(_ context.Context, e idempotency.Event) {
				outcomes = append(outcomes, e.Outcome)
			})))
			runs := 0
			h := idempotency.Middleware(store, opts...)(func(*message.Message) ([]*message.Message, error) {
				runs++
				return nil, nil
			})
			id := idPrefix + "intent-" + map[bool]string{false: "seen", true: "claim"}[claim]
			original := fmt.Sprintf(`{"job":"urn:babel:orders:created","trace_id":"t-1","data":{"order_id":1042,"lines":[{"sku":"A","qty":2}],"note":"é"},`+
				`"meta":{"id":%q,"queue":"orders","lang":"php","schema_version":1,"created_at":%d},"attempts":0}`, id, time.Now().UnixMilli())
			redelivery := fmt.Sprintf(`{ "attempts": 3, "meta": {"created_at": %d, "schema_version": 1, "id": %q, "lang": "php", "queue": "orders"},
				"data": { "note": "\u00e9", "lines": [ { "qty": 2, "sku": "A" } ], "order_id": 1042 }, "trace_id": "t-1", "job": "urn:babel:orders:created" }`,
				time.Now().UnixMilli(), id)
			deliver := func(payload string) error {
				_, err := h(message.NewMessage(watermill.NewUUID(), []byte(payload)))
				return err
			}
			if err := deliver(original); err != nil || runs != 1 {
				t.Fatalf("first delivery: runs=%d err=%v", runs, err)
			}
			if err := deliver(redelivery); err != nil || runs != 1 {
				t.Fatalf("redelivery with reordered keys and attempts changed: runs=%d err=%v, want a skip", runs, err)
			}
			caps := store.Capabilities()
			if caps.Fingerprint == nil {
				return
			}
			// Another order under the same meta.id. A store may keep fewer
			// bits: pick data whose kept fingerprint differs, as almost all do.
			var reused string
			for n := 1043; ; n++ {
				reused = strings.Replace(original, `"order_id":1042`, fmt.Sprintf(`"order_id":%d`, n), 1)
				a, _ := envelope.Fingerprint([]byte(original))
				b, _ := envelope.Fingerprint([]byte(reused))
				if caps.KeptFingerprint(a) != caps.KeptFingerprint(b) {
					break
				}
			}
			err := deliver(reused)
			if !errors.Is(err, idempotency.ErrConflict) || !idempotency.IsPermanent(err) || runs != 1 {
				t.Fatalf("meta.id reused with other data: runs=%d err=%v, want a permanent ErrConflict and no run", runs, err)
			}
			if last := outcomes[len(outcomes)-1]; last != idempotency.OutcomeConflict {
				t.Fatalf("outcomes %v: want the conflict counted", outcomes)
			}
			_ = store.Forget(context.Background(), id)
		})
	}
}
