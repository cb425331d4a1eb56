package envelope_test

import (
	"encoding/json"
	"fmt"
	"math"
	"math/big"
	"strconv"
	"strings"
	"testing"

	"github.com/babelqueue/watermill-idempotency/envelope"
)

func fp(t *testing.T, payload string) uint64 {
	t.Helper()
	f, err := envelope.Fingerprint([]byte(payload))
	if err != nil {
		t.Fatalf("Fingerprint(%s): %v", payload, err)
	}
	if f == 0 {
		t.Fatalf("Fingerprint(%s) = 0; 0 means none", payload)
	}
	return f
}

func TestFingerprintIgnoresWhatIsNotIntent(t *testing.T) {
	base := `{"job":"urn:x","trace_id":"t1","data":{"a":1,"b":{"c":[1,"x",null,true]},"s":"é"},"meta":{"id":"m1","created_at":1},"attempts":0}`
	same := []string{
		// members reordered at every level, white space, other meta,
		// attempts, trace_id and a dead_letter block
		`{ "attempts": 7, "dead_letter": {"reason":"failed"}, "meta": {"id":"m1","created_at":99,"queue":"q"},
		   "data": { "s": "\u00e9", "b": { "c": [ 1, "x", null, true ] }, "a": 1 }, "trace_id": "other", "job": "urn:x" }`,
		// the urn alias names the same job
		`{"urn":"urn:x","data":{"b":{"c":[1,"x",null,true]},"a":1,"s":"é"}}`,
	}
	want := fp(t, base)
	for _, p := range same {
		if got := fp(t, p); got != want {
			t.Fatalf("fingerprint of\n%s\ndiffers from\n%s", p, base)
		}
	}
	different := []string{
		`{"job":"urn:y","data":{"a":1,"b":{"c":[1,"x",null,true]},"s":"é"}}`,        // another job
		`{"job":"urn:x","data":{"a":2,"b":{"c":[1,"x",null,true]},"s":"é"}}`,        // another value
		`{"job":"urn:x","data":{"a":1.5,"b":{"c":[1,"x",null,true]},"s":"é"}}`,      // another number
		`{"job":"urn:x","data":{"a":1,"b":{"c":["x",1,null,true]},"s":"é"}}`,        // array order counts
		`{"job":"urn:x","data":{"a":1,"b":{"c":[1,"x",null,false]},"s":"é"}}`,       // true/false
		`{"job":"urn:x","data":{"a":"1","b":{"c":[1,"x",null,true]},"s":"é"}}`,      // "1" is not 1
		`{"job":"urn:x","data":{"a":1,"b":{"c":[1,"x",null,true]},"s":"e"}}`,        // a letter
		`{"job":"urn:x","data":{"a":1,"b":{"c":[1,"x",null,true]},"t":"é"}}`,        // a name
		`{"job":"urn:x","data":{"a":1,"b":{"c":[1,"x",null,true]},"s":"é","z":{}}}`, // one more member
		`{"job":"urn:x","data":{"a":1,"b":{"c":[1,"x",null,true]},"s":"é","z":[]}}`,
	}
	seen := map[uint64]string{want: base}
	for _, p := range different {
		got := fp(t, p)
		if prev, dup := seen[got]; dup {
			t.Fatalf("same fingerprint for\n%s\nand\n%s", p, prev)
		}
		seen[got] = p
	}
	if _, err := envelope.Fingerprint([]byte(`[1]`)); err == nil {
		t.Fatal("Fingerprint of a non-object succeeded")
	}
}

func TestReadIdentityFingerprintAgreesWithReadIdentity(t *testing.T) {
	payload := []byte(`{"job":"j","data":{"x":1},"meta":{"id":"a","schema_version":1,"created_at":5}}`)
	plain, err := envelope.ReadIdentity(payload)
	if err != nil {
		t.Fatal(err)
	}
	withFP, err := envelope.ReadIdentityFingerprint(payload)
	if err != nil {
		t.Fatal(err)
	}
	if plain.Fingerprint != 0 || withFP.Fingerprint == 0 {
		t.Fatalf("fingerprints: plain %x, with %x", plain.Fingerprint, withFP.Fingerprint)
	}
	withFP.Fingerprint = 0
	if plain != withFP {
		t.Fatalf("identities differ: %+v vs %+v", plain, withFP)
	}
}

func TestReadTraceID(t *testing.T) {
	for payload, want := range map[string]string{
		`{"job":"j","trace_id":"t-1","data":{"trace_id":"no"}}`: "t-1",
		`{"trace_id":"a\u00e9"}`:                                "aé",
		`{"job":"j"}`:                                           "",
		`not json`:                                              "",
		`{"trace_id":5}`:                                        "",
	} {
		if got := envelope.ReadTraceID([]byte(payload)); got != want {
			t.Fatalf("ReadTraceID(%s) = %q, want %q", payload, got, want)
		}
	}
}

func TestDeriveID(t *testing.T) {
	parent := "f1e2d3c4-b5a6-4789-90ab-cdef01234567"
	a := envelope.DeriveID(parent, "invoice")
	if a != envelope.DeriveID(parent, "invoice") {
		t.Fatal("DeriveID is not stable")
	}
	if len(a) != 36 || a[14] != '5' {
		t.Fatalf("DeriveID = %q, want a version 5 UUID", a)
	}
	for _, other := range []string{
		envelope.DeriveID(parent, "email"),
		envelope.DeriveID(parent, "invoice-2"),
		envelope.DeriveID("a1b2c3d4-e5f6-4789-90ab-cdef01234567", "invoice"),
		envelope.DeriveID("order-1042", "invoice"), // a parent id that is not a UUID
	} {
		if other == a {
			t.Fatalf("two derivations collide: %s", a)
		}
	}
	first, again := envelope.DeriveID("order-1042", "x"), envelope.DeriveID("order-1042", "x")
	if first != again {
		t.Fatal("DeriveID of a non-UUID parent is not stable")
	}

	p, _ := envelope.New("urn:babel:orders:created", map[string]any{"n": 1})
	child, err := envelope.NewChild(p, "line-3", "urn:babel:invoices:requested", map[string]any{"line": 3}, envelope.WithQueue("invoices"))
	if err != nil {
		t.Fatal(err)
	}
	if child.Meta.ID != envelope.DeriveID(p.Meta.ID, "line-3") || child.TraceID != p.TraceID || child.Meta.Queue != "invoices" ||
		!strings.HasPrefix(child.Job, "urn:babel:invoices") {
		t.Fatalf("child %+v of parent %+v", child, p)
	}
}

// TestFingerprintNumbersByValue: every spelling of one number is one value,
// exactly, however many digits it has; different values differ, even where
// float64 cannot tell them apart.
func TestFingerprintNumbersByValue(t *testing.T) {
	groups := [][]string{
		{"1", "1.0", "1e0", "1E0", "1e+0", "10e-1", "0.1e1", "1.000", "100e-2"},
		{"100", "1e2", "100.0", "1.00e2", "10E1", "1000e-1"},
		{"0", "-0", "0.0", "-0.0", "0e5", "-0e-5", "0.000e100"},
		{"-1.5", "-15e-1", "-1.50", "-0.15e1"},
		{"1.1", "1.10", "11e-1", "0.11e1"},
		{"123456789012345678901234567890", "1.23456789012345678901234567890e29", "12345678901234567890123456789e1", "123456789012345678901234567890.000"},
		{"1e400", "10e399", "1.0e400", "0.1e401"},
		{"1e-400", "0.1e-399", "10e-401"},
		{"0.000001", "1e-6", "10e-7"},
		{"0.0000001", "1e-7"},
		{"1e21", "1000000000000000000000", "1e+21"},
		{"1e22", "10000000000000000000000"},
		{"1e30", "1000000000000000000000000000000"},
		{"1e99999999999999999999", "10e99999999999999999998", "0.1e100000000000000000000"},
		{"9007199254740993", "9007199254740993.0", "9.007199254740993e15"},
	}
	seen := map[uint64]string{}
	for _, group := range groups {
		want := fp(t, `{"job":"j","data":{"v":`+group[0]+`}}`)
		for _, spelling := range group[1:] {
			if got := fp(t, `{"job":"j","data":{"v":`+spelling+`}}`); got != want {
				t.Errorf("%s and %s fingerprint differently", spelling, group[0])
			}
		}
		if prev, dup := seen[want]; dup {
			t.Errorf("%s and %s are different values with one fingerprint", group[0], prev)
		}
		seen[want] = group[0]
	}
	// Values float64 rounds together stay apart.
	for _, pair := range [][2]string{
		{"9007199254740993", "9007199254740992"},
		{"1.0000000000000000000001", "1"},
		{"123456789012345678901234567891", "123456789012345678901234567890"},
		{"1e400", "1e401"},
		{"-1", "1"},
		{"1e-7", "1e7"},
	} {
		if fp(t, `{"job":"j","data":{"v":`+pair[0]+`}}`) == fp(t, `{"job":"j","data":{"v":`+pair[1]+`}}`) {
			t.Errorf("%s and %s fingerprint alike", pair[0], pair[1])
		}
	}
}

// TestFingerprintKeepsCanonicalSpellings: numbers already written the way
// the fingerprint normalises them hash as they always did, so fingerprints
// kept by stores before numbers were normalised still match.
func TestFingerprintKeepsCanonicalSpellings(t *testing.T) {
	// Fingerprints computed before numbers were normalised.
	for payload, want := range map[string]uint64{
		`{"job":"j","data":{"a":1,"b":-42,"c":1.5,"d":0.25,"e":123456789012345678901234567890,"f":0}}`: 0xb7e56f3c53afda6c,
	} {
		if got := fp(t, payload); got != want {
			t.Errorf("fingerprint of %s = %#x, want %#x", payload, got, want)
		}
	}
}

// TestDuplicateMembersLastWins: like encoding/json, and so like Parse, the
// last of two members with one name is the one that counts, at every level.
func TestDuplicateMembersLastWins(t *testing.T) {
	for dup, single := range map[string]string{
		`{"job":"a","job":null,"urn":"b","data":{}}`:               `{"urn":"b","data":{}}`,
		`{"job":"a","job":"b","data":{}}`:                          `{"job":"b","data":{}}`,
		`{"job":"j","data":{"x":1},"data":{"x":2}}`:                `{"job":"j","data":{"x":2}}`,
		`{"job":"j","data":{"x":1,"y":3,"x":2}}`:                   `{"job":"j","data":{"y":3,"x":2}}`,
		`{"job":"j","data":{"o":{"k":"a","k":null}}}`:              `{"job":"j","data":{"o":{"k":null}}}`,
		`{"job":"j","data":{"\u0078":1,"x":2}}`:                    `{"job":"j","data":{"x":2}}`,
		`{"job":"j","data":{"l":[{"a":1,"a":[1,{"b":2,"b":3}]}]}}`: `{"job":"j","data":{"l":[{"a":[1,{"b":3}]}]}}`,
	} {
		if fp(t, dup) != fp(t, single) {
			t.Errorf("%s does not fingerprint as %s", dup, single)
		}
	}
	// Many members (past the small-object path).
	var b, want strings.Builder
	b.WriteString(`{"job":"j","data":{`)
	want.WriteString(`{"job":"j","data":{`)
	for i := range 100 {
		fmt.Fprintf(&b, `"k%d":%d,`, i, i)
	}
	for i := range 100 {
		if i > 0 {
			b.WriteByte(',')
			want.WriteByte(',')
		}
		fmt.Fprintf(&b, `"k%d":%d`, i, i+1000)
		fmt.Fprintf(&want, `"k%d":%d`, i, i+1000)
	}
	b.WriteString(`}}`)
	want.WriteString(`}}`)
	if fp(t, b.String()) != fp(t, want.String()) {
		t.Error("duplicates in a large object do not fingerprint as their last values")
	}
}

// TestFingerprintSurvivesParseAndMarshal: what Parse reads and Marshal
// writes back has the fingerprint of the original, including invalid UTF-8
// (decoded as U+FFFD, as encoding/json does) and duplicate members.
func TestFingerprintSurvivesParseAndMarshal(t *testing.T) {
	for _, payload := range []string{
		`{"job":"a","job":null,"urn":"b","trace_id":"t","data":{},"meta":{"id":"m","schema_version":1}}`,
		"{\"job\":\"urn:\xff\",\"trace_id\":\"t\",\"data\":{\"\xfe\":\"\xff\"},\"meta\":{\"id\":\"m\",\"schema_version\":1}}",
		`{"job":"j","trace_id":"t","data":{"n":1.10,"m":-0,"o":{"x":1,"x":2}},"meta":{"id":"m","schema_version":1}}`,
	} {
		e, err := envelope.Parse([]byte(payload))
		if err != nil {
			t.Fatalf("%s: %v", payload, err)
		}
		out, err := e.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		if fp(t, payload) != fp(t, string(out)) {
			t.Errorf("Parse+Marshal changed the fingerprint:\n%s\n%s", payload, out)
		}
	}
}

// FuzzNumberFingerprint: two JSON numbers fingerprint alike exactly when
// they are one value (compared as exact rationals).
func FuzzNumberFingerprint(f *testing.F) {
	for _, pair := range [][2]string{
		{"1", "1.0"}, {"1e2", "100.0"}, {"-0", "0"}, {"1.10", "1.1"}, {"1e400", "10e399"},
		{"123456789012345678901234567890", "1.23456789012345678901234567890e29"},
		{"9007199254740993", "9007199254740992"}, {"0.0000001", "1e-7"}, {"1e21", "1e+21"},
	} {
		f.Add(pair[0], pair[1])
	}
	f.Fuzz(func(t *testing.T, a, b string) {
		ra, ok := exactNumber(a)
		if !ok {
			return
		}
		rb, ok := exactNumber(b)
		if !ok {
			return
		}
		fa := fp(t, `{"job":"j","data":{"v":`+a+`}}`)
		fb := fp(t, `{"job":"j","data":{"v":`+b+`}}`)
		if (ra.Cmp(rb) == 0) != (fa == fb) {
			t.Fatalf("%s and %s: equal values %v, equal fingerprints %v", a, b, ra.Cmp(rb) == 0, fa == fb)
		}
		// Any other spelling of a float64 value: Go's shortest forms.
		if v, err := strconv.ParseFloat(a, 64); err == nil && !math.IsInf(v, 0) && new(big.Rat).SetFloat64(v).Cmp(ra) == 0 {
			for _, format := range []byte{'e', 'E', 'f', 'g'} {
				s := strconv.FormatFloat(v, format, -1, 64)
				if fp(t, `{"job":"j","data":{"v":`+s+`}}`) != fa {
					t.Fatalf("%s and %s fingerprint differently", a, s)
				}
			}
		}
	})
}

// exactNumber reads a JSON number with a modest exponent as an exact rational.
func exactNumber(s string) (*big.Rat, bool) {
	if len(s) > 200 || !json.Valid([]byte(s)) || s == "" || !(s[0] == '-' || (s[0] >= '0' && s[0] <= '9')) {
		return nil, false
	}
	if i := strings.IndexAny(s, "eE"); i >= 0 {
		if e, err := strconv.Atoi(strings.TrimPrefix(s[i+1:], "+")); err != nil || e > 2000 || e < -2000 {
			return nil, false
		}
	}
	r, ok := new(big.Rat).SetString(s)
	return r, ok
}
