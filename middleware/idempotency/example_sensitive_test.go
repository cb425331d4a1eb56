package idempotency_test

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// aesGCM is the BabelQueue SDKs' field cipher (the Go SDK's
// gdpr.AESGCMCipher, which a Go service passes as it is): AES-GCM, a
// random nonce per call before the sealed bytes, in base64.
type aesGCM struct{ aead cipher.AEAD }

func newAESGCM(key []byte) aesGCM {
	block, _ := aes.NewCipher(key)
	aead, _ := cipher.NewGCM(block)
	return aesGCM{aead}
}

func (c aesGCM) Encrypt(plaintext []byte) string {
	nonce := make([]byte, c.aead.NonceSize())
	_, _ = rand.Read(nonce)
	return base64.StdEncoding.EncodeToString(c.aead.Seal(nonce, nonce, plaintext, nil))
}

func (c aesGCM) Decrypt(ciphertext string) ([]byte, error) {
	raw, err := base64.StdEncoding.DecodeString(ciphertext)
	if err != nil || len(raw) < c.aead.NonceSize() {
		return nil, errors.New("malformed ciphertext")
	}
	n := c.aead.NonceSize()
	return c.aead.Open(nil, raw[:n], raw[n:], nil)
}

// A producer encrypts the card number, as the BabelQueue SDKs encrypt the
// fields a schema marks x-gdpr-sensitive, and retries the payment: each
// retry carries other ciphertext. Given the job's sensitive paths, the
// cipher and a key of its own, the guard recognises the retry by the
// cleartext, through a keyed hash, and still refuses the id reused for
// another card.
func ExampleWithSensitiveFields() {
	cipherKey := make([]byte, 32)      // the producers' field key (from a secret store)
	fingerprintKey := make([]byte, 32) // the consumers' own secret, 32 random bytes or more
	_, _ = rand.Read(cipherKey)
	_, _ = rand.Read(fingerprintKey)
	fields := newAESGCM(cipherKey)

	guard := idempotency.Middleware(memstore.New(), idempotency.WithSensitiveFields(idempotency.SensitiveFields{
		Jobs:   map[string][]string{"urn:babel:payments:charge": {"card.number"}}, // the schema's x-gdpr-sensitive paths
		Cipher: fields,
		Key:    fingerprintKey,
	}))
	charge := guard(func(msg *message.Message) ([]*message.Message, error) {
		e, _ := envelope.Parse(msg.Payload)
		var data struct{ Order string }
		_ = json.Unmarshal(e.Data, &data)
		fmt.Println("charged", data.Order)
		return nil, nil
	})

	// The producer: the same payment three times, the last with another card.
	for _, card := range []string{"4111111111111111", "4111111111111111", "4000056655665556"} {
		number, _ := json.Marshal(card)
		e, _ := envelope.New("urn:babel:payments:charge",
			map[string]any{"order": "ord-1042", "card": map[string]any{"number": fields.Encrypt(number)}},
			envelope.WithID("pay-ord-1042"))
		body, _ := e.Marshal()
		msg := message.NewMessage(watermill.NewUUID(), body)
		_, err := charge(msg)
		msg.Ack()
		switch {
		case errors.Is(err, idempotency.ErrConflict):
			fmt.Println("rejected: meta.id reused for another card")
		case err != nil:
			fmt.Println("error:", err)
		default:
			fmt.Println("acked")
		}
	}
	// Output:
	// charged ord-1042
	// acked
	// acked
	// rejected: meta.id reused for another card
}
