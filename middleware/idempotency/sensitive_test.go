package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

func TestSensitiveFieldsRefusesWhatCannotWork(t *testing.T) {
	t.Parallel()
	c := newSDKCipher(t, randomKey(t))
	key := randomKey(t)
	jobs := map[string][]string{paymentURN: {"card.number"}}
	for _, tc := range []struct {
		name string
		opts []idempotency.Option
		want string
	}{
		{"no job", []idempotency.Option{idempotency.WithSensitiveFields(idempotency.SensitiveFields{})}, "no job"},
		{"empty job", []idempotency.Option{idempotency.WithSensitiveFields(idempotency.SensitiveFields{Jobs: map[string][]string{" ": {"a"}}})}, "an empty job"},
		{"empty member", []idempotency.Option{idempotency.WithSensitiveFields(idempotency.SensitiveFields{Jobs: map[string][]string{paymentURN: {"card..number"}}})}, `path "card..number": an empty member name`},
		{"bare brackets", []idempotency.Option{idempotency.WithSensitiveFields(idempotency.SensitiveFields{Jobs: map[string][]string{paymentURN: {"items.[]"}}})}, "an empty member name"},
		{"key without cipher", []idempotency.Option{idempotency.WithSensitiveFields(idempotency.SensitiveFields{Jobs: jobs, Key: key})}, "need a Cipher"},
		{"cipher without key", []idempotency.Option{idempotency.WithSensitiveFields(idempotency.SensitiveFields{Jobs: jobs, Cipher: c})}, "the Key is 0 bytes; give at least 32"},
		{"short key", []idempotency.Option{idempotency.WithSensitiveFields(idempotency.SensitiveFields{Jobs: jobs, Cipher: c, Key: key[:16]})}, "the Key is 16 bytes"},
		{"short previous key", []idempotency.Option{idempotency.WithSensitiveFields(idempotency.SensitiveFields{Jobs: jobs, Cipher: c, Key: key, PreviousKeys: [][]byte{key[:8]}})}, "PreviousKeys[0] is 8 bytes"},
		{"no envelope key source", []idempotency.Option{idempotency.WithKeySource(idempotency.KeyFromUUID()),
			idempotency.WithSensitiveFields(idempotency.SensitiveFields{Jobs: jobs})}, "needs KeyFromEnvelope"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := idempotency.New(memstore.New(), tc.opts...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("New: %v, want an error saying %q", err, tc.want)
			}
		})
	}
	// A root mark ("") is skipped, as the SDKs skip it.
	if _, err := idempotency.New(memstore.New(), idempotency.WithSensitiveFields(idempotency.SensitiveFields{
		Jobs: map[string][]string{paymentURN: {"", "card.number"}}})); err != nil {
		t.Fatalf("New with a root mark: %v", err)
	}
}

// deliverer runs deliveries of payloads through one guard on store and
// reports the outcome of each.
type deliverer struct {
	t    *testing.T
	h    message.HandlerFunc
	rec  *recorder
	runs int
}

func newDeliverer(t *testing.T, store stores.Store, f idempotency.SensitiveFields) *deliverer {
	t.Helper()
	d := &deliverer{t: t, rec: &recorder{}}
	g, err := idempotency.New(store, idempotency.WithObserver(d.rec), idempotency.WithSensitiveFields(f))
	if err != nil {
		t.Fatal(err)
	}
	d.h = g.Middleware(counting(&d.runs, nil))
	return d
}

// deliver runs one delivery of payload, acked, and returns its outcome
// and error.
func (d *deliverer) deliver(payload []byte) (idempotency.Outcome, error) {
	d.t.Helper()
	before := len(d.rec.outcomes())
	msg := msgOf(payload)
	_, err := d.h(msg)
	msg.Ack()
	out := d.rec.outcomes()
	if len(out) == before {
		d.t.Fatalf("no outcome observed for %s (err %v)", payload, err)
	}
	return out[len(out)-1], err
}

func (d *deliverer) want(payload []byte, outcome idempotency.Outcome) {
	d.t.Helper()
	got, err := d.deliver(payload)
	if got != outcome {
		d.t.Fatalf("outcome %s (err %v), want %s, for %s", got, err, outcome, payload)
	}
}

func goEnvelope(t *testing.T, key []byte, id string, paths []string, data map[string]any) []byte {
	t.Helper()
	return goProducer(t, key, paymentURN, id, "payments", paths, send{data, 1})[0]
}

func TestSensitiveFieldsDecisions(t *testing.T) {
	t.Parallel()
	cipherKey, key, otherKey := randomKey(t), randomKey(t), randomKey(t)
	c := newSDKCipher(t, cipherKey)
	jobs := map[string][]string{paymentURN: paymentPaths}
	keyed := idempotency.SensitiveFields{Jobs: jobs, Cipher: c, Key: key}
	enc := func(id string, data map[string]any) []byte { return goEnvelope(t, cipherKey, id, paymentPaths, data) }

	t.Run("without a cipher the values do not count", func(t *testing.T) {
		t.Parallel()
		d := newDeliverer(t, memstore.New(), idempotency.SensitiveFields{Jobs: jobs})
		d.want(enc("a", paymentData(cardNumber, 10)), idempotency.OutcomeRun)
		d.want(enc("a", paymentData(cardNumber, 10)), idempotency.OutcomeSkip)
		d.want(enc("a", paymentData(otherCard, 10)), idempotency.OutcomeSkip) // the documented blind spot
		d.want(enc("a", paymentData(cardNumber, 11)), idempotency.OutcomeConflict)
		// Present or absent still counts.
		noCard := paymentData(cardNumber, 10)
		delete(noCard, "email")
		d.want(enc("a", noCard), idempotency.OutcomeConflict)
	})

	t.Run("with a cipher the cleartext counts", func(t *testing.T) {
		t.Parallel()
		d := newDeliverer(t, memstore.New(), keyed)
		d.want(enc("a", paymentData(cardNumber, 10)), idempotency.OutcomeRun)
		d.want(enc("a", paymentData(cardNumber, 10)), idempotency.OutcomeSkip)
		d.want(enc("a", paymentData(otherCard, 10)), idempotency.OutcomeConflict)
		d.want(enc("a", paymentData(cardNumber, 11)), idempotency.OutcomeConflict)
		// A producer that does not protect a value that is not a string
		// (a whole object marked sensitive) sends its cleartext: the same
		// message.
		whole := idempotency.SensitiveFields{Jobs: map[string][]string{paymentURN: {"card"}}, Cipher: c, Key: key}
		d2 := newDeliverer(t, memstore.New(), whole)
		d2.want(goEnvelope(t, cipherKey, "b", []string{"card"}, paymentData(cardNumber, 10)), idempotency.OutcomeRun)
		d2.want(goEnvelope(t, cipherKey, "b", nil, paymentData(cardNumber, 10)), idempotency.OutcomeSkip)
		d2.want(goEnvelope(t, cipherKey, "b", []string{"card"}, paymentData(otherCard, 10)), idempotency.OutcomeConflict)
	})

	t.Run("the key counts", func(t *testing.T) {
		t.Parallel()
		store := memstore.New()
		newDeliverer(t, store, keyed).want(enc("a", paymentData(cardNumber, 10)), idempotency.OutcomeRun)
		rotated := idempotency.SensitiveFields{Jobs: jobs, Cipher: c, Key: otherKey}
		newDeliverer(t, store, rotated).want(enc("a", paymentData(cardNumber, 10)), idempotency.OutcomeConflict)
		rotated.PreviousKeys = [][]byte{key}
		d := newDeliverer(t, store, rotated)
		d.want(enc("a", paymentData(cardNumber, 10)), idempotency.OutcomeSkip)
		d.want(enc("a", paymentData(otherCard, 10)), idempotency.OutcomeConflict)
	})

	t.Run("records kept before the option", func(t *testing.T) {
		t.Parallel()
		store := memstore.New()
		first := enc("a", paymentData(cardNumber, 10))
		before, err := idempotency.New(store)
		if err != nil {
			t.Fatal(err)
		}
		msg := msgOf(first)
		if _, err := before.Middleware(counting(new(int), nil))(msg); err != nil {
			t.Fatal(err)
		}
		msg.Ack()
		d := newDeliverer(t, store, keyed)
		d.want(first, idempotency.OutcomeSkip) // a redelivery of the same bytes
		d.want(enc("a", paymentData(otherCard, 10)), idempotency.OutcomeConflict)

		// Kept without a cipher, then read with one: its retries match.
		store = memstore.New()
		newDeliverer(t, store, idempotency.SensitiveFields{Jobs: jobs}).want(enc("b", paymentData(cardNumber, 10)), idempotency.OutcomeRun)
		newDeliverer(t, store, keyed).want(enc("b", paymentData(cardNumber, 10)), idempotency.OutcomeSkip)
	})

	t.Run("other jobs and absent fields keep their fingerprint", func(t *testing.T) {
		t.Parallel()
		store := memstore.New()
		d := newDeliverer(t, store, keyed)
		plain := paymentData(cardNumber, 10)
		for _, k := range []string{"email", "card", "items"} {
			delete(plain, k)
		}
		other, err := envelope.New("urn:babel:orders:created", paymentData(cardNumber, 10), envelope.WithID("other"))
		if err != nil {
			t.Fatal(err)
		}
		otherBody, _ := other.Marshal()
		for id, body := range map[string][]byte{"plain": enc("plain", plain), "other": otherBody} {
			d.want(body, idempotency.OutcomeRun)
			rec, err := store.Lookup(context.Background(), idempotency.Key("", id))
			if err != nil {
				t.Fatal(err)
			}
			want, _ := envelope.Fingerprint(body)
			if rec.Fingerprint != want {
				t.Errorf("%s: kept fingerprint %016x, want the envelope's own %016x", id, rec.Fingerprint, want)
			}
		}
	})

	t.Run("urn alias and arrays of values", func(t *testing.T) {
		t.Parallel()
		tags := idempotency.SensitiveFields{Jobs: map[string][]string{"urn:babel:people:tagged": {"tags[]", "people[].name"}}, Cipher: c, Key: key}
		d := newDeliverer(t, memstore.New(), tags)
		body := func(tag string) []byte {
			data := map[string]any{"tags": []any{"vip", tag}, "people": []any{map[string]any{"name": "Zoë"}, map[string]any{"age": 3}}}
			if err := sdkProtect(data, []string{"tags[]", "people[].name"}, c); err != nil {
				t.Fatal(err)
			}
			e, err := envelope.New("urn:babel:people:tagged", data, envelope.WithID("t"))
			if err != nil {
				t.Fatal(err)
			}
			b, _ := e.Marshal()
			// The urn alias in place of job names the message too.
			return []byte(strings.Replace(string(b), `"job":`, `"urn":`, 1))
		}
		d.want(body("gold"), idempotency.OutcomeRun)
		d.want(body("gold"), idempotency.OutcomeSkip)
		d.want(body("silver"), idempotency.OutcomeConflict)
	})

	t.Run("a value that cannot be decrypted is rejected", func(t *testing.T) {
		t.Parallel()
		d := newDeliverer(t, memstore.New(), keyed)
		wrong := goEnvelope(t, randomKey(t), "w", paymentPaths, paymentData(cardNumber, 10))
		unprotected := goEnvelope(t, cipherKey, "u", []string{"card.holder", "email", "items[].note"}, paymentData(cardNumber, 10))
		for where, body := range map[string][]byte{"data.card.holder": wrong, "data.card.number": unprotected} {
			outcome, err := d.deliver(body)
			if outcome != idempotency.OutcomeReject || !errors.Is(err, idempotency.ErrUndecryptable) || !idempotency.IsPermanent(err) {
				t.Fatalf("outcome %s, err %v; want a permanent rejection matching ErrUndecryptable", outcome, err)
			}
			if got := deadletter.Reason(err); got != envelope.ReasonPoison {
				t.Errorf("dead-letter reason %q, want %q", got, envelope.ReasonPoison)
			}
			for _, secret := range cleartexts {
				if strings.Contains(err.Error(), secret) {
					t.Errorf("the error holds the cleartext %q: %v", secret, err)
				}
			}
			if !strings.Contains(err.Error(), "the value at "+where+" does not open") {
				t.Errorf("the error does not say where: %v", err)
			}
		}
		if d.runs != 0 {
			t.Fatalf("the handler ran %d times", d.runs)
		}
	})

	t.Run("a cipher that quotes its input is not printed", func(t *testing.T) {
		t.Parallel()
		d := newDeliverer(t, memstore.New(), idempotency.SensitiveFields{Jobs: jobs, Cipher: quotingCipher{}, Key: key})
		// A producer that encrypted nothing: the cleartext reaches the cipher.
		outcome, err := d.deliver(goEnvelope(t, cipherKey, "q", nil, paymentData(cardNumber, 10)))
		if outcome != idempotency.OutcomeReject || !errors.Is(err, errQuoting) {
			t.Fatalf("outcome %s, err %v; want a rejection with the cipher's error in its chain", outcome, err)
		}
		for _, secret := range cleartexts {
			if strings.Contains(err.Error(), secret) {
				t.Errorf("the error holds the cleartext %q: %v", secret, err)
			}
		}
	})
}

var errQuoting = errors.New("cannot decrypt")

// quotingCipher is a careless cipher of a user's: its error quotes what it
// was given.
type quotingCipher struct{}

func (quotingCipher) Decrypt(ciphertext string) ([]byte, error) {
	return nil, fmt.Errorf("%w %q", errQuoting, ciphertext)
}
