package idempotency

import (
	"fmt"
	"unicode"
	"unicode/utf8"
)

// MaxIDBytes is the longest meta.id accepted as a deduplication key.
const MaxIDBytes = 256

// scopeSeparator joins a scope and an id in a key. A meta.id never holds it
// (control characters are rejected), so distinct (scope, id) pairs never
// make the same key.
const scopeSeparator = "\x1f"

// Key returns the store key for id under scope, as the middleware computes
// it: id itself when scope is empty, otherwise scope, U+001F, id. Operator
// tools use it to forget or inspect a message's record.
func Key(scope, id string) string {
	if scope == "" {
		return id
	}
	return scope + scopeSeparator + id
}

// ValidateID reports whether id can be used as a deduplication key. The
// error matches ErrInvalidID and ErrPermanent and says what is wrong.
func ValidateID(id string) error {
	if len(id) > MaxIDBytes {
		return fmt.Errorf("%w: it is %d bytes, over the %d-byte limit", ErrInvalidID, len(id), MaxIDBytes)
	}
	// Fast path: printable ASCII, as UUIDs and most ids are.
	ascii := true
	for i := 0; i < len(id); i++ {
		if c := id[i]; c < 0x20 || c >= 0x7f {
			ascii = false
			break
		}
	}
	if ascii {
		return nil
	}
	for i, r := range id {
		if r == utf8.RuneError {
			if _, size := utf8.DecodeRuneInString(id[i:]); size == 1 {
				return fmt.Errorf("%w: invalid UTF-8 at byte %d", ErrInvalidID, i)
			}
		}
		if unicode.IsControl(r) {
			return fmt.Errorf("%w: control character %U at byte %d", ErrInvalidID, r, i)
		}
	}
	return nil
}
