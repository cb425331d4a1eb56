package redislist

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"io"
	"math"
	"slices"
	"sort"
	"strconv"
	"strings"
	"unicode/utf16"
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

// FrameBodyBase64Key is the frame member that carries, base64-encoded
// (standard alphabet, padded), a body that is not UTF-8 in place of "body",
// whose JSON string cannot hold it unchanged. A frame has one or the other.
const FrameBodyBase64Key = "body_b64"

// LaravelReservationKey is the member the Subscriber sets, to a token of
// its own, in each job it adds to a Laravel queue's reserved or delayed set
// (the reservation, or the release of a nack), so that two byte-identical
// jobs in flight are two members of the set and never one. A job taken back
// to the ready list (a reservation that lapsed, a release that came due)
// carries it there, which Laravel workers ignore; the Subscriber delivers
// and Browse shows a job without it, every other byte as it was.
const LaravelReservationKey = "__bq_reservation"

// MetadataStoredValue is the metadata entry of a delivered message that
// holds the list value it was read from, when publishing the message as it
// is would not write that very value: a frame written by another runtime
// (its own spelling, member order, headers that are not strings, which are
// not metadata) or a bare value without meta.id (whose UUID was made up).
// Publish writes that value back, byte for byte, for a message whose UUID,
// payload and other metadata are what was read (a redrive put-back), and
// never writes the entry as a header. The entry is a transport header
// (envelope.TransportHeader): children and dead letters do not inherit it.
const MetadataStoredValue = "bq-redislist-stored-value"

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
		case envelope.MetadataMessageID, envelope.MetadataTraceID, envelope.MetadataJob, MetadataStoredValue:
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

// encodeFrame returns the frame carrying payload and headers: the payload
// as the JSON string "body" when it is UTF-8, else base64-encoded under
// FrameBodyBase64Key.
func encodeFrame(payload []byte, headers map[string]string) ([]byte, error) {
	var b bytes.Buffer
	b.Grow(len(payload)*4/3 + 64 + 32*len(headers))
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
	if !utf8.Valid(payload) {
		b.WriteString(`},"` + FrameBodyBase64Key + `":"`)
		b.WriteString(base64.StdEncoding.EncodeToString(payload))
		b.WriteString(`"}`)
		return b.Bytes(), nil
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
// "__bq_frame" and a string "body" or, without "body", a FrameBodyBase64Key
// string of valid base64. Headers that are not strings, or are blank, are
// dropped.
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
	var f frame
	var body string
	if raw, ok := members["body"]; ok {
		if !isJSONString(raw) || json.Unmarshal(raw, &body) != nil {
			return frame{}, false
		}
		f.body = []byte(body)
	} else {
		raw := members[FrameBodyBase64Key]
		if !isJSONString(raw) || json.Unmarshal(raw, &body) != nil {
			return frame{}, false
		}
		decoded, err := base64.StdEncoding.DecodeString(body)
		if err != nil {
			return frame{}, false
		}
		f.body = decoded
	}
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
// reliable-list layout. When publishing that message as it is would write
// another value, the value rides along as MetadataStoredValue.
func toMessage(value []byte) *message.Message {
	payload := value
	var headers map[string]string
	f, framed := decodeFrame(value)
	if framed {
		payload, headers = f.body, f.headers
	}
	uuid := metaID(payload)
	canonical := !framed && uuid != "" // a bare value with meta.id is written back as it is
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
	if !canonical {
		if again, err := encodeValue(payload, frameHeaders(msg)); err != nil || !bytes.Equal(again, value) {
			msg.Metadata.Set(MetadataStoredValue, string(value))
		}
	}
	return msg
}

// listValue returns the value Publish writes for msg: the value it was read
// from (MetadataStoredValue) when msg is unchanged since, else its payload,
// bare or framed with its headers.
func listValue(msg *message.Message) ([]byte, error) {
	value, err := encodeValue(msg.Payload, frameHeaders(msg))
	stored, ok := msg.Metadata[MetadataStoredValue]
	if err != nil || !ok || stored == "" {
		return value, err
	}
	read := toMessage([]byte(stored))
	read.UUID = msg.UUID // made up when the value carries none
	if again, err := encodeValue(read.Payload, frameHeaders(read)); err == nil && bytes.Equal(again, value) {
		return []byte(stored), nil
	}
	return value, nil
}

// laravelJob returns a popped job as the Subscriber delivers it: without
// the LaravelReservationKey member a reservation or release of this package
// left in it.
func laravelJob(job []byte) []byte {
	if !bytes.Contains(job, []byte(`"`+LaravelReservationKey+`"`)) {
		return job
	}
	out, _ := withoutMember(job, LaravelReservationKey)
	return out
}

// LaravelRedriveKey is the member a Laravel job carries the mark of a
// redrive in (envelope.MetadataRedrive): Laravel jobs have no headers, so
// Publish writes a message's mark into the job, where Laravel workers
// ignore it, and the Subscriber delivers it as metadata again, the job
// without the member.
const LaravelRedriveKey = "__bq_redrive"

// LaravelWrapperName is the "displayName" of the Laravel job that wraps a
// body that is not one (see the package doc), as Laravel's tools show it.
const LaravelWrapperName = "BabelQueue wrapped body"

// laravelValue returns what Publish writes for msg in the Laravel layout:
// its payload when a Laravel worker can pop it and the Subscriber delivers
// it as it is, else the wrapper of the payload (laravelWrapper).
func laravelValue(msg *message.Message) ([]byte, error) {
	p := msg.Payload
	if isLaravelJob(p) && !isLaravelWrapper(p) && bytes.Equal(laravelJob(p), p) {
		if mark := msg.Metadata.Get(envelope.MetadataRedrive); mark != "" {
			quoted, err := json.Marshal(mark)
			if err != nil {
				return nil, err
			}
			return withMember(p, LaravelRedriveKey, quoted), nil
		}
		return p, nil
	}
	return laravelWrapper(msg)
}

// laravelWrapper returns the Laravel job that carries msg's payload: a
// frame (the payload under "body", or base64-encoded under
// FrameBodyBase64Key when it is not UTF-8, and msg's metadata as its
// headers) with Laravel's "uuid" (msg's UUID), "displayName"
// (LaravelWrapperName) and "attempts" 0 first.
func laravelWrapper(msg *message.Message) ([]byte, error) {
	headers := frameHeaders(msg)
	delete(headers, HeaderUUID) // the UUID is the job's "uuid"
	frame, err := encodeFrame(msg.Payload, headers)
	if err != nil {
		return nil, err
	}
	var b bytes.Buffer
	b.Grow(len(frame) + 96)
	b.WriteString(`{"uuid":`)
	if err := writeJSONString(&b, msg.UUID); err != nil {
		return nil, err
	}
	b.WriteString(`,"displayName":"` + LaravelWrapperName + `","attempts":0,`)
	b.Write(frame[1:]) // the frame's members
	return b.Bytes(), nil
}

// isLaravelWrapper reports whether job is a Laravel job that wraps a body:
// a JSON object with an integer "attempts" that is also a frame.
func isLaravelWrapper(job []byte) bool {
	_, ok := unwrapLaravel(job)
	return ok
}

// unwrapLaravel returns the frame a wrapping Laravel job carries.
func unwrapLaravel(job []byte) (frame, bool) {
	if !bytes.Contains(job, []byte(`"`+FrameKey+`"`)) || !isLaravelJob(job) {
		return frame{}, false
	}
	return decodeFrame(job)
}

// laravelMessage is the message a job of the Laravel layout (without its
// reservation token) is delivered as: the body and headers of a wrapper,
// else the job itself.
func laravelMessage(job []byte) *message.Message {
	f, wrapped := unwrapLaravel(job)
	if !wrapped {
		var mark string
		if bytes.Contains(job, []byte(`"`+LaravelRedriveKey+`"`)) {
			if at, ok := lastMember(job, LaravelRedriveKey); ok {
				_ = json.Unmarshal(job[at.start:at.end], &mark)
			}
			job, _ = withoutMember(job, LaravelRedriveKey)
		}
		msg := message.NewMessage(laravelUUID(job), job)
		if mark != "" {
			msg.Metadata.Set(envelope.MetadataRedrive, mark)
		}
		return msg
	}
	uuid := metaID(f.body)
	if uuid == "" {
		uuid = laravelUUID(job)
	}
	msg := message.NewMessage(uuid, f.body)
	for k, v := range f.headers {
		if k != HeaderUUID {
			msg.Metadata.Set(k, v)
		}
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
// higher and not one other byte changed: in a frame, only the digits of
// "attempts" inside the body's JSON string change (its escapes, the other
// members and the headers stay as they were written). ok is false when the
// payload has no integer "attempts" to raise; value is then returned
// unchanged.
func bumpValue(value []byte) (out []byte, ok bool) {
	if _, framed := decodeFrame(value); !framed {
		return bumpAttempts(value)
	}
	body, ok := lastMember(value, "body")
	if !ok || !isJSONString(value[body.start:body.end]) {
		return bumpBase64Body(value)
	}
	raw := value[body.start:body.end]
	var decoded string
	if json.Unmarshal(raw, &decoded) != nil {
		return value, false
	}
	spans, ok := attemptsSpans([]byte(decoded))
	if !ok {
		return value, false
	}
	inner, ok := rawSpans(raw, spans)
	if !ok {
		// An escape this reader does not map: write the body string anew.
		bumped, _ := bumpAttempts([]byte(decoded))
		var b bytes.Buffer
		if writeJSONString(&b, string(bumped)) != nil {
			return value, false
		}
		return splice(value, []span{{start: body.start, end: body.end, text: b.Bytes()}}), true
	}
	for i := range inner {
		inner[i].start += body.start
		inner[i].end += body.start
	}
	return splice(value, inner), true
}

// bumpBase64Body is bumpValue for a frame whose body is base64-encoded.
func bumpBase64Body(value []byte) ([]byte, bool) {
	m, ok := lastMember(value, FrameBodyBase64Key)
	if !ok {
		return value, false
	}
	var encoded string
	if json.Unmarshal(value[m.start:m.end], &encoded) != nil {
		return value, false
	}
	body, err := base64.StdEncoding.DecodeString(encoded)
	if err != nil {
		return value, false
	}
	bumped, ok := bumpAttempts(body)
	if !ok {
		return value, false
	}
	text := `"` + base64.StdEncoding.EncodeToString(bumped) + `"`
	return splice(value, []span{{start: m.start, end: m.end, text: []byte(text)}}), true
}

// bumpAttempts returns payload with its top-level "attempts" integer one
// higher: only the digits of that member's value change. ok is false, and
// payload is returned, when payload is not a JSON object with an integer
// "attempts".
func bumpAttempts(payload []byte) ([]byte, bool) {
	spans, ok := attemptsSpans(payload)
	if !ok {
		return payload, false
	}
	return splice(payload, spans), true
}

// span is a byte range of a JSON text and what replaces it.
type span struct {
	start, end int
	text       []byte
}

// splice returns b with each span (in order, not overlapping) replaced.
func splice(b []byte, spans []span) []byte {
	out := make([]byte, 0, len(b)+2*len(spans))
	last := 0
	for _, s := range spans {
		out = append(out, b[last:s.start]...)
		out = append(out, s.text...)
		last = s.end
	}
	return append(out, b[last:]...)
}

// attemptsSpans returns where the values of payload's top-level "attempts"
// members are, each with its integer one higher (saturating: a wrapped
// count would be negative). ok is false when payload is not one JSON object
// with an integer "attempts".
func attemptsSpans(payload []byte) ([]span, bool) {
	var spans []span
	ok := walkMembers(payload, func(name string, start, end int) bool {
		if name != "attempts" {
			return true
		}
		n, err := strconv.ParseInt(string(payload[start:end]), 10, 64)
		if err != nil {
			return false
		}
		if n < math.MaxInt64 {
			n++
		}
		spans = append(spans, span{start: start, end: end, text: strconv.AppendInt(nil, n, 10)})
		return true
	})
	return spans, ok && len(spans) > 0
}

// lastMember returns where the value of the last top-level member called
// name is in the JSON object value (the one JSON decoders keep).
func lastMember(value []byte, name string) (span, bool) {
	var found span
	ok := walkMembers(value, func(n string, start, end int) bool {
		if n == name {
			found = span{start: start, end: end}
		}
		return true
	}) && found.end > 0
	return found, ok
}

// walkMembers calls visit with the name of each top-level member of the
// JSON object doc and where its value is. It reports false when doc is not
// one JSON object or visit returned false.
func walkMembers(doc []byte, visit func(name string, start, end int) bool) bool {
	ms, ok := members(doc)
	if !ok {
		return false
	}
	for _, m := range ms {
		if !visit(m.name, m.start, m.end) {
			return false
		}
	}
	return true
}

// member is where one top-level member of a JSON object is: from its
// name's opening quote to the end of its value, [start, end) the value.
type member struct {
	name             string
	from, start, end int
}

// members returns the top-level members of the JSON object doc, in order.
// ok is false when doc is not one JSON object.
func members(doc []byte) (out []member, ok bool) {
	dec := json.NewDecoder(bytes.NewReader(doc))
	dec.UseNumber()
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, false
	}
	prev := int(dec.InputOffset()) // after "{" or the previous value
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, false
		}
		name, _ := tok.(string)
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, false
		}
		end := int(dec.InputOffset())
		start := end - len(raw)
		if start < 0 || !bytes.Equal(doc[start:end], raw) {
			return nil, false
		}
		from := skipSpace(doc, prev)
		if len(out) > 0 && from < len(doc) && doc[from] == ',' {
			from = skipSpace(doc, from+1)
		}
		out = append(out, member{name: name, from: from, start: start, end: end})
		prev = end
	}
	if tok, err := dec.Token(); err != nil || tok != json.Delim('}') {
		return nil, false
	}
	_, err := dec.Token()
	return out, err == io.EOF // nothing after the object
}

// skipSpace returns the offset of the first byte of doc at or after i that
// is not JSON whitespace.
func skipSpace(doc []byte, i int) int {
	for i < len(doc) && (doc[i] == ' ' || doc[i] == '\t' || doc[i] == '\n' || doc[i] == '\r') {
		i++
	}
	return i
}

// withoutMember returns the JSON object doc without its top-level members
// called name, every other byte as it was; ok is false, and doc returned,
// when doc is not a JSON object or has no such member.
func withoutMember(doc []byte, name string) (out []byte, ok bool) {
	out = doc
	for {
		ms, isObject := members(out)
		i := slices.IndexFunc(ms, func(m member) bool { return m.name == name })
		if !isObject || i < 0 {
			return out, ok
		}
		cut := span{start: ms[i].from, end: ms[i].end}
		switch {
		case i > 0: // from the end of the previous value: the comma goes too
			cut.start = ms[i-1].end
		case len(ms) > 1: // the first of several: up to and with the comma after it
			cut.end = skipSpace(out, ms[0].end) + 1
		}
		out, ok = splice(out, []span{cut}), true
	}
}

// withMember returns the JSON object doc with one top-level member name,
// whose value is the JSON text value, first, and every other member as it
// was (withoutMember takes it away again byte for byte); doc when it is not
// a JSON object.
func withMember(doc []byte, name string, value []byte) []byte {
	doc, _ = withoutMember(doc, name)
	ms, ok := members(doc)
	if !ok {
		return doc
	}
	var m bytes.Buffer
	if writeJSONString(&m, name) != nil {
		return doc
	}
	m.WriteByte(':')
	m.Write(value)
	if len(ms) > 0 {
		m.WriteByte(',')
	}
	at := skipSpace(doc, 0) + 1 // after "{"
	return splice(doc, []span{{start: at, end: at, text: m.Bytes()}})
}

// rawSpans maps spans of a decoded JSON string to the bytes of its encoded
// form raw (quotes included) that spell them. ok is false when a span does
// not start or end on the boundary of one spelled character, or raw holds
// bytes that are not UTF-8.
func rawSpans(raw []byte, spans []span) ([]span, bool) {
	out := make([]span, len(spans))
	next := 0 // the next span bound to find: 2*i its start, 2*i+1 its end
	decoded := 0
	at := func(i int) bool { // records the raw offset i of the decoded offset
		for next < 2*len(spans) {
			s := spans[next/2]
			want := s.start
			if next%2 == 1 {
				want = s.end
			}
			if want > decoded {
				return true
			}
			if want < decoded {
				return false
			}
			if next%2 == 0 {
				out[next/2] = span{start: i, text: s.text}
			} else {
				out[next/2].end = i
			}
			next++
		}
		return true
	}
	for i := 1; i < len(raw)-1; {
		if !at(i) {
			return nil, false
		}
		c := raw[i]
		switch {
		case c == '\\' && i+1 < len(raw)-1 && raw[i+1] == 'u':
			if i+6 > len(raw)-1 {
				return nil, false
			}
			r1, err := strconv.ParseUint(string(raw[i+2:i+6]), 16, 32)
			if err != nil {
				return nil, false
			}
			r, n := rune(r1), 6
			if utf16.IsSurrogate(r) {
				if i+12 > len(raw)-1 || raw[i+6] != '\\' || raw[i+7] != 'u' {
					return nil, false
				}
				r2, err := strconv.ParseUint(string(raw[i+8:i+12]), 16, 32)
				if err != nil {
					return nil, false
				}
				if r = utf16.DecodeRune(r, rune(r2)); r == utf8.RuneError {
					return nil, false
				}
				n = 12
			}
			decoded += utf8.RuneLen(r)
			i += n
		case c == '\\':
			decoded++
			i += 2
		case c < utf8.RuneSelf:
			decoded++
			i++
		default:
			r, n := utf8.DecodeRune(raw[i:])
			if r == utf8.RuneError && n <= 1 {
				return nil, false
			}
			decoded += n
			i += n
		}
	}
	if !at(len(raw)-1) || next != 2*len(spans) {
		return nil, false
	}
	return out, true
}

// isLaravelJob reports whether a Laravel worker can pop payload without
// losing it: a JSON object with an integer "attempts".
func isLaravelJob(payload []byte) bool {
	_, ok := bumpAttempts(payload)
	return ok
}
