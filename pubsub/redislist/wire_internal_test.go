package redislist

import (
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
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

// TestReservationMarkComesOffByteForByte: the reservation token a release
// puts in a job comes off again with every other byte as it was, wherever
// Lua's encoder put it; values that are not JSON objects are left alone.
func TestReservationMarkComesOffByteForByte(t *testing.T) {
	for _, job := range []string{
		`{"job":"x","attempts":1}`,
		"{\n  \"job\": \"x\",\n  \"attempts\": 1\n}",
		` { "attempts" : 1 } `,
		`{"attempts":1,"__bq_reservation":"old"}`,
		`{}`,
	} {
		marked := withMember([]byte(job), LaravelReservationKey, []byte(`"0123456789abcdef"`))
		if ms, _ := members(marked); len(ms) == 0 || ms[0].name != LaravelReservationKey || string(marked[ms[0].start:ms[0].end]) != `"0123456789abcdef"` {
			t.Errorf("withMember(%s) = %s, want the token first", job, marked)
		}
		want, _ := withoutMember([]byte(job), LaravelReservationKey)
		if got := laravelJob(marked); string(got) != string(want) {
			t.Errorf("laravelJob(%s) = %q, want %q", marked, got, want)
		}
	}
	for _, c := range []struct{ in, want string }{
		{`{"__bq_reservation":"t","attempts":2}`, `{"attempts":2}`},
		{`{"job":"x","__bq_reservation":"t","attempts":2}`, `{"job":"x","attempts":2}`},
		{`{"job":"x","attempts":2,"__bq_reservation":"t"}`, `{"job":"x","attempts":2}`},
		{`{"job":"x" , "__bq_reservation" : "t" }`, `{"job":"x" }`},
		{`{"__bq_reservation":"t"}`, `{}`},
		{`{"__bq_reservation":"t","__bq_reservation":"u","attempts":2}`, `{"attempts":2}`},
		{`{"data":{"__bq_reservation":"t"},"attempts":2}`, `{"data":{"__bq_reservation":"t"},"attempts":2}`},
		{`["__bq_reservation"]`, `["__bq_reservation"]`},
		{`"__bq_reservation" x`, `"__bq_reservation" x`},
	} {
		if got := laravelJob([]byte(c.in)); string(got) != c.want {
			t.Errorf("laravelJob(%s) = %s, want %s", c.in, got, c.want)
		}
	}
}

// TestLaravelWrapperRoundTrip: every payload Publish writes in the Laravel
// layout is a Laravel job, and the subscriber reads it back as it was,
// with its UUID (and, when wrapped, its metadata). Only a payload that is
// a Laravel job and reads as one is written as it is.
func TestLaravelWrapperRoundTrip(t *testing.T) {
	for _, c := range []struct {
		payload string
		bare    bool
	}{
		{`{"job":"x","attempts":0}`, true},
		{`{"uuid":"u-9","job":"x","data":{"__bq_frame":1},"attempts":3}`, true},
		{"\x00\xff\xfe binary", false},
		{"not JSON", false},
		{`{"no":"attempts"}`, false},
		{`{"attempts":1.5}`, false},
		{``, false},
		{`{"__bq_frame":1,"body":"x","attempts":0}`, false},
		{`{"attempts":0,"__bq_reservation":"t"}`, false},
		{`{"uuid":"u","displayName":"BabelQueue wrapped body","attempts":0,"__bq_frame":1,"headers":{},"body":"y"}`, false},
	} {
		msg := message.NewMessage("u-1", []byte(c.payload))
		if !c.bare {
			msg.Metadata.Set("bq-dead-letter-reason", "failed")
		}
		value, err := laravelValue(msg)
		if err != nil {
			t.Fatalf("laravelValue(%q): %v", c.payload, err)
		}
		if got := string(value) == c.payload; got != c.bare {
			t.Errorf("laravelValue(%q) = %s: written as it is %v, want %v", c.payload, value, got, c.bare)
		}
		if !isLaravelJob(value) {
			t.Errorf("laravelValue(%q) = %s, not a Laravel job", c.payload, value)
		}
		read := laravelMessage(laravelJob(value))
		if string(read.Payload) != c.payload || (!c.bare && (read.UUID != "u-1" || read.Metadata.Get("bq-dead-letter-reason") != "failed")) {
			t.Errorf("%q read back as %s %q %v", c.payload, read.UUID, read.Payload, read.Metadata)
		}
	}
}

// TestLaravelJobsCarryARedriveMark: a Laravel job has no headers, so the
// mark of a redrive (envelope.MetadataRedrive) travels in the job, where a
// Laravel worker ignores it, and is delivered as metadata again, the
// payload as it was published.
func TestLaravelJobsCarryARedriveMark(t *testing.T) {
	t.Parallel()
	payload := `{"job":"urn:babel:orders:created","trace_id":"t","data":{"i":1},"meta":{"id":"m-1","schema_version":1},"attempts":0}`
	msg := message.NewMessage("m-1", []byte(payload))
	msg.Metadata.Set(envelope.MetadataRedrive, "mark-7")
	value, err := laravelValue(msg)
	if err != nil {
		t.Fatal(err)
	}
	if !isLaravelJob(value) || !strings.Contains(string(value), `"`+LaravelRedriveKey+`":"mark-7"`) {
		t.Fatalf("laravelValue = %s, want the job with the mark in %s", value, LaravelRedriveKey)
	}
	read := laravelMessage(laravelJob(value))
	if string(read.Payload) != payload || read.Metadata.Get(envelope.MetadataRedrive) != "mark-7" {
		t.Fatalf("read back as %q %v, want the payload as published and the mark in the metadata", read.Payload, read.Metadata)
	}
}
