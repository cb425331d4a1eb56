package httpidempotency

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/http"
	"time"
)

// Response is a response saved for a consistent retry: what a replay sends,
// and what an Operation's Authorize hook and Resolve function see.
type Response struct {
	// Status is the HTTP status code.
	Status int
	// Header holds the response headers the operation saves
	// (Operation.SaveHeaders, and Content-Type).
	Header http.Header
	// Body is the response body; nil when BodyNotKept.
	Body []byte
	// BodyNotKept reports a response whose body was over the size limit
	// when it was first sent: the operation ran, but a retry cannot be
	// given the same body (it gets a problem naming the limit).
	BodyNotKept bool
	// SavedAt is when the response was saved (zero for one a Resolve
	// function returned without it).
	SavedAt time.Time
	// Subject is who the request was made for, as WithSubject read it
	// from the first request ("" without WithSubject).
	Subject string
}

// encodingVersion is the first byte of a saved response. Decode refuses
// any other, so a future layout is never misread.
const encodingVersion = 1

// flagBodyNotKept marks a response whose body was not kept.
const flagBodyNotKept = 1

// ErrUnknownEncoding is matched by DecodeResponse for a value that is not a
// saved response in a layout this version reads.
var ErrUnknownEncoding = errors.New("httpidempotency: not a saved response in a known encoding")

// EncodeResponse returns resp in the versioned encoding kept as the
// record's value: a version byte, then flags, the save time (Unix
// milliseconds), the status, the subject, the headers and the body.
func EncodeResponse(resp *Response) []byte {
	size := 1 + 4*binary.MaxVarintLen64 + len(resp.Subject) + len(resp.Body)
	for name, values := range resp.Header {
		size += binary.MaxVarintLen64 * (2 + len(values))
		size += len(name)
		for _, v := range values {
			size += len(v)
		}
	}
	b := make([]byte, 0, size)
	b = append(b, encodingVersion)
	var flags uint64
	if resp.BodyNotKept {
		flags |= flagBodyNotKept
	}
	b = appendHead(b, flags, resp.SavedAt, resp.Status, resp.Subject)
	b = binary.AppendUvarint(b, uint64(len(resp.Header)))
	for _, name := range sortedKeys(resp.Header) {
		values := resp.Header[name]
		b = appendString(b, name)
		b = binary.AppendUvarint(b, uint64(len(values)))
		for _, v := range values {
			b = appendString(b, v)
		}
	}
	return append(b, resp.Body...)
}

// appendHead appends what a saved response and an identity record start
// with after their version byte: flags, the save time (Unix milliseconds,
// 0 for none), the status and the subject.
func appendHead(b []byte, flags uint64, savedAt time.Time, status int, subject string) []byte {
	b = binary.AppendUvarint(b, flags)
	var ms int64
	if !savedAt.IsZero() {
		ms = savedAt.UnixMilli()
	}
	b = binary.AppendVarint(b, ms)
	b = binary.AppendUvarint(b, uint64(status))
	return appendString(b, subject)
}

func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

// DecodeResponse reads a value EncodeResponse wrote. An error matches
// ErrUnknownEncoding.
func DecodeResponse(value []byte) (*Response, error) {
	if len(value) == 0 || value[0] != encodingVersion {
		return nil, fmt.Errorf("%w (first byte %s)", ErrUnknownEncoding, firstByte(value))
	}
	d := decoder{b: value[1:]}
	flags := d.uvarint()
	savedAt := d.varint()
	status := d.uvarint()
	resp := &Response{BodyNotKept: flags&flagBodyNotKept != 0, Subject: d.string()}
	if savedAt != 0 {
		resp.SavedAt = time.UnixMilli(savedAt)
	}
	n := d.uvarint()
	if n > uint64(len(d.b)) { // each header takes a byte at least
		d.err = true
	}
	if n > 0 && !d.err {
		resp.Header = make(http.Header, n)
		for i := uint64(0); i < n && !d.err; i++ {
			name := d.string()
			count := d.uvarint()
			if count > uint64(len(d.b)) {
				d.err = true
				break
			}
			values := make([]string, 0, count)
			for j := uint64(0); j < count && !d.err; j++ {
				values = append(values, d.string())
			}
			resp.Header[name] = values
		}
	}
	if d.err || status < 100 || status > 999 {
		return nil, fmt.Errorf("%w (truncated or malformed)", ErrUnknownEncoding)
	}
	resp.Status = int(status)
	if len(d.b) > 0 {
		resp.Body = d.b
	}
	return resp, nil
}

func firstByte(b []byte) string {
	if len(b) == 0 {
		return "none: an empty value"
	}
	return fmt.Sprintf("%#x", b[0])
}

// decoder reads the encoding; err sticks once a read ran past the end.
type decoder struct {
	b   []byte
	err bool
}

func (d *decoder) uvarint() uint64 {
	if d.err {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.err = true
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *decoder) varint() int64 {
	if d.err {
		return 0
	}
	v, n := binary.Varint(d.b)
	if n <= 0 {
		d.err = true
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *decoder) string() string {
	n := d.uvarint()
	if d.err || n > uint64(len(d.b)) {
		d.err = true
		return ""
	}
	s := string(d.b[:n])
	d.b = d.b[n:]
	return s
}
