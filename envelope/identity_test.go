package envelope_test

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/testkit/conformance"
)

func TestReadIdentity(t *testing.T) {
	cases := []struct {
		name    string
		payload string
		want    envelope.Identity
		invalid bool
	}{
		{"fixture shape", `{"job":"j","data":{"x":[1,{"meta":{"id":"decoy"}}]},"meta":{"id":"m-1","schema_version":1,"created_at":1749132727000}}`,
			envelope.Identity{ID: "m-1", HasID: true, SchemaVersion: 1, HasSchemaVersion: true, CreatedAt: 1749132727000}, false},
		{"meta first, white space", " \n{ \"meta\" : { \"id\" : \"a\" } , \"data\" : { } } \t",
			envelope.Identity{ID: "a", HasID: true}, false},
		{"no meta", `{"job":"j"}`, envelope.Identity{}, false},
		{"empty object", `{}`, envelope.Identity{}, false},
		{"meta not an object", `{"meta":"x"}`, envelope.Identity{}, false},
		{"id null", `{"meta":{"id":null}}`, envelope.Identity{}, false},
		{"id number", `{"meta":{"id":42}}`, envelope.Identity{}, false},
		{"id empty", `{"meta":{"id":""}}`, envelope.Identity{HasID: true}, false},
		{"id escaped", `{"meta":{"id":"a\"b\u00e9\n"}}`, envelope.Identity{ID: "a\"bé\n", HasID: true}, false},
		{"last meta wins", `{"meta":{"id":"a","schema_version":2},"meta":{"id":"b"}}`, envelope.Identity{ID: "b", HasID: true}, false},
		{"last id wins", `{"meta":{"id":"a","id":"b"}}`, envelope.Identity{ID: "b", HasID: true}, false},
		{"escaped member name", `{"m\u0065ta":{"\u0069d":"x"}}`, envelope.Identity{ID: "x", HasID: true}, false},
		{"names are case-sensitive", `{"Meta":{"id":"x"},"meta":{"ID":"y"}}`, envelope.Identity{}, false},
		{"schema 2", `{"meta":{"schema_version":2}}`, envelope.Identity{SchemaVersion: 2, HasSchemaVersion: true}, false},
		{"schema 1.0", `{"meta":{"schema_version":1.0}}`, envelope.Identity{SchemaVersion: 1, HasSchemaVersion: true}, false},
		{"schema string", `{"meta":{"schema_version":"1"}}`, envelope.Identity{SchemaVersion: -1, HasSchemaVersion: true}, false},
		{"schema null", `{"meta":{"schema_version":null}}`, envelope.Identity{}, false},
		{"schema huge", `{"meta":{"schema_version":1e400}}`, envelope.Identity{SchemaVersion: -1, HasSchemaVersion: true}, false},
		{"created_at beyond int64", `{"meta":{"created_at":99999999999999999999999}}`, envelope.Identity{}, false},
		{"not json", `hello`, envelope.Identity{}, true},
		{"empty", ``, envelope.Identity{}, true},
		{"array", `[{"meta":{"id":"a"}}]`, envelope.Identity{}, true},
		{"string", `"x"`, envelope.Identity{}, true},
		{"trailing comma", `{"meta":{"id":"a"},}`, envelope.Identity{}, true},
		{"trailing garbage", `{"meta":{"id":"a"}} x`, envelope.Identity{}, true},
		{"two objects", `{}{}`, envelope.Identity{}, true},
		{"bad data after meta", `{"meta":{"id":"a"},"data":{"x":01}}`, envelope.Identity{}, true},
		{"unterminated", `{"meta":{"id":"a"`, envelope.Identity{}, true},
		{"raw control char", "{\"meta\":{\"id\":\"a\x01\"}}", envelope.Identity{}, true},
		{"bad escape", `{"meta":{"id":"\x"}}`, envelope.Identity{}, true},
		{"bad literal", `{"data":tru}`, envelope.Identity{}, true},
		{"bad number", `{"data":-}`, envelope.Identity{}, true},
		{"missing colon", `{"meta" {"id":"a"}}`, envelope.Identity{}, true},
		{"bad nesting", `{"data":[1,2}}`, envelope.Identity{}, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := envelope.ReadIdentity([]byte(c.payload))
			if c.invalid {
				if !errors.Is(err, envelope.ErrNotObject) || !errors.Is(err, envelope.ErrInvalid) {
					t.Fatalf("err = %v, want ErrNotObject", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("err = %v", err)
			}
			if got != c.want {
				t.Fatalf("got %+v, want %+v", got, c.want)
			}
			checkAgainstReference(t, []byte(c.payload))
		})
	}
}

func TestReadIdentityDepthMatchesEncodingJSON(t *testing.T) {
	for _, depth := range []int{9998, 9999, 10000, 10001} {
		// depth counts the top-level object.
		inner := strings.Repeat("[", depth-1) + strings.Repeat("]", depth-1)
		payload := []byte(`{"data":` + inner + `,"meta":{"id":"a"}}`)
		checkAgainstReference(t, payload)
	}
}

func TestReadIdentityAllocatesOnlyTheID(t *testing.T) {
	payload, err := os.ReadFile(filepath.Join(conformanceDir, "fixtures", "unicode-and-numbers.json"))
	if err != nil {
		t.Fatal(err)
	}
	allocs := testing.AllocsPerRun(100, func() {
		if _, err := envelope.ReadIdentity(payload); err != nil {
			t.Fatal(err)
		}
	})
	if allocs > 1 {
		t.Fatalf("ReadIdentity allocates %.0f times, want at most 1 (the id)", allocs)
	}
}

// reference reads the identity the slow, obviously right way.
func reference(payload []byte) (envelope.Identity, bool) {
	var top map[string]json.RawMessage
	if err := json.Unmarshal(payload, &top); err != nil || top == nil {
		return envelope.Identity{}, false
	}
	var id envelope.Identity
	var meta map[string]json.RawMessage
	if raw, ok := top["meta"]; !ok || json.Unmarshal(raw, &meta) != nil {
		return id, true
	}
	if raw, ok := meta["id"]; ok && json.Unmarshal(raw, &id.ID) == nil && string(raw) != "null" {
		id.HasID = true
	} else {
		id.ID = ""
	}
	if raw, ok := meta["schema_version"]; ok && string(raw) != "null" {
		id.HasSchemaVersion = true
		id.SchemaVersion = -1
		if f, err := strconv.ParseFloat(string(raw), 64); err == nil && f == 1 {
			id.SchemaVersion = 1
		}
	}
	return id, true
}

func checkAgainstReference(t *testing.T, payload []byte) {
	t.Helper()
	got, err := envelope.ReadIdentity(payload)
	want, valid := reference(payload)
	if withFP, fpErr := envelope.ReadIdentityFingerprint(payload); (fpErr == nil) != (err == nil) || (fpErr == nil && withFP.ID != got.ID) {
		t.Fatalf("ReadIdentityFingerprint(%q) = %+v, %v; ReadIdentity = %+v, %v", clipped(payload), withFP, fpErr, got, err)
	}
	if (err == nil) != valid {
		t.Fatalf("ReadIdentity(%q) err = %v; encoding/json says valid object = %v", clipped(payload), err, valid)
	}
	if !valid {
		return
	}
	// encoding/json replaces each invalid UTF-8 byte with U+FFFD; ReadIdentity
	// keeps the raw bytes so that callers can reject them.
	if string([]rune(got.ID)) != want.ID || got.HasID != want.HasID || got.HasSchemaVersion != want.HasSchemaVersion ||
		(got.SchemaVersion == 1) != (want.SchemaVersion == 1) {
		t.Fatalf("ReadIdentity(%q) = %+v, encoding/json reads %+v", clipped(payload), got, want)
	}
}

func clipped(b []byte) string {
	if len(b) > 200 {
		return string(b[:200]) + "…"
	}
	return string(b)
}

func fuzzSeeds(f *testing.F) {
	conformance.AddFixtureSeeds(f)
	for _, s := range []string{
		``, `{}`, `[]`, `null`, `{"meta":{"id":""}}`, `{"meta":{"id":"\ud800"}}`, "{\"meta\":{\"id\":\"\xff\xfe\"}}",
		`{"meta":{"schema_version":1e999}}`, `{"meta":{"created_at":-0.0}}`, `{"data":[[[[[[[[[[]]]]]]]]]]}`,
		`{"meta":{"id":"a"},"meta":null}`, `{"a":1,}`, `{"a":"\u12"}`, `{"meta":{"id":"` + strings.Repeat("x", 300) + `"}}`,
	} {
		f.Add([]byte(s))
	}
}

// FuzzReadIdentity holds ReadIdentity to encoding/json's verdicts on any
// input: same notion of a JSON object, same meta.id.
func FuzzReadIdentity(f *testing.F) {
	fuzzSeeds(f)
	f.Fuzz(func(t *testing.T, payload []byte) {
		checkAgainstReference(t, payload)
	})
}

// FuzzParse checks that Parse never panics, that every error matches
// ErrInvalid, and that an accepted envelope re-encodes to one that parses
// to the same values.
func FuzzParse(f *testing.F) {
	fuzzSeeds(f)
	f.Fuzz(func(t *testing.T, payload []byte) {
		e, err := envelope.Parse(payload)
		if err != nil {
			if !errors.Is(err, envelope.ErrInvalid) {
				t.Fatalf("Parse error %v does not match ErrInvalid", err)
			}
			return
		}
		out, err := e.Marshal()
		if err != nil {
			t.Fatalf("Marshal of a parsed envelope: %v", err)
		}
		back, err := envelope.Parse(out)
		if err != nil {
			t.Fatalf("re-encoded envelope does not parse: %v\n%s", err, out)
		}
		again, err := back.Marshal()
		if err != nil || string(again) != string(out) {
			t.Fatalf("re-encoding is not stable:\n%s\n%s", out, again)
		}
		// Re-encoding keeps the intent: same fingerprint.
		before, err1 := envelope.Fingerprint(payload)
		after, err2 := envelope.Fingerprint(out)
		if err1 != nil || err2 != nil || before != after {
			t.Fatalf("fingerprint changed by Parse/Marshal: %x (%v) vs %x (%v)\n%s\n%s", before, err1, after, err2, payload, out)
		}
		// So does another runtime's re-encoding: members deduplicated (the
		// last wins) and sorted, numbers re-spelled.
		if other, ok := reencode(payload); ok {
			if fp, err := envelope.Fingerprint(other); err != nil || fp != before {
				t.Fatalf("fingerprint changed by a re-encoding: %x vs %x (%v)\n%s\n%s", before, fp, err, payload, other)
			}
		}
	})
}

// reencode decodes payload generically and encodes it again the way another
// JSON library may: duplicate members collapsed, members sorted, every
// number re-spelled (1 as 1.0e0, 1.5 as 1.5e0).
func reencode(payload []byte) ([]byte, bool) {
	d := json.NewDecoder(strings.NewReader(string(payload)))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		return nil, false
	}
	out, err := json.Marshal(respell(v))
	return out, err == nil
}

func respell(v any) any {
	switch v := v.(type) {
	case map[string]any:
		for k, x := range v {
			v[k] = respell(x)
		}
	case []any:
		for i, x := range v {
			v[i] = respell(x)
		}
	case json.Number:
		s := string(v)
		if !strings.ContainsAny(s, ".eE") {
			s += ".0"
		}
		if !strings.ContainsAny(s, "eE") {
			s += "e0"
		}
		return json.Number(s)
	}
	return v
}
