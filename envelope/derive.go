package envelope

import (
	"strings"

	"github.com/google/uuid"
)

// DeriveID returns the meta.id for a message produced while handling the
// message whose meta.id is parentID: a name-based UUID (version 5, SHA-1) of
// name in the namespace of parentID. The same parent and name always give the
// same id, so a retry of the parent re-emits the same ids and downstream
// consumers skip the copies; distinct names (or sequence numbers) give
// distinct ids.
//
// The derivation, for other SDKs to match: the namespace is parentID parsed
// as a UUID; a parentID that is not a UUID is first turned into one as the
// version 5 UUID of "urn:babel:meta-id:" + parentID in the URL namespace.
func DeriveID(parentID, name string) string {
	ns, err := uuid.Parse(parentID)
	if err != nil {
		ns = uuid.NewSHA1(uuid.NameSpaceURL, []byte("urn:babel:meta-id:"+parentID))
	}
	return uuid.NewSHA1(ns, []byte(name)).String()
}

// NewChild builds an envelope produced while handling parent: its meta.id is
// DeriveID(parent.Meta.ID, name) and its trace_id is the parent's, so the
// causal chain and the identity both survive a retry of the parent. name
// tells the children of one parent apart ("invoice", "email", or a sequence
// number such as "line-3"). Options apply after those two.
//
// An envelope carries no transport headers: the parent message's out-of-band
// headers (a W3C traceparent, …) travel beside the child in the produced
// message's metadata, as [CarriedHeaders] selects them. The idempotency
// package's NewChildMessage builds the whole Watermill message, and its
// CarryHeaders middleware copies them onto whatever a handler returns.
func NewChild(parent Envelope, name, urn string, data any, opts ...Option) (Envelope, error) {
	base := []Option{WithID(DeriveID(parent.Meta.ID, name)), WithTraceID(parent.TraceID)}
	return New(urn, data, append(base, opts...)...)
}

// Out-of-band headers are Watermill metadata entries that ride beside the
// envelope (a W3C traceparent, tracestate, baggage, bq-replay-bypass, a
// correlation id of the user's own). They belong to the causal chain, so they
// travel from a handled message to the messages produced from it: its
// children, its dead letter, a redriven copy. Transport headers do not: they
// describe one hop and are written again from the body or by the broker.

// transportHeaders are the metadata keys that describe one hop: projections of
// envelope fields (written again from the new body), the broker bindings'
// contract headers, the dead-letter annotations and Watermill's own keys.
var transportHeaders = map[string]bool{
	MetadataMessageID: true, MetadataTraceID: true, MetadataJob: true,
	// RabbitMQ binding contract headers.
	"x-attempts": true, "x-schema-version": true, "x-source-lang": true,
	// Kafka, Pulsar and Service Bus binding headers.
	"bq-attempts": true, "bq-schema-version": true, "bq-source-lang": true, "bq-created-at": true,
	// The Redis list binding's copy of the value a message was read from
	// (redislist.MetadataStoredValue).
	"bq-redislist-stored-value": true,
	// A redrive's mark of the copy it sent back (MetadataRedrive).
	"bq-redrive-id": true,
	// Watermill's poison queue annotations.
	"reason_poisoned": true, "topic_poisoned": true, "handler_poisoned": true, "subscriber_poisoned": true,
}

// TransportHeader reports whether the Watermill metadata key describes one hop
// of one message rather than its causal chain, so that a message built from
// it (a child, a dead letter, a redriven copy) must not inherit it: the
// projections bq-message-id, bq-trace-id and bq-job (written again from the
// new body), the broker bindings' contract headers (x-attempts,
// x-schema-version, x-source-lang, bq-attempts, bq-schema-version,
// bq-source-lang, bq-created-at) and the Redis list binding's copy of the
// value read (bq-redislist-stored-value), a redrive's mark (bq-redrive-id),
// the dead-letter annotations (bq-dead-letter-…
// and Watermill's *_poisoned keys) and Watermill's internal keys (_watermill_…,
// such as the AMQP redelivery flag). Inherited, such a header would disagree
// with the new message, e.g. an x-attempts of 3 on a redriven body whose
// attempts is 0.
func TransportHeader(key string) bool {
	return transportHeaders[key] || strings.HasPrefix(key, "_watermill_") || strings.HasPrefix(key, "bq-dead-letter-")
}

// CarriedHeaders returns the out-of-band headers of a handled message that
// travel to the messages produced from it: every entry of metadata whose key
// and value are not blank and whose key is not a [TransportHeader]. It
// returns nil when there is none. Pass a Watermill message's Metadata.
func CarriedHeaders(metadata map[string]string) map[string]string {
	var out map[string]string
	for k, v := range metadata {
		if strings.TrimSpace(k) == "" || strings.TrimSpace(v) == "" || TransportHeader(k) {
			continue
		}
		if out == nil {
			out = make(map[string]string, len(metadata))
		}
		out[k] = v
	}
	return out
}
