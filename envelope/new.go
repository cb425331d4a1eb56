package envelope

import (
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
)

// Watermill metadata keys that project envelope fields out of band, so that
// routing and tooling can read them without decoding the body.
const (
	// MetadataMessageID carries meta.id.
	MetadataMessageID = "bq-message-id"
	// MetadataTraceID carries trace_id.
	MetadataTraceID = "bq-trace-id"
	// MetadataJob carries job, the URN.
	MetadataJob = "bq-job"
	// MetadataReplayBypass is "1" on a message an operator deliberately
	// replayed; handlers skip external effects for it.
	MetadataReplayBypass = "bq-replay-bypass"
	// MetadataRedrive marks a message an operator sent back from a
	// dead-letter topic (redrive), with an id of its own per message
	// sent back: a consumer that remembered the message's end knows it
	// from a redelivery of the copy that ended, and runs it again.
	MetadataRedrive = "bq-redrive-id"
	// MetadataDeadLetterTopic is set, on the message a delivery
	// dead-lettered, to the topic its dead letter went to, for the
	// middleware that remembers the message's end. Like every
	// "bq-dead-letter-" key it describes one hop: it does not travel.
	MetadataDeadLetterTopic = "bq-dead-letter-topic"
	// MetadataDeadLetterReason holds the dead_letter reason, on a dead
	// letter and on the message it was made from.
	MetadataDeadLetterReason = "bq-dead-letter-reason"
)

// Option sets an optional field of an envelope built by [New].
type Option func(*building)

// building is an envelope under construction by New, with what the options
// said beyond the envelope's fields.
type building struct {
	e     Envelope
	idSet bool // WithID was given, so New must not mint an id
}

// WithID sets meta.id instead of a fresh UUIDv4. The id is used verbatim;
// an empty or blank id makes New fail with an error matching ErrInvalid
// rather than mint a random one, since a producer whose business key came
// out empty would otherwise lose deduplication without noticing.
func WithID(id string) Option {
	return func(b *building) { b.e.Meta.ID, b.idSet = id, true }
}

// WithTraceID sets trace_id instead of a fresh UUIDv4. Pass the trace_id of
// the message being handled to continue its causal chain.
func WithTraceID(traceID string) Option { return func(b *building) { b.e.TraceID = traceID } }

// WithQueue sets meta.queue, the logical queue (Watermill topic) the message
// is produced for.
func WithQueue(queue string) Option { return func(b *building) { b.e.Meta.Queue = queue } }

// WithCreatedAt sets meta.created_at instead of the current time.
func WithCreatedAt(t time.Time) Option {
	return func(b *building) { b.e.Meta.CreatedAt = t.UnixMilli() }
}

// New builds an envelope for urn carrying data, as a producer does: a fresh
// UUIDv4 meta.id and trace_id unless given, meta.lang "go", schema_version 1,
// meta.created_at now in milliseconds, attempts 0. data is encoded with
// encoding/json without HTML escaping (a json.RawMessage or []byte holding
// JSON is used as it is) and must be a JSON object; nil means {}.
//
// It returns an error matching ErrInvalid when urn is blank, when data is
// not a JSON object, or when WithID was given an empty or blank id.
func New(urn string, data any, opts ...Option) (Envelope, error) {
	if strings.TrimSpace(urn) == "" {
		return Envelope{}, fmt.Errorf("%w: the URN is empty", ErrInvalid)
	}
	raw, err := encodeData(data)
	if err != nil {
		return Envelope{}, err
	}
	b := building{e: Envelope{
		Job:  urn,
		Data: raw,
		Meta: Meta{Lang: Lang, SchemaVersion: SchemaVersion},
	}}
	for _, opt := range opts {
		opt(&b)
	}
	e := b.e
	switch {
	case b.idSet && strings.TrimSpace(e.Meta.ID) == "":
		return Envelope{}, fmt.Errorf("%w: WithID was given an empty meta.id %q; pass a non-blank id, or leave WithID out to mint one", ErrInvalid, e.Meta.ID)
	case e.Meta.ID == "":
		e.Meta.ID = uuid.NewString()
	}
	if e.TraceID == "" {
		e.TraceID = uuid.NewString()
	}
	if e.Meta.CreatedAt == 0 {
		e.Meta.CreatedAt = time.Now().UnixMilli()
	}
	return e, nil
}

func encodeData(data any) (json.RawMessage, error) {
	var raw []byte
	switch d := data.(type) {
	case nil:
		return json.RawMessage("{}"), nil
	case json.RawMessage:
		raw = d
	case []byte:
		raw = d
	default:
		var sb strings.Builder
		enc := json.NewEncoder(&sb)
		enc.SetEscapeHTML(false)
		if err := enc.Encode(data); err != nil {
			return nil, fmt.Errorf("envelope: encode data: %w", err)
		}
		raw = []byte(strings.TrimSuffix(sb.String(), "\n"))
	}
	if !json.Valid(raw) || firstByte(raw) != '{' {
		return nil, fmt.Errorf("%w: data must be a JSON object, got %s", ErrInvalid, clip(raw))
	}
	return append(json.RawMessage(nil), raw...), nil
}
