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
		{`{ "data" : {"attempts": 7, "n": 1.50}, "attempts" : 41 , "z":"</>"}`, `{"data":{"attempts": 7, "n": 1.50},"attempts":42,"z":"</>"}`, true},
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
