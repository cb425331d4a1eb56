package envelope_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/envelope"
)

const conformanceDir = "../testdata/conformance"

type manifest struct {
	Cases []struct {
		Name   string `json:"name"`
		File   string `json:"file"`
		Valid  bool   `json:"valid"`
		Reason string `json:"reason"`
		Expect struct {
			URN           string          `json:"urn"`
			Data          json.RawMessage `json:"data"`
			Attempts      int             `json:"attempts"`
			Lang          string          `json:"lang"`
			SchemaVersion int             `json:"schema_version"`
			DeadLetter    *struct {
				Reason        string `json:"reason"`
				OriginalQueue string `json:"original_queue"`
			} `json:"dead_letter"`
		} `json:"expect"`
	} `json:"cases"`
}

func readManifest(t *testing.T) manifest {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(conformanceDir, "manifest.json"))
	if err != nil {
		t.Fatalf("read vendored conformance manifest: %v", err)
	}
	var m manifest
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatalf("decode manifest: %v", err)
	}
	if len(m.Cases) == 0 {
		t.Fatal("manifest has no cases")
	}
	return m
}

// sameJSON reports whether a and b hold the same JSON value, comparing
// numbers by their text so that big integers and floats are exact.
func sameJSON(t *testing.T, a, b []byte) bool {
	t.Helper()
	decode := func(raw []byte) any {
		dec := json.NewDecoder(bytes.NewReader(raw))
		dec.UseNumber()
		var v any
		if err := dec.Decode(&v); err != nil {
			t.Fatalf("decode %s: %v", raw, err)
		}
		return v
	}
	return reflect.DeepEqual(decode(a), decode(b))
}

// TestConformanceCases runs every "cases" entry of the vendored cross-SDK
// suite through Parse.
func TestConformanceCases(t *testing.T) {
	for _, c := range readManifest(t).Cases {
		t.Run(c.Name, func(t *testing.T) {
			raw, err := os.ReadFile(filepath.Join(conformanceDir, c.File))
			if err != nil {
				t.Fatal(err)
			}
			e, err := envelope.Parse(raw)
			if !c.Valid {
				if !errors.Is(err, envelope.ErrInvalid) {
					t.Fatalf("Parse accepted an envelope the suite rejects (%s): err=%v", c.Reason, err)
				}
				if strings.Contains(c.Name, "schema-version") && !errors.Is(err, envelope.ErrUnsupportedSchemaVersion) {
					t.Fatalf("want ErrUnsupportedSchemaVersion, got %v", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			x := c.Expect
			if e.Job != x.URN || e.Attempts != x.Attempts || e.Meta.Lang != x.Lang || e.Meta.SchemaVersion != x.SchemaVersion {
				t.Fatalf("got job=%q attempts=%d lang=%q schema=%d, want %+v", e.Job, e.Attempts, e.Meta.Lang, e.Meta.SchemaVersion, x)
			}
			if !sameJSON(t, e.Data, x.Data) {
				t.Fatalf("data = %s, want %s", e.Data, x.Data)
			}
			if (x.DeadLetter == nil) != (e.DeadLetter == nil) {
				t.Fatalf("dead_letter = %+v, want %+v", e.DeadLetter, x.DeadLetter)
			}
			if x.DeadLetter != nil && (e.DeadLetter.Reason != x.DeadLetter.Reason || e.DeadLetter.OriginalQueue != x.DeadLetter.OriginalQueue) {
				t.Fatalf("dead_letter = %+v, want %+v", e.DeadLetter, x.DeadLetter)
			}
			// Re-encoding changes nothing but the alias: the fixture and its
			// re-encoding hold the same JSON (with urn renamed to job).
			out, err := e.Marshal()
			if err != nil {
				t.Fatal(err)
			}
			want := bytes.Replace(raw, []byte(`"urn":`), []byte(`"job":`), 1)
			if !sameJSON(t, out, want) {
				t.Fatalf("Marshal changed the envelope:\n got %s\nwant %s", out, want)
			}
		})
	}
}

func TestParseRejections(t *testing.T) {
	valid := func(mutate func(m map[string]any)) []byte {
		m := map[string]any{
			"job": "urn:babel:orders:created", "trace_id": "t-1", "data": map[string]any{"a": 1},
			"meta":     map[string]any{"id": "m-1", "queue": "orders", "lang": "php", "schema_version": 1, "created_at": 1},
			"attempts": 0,
		}
		mutate(m)
		b, _ := json.Marshal(m)
		return b
	}
	cases := []struct {
		name    string
		payload []byte
		want    string
		also    error
	}{
		{"not json", []byte("hello"), "not a JSON object", envelope.ErrNotObject},
		{"array", []byte(`[1,2]`), "not a JSON object", envelope.ErrNotObject},
		{"null", []byte(`null`), "not a JSON object", envelope.ErrNotObject},
		{"trailing garbage", append(valid(func(map[string]any) {}), 'x'), "not a JSON object", envelope.ErrNotObject},
		{"no job", valid(func(m map[string]any) { delete(m, "job") }), `no "job" or "urn"`, nil},
		{"empty job", valid(func(m map[string]any) { m["job"] = "" }), `no "job" or "urn"`, nil},
		{"job not a string", valid(func(m map[string]any) { m["job"] = 5 }), `"job" must be a string`, nil},
		{"blank trace", valid(func(m map[string]any) { m["trace_id"] = "  " }), `"trace_id" is missing or blank`, nil},
		{"data array", valid(func(m map[string]any) { m["data"] = []int{1} }), `"data" must be a JSON object`, nil},
		{"data missing", valid(func(m map[string]any) { delete(m, "data") }), `"data" must be a JSON object`, nil},
		{"meta missing", valid(func(m map[string]any) { delete(m, "meta") }), `"meta" must be a JSON object`, nil},
		{"schema missing", valid(func(m map[string]any) { delete(m["meta"].(map[string]any), "schema_version") }), "schema_version\" is missing", nil},
		{"schema 2", valid(func(m map[string]any) { m["meta"].(map[string]any)["schema_version"] = 2 }), "meta.schema_version is 2", envelope.ErrUnsupportedSchemaVersion},
		{"schema string", valid(func(m map[string]any) { m["meta"].(map[string]any)["schema_version"] = "1" }), `meta.schema_version is "1"`, envelope.ErrUnsupportedSchemaVersion},
		{"attempts string", valid(func(m map[string]any) { m["attempts"] = "3" }), `"attempts" must be an integer`, nil},
		{"created_at float", valid(func(m map[string]any) { m["meta"].(map[string]any)["created_at"] = 1.5 }), `"created_at" must be an integer`, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := envelope.Parse(c.payload)
			if !errors.Is(err, envelope.ErrInvalid) {
				t.Fatalf("err = %v, want ErrInvalid", err)
			}
			if c.also != nil && !errors.Is(err, c.also) {
				t.Fatalf("err = %v, want it to match %v too", err, c.also)
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %q, want it to say %q", err, c.want)
			}
		})
	}
}

func TestMarshalKeepsUnknownFieldsAndExactNumbers(t *testing.T) {
	in := []byte(`{
	  "trace_id": "t-1", "urn": "urn:x", "x-tenant": {"id": 7},
	  "data": {"big": 123456789012345678901234567890, "f": 0.1, "s": "<a&b>", "n": null, "u": "Café ☕"},
	  "meta": {"id": "m-1", "queue": "q", "lang": "php", "schema_version": 1, "created_at": 1749132727000, "region": "eu"},
	  "attempts": 4,
	  "dead_letter": {"reason": "failed", "error": null, "exception": "E", "failed_at": 5, "original_queue": "q", "attempts": 4, "lang": "php", "host": "w1"}
	}`)
	e, err := envelope.Parse(in)
	if err != nil {
		t.Fatal(err)
	}
	if e.Job != "urn:x" {
		t.Fatalf("urn alias not resolved: %q", e.Job)
	}
	if e.DeadLetter.Error != nil || *e.DeadLetter.Exception != "E" {
		t.Fatalf("dead_letter nullable strings: %+v", e.DeadLetter)
	}
	out, err := e.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	want := `{"job":"urn:x","trace_id":"t-1","data":{"big":123456789012345678901234567890,"f":0.1,"s":"<a&b>","n":null,"u":"Café ☕"},` +
		`"meta":{"id":"m-1","queue":"q","lang":"php","schema_version":1,"created_at":1749132727000,"region":"eu"},"attempts":4,` +
		`"dead_letter":{"reason":"failed","error":null,"exception":"E","failed_at":5,"original_queue":"q","attempts":4,"lang":"php","host":"w1"},` +
		`"x-tenant":{"id":7}}`
	if string(out) != want {
		t.Fatalf("Marshal:\n got %s\nwant %s", out, want)
	}
	if v, ok := e.Extra("x-tenant"); !ok || string(v) != `{"id": 7}` {
		t.Fatalf("Extra(x-tenant) = %s, %v", v, ok)
	}

	// A redrive-like change: strip dead_letter, reset attempts; everything
	// else stays.
	e.DeadLetter, e.Attempts = nil, 0
	out, _ = e.Marshal()
	if bytes.Contains(out, []byte("dead_letter")) || !bytes.Contains(out, []byte(`"x-tenant":{"id":7}`)) || !bytes.Contains(out, []byte(`"attempts":0`)) {
		t.Fatalf("redrive re-encoding: %s", out)
	}
}

func TestNew(t *testing.T) {
	before := time.Now().UnixMilli()
	e, err := envelope.New("urn:babel:orders:created", map[string]any{"order_id": 1042, "note": "<b>"}, envelope.WithQueue("orders"))
	if err != nil {
		t.Fatal(err)
	}
	if e.Meta.Lang != "go" || e.Meta.SchemaVersion != 1 || e.Meta.Queue != "orders" || e.Attempts != 0 {
		t.Fatalf("defaults: %+v", e)
	}
	if len(e.Meta.ID) != 36 || len(e.TraceID) != 36 || e.Meta.ID == e.TraceID {
		t.Fatalf("ids: id=%q trace=%q", e.Meta.ID, e.TraceID)
	}
	if e.Meta.CreatedAt < before || e.Meta.CreatedAt > time.Now().UnixMilli() {
		t.Fatalf("created_at %d not now (ms)", e.Meta.CreatedAt)
	}
	out, err := e.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(out, []byte(`"note":"<b>"`)) {
		t.Fatalf("HTML escaped or data lost: %s", out)
	}
	back, err := envelope.Parse(out)
	if err != nil {
		t.Fatalf("a produced envelope does not parse: %v", err)
	}
	if back.Meta.ID != e.Meta.ID || back.TraceID != e.TraceID || back.Job != e.Job || !sameJSON(t, back.Data, e.Data) {
		t.Fatalf("round trip: %+v vs %+v", back, e)
	}

	given, _ := envelope.New("urn:x", json.RawMessage(`{"a":1}`), envelope.WithID("id-1"), envelope.WithTraceID("tr-1"),
		envelope.WithCreatedAt(time.UnixMilli(42)))
	if given.Meta.ID != "id-1" || given.TraceID != "tr-1" || given.Meta.CreatedAt != 42 || string(given.Data) != `{"a":1}` {
		t.Fatalf("options: %+v", given)
	}
	for _, bad := range []any{[]int{1}, "str", json.RawMessage(`{`)} {
		if _, err := envelope.New("urn:x", bad); !errors.Is(err, envelope.ErrInvalid) {
			t.Fatalf("New(data=%v) err = %v, want ErrInvalid", bad, err)
		}
	}
	if _, err := envelope.New(" ", nil); !errors.Is(err, envelope.ErrInvalid) {
		t.Fatalf("empty urn: %v", err)
	}
}
