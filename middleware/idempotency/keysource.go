package idempotency

import (
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/internal/fphash"
)

// KeySource is where the middleware finds a message's identity: meta.id of
// a BabelQueue envelope ([KeyFromEnvelope], the default), the Watermill
// UUID ([KeyFromUUID]), a metadata field ([KeyFromMetadata]) or whatever a
// function of the caller's reads ([KeyFromFunc]). Pass one or more, in the
// order they are tried, to [WithKeySource].
type KeySource struct {
	what     string // names the source in the fail-open reason
	envelope bool   // meta.id of the envelope in the body
	key      func(*message.Message) string
}

// KeyFromEnvelope keys messages on meta.id of the BabelQueue envelope in
// their body, the default. Its content fingerprint is the envelope's (job
// and data) and its creation time meta.created_at. A body that is not an
// envelope, or has no meta.id, yields no key, and the next source is
// tried; an envelope with an unsupported schema_version is rejected
// whatever sources follow.
func KeyFromEnvelope() KeySource {
	return KeySource{what: "no meta.id in an envelope", envelope: true}
}

// KeyFromUUID keys messages on their Watermill UUID (message.Message.UUID).
// It suits a producer that publishes one message once and lets the broker
// or an outbox redeliver that same message: every copy carries the UUID the
// producer gave it. A producer that builds a new message for each attempt
// (cqrs.JSONMarshaler mints a new UUID on every Send) gets a new key each
// time; key those on a field the producer sets instead.
func KeyFromUUID() KeySource {
	return KeySource{what: "no message UUID", key: func(msg *message.Message) string { return msg.UUID }}
}

// KeyFromMetadata keys messages on the Watermill metadata field name, such
// as an idempotency key the producer sets ("Idempotency-Key") or
// envelope.MetadataMessageID ("bq-message-id").
func KeyFromMetadata(name string) KeySource {
	return KeySource{what: "no " + strconv.Quote(name) + " metadata", key: func(msg *message.Message) string {
		return msg.Metadata.Get(name)
	}}
}

// KeyFromFunc keys messages on what fn returns, for example a business key
// decoded from the payload. An empty result means the message has no
// identity from this source. fn is called once per delivery, on the
// delivery's goroutine.
func KeyFromFunc(fn func(msg *message.Message) string) KeySource {
	return KeySource{what: "the key function returned no key", key: fn}
}

// WithKeySource sets where the middleware finds each message's identity:
// the sources are tried in order and the first that yields a key wins, so
// a topic carrying envelopes and plain messages can say
//
//	idempotency.WithKeySource(idempotency.KeyFromEnvelope(),
//		idempotency.KeyFromMetadata("Idempotency-Key"), idempotency.KeyFromUUID())
//
// The default is KeyFromEnvelope alone. The rest of the decision is
// unchanged: scopes, claims, the transactional mode, skips, parks, the
// metrics and the Observer by outcome. A message for which no source yields
// a key (an empty or blank one counts as none) runs without deduplication
// (fail open, counted), or is rejected under WithRequireIdentity; a key
// that cannot be a key (over MaxIDBytes, invalid UTF-8, control
// characters) is rejected with a permanent error matching ErrInvalidID.
//
// For a key that does not come from an envelope, the content fingerprint
// (when the store keeps one) covers the whole payload (a JSON payload by
// its meaning, insensitive to member order, white space and number
// spelling as with envelopes; any other payload by its bytes) and the
// metadata fields named by WithFingerprintMetadata, and the replay horizon
// applies only with WithCreatedAtMetadata.
func WithKeySource(sources ...KeySource) Option {
	return func(c *config) { c.keys.sources, c.keys.set = append([]KeySource(nil), sources...), true }
}

// WithFingerprintMetadata adds the named metadata fields to the content
// fingerprint of messages keyed by a source other than the envelope, so
// that one key reused with, say, another tenant header is reported as a
// conflict. A field's absence and its empty value differ. It needs
// WithKeySource with such a source.
func WithFingerprintMetadata(names ...string) Option {
	return func(c *config) { c.keys.fingerprint = append([]string(nil), names...) }
}

// WithCreatedAtMetadata names the metadata field that holds the creation
// time of messages keyed by a source other than the envelope, as Unix
// milliseconds or an RFC 3339 time, so the replay horizon
// (WithReplayHorizon) applies to them. A message whose field is absent or
// unreadable is not checked, like an envelope without meta.created_at. It
// needs WithKeySource with such a source.
func WithCreatedAtMetadata(name string) Option {
	return func(c *config) { c.keys.createdAt = name }
}

// keyConfig is the configuration of WithKeySource and its companions.
type keyConfig struct {
	set         bool // WithKeySource was given
	sources     []KeySource
	fingerprint []string
	createdAt   string
	sensitive   *SensitiveFields // WithSensitiveFields (sensitive.go)
	fields      *sensitiveFields // sensitive, checked
}

// check reports sources that cannot work and options that make no sense
// without a source other than the envelope; it sets the default source.
func (k *keyConfig) check() error {
	if k.set && len(k.sources) == 0 {
		return errors.New("idempotency: WithKeySource: no key source")
	}
	if !k.set {
		k.sources = []KeySource{KeyFromEnvelope()}
	}
	plain := false
	for _, src := range k.sources {
		if !src.envelope && src.key == nil {
			return errors.New("idempotency: WithKeySource: a zero KeySource, or KeyFromFunc with a nil function")
		}
		plain = plain || !src.envelope
	}
	if !plain && (len(k.fingerprint) > 0 || k.createdAt != "") {
		return errors.New("idempotency: WithFingerprintMetadata and WithCreatedAtMetadata need WithKeySource with a source other than KeyFromEnvelope (an envelope's fingerprint and creation time come from its body)")
	}
	if k.sensitive != nil {
		if !slices.ContainsFunc(k.sources, func(src KeySource) bool { return src.envelope }) {
			return errors.New("idempotency: WithSensitiveFields needs KeyFromEnvelope among the key sources (the fields are those of an envelope's data)")
		}
		var err error
		if k.fields, err = k.sensitive.compile(); err != nil {
			return err
		}
	}
	return nil
}

// identity reads the identity of msg from the sources in order. It returns
// the reason there is none (for the fail-open report), or a rejection of an
// envelope that cannot be read. also holds the fingerprints other than
// id.Fingerprint that a record kept for this very content may hold (see
// WithSensitiveFields).
func (k *keyConfig) identity(msg *message.Message, fingerprint bool) (id envelope.Identity, also []uint64, none string, err error) {
	for _, src := range k.sources {
		if src.envelope {
			var rerr error
			if fingerprint {
				id, rerr = envelope.ReadIdentityFingerprint(msg.Payload)
			} else {
				id, rerr = envelope.ReadIdentity(msg.Payload)
			}
			switch {
			case rerr != nil: // not a JSON object
				none = rerr.Error()
				continue
			case id.HasSchemaVersion && id.SchemaVersion != envelope.SchemaVersion:
				return id, nil, "", fmt.Errorf("idempotency: %w: meta.schema_version %d, this consumer reads %d",
					ErrUnsupportedSchemaVersion, id.SchemaVersion, envelope.SchemaVersion)
			case strings.TrimSpace(id.ID) == "":
				none = "no meta.id"
				continue
			}
			if fingerprint && k.fields != nil {
				id.Fingerprint, also, err = k.fields.fingerprint(id.ID, msg.Payload, id.Fingerprint)
			}
			return id, also, "", err
		}
		key := src.key(msg)
		if strings.TrimSpace(key) == "" {
			none = src.what
			continue
		}
		id = envelope.Identity{ID: key, HasID: true}
		if k.createdAt != "" {
			id.CreatedAt = parseCreatedAt(msg.Metadata.Get(k.createdAt))
		}
		if fingerprint {
			id.Fingerprint = k.fingerprintOf(msg)
		}
		return id, nil, "", nil
	}
	return envelope.Identity{}, nil, none, nil
}

// parseCreatedAt reads Unix milliseconds or an RFC 3339 time; 0 when it is
// neither.
func parseCreatedAt(v string) int64 {
	if v == "" {
		return 0
	}
	if ms, err := strconv.ParseInt(v, 10, 64); err == nil {
		if ms < 0 {
			return 0
		}
		return ms
	}
	if t, err := time.Parse(time.RFC3339Nano, v); err == nil {
		return t.UnixMilli()
	}
	return 0
}

// Fingerprint tags, so that a JSON payload and the same bytes taken
// verbatim, or a metadata field and the payload, never hash alike.
const (
	tagJSONPayload  = 0x6a736f6e00000001
	tagBytePayload  = 0x6279746573000002
	tagMetadataName = 0x6d65746100000003
)

// fingerprintOf fingerprints the payload and the chosen metadata fields of
// a keyed message. It is never 0 (stores read 0 as "none kept").
func (k *keyConfig) fingerprintOf(msg *message.Message) uint64 {
	h := payloadFingerprint(msg.Payload)
	for _, name := range k.fingerprint {
		v, ok := msg.Metadata[name]
		f := fnv.New64a()
		_, _ = f.Write([]byte(name))
		_, _ = f.Write([]byte{0, presence(ok)})
		_, _ = f.Write([]byte(v))
		h = fphash.Mix(h + fphash.Mix(tagMetadataName^f.Sum64()))
	}
	if h == 0 {
		h = 1
	}
	return h
}

func presence(ok bool) byte {
	if ok {
		return 1
	}
	return 0
}

// payloadFingerprint hashes a JSON payload by its meaning, with the same
// canonical hash envelopes' data gets, and any other payload by its bytes.
func payloadFingerprint(payload []byte) uint64 {
	if fp, err := envelope.FingerprintJSON(payload); err == nil {
		return fphash.Mix(tagJSONPayload ^ fp)
	}
	return fphash.Mix(tagBytePayload ^ fphash.Bytes(payload))
}
