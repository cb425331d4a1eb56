package redislist

import (
	"bytes"
	"encoding/json"
	"math"
	"sort"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
)

// HeaderUUID is the frame header that carries the Watermill UUID of a
// message whose payload has no meta.id, so that it survives the trip.
const HeaderUUID = "bq-watermill-uuid"

// FrameKey is the member that marks a list value as a frame.
const FrameKey = "__bq_frame"

// frameHeaders returns the headers a message carries out of band: its
// metadata without blank keys or values and without the projections of the
// body, plus HeaderUUID when the payload has no meta.id.
func frameHeaders(msg *message.Message) map[string]string {
	var h map[string]string
	for k, v := range msg.Metadata {
		if strings.TrimSpace(k) == "" || strings.TrimSpace(v) == "" {
			continue
		}
		switch k {
		case envelope.MetadataMessageID, envelope.MetadataTraceID, envelope.MetadataJob:
			continue
		}
		if h == nil {
			h = make(map[string]string, len(msg.Metadata))
		}
		h[k] = v
	}
	if strings.TrimSpace(msg.UUID) != "" && metaID(msg.Payload) == "" {
		if h == nil {
			h = make(map[string]string, 1)
		}
		h[HeaderUUID] = msg.UUID
	}
	return h
}

// encodeValue returns the list value for payload: the payload itself, or a
// frame when there are headers.
func encodeValue(payload []byte, headers map[string]string) ([]byte, error) {
	if len(headers) == 0 {
		return payload, nil
	}
	return encodeFrame(payload, headers)
}

// encodeFrame returns the frame carrying payload and headers.
func encodeFrame(payload []byte, headers map[string]string) ([]byte, error) {
	if !utf8.Valid(payload) {
		return nil, ErrNotUTF8
	}
	var b bytes.Buffer
	b.Grow(len(payload) + 64 + 32*len(headers))
	b.WriteString(`{"` + FrameKey + `":1,"headers":{`)
	names := make([]string, 0, len(headers))
	for k := range headers {
		names = append(names, k)
	}
	sort.Strings(names)
	for i, k := range names {
		if i > 0 {
			b.WriteByte(',')
		}
		if err := writeJSONString(&b, k); err != nil {
			return nil, err
		}
		b.WriteByte(':')
		if err := writeJSONString(&b, headers[k]); err != nil {
			return nil, err
		}
	}
	b.WriteString(`},"body":`)
	if err := writeJSONString(&b, string(payload)); err != nil {
		return nil, err
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

func writeJSONString(b *bytes.Buffer, s string) error {
	enc := json.NewEncoder(b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(s); err != nil {
		return err
	}
	b.Truncate(b.Len() - 1) // the encoder's newline
	return nil
}

// frame is a decoded frame.
type frame struct {
	headers map[string]string
	body    []byte
}

// decodeFrame reports whether value is a frame: a JSON object with a truthy
// "__bq_frame" and a string "body". Headers that are not strings, or are
// blank, are dropped.
func decodeFrame(value []byte) (frame, bool) {
	v := bytes.TrimLeft(value, " \t\r\n")
	if len(v) == 0 || v[0] != '{' || !bytes.Contains(v, []byte(`"`+FrameKey+`"`)) {
		return frame{}, false
	}
	var members map[string]json.RawMessage
	if json.Unmarshal(value, &members) != nil {
		return frame{}, false
	}
	if !truthy(members[FrameKey]) {
		return frame{}, false
	}
	var body string
	if raw, ok := members["body"]; !ok || json.Unmarshal(raw, &body) != nil || !isJSONString(raw) {
		return frame{}, false
	}
	f := frame{body: []byte(body)}
	var headers map[string]json.RawMessage
	if json.Unmarshal(members["headers"], &headers) == nil {
		for k, raw := range headers {
			var s string
			if !isJSONString(raw) || json.Unmarshal(raw, &s) != nil {
				continue
			}
			if strings.TrimSpace(k) == "" || strings.TrimSpace(s) == "" {
				continue
			}
			if f.headers == nil {
				f.headers = make(map[string]string, len(headers))
			}
			f.headers[k] = s
		}
	}
	return f, true
}

func isJSONString(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) > 0 && raw[0] == '"'
}

// truthy follows the SDKs' reading of "__bq_frame": true, a non-zero
// number, a non-empty string, array or object.
func truthy(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return false
	}
	switch raw[0] {
	case 't':
		return string(raw) == "true"
	case 'f', 'n':
		return false
	case '"':
		return len(raw) > 2
	case '[', '{':
		var v any
		if json.Unmarshal(raw, &v) != nil {
			return false
		}
		switch x := v.(type) {
		case []any:
			return len(x) > 0
		case map[string]any:
			return len(x) > 0
		}
		return false
	default:
		f, err := strconv.ParseFloat(string(raw), 64)
		return err == nil && f != 0
	}
}

// metaID returns the envelope's meta.id when it is a non-blank string.
func metaID(payload []byte) string {
	id, err := envelope.ReadIdentity(payload)
	if err != nil || !id.HasID || strings.TrimSpace(id.ID) == "" {
		return ""
	}
	return id.ID
}

// toMessage builds the Watermill message for a stored value of the
// reliable-list layout.
func toMessage(value []byte) *message.Message {
	payload := value
	var headers map[string]string
	if f, ok := decodeFrame(value); ok {
		payload, headers = f.body, f.headers
	}
	uuid := metaID(payload)
	if uuid == "" {
		uuid = headers[HeaderUUID]
	}
	if uuid == "" {
		uuid = watermill.NewUUID()
	}
	delete(headers, HeaderUUID)
	msg := message.NewMessage(uuid, payload)
	for k, v := range headers {
		msg.Metadata.Set(k, v)
	}
	return msg
}

// laravelUUID is meta.id, else the Laravel job's "uuid", else a fresh UUID.
func laravelUUID(payload []byte) string {
	if id := metaID(payload); id != "" {
		return id
	}
	var job struct {
		UUID json.RawMessage `json:"uuid"`
	}
	var s string
	if json.Unmarshal(payload, &job) == nil && isJSONString(job.UUID) && json.Unmarshal(job.UUID, &s) == nil && strings.TrimSpace(s) != "" {
		return s
	}
	return watermill.NewUUID()
}

// bumpValue returns the stored value with the payload's "attempts" one
// higher, keeping a frame's headers. ok is false when the payload has no
// integer "attempts" to raise; value is then returned unchanged.
func bumpValue(value []byte) (out []byte, ok bool) {
	f, framed := decodeFrame(value)
	if !framed {
		return bumpAttempts(value)
	}
	body, ok := bumpAttempts(f.body)
	if !ok {
		return value, false
	}
	out, err := encodeFrame(body, f.headers)
	if err != nil {
		return value, false
	}
	return out, true
}

// bumpAttempts returns payload with its top-level "attempts" integer one
// higher. Members keep their order and their values' bytes; only the
// white space between members and the spelling of member names (escapes)
// may change. ok is false, and payload is returned, when payload is not a
// JSON object with an integer "attempts".
func bumpAttempts(payload []byte) ([]byte, bool) {
	dec := json.NewDecoder(bytes.NewReader(payload))
	dec.UseNumber()
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return payload, false
	}
	var b bytes.Buffer
	b.Grow(len(payload) + 2)
	b.WriteByte('{')
	found := false
	for i := 0; dec.More(); i++ {
		tok, err := dec.Token()
		if err != nil {
			return payload, false
		}
		name, _ := tok.(string)
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return payload, false
		}
		if name == "attempts" {
			n, err := strconv.ParseInt(string(bytes.TrimSpace(raw)), 10, 64)
			if err != nil {
				return payload, false
			}
			if n < math.MaxInt64 { // saturates: a wrapped count would be negative
				n++
			}
			raw = strconv.AppendInt(nil, n, 10)
			found = true
		}
		if i > 0 {
			b.WriteByte(',')
		}
		if writeJSONString(&b, name) != nil {
			return payload, false
		}
		b.WriteByte(':')
		b.Write(raw)
	}
	if tok, err := dec.Token(); err != nil || tok != json.Delim('}') {
		return payload, false
	}
	if _, err := dec.Token(); err == nil {
		return payload, false // trailing data
	}
	if !found {
		return payload, false
	}
	b.WriteByte('}')
	return b.Bytes(), true
}

// isLaravelJob reports whether a Laravel worker can pop payload without
// losing it: a JSON object with an integer "attempts".
func isLaravelJob(payload []byte) bool {
	_, ok := bumpAttempts(payload)
	return ok
}
