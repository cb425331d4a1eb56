package envelope

import "fmt"

// errNotJSON is returned by FingerprintJSON for a payload that is not one
// JSON value.
var errNotJSON = fmt.Errorf("%w: the payload is not a single JSON value", ErrInvalid)

// FingerprintJSON returns a 64-bit fingerprint of payload, any single JSON
// value, hashed as Fingerprint hashes an envelope's data: insensitive to the
// order of object members, to white space and to string escapes. It is for
// messages that are not envelopes, whose whole payload is their content.
// It validates payload as it goes, agreeing with encoding/json, and returns
// an error matching ErrInvalid when payload is not exactly one JSON value.
func FingerprintJSON(payload []byte) (uint64, error) {
	s := scanner{data: payload}
	h, ok := s.hashValue(0)
	if !ok || s.end() != nil {
		return 0, errNotJSON
	}
	return h, nil
}
