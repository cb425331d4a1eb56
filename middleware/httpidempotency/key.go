package httpidempotency

import (
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
)

// HeaderKey is the request header carrying the client's idempotency key.
const HeaderKey = "Idempotency-Key"

// HeaderReplayed is set to "true" on a response replayed from a saved one,
// as payment APIs do: the handler did not run for this request.
const HeaderReplayed = "Idempotent-Replayed"

// MaxKeyBytes is the longest idempotency key accepted, in bytes (after
// removing the quotes of a structured-field string).
const MaxKeyBytes = idempotency.MaxIDBytes

// separator joins the parts of a record key. No part holds it: tenants,
// operation names and keys with control characters are refused.
const separator = "\x1f"

// scopePrefix starts the scope of every API record, so that an API record
// never shares a key with a consumer's record (the middleware's scopes are
// handler names, whose records hold one separator, not three).
const scopePrefix = "http"

// RecordKey returns the store key of the API record of (tenant, operation,
// key): "http", tenant, operation and key joined by U+001F. None of the
// three may hold a control character (the middleware refuses them), so two
// distinct triples never share a record. The operator command
// (bq-idempotency inspect|forget --api-tenant T --operation O KEY...) finds
// records by it.
func RecordKey(tenant, operation, key string) string {
	return idempotency.Key(scopePrefix+separator+tenant+separator+operation, key)
}

// Errors of reading the Idempotency-Key header.
var (
	// ErrKeyMissing is matched when a request carries no key.
	ErrKeyMissing = errors.New("no Idempotency-Key header")
	// ErrKeyInvalid is matched when a request's key cannot be used.
	ErrKeyInvalid = errors.New("unusable Idempotency-Key header")
)

// ParseKey reads the Idempotency-Key of a request: a structured-field
// string as the IETF draft writes it ("8e03978e-…", quotes included), or
// the bare value payment APIs take (8e03978e-…). It refuses a request
// with more than one such header, an empty key, one over MaxKeyBytes, one
// that is not UTF-8 or holds a control character, and a malformed quoted
// string.
func ParseKey(h http.Header) (string, error) {
	values := h.Values(HeaderKey)
	switch len(values) {
	case 0:
		return "", ErrKeyMissing
	case 1:
	default:
		return "", fmt.Errorf("%w: %d headers, one is allowed", ErrKeyInvalid, len(values))
	}
	v := strings.TrimSpace(values[0])
	if len(v) > MaxKeyBytes+2 { // before unquoting: never scan a huge value
		return "", fmt.Errorf("%w: it is %d bytes, over the %d-byte limit", ErrKeyInvalid, len(v), MaxKeyBytes)
	}
	if strings.HasPrefix(v, `"`) {
		var err error
		if v, err = unquote(v); err != nil {
			return "", err
		}
	}
	if v == "" {
		return "", fmt.Errorf("%w: it is empty", ErrKeyInvalid)
	}
	if err := idempotency.ValidateID(v); err != nil {
		return "", fmt.Errorf("%w: %s", ErrKeyInvalid, strings.TrimPrefix(err.Error(), idempotency.ErrInvalidID.Error()+": "))
	}
	return v, nil
}

// unquote reads an sf-string (RFC 8941, 3.3.3): printable ASCII between
// double quotes, with \" and \\ the only escapes.
func unquote(v string) (string, error) {
	var b strings.Builder
	for i := 1; i < len(v); i++ {
		c := v[i]
		switch {
		case c == '\\':
			i++
			if i == len(v) || (v[i] != '"' && v[i] != '\\') {
				return "", fmt.Errorf("%w: a quoted key may escape only \\\" and \\\\", ErrKeyInvalid)
			}
			b.WriteByte(v[i])
		case c == '"':
			if i != len(v)-1 {
				return "", fmt.Errorf("%w: text after the closing quote", ErrKeyInvalid)
			}
			return b.String(), nil
		case c < 0x20 || c > 0x7e:
			return "", fmt.Errorf("%w: a quoted key holds printable ASCII only (byte %#x)", ErrKeyInvalid, c)
		default:
			b.WriteByte(c)
		}
	}
	return "", fmt.Errorf("%w: no closing quote", ErrKeyInvalid)
}
