package envelope_test

import (
	"encoding/json"
	"testing"

	"github.com/babelqueue/watermill-idempotency/envelope"
)

func TestFingerprintJSON(t *testing.T) {
	same := [][2]string{
		{`{"a":1,"b":[true,null,"é"]}`, " { \"b\" : [true, null, \"\\u00e9\"], \"a\":1 }\n"},
		{`"x"`, ` "x" `},
		{`[1,2]`, `[1, 2]`},
	}
	for _, p := range same {
		a, errA := envelope.FingerprintJSON([]byte(p[0]))
		b, errB := envelope.FingerprintJSON([]byte(p[1]))
		if errA != nil || errB != nil || a != b {
			t.Errorf("%s and %s: %x %v, %x %v; want one fingerprint", p[0], p[1], a, errA, b, errB)
		}
	}
	distinct := []string{`{"a":1}`, `{"a":2}`, `{"b":1}`, `[1,2]`, `[2,1]`, `"1"`, `1`, `null`, `{}`, `[]`, `true`}
	seen := map[uint64]string{}
	for _, p := range distinct {
		h, err := envelope.FingerprintJSON([]byte(p))
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		if q, dup := seen[h]; dup {
			t.Errorf("%s and %s share a fingerprint", p, q)
		}
		seen[h] = p
	}
	// Not one JSON value, including payloads that would make a valid
	// value if pasted into a wrapper.
	for _, p := range []string{``, ` `, `1,2`, `{"a":1}{"b":2}`, `1]},"job":"x","y":{"z":[2`, `{`, "\xff"} {
		if _, err := envelope.FingerprintJSON([]byte(p)); err == nil {
			t.Errorf("%q accepted", p)
		}
		if json.Valid([]byte(p)) {
			t.Fatalf("test bug: %q is valid JSON", p)
		}
	}
}

func FuzzFingerprintJSON(f *testing.F) {
	for _, s := range []string{`{"a":1}`, `[1,"x",null]`, `1,2`, `"\u00e9"`, ``} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, payload []byte) {
		_, err := envelope.FingerprintJSON(payload)
		if (err == nil) != json.Valid(payload) {
			t.Fatalf("FingerprintJSON err=%v, json.Valid=%v for %q", err, json.Valid(payload), payload)
		}
	})
}
