package httpidempotency

import (
	"hash/fnv"
	"net/http"
	"slices"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/internal/fphash"
)

// BodyMode says how a request body enters the fingerprint.
type BodyMode int

const (
	// BodyJSON compares a JSON body by its meaning: member order, white
	// space, string escapes and number spelling (1, 1.0, 1e0) do not
	// matter; values, names and array order do. A body that is not JSON is
	// compared byte for byte. The default.
	BodyJSON BodyMode = iota
	// BodyBytes compares the body byte for byte.
	BodyBytes
)

// Fingerprint tags, so that parts never hash alike across kinds.
const (
	tagJSONBody  = 0x6a736f6e62000001
	tagByteBody  = 0x6279746562000002
	tagRequest   = 0x7265717565000003
	tagHeader    = 0x6865616465000004
	tagNoHeader  = 0x6e6f686561000005
	tagEmptyBody = 0x656d707479000006
)

// fingerprint returns the request's intent: method, path and query byte
// for byte, the operation's declared headers (names folded, values in
// order, an absent header unlike an empty one) and the body as the
// operation's BodyMode says. It is never 0 (stores read 0 as none kept).
func (op *Operation) fingerprint(r *http.Request, body []byte) uint64 {
	f := fnv.New64a()
	fphash.WriteString(f, r.Method)
	fphash.WriteString(f, r.URL.EscapedPath())
	fphash.WriteString(f, r.URL.RawQuery)
	h := fphash.Mix(tagRequest ^ f.Sum64())
	for _, name := range op.headers {
		values, ok := r.Header[name]
		if !ok {
			h = fphash.Mix(h + fphash.Mix(tagNoHeader^fphash.String(name)))
			continue
		}
		f := fnv.New64a()
		fphash.WriteString(f, name)
		for _, v := range values {
			fphash.WriteString(f, v)
		}
		h = fphash.Mix(h + fphash.Mix(tagHeader^f.Sum64()))
	}
	h = fphash.Mix(h + bodyFingerprint(op.Body, body))
	if h == 0 {
		h = 1
	}
	return h
}

func bodyFingerprint(mode BodyMode, body []byte) uint64 {
	if len(body) == 0 {
		return fphash.Mix(tagEmptyBody)
	}
	if mode == BodyJSON {
		if fp, err := envelope.FingerprintJSON(body); err == nil {
			return fphash.Mix(tagJSONBody ^ fp)
		}
	}
	return fphash.Mix(tagByteBody ^ fphash.Bytes(body))
}

func sortedKeys(h http.Header) []string {
	keys := make([]string, 0, len(h))
	for k := range h {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
