// Package cqrsenvelope carries the commands and events of Watermill's
// components/cqrs in BabelQueue envelopes, so that a CQRS application gets
// message identity, deduplication by the idempotency middleware and reach
// to consumers in other languages without code of its own.
//
// [Marshaler] is a cqrs.CommandEventMarshaler. Marshal puts a command or
// event into an envelope: job is its URN (from its type name, or a mapping
// of the application's), data its JSON encoding, meta.id minted once per
// message (or the application's own key for it), trace_id fresh,
// meta.queue, meta.lang "go" and meta.created_at set as any BabelQueue
// producer sets them. Unmarshal reads envelopes from any BabelQueue SDK (the
// "urn" alias of job, unknown fields), and Name is the URN, so a command a
// PHP or Python service sends under a URN reaches the Go handler for it.
//
// A message sent while handling another one continues it: wire
// [Marshaler.OnSend] into cqrs.CommandBusConfig.OnSend and
// [Marshaler.OnPublish] into cqrs.EventBusConfig.OnPublish, and a command or
// event sent from a CQRS handler with the handler's context carries the
// handled message's trace_id and a meta.id derived from the handled
// message's (envelope.DeriveID). A retry of the handled message then sends
// the same ids again, and their consumers skip the copies.
package cqrsenvelope

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"unicode"

	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
)

// Marshaler marshals components/cqrs commands and events into BabelQueue
// envelopes and back. The zero value is ready to use: URNs from type names,
// a fresh meta.id per message, no meta.queue. It is safe for concurrent use.
type Marshaler struct {
	// URN returns the URN (the envelope's job) of a command or event; v may
	// be a value or a pointer. It must give every type one URN, the one its
	// consumers in every language route on. Nil means DefaultURN.
	URN func(v any) string

	// ID returns the meta.id of a command or event, such as a business key
	// ("order-1042-placed"), so that sending one command twice sends one
	// message twice and its handler runs once. The id is used verbatim and
	// must be a usable key (at most 256 bytes, no control characters). An
	// empty result, or a nil ID, leaves meta.id to the marshaler: a fresh
	// UUIDv4, or an id derived from the handled message (see OnSend).
	ID func(v any) string

	// Queue returns meta.queue, the logical queue (Watermill topic) a
	// message with this URN is produced for; usually the function given to
	// the bus as GeneratePublishTopic. Nil leaves meta.queue empty.
	Queue func(urn string) string
}

var _ cqrs.CommandEventMarshaler = Marshaler{}

// Marshal puts v, a command or event, into a new envelope: see Marshaler.
// The Watermill message's UUID is meta.id, and its metadata carry the
// envelope.MetadataMessageID, MetadataTraceID and MetadataJob projections.
func (m Marshaler) Marshal(v any) (*message.Message, error) {
	urn := m.Name(v)
	opts := make([]envelope.Option, 0, 2)
	if m.ID != nil {
		if id := m.ID(v); id != "" {
			opts = append(opts, envelope.WithID(id))
		}
	}
	if m.Queue != nil {
		opts = append(opts, envelope.WithQueue(m.Queue(urn)))
	}
	data, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("cqrsenvelope: encode %T: %w", v, err)
	}
	e, err := envelope.New(urn, json.RawMessage(data), opts...)
	if err != nil {
		return nil, fmt.Errorf("cqrsenvelope: %T: %w", v, err)
	}
	return toMessage(e)
}

func toMessage(e envelope.Envelope) (*message.Message, error) {
	payload, err := e.Marshal()
	if err != nil {
		return nil, fmt.Errorf("cqrsenvelope: %w", err)
	}
	msg := message.NewMessage(e.Meta.ID, payload)
	project(msg, e)
	return msg, nil
}

// project writes the envelope's identity into the message's UUID and
// metadata.
func project(msg *message.Message, e envelope.Envelope) {
	msg.UUID = e.Meta.ID
	msg.Metadata.Set(envelope.MetadataMessageID, e.Meta.ID)
	msg.Metadata.Set(envelope.MetadataTraceID, e.TraceID)
	msg.Metadata.Set(envelope.MetadataJob, e.Job)
}

// Unmarshal decodes the envelope in msg, from this marshaler or any other
// BabelQueue producer, and its data into v. An envelope a consumer must
// refuse (no URN, a schema version other than 1, data not an object, no
// trace_id) is an error matching envelope.ErrInvalid.
func (m Marshaler) Unmarshal(msg *message.Message, v any) error {
	e, err := envelope.Parse(msg.Payload)
	if err != nil {
		return fmt.Errorf("cqrsenvelope: message %s: %w", msg.UUID, err)
	}
	if err := json.Unmarshal(e.Data, v); err != nil {
		return fmt.Errorf("cqrsenvelope: decode data of %s (%s) into %T: %w", e.Meta.ID, e.Job, v, err)
	}
	return nil
}

// Name returns the URN of v, a command or event (value or pointer).
func (m Marshaler) Name(v any) string {
	if m.URN != nil {
		return m.URN(v)
	}
	return DefaultURN(v)
}

// NameFromMessage returns the URN of the envelope in msg: its job, or the
// urn alias other SDKs may send; "" when msg holds no envelope, so that no
// handler takes it.
func (m Marshaler) NameFromMessage(msg *message.Message) string {
	var head struct {
		Job *string `json:"job"`
		URN *string `json:"urn"`
	}
	if json.Unmarshal(msg.Payload, &head) != nil {
		return ""
	}
	switch {
	case head.Job != nil && *head.Job != "":
		return *head.Job
	case head.URN != nil:
		return *head.URN
	}
	return ""
}

// OnSend continues the handled message in a command sent while handling it;
// set it as cqrs.CommandBusConfig.OnSend (or call it from yours). See
// Continue.
func (m Marshaler) OnSend(p cqrs.CommandBusOnSendParams) error {
	return m.Continue(p.Message, p.Command)
}

// OnPublish continues the handled message in an event published while
// handling it; set it as cqrs.EventBusConfig.OnPublish (or call it from
// yours). See Continue.
func (m Marshaler) OnPublish(p cqrs.OnEventSendParams) error {
	return m.Continue(p.Message, p.Event)
}

// Continue rewrites msg, which Marshal built from v, as a message produced
// while handling the message in msg's context (cqrs.OriginalMessageFromCtx,
// set for every CQRS handler; outside CQRS handlers put it there with
// cqrs.CtxWithOriginalMessage). It takes the handled message's trace_id
// and, unless ID gave v an id of its own, the meta.id
// envelope.DeriveID(handled id, name), where name is the URN and a
// fingerprint of data, or the name given with ChildName. The handled id is
// its meta.id, or for a message that is not an envelope its
// envelope.MetadataMessageID metadata or else its UUID.
//
// So a retry of the handled message sends the same ids again. Two identical
// commands sent while handling one message get one id, and their handler
// runs once; give them distinct names with ChildName when both must run.
// Without a handled message in the context msg is left as it is.
func (m Marshaler) Continue(msg *message.Message, v any) error {
	parent := cqrs.OriginalMessageFromCtx(msg.Context())
	if parent == nil {
		return nil
	}
	e, err := envelope.Parse(msg.Payload)
	if err != nil {
		return fmt.Errorf("cqrsenvelope: continue %T: the message is not an envelope from Marshal: %w", v, err)
	}
	parentID, parentTrace := parentIdentity(parent)
	if parentTrace != "" {
		e.TraceID = parentTrace
	}
	if !m.ownID(v) && parentID != "" {
		name, ok := childName(msg.Context())
		if !ok {
			fp, err := envelope.Fingerprint(msg.Payload)
			if err != nil {
				return fmt.Errorf("cqrsenvelope: continue %T: %w", v, err)
			}
			name = fmt.Sprintf("%s#%016x", e.Job, fp)
		}
		e.Meta.ID = envelope.DeriveID(parentID, name)
	}
	payload, err := e.Marshal()
	if err != nil {
		return fmt.Errorf("cqrsenvelope: continue %T: %w", v, err)
	}
	msg.Payload = payload
	project(msg, e)
	return nil
}

func (m Marshaler) ownID(v any) bool {
	return m.ID != nil && m.ID(v) != ""
}

// parentIdentity returns the identity and trace_id of a handled message.
func parentIdentity(parent *message.Message) (id, trace string) {
	if ident, err := envelope.ReadIdentity(parent.Payload); err == nil && strings.TrimSpace(ident.ID) != "" {
		return ident.ID, envelope.ReadTraceID(parent.Payload)
	}
	id = parent.Metadata.Get(envelope.MetadataMessageID)
	if id == "" {
		id = parent.UUID
	}
	return id, parent.Metadata.Get(envelope.MetadataTraceID)
}

type childNameKey struct{}

// ChildName returns a copy of ctx under which a command or event sent
// while handling a message derives its meta.id from name instead of from
// its URN and data. Use it to tell apart messages with the same URN
// and data sent while handling one message, each of which must take effect
// ("reminder-1", "reminder-2").
func ChildName(ctx context.Context, name string) context.Context {
	return context.WithValue(ctx, childNameKey{}, name)
}

func childName(ctx context.Context) (string, bool) {
	name, ok := ctx.Value(childNameKey{}).(string)
	return name, ok
}

// DefaultURN returns "urn:babel:<package>:<type>" for v (a value or a
// pointer), the package name and the type name in snake case:
// orders.PlaceOrder gives "urn:babel:orders:place_order", and
// billing.HTTPInvoiceSent "urn:babel:billing:http_invoice_sent". Producers
// in other languages send that URN to reach the Go handler; map types to
// other URNs with Marshaler.URN.
func DefaultURN(v any) string {
	name := cqrs.FullyQualifiedStructName(v) // "orders.PlaceOrder"
	pkg, typ := "", name
	if i := strings.LastIndexByte(name, '.'); i >= 0 {
		pkg, typ = name[:i], name[i+1:]
	}
	if pkg == "" {
		pkg = "builtin"
	}
	return "urn:babel:" + snake(pkg) + ":" + snake(typ)
}

// snake turns a Go identifier into snake case, keeping acronyms together.
func snake(s string) string {
	r := []rune(s)
	var b strings.Builder
	for i, c := range r {
		if c == '-' || c == '.' {
			c = '_'
		}
		if unicode.IsUpper(c) {
			prevLower := i > 0 && (unicode.IsLower(r[i-1]) || unicode.IsDigit(r[i-1]))
			acronymEnd := i > 0 && unicode.IsUpper(r[i-1]) && i+1 < len(r) && unicode.IsLower(r[i+1])
			if (prevLower || acronymEnd) && b.Len() > 0 {
				b.WriteByte('_')
			}
			c = unicode.ToLower(c)
		}
		b.WriteRune(c)
	}
	return b.String()
}
