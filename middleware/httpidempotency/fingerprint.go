package httpidempotency

import (
	"encoding/binary"
	"hash/fnv"
	"net/http"
	"slices"

	"github.com/babelqueue/watermill-idempotency/envelope"
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
	writeString(f, r.Method)
	writeString(f, r.URL.EscapedPath())
	writeString(f, r.URL.RawQuery)
	h := mix64(tagRequest ^ f.Sum64())
	for _, name := range op.headers {
		values, ok := r.Header[name]
		if !ok {
			h = mix64(h + mix64(tagNoHeader^hashString(name)))
			continue
		}
		f := fnv.New64a()
		writeString(f, name)
		for _, v := range values {
			writeString(f, v)
		}
		h = mix64(h + mix64(tagHeader^f.Sum64()))
	}
	h = mix64(h + bodyFingerprint(op.Body, body))
	if h == 0 {
		h = 1
	}
	return h
}

func bodyFingerprint(mode BodyMode, body []byte) uint64 {
	if len(body) == 0 {
		return mix64(tagEmptyBody)
	}
	if mode == BodyJSON {
		if fp, err := envelope.FingerprintJSON(body); err == nil {
			return mix64(tagJSONBody ^ fp)
		}
	}
	f := fnv.New64a()
	_, _ = f.Write(body)
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(len(body)))
	_, _ = f.Write(n[:])
	return mix64(tagByteBody ^ f.Sum64())
}

type byteWriter interface{ Write([]byte) (int, error) }

// writeString writes s with its length, so that parts never run together.
func writeString(w byteWriter, s string) {
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(len(s)))
	_, _ = w.Write(n[:])
	_, _ = w.Write([]byte(s))
}

func hashString(s string) uint64 {
	f := fnv.New64a()
	writeString(f, s)
	return f.Sum64()
}

// mix64 is the splitmix64 finaliser.
func mix64(h uint64) uint64 {
	h ^= h >> 30
	h *= 0xbf58476d1ce4e5b9
	h ^= h >> 27
	h *= 0x94d049bb133111eb
	h ^= h >> 31
	return h
}

func sortedKeys(h http.Header) []string {
	keys := make([]string, 0, len(h))
	for k := range h {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
