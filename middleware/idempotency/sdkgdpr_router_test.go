package idempotency_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/pubsub/redislist"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// The payment of these tests: a schema that marks the card, the e-mail
// address and each item's note x-gdpr-sensitive. The holder's name is not
// ASCII and the note holds <, > and &, which the Go and Python SDKs encode
// differently before encrypting.
const paymentURN = "urn:babel:payments:charge"

var paymentPaths = []string{"card.holder", "card.number", "email", "items[].note"}

const (
	cardNumber  = "4111111111111111"
	otherCard   = "4000056655665556"
	holderName  = "José Müller"
	email       = "jose.muller@example.com"
	noteText    = "gift <for> mum & dad"
	paymentCent = 1999
)

func paymentData(card string, amount int) map[string]any {
	return map[string]any{
		"order_id": "ord-1042", "amount_cents": amount, "currency": "EUR", "email": email,
		"card":  map[string]any{"number": card, "holder": holderName, "brand": "visa"},
		"items": []any{map[string]any{"sku": "mug", "qty": 2, "note": noteText}},
	}
}

// cleartexts are what no record, dead letter or log may hold, in the
// spellings an encoder may give them.
var cleartexts = []string{cardNumber, otherCard, email, "José", `Jos\u00e9`, "Müller", `M\u00fcller`, "gift <for>", `gift \u003cfor\u003e`}

func randomKey(t testing.TB) []byte {
	t.Helper()
	k := make([]byte, 32)
	if _, err := rand.Read(k); err != nil {
		t.Fatal(err)
	}
	return k
}

// sdkWiring is the wiring docs/sdk-interop.md shows a fleet whose producers
// protect fields.
func sdkWiring(c *sdkCipher, fingerprintKey []byte) []idempotency.Option {
	return []idempotency.Option{idempotency.WithSensitiveFields(idempotency.SensitiveFields{
		Jobs:   map[string][]string{paymentURN: paymentPaths},
		Cipher: c,
		Key:    fingerprintKey,
	})}
}

// A producer retries a payment (same meta.id, same cleartext, new ciphertext
// each time) through the SDKs' Redis reliable list, from the Go SDK, the
// Python SDK, or the Go SDK first and the Python SDK for the retries: the
// payment is charged once and no retry is dead-lettered; a payment reusing
// the id with another card or another amount is still a conflict. Nothing
// the kit writes (records, dead letters, logs) holds the cleartext, and the
// kept fingerprint is not the unkeyed one of the cleartext.
func TestSDKEncryptedRetriesRunOnce(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	db := testenv.Postgres(t)
	pg, err := postgresstore.New(db, postgresstore.WithTable("idem_gdpr_"+testenv.RandomHex(4)))
	if err != nil {
		t.Fatal(err)
	}
	if err := pg.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = db.Exec(`DROP TABLE IF EXISTS ` + pg.Table()) })
	type fleet struct {
		name          string
		first, retrys sdkProducer
	}
	for _, f := range []fleet{
		{"go", goProducer, goProducer},
		{"python", pythonProducer, pythonProducer},
		{"go-then-python", goProducer, pythonProducer},
	} {
		for _, s := range []struct {
			name  string
			store func(t *testing.T) (stores.Store, func(t *testing.T) string)
		}{
			{"memstore", func(*testing.T) (stores.Store, func(*testing.T) string) {
				return memstore.New(), func(*testing.T) string { return "" }
			}},
			{"redisstore", func(t *testing.T) (stores.Store, func(*testing.T) string) {
				prefix := "bq-gdpr-" + testenv.RandomHex(4) + ":"
				return redisstore.New(client, redisstore.WithPrefix(prefix)),
					func(t *testing.T) string { return redisDump(t, client, prefix+"*") }
			}},
			{"postgresstore", func(*testing.T) (stores.Store, func(*testing.T) string) {
				return pg, func(t *testing.T) string { return tableDump(t, db, pg.Table()) }
			}},
		} {
			t.Run(f.name+"/"+s.name, func(t *testing.T) {
				t.Parallel()
				store, dump := s.store(t)
				sdkRetries(t, client, store, dump, f.first, f.retrys)
			})
		}
	}
}

// tableDump returns every row of table as text.
func tableDump(t testing.TB, db *sql.DB, table string) string {
	t.Helper()
	var b strings.Builder
	for _, row := range testenv.Column[string](context.Background(), t, db, `SELECT t::text FROM `+table+` t`) {
		b.WriteString(row + "\n")
	}
	return b.String()
}

// payments is the handler: it decrypts the fields as an SDK consumer
// does and charges the card.
type payments struct {
	t       *testing.T
	c       *sdkCipher
	mu      sync.Mutex
	charges []string // meta.id card amount, one per charge
}

func (p *payments) charge(msg *message.Message) error {
	e, err := envelope.Parse(msg.Payload)
	if err != nil {
		return err
	}
	var data map[string]any
	if err := json.Unmarshal(e.Data, &data); err != nil {
		return err
	}
	if err := sdkUnprotect(data, paymentPaths, p.c); err != nil {
		return fmt.Errorf("decrypt the payment: %w", err)
	}
	card := data["card"].(map[string]any)
	if card["holder"] != holderName || data["email"] != email || data["items"].([]any)[0].(map[string]any)["note"] != noteText {
		p.t.Errorf("the handler read %v after decrypting", data)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.charges = append(p.charges, fmt.Sprintf("%s %v %v", e.Meta.ID, card["number"], data["amount_cents"]))
	return nil
}

func (p *payments) made() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.charges...)
}

func sdkRetries(t *testing.T, client *redis.Client, store stores.Store, dump func(*testing.T) string, first, retries sdkProducer) {
	ctx := context.Background()
	cipherKey, fpKey := randomKey(t), randomKey(t)
	c := newSDKCipher(t, cipherKey)
	queue := "bq-gdpr-" + testenv.RandomHex(4)
	id := "pay-" + testenv.RandomHex(8)

	logs := &testenv.SyncBuffer{}
	logger := watermill.NewStdLoggerWithOut(logs, true, true)
	pub, err := redislist.NewPublisher(client, redislist.WithLogger(logger))
	if err != nil {
		t.Fatal(err)
	}
	sub, err := redislist.NewSubscriber(client, redislist.WithLogger(logger), redislist.WithBlockTime(100*time.Millisecond),
		redislist.WithCloseTimeout(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Close(); _ = pub.Close() })
	dlq, err := deadletter.Middleware(pub, deadletter.WithLogger(logger))
	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	opts := append(sdkWiring(c, fpKey), idempotency.WithLogger(logger), idempotency.WithClaim(10*time.Second),
		idempotency.WithParkWait(50*time.Millisecond))
	guard, err := idempotency.New(store, opts...)
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(dlq, guard.Middleware)
	p := &payments{t: t, c: c}
	r.AddConsumerHandler("charge", queue, sub, p.charge)
	stop := testenv.RunRouter(t, r)

	push := func(bodies [][]byte) {
		t.Helper()
		for _, b := range bodies {
			if err := client.RPush(ctx, queue, b).Err(); err != nil {
				t.Fatal(err)
			}
		}
	}
	// The first send, then three retries, one the same id with another
	// card, one with another amount.
	firstBody := first(t, cipherKey, paymentURN, id, queue, paymentPaths, send{paymentData(cardNumber, paymentCent), 1})
	later := retries(t, cipherKey, paymentURN, id, queue, paymentPaths, send{paymentData(cardNumber, paymentCent), 3},
		send{paymentData(otherCard, paymentCent), 1}, send{paymentData(cardNumber, 2999), 1})
	push(firstBody)
	testenv.Eventually(t, "the first charge", func() bool { return len(p.made()) >= 1 })
	push(later)

	lists := func() (queued, processing, dead int64) {
		queued, _ = client.LLen(ctx, queue).Result()
		processing, _ = client.LLen(ctx, queue+":processing").Result()
		dead, _ = client.LLen(ctx, queue+".dlq").Result()
		return
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		q, pr, d := lists()
		if q == 0 && pr == 0 && d >= 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 20 s: %d queued, %d in processing, %d dead letters (want 0, 0, 2); charges %v", q, pr, d, p.made())
		}
		time.Sleep(10 * time.Millisecond)
	}
	stop()

	if got, want := p.made(), []string{fmt.Sprintf("%s %s %d", id, cardNumber, paymentCent)}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("charges %q, want %q (one)", got, want)
	}
	letters, err := client.LRange(ctx, queue+".dlq", 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	var conflicts []string
	for _, l := range letters {
		var frame struct {
			Headers map[string]string `json:"headers"`
			Body    string            `json:"body"`
		}
		if err := json.Unmarshal([]byte(l), &frame); err != nil {
			t.Fatalf("dead letter %s: %v", l, err)
		}
		e, err := envelope.Parse([]byte(frame.Body))
		if err != nil {
			t.Fatal(err)
		}
		var data map[string]any
		if err := json.Unmarshal(e.Data, &data); err != nil {
			t.Fatal(err)
		}
		if err := sdkUnprotect(data, paymentPaths, c); err != nil {
			t.Fatal(err)
		}
		conflicts = append(conflicts, fmt.Sprintf("%s %v %v", frame.Headers[deadletter.MetadataReason], data["card"].(map[string]any)["number"], data["amount_cents"]))
	}
	if got, want := strings.Join(conflicts, ", "), fmt.Sprintf("conflict %s %d, conflict %s 2999", otherCard, paymentCent, cardNumber); got != want {
		t.Errorf("dead letters: %s; want %s (the retries are none of them)", got, want)
	}

	// Nothing the kit wrote holds the cleartext.
	rec, err := store.Lookup(ctx, idempotency.Key("charge", id))
	if err != nil {
		t.Fatal(err)
	}
	if !rec.Remembered() {
		t.Fatalf("the record of %s is %v, want remembered", id, rec.State)
	}
	clear, err := envelope.New(paymentURN, paymentData(cardNumber, paymentCent), envelope.WithID(id))
	if err != nil {
		t.Fatal(err)
	}
	clearBody, _ := clear.Marshal()
	unkeyed, _ := envelope.Fingerprint(clearBody)
	if caps := store.Capabilities(); caps.KeptFingerprint(unkeyed) == unkeyed && rec.Fingerprint == unkeyed { // a store keeping all 64 bits
		t.Errorf("the record keeps %016x, the unkeyed fingerprint of the cleartext: a card number is brute-forced from it", rec.Fingerprint)
	}
	for what, text := range map[string]string{"the store": dump(t), "the dead letters": strings.Join(letters, "\n"), "the logs": logs.String()} {
		for _, secret := range cleartexts {
			if strings.Contains(text, secret) {
				t.Errorf("%s hold the cleartext %q:\n%s", what, secret, text)
			}
		}
	}
}
