// Package envelope reads and writes BabelQueue message envelopes, the JSON
// wire format (frozen at schema_version 1) that services in every BabelQueue
// language exchange:
//
//	{"job":"urn:babel:orders:created","trace_id":"…","data":{…},
//	 "meta":{"id":"…","queue":"orders","lang":"go","schema_version":1,"created_at":1749132727000},
//	 "attempts":0}
//
// [Parse] is the consumer side: it accepts what the contract says a consumer
// accepts, resolves the inbound "urn" alias into Job, and keeps unknown fields
// so that a decode followed by [Envelope.Marshal] only changes what the caller
// changed. [New] is the producer side. [ReadIdentity] reads only what a
// deduplication decision needs (meta.id, meta.schema_version, meta.created_at)
// without decoding data, and allocates nothing but the id.
//
// The package depends on nothing but the standard library and
// github.com/google/uuid; it does not import Watermill.
package envelope

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"
)

// SchemaVersion is the only envelope schema version this package reads and
// writes.
const SchemaVersion = 1

// Lang is the producer language tag this package writes into meta.lang.
const Lang = "go"

// Dead-letter reasons, the values of DeadLetter.Reason: one per cause, so
// that an operator can select what to redrive. Every BabelQueue SDK writes
// and knows the first three; the others are written by this kit (a reader
// that knows only the three sees them as reasons it does not know, and a
// selection by one of the three does not match them).
const (
	ReasonFailed     = "failed"      // the handler failed after its retries
	ReasonUnknownURN = "unknown_urn" // no handler is registered for the URN
	// ReasonPoison: the message cannot be read at all (not an envelope, an
	// unsupported schema version, an unusable or missing identity).
	ReasonPoison = "poison"
	// ReasonUnknownOutcome: an external effect's outcome is unknown (a
	// charge whose reply was lost) and nothing settled it; an operator
	// resolves it before the message is redriven (package effects).
	ReasonUnknownOutcome = "unknown_outcome"
	// ReasonConflict: the message's identity was already used for another
	// intent: its meta.id is remembered with other content, or an external
	// effect's request differs from the one recorded for it. Redriving it
	// changes nothing; the producer reused an id.
	ReasonConflict = "conflict"
	// ReasonTooOld: the message is older than the replay horizon, so its
	// record may have expired; after checking it did not run, an operator
	// forgets its id and redrives it as a replay.
	ReasonTooOld = "too_old"
	// ReasonRejected: the handler rejected the message for good (it
	// returned a permanent error), without retrying it.
	ReasonRejected = "rejected"
)

// Errors returned by [Parse], [New] and [ReadIdentity]. Every rejection by
// Parse matches ErrInvalid; the more specific ones match their own sentinel
// as well.
var (
	// ErrInvalid is matched by every envelope a consumer must reject.
	ErrInvalid = errors.New("invalid envelope")
	// ErrUnsupportedSchemaVersion is matched when meta.schema_version is
	// present and is not SchemaVersion.
	ErrUnsupportedSchemaVersion = errors.New("unsupported envelope schema version")
	// ErrNotObject is matched when the body is not a JSON object at all
	// (empty, not JSON, an array, trailing garbage, …).
	ErrNotObject = errors.New("body is not a JSON object")
)

// Envelope is one BabelQueue message. The zero value is not a valid envelope;
// build one with [New] or [Parse].
type Envelope struct {
	// Job is the message URN, e.g. "urn:babel:orders:created". Parse fills it
	// from "job" or, failing that, from the inbound alias "urn".
	Job string
	// TraceID correlates every message of one causal chain; copied unchanged
	// by every hop.
	TraceID string
	// Data is the business payload, a JSON object kept as raw bytes so that
	// big integers, floats, unicode and null survive unchanged.
	Data json.RawMessage
	// Meta is the producer-set, immutable description of this message.
	Meta Meta
	// Attempts is the transport retry counter.
	Attempts int
	// DeadLetter is set only on a message sitting on a dead-letter queue.
	DeadLetter *DeadLetter

	extra fields // unknown top-level fields, kept for Marshal
}

// Meta is the envelope's "meta" block.
type Meta struct {
	// ID is the identity of this message and the deduplication key.
	ID string
	// Queue is the logical queue (Watermill topic) the message was produced for.
	Queue string
	// Lang is the producer language tag ("go", "php", "python", …).
	Lang string
	// SchemaVersion is the envelope schema version; always SchemaVersion here.
	SchemaVersion int
	// CreatedAt is the production time in Unix epoch milliseconds, UTC.
	CreatedAt int64

	extra fields // unknown meta fields, kept for Marshal
}

// DeadLetter is the additive "dead_letter" block of a message on a
// dead-letter queue.
type DeadLetter struct {
	// Reason is one of the Reason constants (ReasonFailed, …); a reader
	// meets reasons of other producers too.
	Reason string
	// Error is the human-readable error, or nil.
	Error *string
	// Exception is the producer-language error type, or nil.
	Exception *string
	// FailedAt is the dead-letter time in Unix epoch milliseconds, UTC.
	FailedAt int64
	// OriginalQueue is the queue the message was consumed from.
	OriginalQueue string
	// Attempts is the number of delivery attempts made before dead-lettering.
	Attempts int
	// Lang is the language of the SDK that dead-lettered the message.
	Lang string

	extra fields // unknown dead_letter fields, kept for Marshal
}

// CreatedTime returns Meta.CreatedAt as a time.Time, or the zero time when
// it is not set.
func (e Envelope) CreatedTime() time.Time {
	if e.Meta.CreatedAt == 0 {
		return time.Time{}
	}
	return time.UnixMilli(e.Meta.CreatedAt).UTC()
}

// fields holds JSON members this package does not know, by name.
type fields map[string]json.RawMessage

// Parse decodes payload as a consumer does. It accepts an envelope when job
// (or its alias urn) is a non-empty string, meta.schema_version is 1, data is
// a JSON object and trace_id is a non-blank string; every other payload is
// rejected with an error matching [ErrInvalid] that says what is wrong. A
// known field of the wrong JSON type is rejected too, since it could not be
// written back faithfully. Unknown fields are kept and written back by
// [Envelope.Marshal].
func Parse(payload []byte) (Envelope, error) {
	var top fields
	if err := json.Unmarshal(payload, &top); err != nil || top == nil {
		return Envelope{}, fmt.Errorf("%w: %w", ErrInvalid, ErrNotObject)
	}
	var e Envelope
	var job, urn string
	if err := takeString(top, "job", &job); err != nil {
		return Envelope{}, err
	}
	if err := takeString(top, "urn", &urn); err != nil {
		return Envelope{}, err
	}
	e.Job = job
	if e.Job == "" {
		e.Job = urn
	}
	if e.Job == "" {
		return Envelope{}, fmt.Errorf("%w: no \"job\" or \"urn\": the message has no URN", ErrInvalid)
	}
	if err := takeString(top, "trace_id", &e.TraceID); err != nil {
		return Envelope{}, err
	}
	if strings.TrimSpace(e.TraceID) == "" {
		return Envelope{}, fmt.Errorf("%w: \"trace_id\" is missing or blank", ErrInvalid)
	}
	data, ok := top["data"]
	delete(top, "data")
	if !ok || firstByte(data) != '{' {
		return Envelope{}, fmt.Errorf("%w: \"data\" must be a JSON object", ErrInvalid)
	}
	e.Data = data
	metaRaw, ok := top["meta"]
	delete(top, "meta")
	if !ok || firstByte(metaRaw) != '{' {
		return Envelope{}, fmt.Errorf("%w: \"meta\" must be a JSON object", ErrInvalid)
	}
	meta, err := parseMeta(metaRaw)
	if err != nil {
		return Envelope{}, err
	}
	e.Meta = meta
	if err := takeInt(top, "attempts", &e.Attempts); err != nil {
		return Envelope{}, err
	}
	if dl, ok := top["dead_letter"]; ok {
		delete(top, "dead_letter")
		if string(dl) != "null" {
			e.DeadLetter, err = parseDeadLetter(dl)
			if err != nil {
				return Envelope{}, err
			}
		}
	}
	if len(top) > 0 {
		e.extra = top
	}
	return e, nil
}

func parseMeta(raw json.RawMessage) (Meta, error) {
	var m fields
	if err := json.Unmarshal(raw, &m); err != nil {
		return Meta{}, fmt.Errorf("%w: \"meta\": %v", ErrInvalid, err)
	}
	var meta Meta
	version, ok := m["schema_version"]
	delete(m, "schema_version")
	if !ok || string(version) == "null" {
		return Meta{}, fmt.Errorf("%w: \"meta.schema_version\" is missing", ErrInvalid)
	}
	if v, isInt := wholeNumber(version); !isInt || v != SchemaVersion {
		return Meta{}, fmt.Errorf("%w: %w: meta.schema_version is %s, this consumer reads %d",
			ErrInvalid, ErrUnsupportedSchemaVersion, version, SchemaVersion)
	}
	meta.SchemaVersion = SchemaVersion
	for name, dst := range map[string]*string{"id": &meta.ID, "queue": &meta.Queue, "lang": &meta.Lang} {
		if err := takeString(m, name, dst); err != nil {
			return Meta{}, fmt.Errorf("meta: %w", err)
		}
	}
	if err := takeInt64(m, "created_at", &meta.CreatedAt); err != nil {
		return Meta{}, fmt.Errorf("meta: %w", err)
	}
	if len(m) > 0 {
		meta.extra = m
	}
	return meta, nil
}

func parseDeadLetter(raw json.RawMessage) (*DeadLetter, error) {
	var m fields
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, fmt.Errorf("%w: \"dead_letter\" must be a JSON object", ErrInvalid)
	}
	dl := &DeadLetter{}
	for name, dst := range map[string]*string{"reason": &dl.Reason, "original_queue": &dl.OriginalQueue, "lang": &dl.Lang} {
		if err := takeString(m, name, dst); err != nil {
			return nil, fmt.Errorf("dead_letter: %w", err)
		}
	}
	for name, dst := range map[string]**string{"error": &dl.Error, "exception": &dl.Exception} {
		if err := takeNullableString(m, name, dst); err != nil {
			return nil, fmt.Errorf("dead_letter: %w", err)
		}
	}
	if err := takeInt64(m, "failed_at", &dl.FailedAt); err != nil {
		return nil, fmt.Errorf("dead_letter: %w", err)
	}
	if err := takeInt(m, "attempts", &dl.Attempts); err != nil {
		return nil, fmt.Errorf("dead_letter: %w", err)
	}
	if len(m) > 0 {
		dl.extra = m
	}
	return dl, nil
}

// takeString moves the string member name out of m into dst. An absent or
// null member leaves dst unchanged.
func takeString(m fields, name string, dst *string) error {
	raw, ok := m[name]
	if !ok {
		return nil
	}
	delete(m, name)
	if string(raw) == "null" {
		return nil
	}
	if err := json.Unmarshal(raw, dst); err != nil {
		return fmt.Errorf("%w: %q must be a string, got %s", ErrInvalid, name, clip(raw))
	}
	return nil
}

func takeNullableString(m fields, name string, dst **string) error {
	var s string
	raw, ok := m[name]
	if !ok || string(raw) == "null" {
		delete(m, name)
		return nil
	}
	if err := takeString(m, name, &s); err != nil {
		return err
	}
	*dst = &s
	return nil
}

func takeInt64(m fields, name string, dst *int64) error {
	raw, ok := m[name]
	if !ok {
		return nil
	}
	delete(m, name)
	if string(raw) == "null" {
		return nil
	}
	v, isInt := wholeNumber(raw)
	if !isInt {
		return fmt.Errorf("%w: %q must be an integer, got %s", ErrInvalid, name, clip(raw))
	}
	*dst = v
	return nil
}

func takeInt(m fields, name string, dst *int) error {
	var v int64
	if err := takeInt64(m, name, &v); err != nil {
		return err
	}
	if v != 0 {
		*dst = int(v)
	}
	return nil
}

// clip shortens raw JSON for an error message.
func clip(raw []byte) string {
	const max = 40
	if len(raw) > max {
		return string(raw[:max]) + "…"
	}
	return string(raw)
}

func firstByte(raw []byte) byte {
	raw = bytes.TrimLeft(raw, " \t\r\n")
	if len(raw) == 0 {
		return 0
	}
	return raw[0]
}

// Marshal encodes the envelope as compact JSON without HTML escaping: job,
// trace_id, data, meta, attempts, dead_letter, then any unknown fields kept
// by Parse, in name order. It never writes the "urn" alias. It fails when
// Data or a kept unknown field is not valid JSON.
func (e Envelope) Marshal() ([]byte, error) {
	b := make([]byte, 0, 160+len(e.Data)+len(e.Job)+len(e.TraceID)+len(e.Meta.ID)+len(e.Meta.Queue))
	b = append(b, `{"job":`...)
	b = appendString(b, e.Job)
	b = append(b, `,"trace_id":`...)
	b = appendString(b, e.TraceID)
	b = append(b, `,"data":`...)
	var err error
	if len(e.Data) == 0 {
		b = append(b, "{}"...)
	} else if b, err = appendRaw(b, e.Data); err != nil {
		return nil, fmt.Errorf("envelope: data: %w", err)
	}
	b = append(b, `,"meta":{"id":`...)
	b = appendString(b, e.Meta.ID)
	b = append(b, `,"queue":`...)
	b = appendString(b, e.Meta.Queue)
	b = append(b, `,"lang":`...)
	b = appendString(b, e.Meta.Lang)
	b = append(b, `,"schema_version":`...)
	b = appendInt(b, int64(e.Meta.SchemaVersion))
	b = append(b, `,"created_at":`...)
	b = appendInt(b, e.Meta.CreatedAt)
	if b, err = e.Meta.extra.append(b); err != nil {
		return nil, fmt.Errorf("envelope: meta: %w", err)
	}
	b = append(b, `},"attempts":`...)
	b = appendInt(b, int64(e.Attempts))
	if dl := e.DeadLetter; dl != nil {
		b = append(b, `,"dead_letter":{"reason":`...)
		b = appendString(b, dl.Reason)
		b = append(b, `,"error":`...)
		b = appendNullableString(b, dl.Error)
		b = append(b, `,"exception":`...)
		b = appendNullableString(b, dl.Exception)
		b = append(b, `,"failed_at":`...)
		b = appendInt(b, dl.FailedAt)
		b = append(b, `,"original_queue":`...)
		b = appendString(b, dl.OriginalQueue)
		b = append(b, `,"attempts":`...)
		b = appendInt(b, int64(dl.Attempts))
		b = append(b, `,"lang":`...)
		b = appendString(b, dl.Lang)
		if b, err = dl.extra.append(b); err != nil {
			return nil, fmt.Errorf("envelope: dead_letter: %w", err)
		}
		b = append(b, '}')
	}
	if b, err = e.extra.append(b); err != nil {
		return nil, fmt.Errorf("envelope: %w", err)
	}
	return append(b, '}'), nil
}

// append writes the fields as ,"name":value members in name order.
func (f fields) append(b []byte) ([]byte, error) {
	if len(f) == 0 {
		return b, nil
	}
	names := make([]string, 0, len(f))
	for name := range f {
		names = append(names, name)
	}
	sort.Strings(names)
	var err error
	for _, name := range names {
		b = append(b, ',')
		b = appendString(b, name)
		b = append(b, ':')
		if b, err = appendRaw(b, f[name]); err != nil {
			return nil, fmt.Errorf("field %q: %w", name, err)
		}
	}
	return b, nil
}

// Extra returns the raw value of an unknown top-level field kept by Parse.
func (e Envelope) Extra(name string) (json.RawMessage, bool) {
	v, ok := e.extra[name]
	return v, ok
}
