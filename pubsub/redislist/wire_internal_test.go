package redislist

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
)

func TestBumpAttempts(t *testing.T) {
	for _, c := range []struct {
		in, want string
		ok       bool
	}{
		{`{"job":"x","attempts":0}`, `{"job":"x","attempts":1}`, true},
		{`{ "data" : {"attempts": 7, "n": 1.50}, "attempts" : 41 , "z":"</>"}`, `{ "data" : {"attempts": 7, "n": 1.50}, "attempts" : 42 , "z":"</>"}`, true},
		{`{"att\u0065mpts":9,"\u00e9":"\u00e9"}`, `{"att\u0065mpts":10,"\u00e9":"\u00e9"}`, true},
		{`{"attempts":-1}`, `{"attempts":0}`, true},
		{`{"attempts":1,"attempts":2}`, `{"attempts":2,"attempts":3}`, true},
		{`{"job":"x"}`, `{"job":"x"}`, false},
		{`{"attempts":1.0}`, `{"attempts":1.0}`, false},
		{`{"attempts":"1"}`, `{"attempts":"1"}`, false},
		{`{"attempts":1} {}`, `{"attempts":1} {}`, false},
		{`[1]`, `[1]`, false},
		{`x`, `x`, false},
	} {
		got, ok := bumpAttempts([]byte(c.in))
		if string(got) != c.want || ok != c.ok {
			t.Errorf("bumpAttempts(%s) = %s, %v; want %s, %v", c.in, got, ok, c.want, c.ok)
		}
	}
}

func TestFrameDetection(t *testing.T) {
	for _, c := range []struct {
		value string
		frame bool
	}{
		{`{"__bq_frame":1,"headers":{},"body":"b"}`, true},
		{`{"__bq_frame":true,"body":""}`, true},
		{`{"__bq_frame":"yes","body":"b"}`, true},
		{`{"__bq_frame":[0],"body":"b"}`, true},
		{`{"__bq_frame":0,"body":"b"}`, false},
		{`{"__bq_frame":"","body":"b"}`, false},
		{`{"__bq_frame":{},"body":"b"}`, false},
		{`{"__bq_frame":null,"body":"b"}`, false},
		{`{"__bq_frame":1,"body":1}`, false},
		{`{"__bq_frame":1}`, false},
		{`{"__bq_frame":1,"body_b64":"AP8="}`, true},
		{`{"__bq_frame":1,"body_b64":"not base64!"}`, false},
		{`{"__bq_frame":1,"body_b64":1}`, false},
		{`{"__bq_frame":1,"body":1,"body_b64":"AP8="}`, false},
		{`{"__bq_frame":1,"body":"b"`, false},
		{`"__bq_frame"`, false},
	} {
		if _, got := decodeFrame([]byte(c.value)); got != c.frame {
			t.Errorf("decodeFrame(%s) = %v, want %v", c.value, got, c.frame)
		}
	}
}

func TestFrameRoundTrip(t *testing.T) {
	msg := message.NewMessage("u-1", []byte(`not an envelope "<&>"`))
	msg.Metadata.Set("traceparent", "00-abc-01")
	msg.Metadata.Set("bq-job", "urn:x") // a projection of the body: not a header
	msg.Metadata.Set(" ", "blank key")
	value, err := encodeValue(msg.Payload, frameHeaders(msg))
	if err != nil {
		t.Fatal(err)
	}
	want := `{"__bq_frame":1,"headers":{"bq-watermill-uuid":"u-1","traceparent":"00-abc-01"},"body":"not an envelope \"<&>\""}`
	if string(value) != want {
		t.Fatalf("frame\n got %s\nwant %s", value, want)
	}
	got := toMessage(value)
	if got.UUID != "u-1" || string(got.Payload) != string(msg.Payload) || len(got.Metadata) != 1 || got.Metadata.Get("traceparent") != "00-abc-01" {
		t.Fatalf("decoded %s %q %v", got.UUID, got.Payload, got.Metadata)
	}
	bumped, ok := bumpValue([]byte(`{"__bq_frame":1,"headers":{"traceparent":"t"},"body":"{\"attempts\":2}"}`))
	if !ok || string(bumped) != `{"__bq_frame":1,"headers":{"traceparent":"t"},"body":"{\"attempts\":3}"}` {
		t.Fatalf("bumped frame %s %v", bumped, ok)
	}
}

// TestBumpValueChangesOnlyTheDigits: a nack changes the digits of the
// body's "attempts" and no other byte of the stored value, whatever the
// spelling of the frame another runtime wrote.
func TestBumpValueChangesOnlyTheDigits(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{`{"__bq_frame":1,"headers":{"traceparent":"t"},"body":"{\"attempts\":2}"}`, `{"__bq_frame":1,"headers":{"traceparent":"t"},"body":"{\"attempts\":3}"}`},
		{`{"body": "{\"note\": \"caf\u00e9 \ud83d\ude9a \/\", \"attempts\": 9}", "headers": {"n": 3, "z": "y"}, "__bq_frame": 1, "x": [1]}`,
			`{"body": "{\"note\": \"caf\u00e9 \ud83d\ude9a \/\", \"attempts\": 10}", "headers": {"n": 3, "z": "y"}, "__bq_frame": 1, "x": [1]}`},
		{`{"__bq_frame":1,"body":"{\"attempts\":\u0031}"}`, `{"__bq_frame":1,"body":"{\"attempts\":2}"}`},
		{`{"__bq_frame":1,"body":"{\"attempts\":1}","body":"{\"attempts\":5}"}`, `{"__bq_frame":1,"body":"{\"attempts\":1}","body":"{\"attempts\":6}"}`},
		{`{"__bq_frame":1,"body_b64":"eyJhdHRlbXB0cyI6MX0="}`, `{"__bq_frame":1,"body_b64":"eyJhdHRlbXB0cyI6Mn0="}`}, // {"attempts":1} -> 2
		{`{"__bq_frame":1,"body":"no envelope"}`, `{"__bq_frame":1,"body":"no envelope"}`},
	} {
		got, _ := bumpValue([]byte(c.in))
		if string(got) != c.want {
			t.Errorf("bumpValue(%s)\n got %s\nwant %s", c.in, got, c.want)
		}
	}
}

// TestBinaryFrameRoundTrip: a body that is not UTF-8 travels base64-encoded
// under body_b64 and is read back byte for byte.
func TestBinaryFrameRoundTrip(t *testing.T) {
	payload := []byte{0xff, 0x00, '"', 0xc3}
	msg := message.NewMessage("u-2", payload)
	msg.Metadata.Set("k", "v")
	value, err := listValue(msg)
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"__bq_frame":1,"headers":{"bq-watermill-uuid":"u-2","k":"v"},"body_b64":"/wAiww=="}`; string(value) != want {
		t.Fatalf("frame\n got %s\nwant %s", value, want)
	}
	got := toMessage(value)
	if got.UUID != "u-2" || string(got.Payload) != string(payload) || len(got.Metadata) != 1 {
		t.Fatalf("decoded %s % x %v", got.UUID, got.Payload, got.Metadata)
	}
}
