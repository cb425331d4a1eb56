package idempotency_test

import (
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
)

// outcomes records the outcomes an Observer sees.
type outcomes struct {
	mu   sync.Mutex
	list []idempotency.Outcome
	errs []error
}

func (o *outcomes) Observe(_ context.Context, e idempotency.Event) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.list = append(o.list, e.Outcome)
	o.errs = append(o.errs, e.Err)
}

func (o *outcomes) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	s := make([]string, len(o.list))
	for i, x := range o.list {
		s[i] = string(x)
	}
	return strings.Join(s, ",")
}

// count returns how many times o saw outcome.
func (o *outcomes) count(outcome idempotency.Outcome) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	n := 0
	for _, x := range o.list {
		if x == outcome {
			n++
		}
	}
	return n
}

// plain builds a Watermill message that is not an envelope.
func plain(uuid, payload string, md ...string) *message.Message {
	msg := message.NewMessage(uuid, []byte(payload))
	for i := 0; i+1 < len(md); i += 2 {
		msg.Metadata.Set(md[i], md[i+1])
	}
	return msg
}

func TestKeySourceUUIDDedupesPlainMessages(t *testing.T) {
	t.Parallel()
	var runs int
	var obs outcomes
	h := idempotency.Middleware(memstore.New(), idempotency.WithKeySource(idempotency.KeyFromUUID()),
		idempotency.WithObserver(&obs))(counting(&runs, nil))
	for range 3 {
		if _, err := h(plain("uuid-1", `not json at all`)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := h(plain("uuid-2", `not json at all`)); err != nil {
		t.Fatal(err)
	}
	if runs != 2 || obs.String() != "run,skip,skip,run" {
		t.Fatalf("runs=%d outcomes=%s; want 2 runs: run,skip,skip,run", runs, obs.String())
	}
}

// The case: three publishes, each a new Watermill message with its
// own UUID, carrying one bq-message-id.
func TestKeySourceMetadataDedupesAcrossUUIDs(t *testing.T) {
	t.Parallel()
	var runs int
	h := idempotency.Middleware(memstore.New(),
		idempotency.WithKeySource(idempotency.KeyFromMetadata(envelope.MetadataMessageID)))(counting(&runs, nil))
	for range 3 {
		msg := plain(watermill.NewUUID(), `{"order_id":1042}`, envelope.MetadataMessageID, "order-1042")
		if _, err := h(msg); err != nil {
			t.Fatal(err)
		}
	}
	if runs != 1 {
		t.Fatalf("ran %d times, want 1", runs)
	}
}

func TestKeySourceFuncReadsABusinessKey(t *testing.T) {
	t.Parallel()
	var runs int
	key := idempotency.KeyFromFunc(func(msg *message.Message) string {
		var p struct {
			OrderID int `json:"order_id"`
		}
		if json.Unmarshal(msg.Payload, &p) != nil || p.OrderID == 0 {
			return ""
		}
		return "order-" + strconv.Itoa(p.OrderID)
	})
	h := idempotency.Middleware(memstore.New(), idempotency.WithKeySource(key))(counting(&runs, nil))
	for _, payload := range []string{`{"order_id":1}`, `{"order_id":1}`, `{"order_id":2}`, `{}`, `{}`} {
		if _, err := h(plain(watermill.NewUUID(), payload)); err != nil {
			t.Fatal(err)
		}
	}
	if runs != 4 { // order 1 once, order 2 once, the two keyless ones each
		t.Fatalf("ran %d times, want 4", runs)
	}
}

func TestKeySourceAbsentKeyFailsOpenAndIsCounted(t *testing.T) {
	t.Parallel()
	var runs int
	var obs outcomes
	h := idempotency.Middleware(memstore.New(), idempotency.WithKeySource(idempotency.KeyFromMetadata("Idempotency-Key")),
		idempotency.WithObserver(&obs))(counting(&runs, nil))
	for _, md := range [][]string{nil, {"Idempotency-Key", ""}, {"Idempotency-Key", "  "}} {
		if _, err := h(plain("same-uuid", `{}`, md...)); err != nil {
			t.Fatal(err)
		}
	}
	if runs != 3 || obs.String() != "fail_open,fail_open,fail_open" {
		t.Fatalf("runs=%d outcomes=%s; want 3 runs failed open", runs, obs.String())
	}
	if !strings.Contains(obs.errs[0].Error(), `no "Idempotency-Key" metadata`) {
		t.Fatalf("fail-open reason %q does not name the field", obs.errs[0])
	}
}

func TestKeySourceUnusableKeyIsRejected(t *testing.T) {
	t.Parallel()
	var runs int
	h := idempotency.Middleware(memstore.New(), idempotency.WithKeySource(idempotency.KeyFromMetadata("k")))(counting(&runs, nil))
	for _, bad := range []string{strings.Repeat("x", idempotency.MaxIDBytes+1), "a\x07b", "\xff\xfe"} {
		_, err := h(plain(watermill.NewUUID(), `{}`, "k", bad))
		if !errors.Is(err, idempotency.ErrInvalidID) || !errors.Is(err, idempotency.ErrPermanent) {
			t.Fatalf("key %q: err = %v, want ErrInvalidID and ErrPermanent", bad, err)
		}
	}
	if runs != 0 {
		t.Fatalf("the handler ran %d times on unusable keys", runs)
	}
}

// With a key source the body's meta.id is not the identity: the source is.
func TestKeySourceWinsOverAnEnvelopeBody(t *testing.T) {
	t.Parallel()
	var runs int
	h := idempotency.Middleware(memstore.New(), idempotency.WithKeySource(idempotency.KeyFromMetadata("k")))(counting(&runs, nil))
	for _, key := range []string{"a", "b"} {
		msg := msgOf(envelopeWithID(t, "same-meta-id"))
		msg.Metadata.Set("k", key)
		if _, err := h(msg); err != nil {
			t.Fatal(err)
		}
	}
	if runs != 2 {
		t.Fatalf("ran %d times, want 2 (two keys)", runs)
	}
}

func TestKeySourceFingerprintCoversThePayload(t *testing.T) {
	t.Parallel()
	var runs int
	h := idempotency.Middleware(memstore.New(), idempotency.WithKeySource(idempotency.KeyFromUUID()))(counting(&runs, nil))
	deliver := func(uuid, payload string) error {
		_, err := h(plain(uuid, payload))
		return err
	}
	// JSON: the same meaning re-spelled is a duplicate; other content is
	// a conflict.
	if err := deliver("j", `{"a":1,"b":[true,null,"é"]}`); err != nil {
		t.Fatal(err)
	}
	if err := deliver("j", " {\"b\" : [true, null, \"\\u00e9\"], \"a\":1}\n"); err != nil {
		t.Fatalf("re-spelled JSON: %v", err)
	}
	if err := deliver("j", `{"a":2,"b":[true,null,"é"]}`); !errors.Is(err, idempotency.ErrConflict) {
		t.Fatalf("other JSON content: err = %v, want ErrConflict", err)
	}
	// Any other payload: by its bytes.
	if err := deliver("p", "\x00\x01proto"); err != nil {
		t.Fatal(err)
	}
	if err := deliver("p", "\x00\x01proto"); err != nil {
		t.Fatalf("same bytes: %v", err)
	}
	if err := deliver("p", "\x00\x02proto"); !errors.Is(err, idempotency.ErrConflict) {
		t.Fatalf("other bytes: err = %v, want ErrConflict", err)
	}
	// A JSON string payload and the same text taken as bytes differ.
	if err := deliver("s", `"x"`); err != nil {
		t.Fatal(err)
	}
	if runs != 3 {
		t.Fatalf("ran %d times, want 3", runs)
	}
}

func TestKeySourceFingerprintCoversChosenMetadata(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		opts   []idempotency.Option
		tenant string
		want   error
	}{
		{"tenant not covered", nil, "other", nil},
		{"tenant covered, same", []idempotency.Option{idempotency.WithFingerprintMetadata("tenant")}, "acme", nil},
		{"tenant covered, other", []idempotency.Option{idempotency.WithFingerprintMetadata("tenant")}, "other", idempotency.ErrConflict},
		{"tenant covered, absent", []idempotency.Option{idempotency.WithFingerprintMetadata("tenant")}, "", idempotency.ErrConflict},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var runs int
			opts := append([]idempotency.Option{idempotency.WithKeySource(idempotency.KeyFromUUID())}, tc.opts...)
			h := idempotency.Middleware(memstore.New(), opts...)(counting(&runs, nil))
			if _, err := h(plain("u", `{"n":1}`, "tenant", "acme", "trace", "1")); err != nil {
				t.Fatal(err)
			}
			second := plain("u", `{"n":1}`, "trace", "2") // uncovered metadata changes freely
			if tc.tenant != "" {
				second.Metadata.Set("tenant", tc.tenant)
			}
			if _, err := h(second); !errors.Is(err, tc.want) || (tc.want == nil && err != nil) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
			if runs != 1 {
				t.Fatalf("ran %d times, want 1", runs)
			}
		})
	}
}

func TestKeySourceReplayHorizonFromMetadata(t *testing.T) {
	t.Parallel()
	old := time.Now().Add(-2 * time.Hour)
	store := func() *memstore.Store { return memstore.New(memstore.WithTTL(time.Hour)) }
	for _, tc := range []struct {
		name    string
		opts    []idempotency.Option
		created string
		want    error
	}{
		{"milliseconds, too old", []idempotency.Option{idempotency.WithCreatedAtMetadata("created_at")}, strconv.FormatInt(old.UnixMilli(), 10), idempotency.ErrTooOld},
		{"RFC 3339, too old", []idempotency.Option{idempotency.WithCreatedAtMetadata("created_at")}, old.Format(time.RFC3339), idempotency.ErrTooOld},
		{"recent", []idempotency.Option{idempotency.WithCreatedAtMetadata("created_at")}, strconv.FormatInt(time.Now().UnixMilli(), 10), nil},
		{"unreadable time is not checked", []idempotency.Option{idempotency.WithCreatedAtMetadata("created_at")}, "yesterday", nil},
		{"no created-at field: horizon off", nil, strconv.FormatInt(old.UnixMilli(), 10), nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var runs int
			opts := append([]idempotency.Option{idempotency.WithKeySource(idempotency.KeyFromUUID())}, tc.opts...)
			h := idempotency.Middleware(store(), opts...)(counting(&runs, nil))
			_, err := h(plain("u", `{}`, "created_at", tc.created))
			if tc.want == nil && err != nil || tc.want != nil && (!errors.Is(err, tc.want) || !errors.Is(err, idempotency.ErrPermanent)) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
		})
	}
}

func TestKeySourceOptionsNeedASource(t *testing.T) {
	t.Parallel()
	for name, opts := range map[string][]idempotency.Option{
		"fingerprint metadata alone": {idempotency.WithFingerprintMetadata("x")},
		"created-at metadata alone":  {idempotency.WithCreatedAtMetadata("x")},
		"nil key function":           {idempotency.WithKeySource(idempotency.KeyFromFunc(nil))},
		"zero key source":            {idempotency.WithKeySource(idempotency.KeySource{})},
	} {
		if _, err := idempotency.New(memstore.New(), opts...); err == nil {
			t.Errorf("%s: New accepted it", name)
		}
	}
}

// Under WithTransaction a keyed message's effect and record commit together
// on the real PostgreSQL, as an envelope's do.
func TestKeySourceInTransactionalMode(t *testing.T) {
	t.Parallel()
	l := newLedgerDB(t)
	runs := 0
	fail := errors.New("declined")
	failNext := true
	h := idempotency.Middleware(l.store, idempotency.WithTransaction(l.db),
		idempotency.WithKeySource(idempotency.KeyFromMetadata("Idempotency-Key")))(noProduce(func(msg *message.Message) error {
		runs++
		tx, ok := postgresstore.TxFromContext(msg.Context())
		if !ok {
			return errors.New("no transaction in the handler's context")
		}
		if _, err := tx.ExecContext(msg.Context(), `UPDATE `+l.ledger+` SET balance = balance + 10 WHERE account = 'alice'`); err != nil {
			return err
		}
		if failNext {
			failNext = false
			return fail
		}
		return nil
	}))
	for i := range 4 {
		_, err := h(plain(watermill.NewUUID(), `{"amount":10}`, "Idempotency-Key", "pay-1"))
		if i == 0 && !errors.Is(err, fail) || i > 0 && err != nil {
			t.Fatalf("delivery %d: err = %v", i, err)
		}
	}
	if runs != 2 || l.balance(t, "alice") != 10 || !l.remembered(t, "pay-1") {
		t.Fatalf("runs=%d balance=%d: want 2 runs (fail, succeed), one credit, the record kept", runs, l.balance(t, "alice"))
	}
}
