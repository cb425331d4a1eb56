package envelope_test

import (
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
		`{"job":"urn:x","data":{"a":1.0,"b":{"c":[1,"x",null,true]},"s":"é"}}`,      // a number written otherwise
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
