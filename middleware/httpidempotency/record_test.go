package httpidempotency_test

import (
	"errors"
	"net/http"
	"reflect"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/middleware/httpidempotency"
)

// TestResponseEncodingRoundTrip: what EncodeResponse writes, DecodeResponse
// reads back; another version byte or a cut value is refused.
func TestResponseEncodingRoundTrip(t *testing.T) {
	for _, resp := range []*httpidempotency.Response{
		{Status: 201, Header: http.Header{"Content-Type": {"application/json"}, "Location": {"/orders/1"}, "Link": {"a", "b"}},
			Body: []byte(`{"order_id":"1"}`), SavedAt: time.UnixMilli(1700000000123), Subject: "alice"},
		{Status: 204},
		{Status: 500, BodyNotKept: true, SavedAt: time.UnixMilli(1)},
	} {
		value := httpidempotency.EncodeResponse(resp)
		got, err := httpidempotency.DecodeResponse(value)
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, resp) {
			t.Fatalf("round trip: %+v, want %+v", got, resp)
		}
		for cut := 1; cut < len(value)-len(resp.Body); cut++ {
			if _, err := httpidempotency.DecodeResponse(value[:cut]); !errors.Is(err, httpidempotency.ErrUnknownEncoding) {
				t.Fatalf("cut at %d of %d: %v", cut, len(value), err)
			}
		}
		other := append([]byte{2}, value[1:]...)
		if _, err := httpidempotency.DecodeResponse(other); !errors.Is(err, httpidempotency.ErrUnknownEncoding) {
			t.Fatalf("version 2: %v", err)
		}
	}
}

// FuzzDecodeResponse: any value is decoded or refused, never a panic, and
// what decodes encodes back to a value that decodes alike.
func FuzzDecodeResponse(f *testing.F) {
	f.Add(httpidempotency.EncodeResponse(&httpidempotency.Response{Status: 201, Header: http.Header{"A": {"b"}}, Body: []byte("x")}))
	f.Add([]byte{1, 0, 0, 0xc9, 0x01, 0, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Fuzz(func(t *testing.T, value []byte) {
		resp, err := httpidempotency.DecodeResponse(value)
		if err != nil {
			return
		}
		again, err := httpidempotency.DecodeResponse(httpidempotency.EncodeResponse(resp))
		if err != nil || again.Status != resp.Status || string(again.Body) != string(resp.Body) {
			t.Fatalf("re-encoded: %+v %v, want %+v", again, err, resp)
		}
	})
}

// TestParseKey: the IETF draft's quoted form and the bare form are one key.
func TestParseKey(t *testing.T) {
	for raw, want := range map[string]string{
		`"8e03978e-40d5-43e8-bc93-6894a57f9324"`: "8e03978e-40d5-43e8-bc93-6894a57f9324",
		`8e03978e-40d5-43e8-bc93-6894a57f9324`:   "8e03978e-40d5-43e8-bc93-6894a57f9324",
		`  spaced  `:                             "spaced",
		`"a \"quoted\" \\ key"`:                  `a "quoted" \ key`,
	} {
		got, err := httpidempotency.ParseKey(http.Header{"Idempotency-Key": {raw}})
		if err != nil || got != want {
			t.Errorf("%s: %q, %v; want %q", raw, got, err, want)
		}
	}
	for _, raw := range []string{`""`, `"a`, `"a"b`, `"\x"`, "\"\x01\"", "a\x00b", ""} {
		if _, err := httpidempotency.ParseKey(http.Header{"Idempotency-Key": {raw}}); !errors.Is(err, httpidempotency.ErrKeyInvalid) {
			t.Errorf("%q: %v, want ErrKeyInvalid", raw, err)
		}
	}
	if _, err := httpidempotency.ParseKey(http.Header{}); !errors.Is(err, httpidempotency.ErrKeyMissing) {
		t.Errorf("no header: %v", err)
	}
}
