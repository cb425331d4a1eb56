package idempotency

import (
	"encoding/binary"
	"errors"
	"hash/fnv"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
)

// KeySource reads the identity of a message that is not a BabelQueue
// envelope: its Watermill UUID ([KeyFromUUID]), a metadata field
// ([KeyFromMetadata]) or whatever a function of the caller's reads
// ([KeyFromFunc]). Pass it to [WithKeySource].
type KeySource struct {
	what string // names the source in the fail-open reason
	key  func(*message.Message) string
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
// identity: it runs without deduplication. fn is called once per delivery,
// on the delivery's goroutine.
func KeyFromFunc(fn func(msg *message.Message) string) KeySource {
	return KeySource{what: "the key function returned no key", key: fn}
}

// WithKeySource makes the middleware take each message's identity from src
// instead of meta.id of a BabelQueue envelope, for Watermill messages that
// are not envelopes. The body is then not read for an identity, and the
// rest of the decision is unchanged: scopes, WithClaim, WithTransaction,
// skips, parks, the metrics and the Observer by outcome. A message for
// which src yields an empty or blank key runs without deduplication (fail
// open, counted); a key that cannot be a key (over MaxIDBytes, invalid
// UTF-8, control characters) is rejected with a permanent error matching
// ErrInvalidID.
//
// The content fingerprint, when the store keeps one, covers the whole
// payload (a JSON payload by its meaning, insensitive to member order,
// white space and number spelling as with envelopes; any other payload by
// its bytes) and the metadata fields named by WithFingerprintMetadata. The
// replay horizon needs a creation time: it applies only with
// WithCreatedAtMetadata and is off otherwise.
func WithKeySource(src KeySource) Option {
	return func(c *config) { c.keys.source, c.keys.set = src, true }
}

// WithFingerprintMetadata adds the named metadata fields to the content
// fingerprint of messages keyed by WithKeySource, so that one key reused
// with, say, another tenant header is reported as a conflict. A field's
// absence and its empty value differ. It needs WithKeySource.
func WithFingerprintMetadata(names ...string) Option {
	return func(c *config) { c.keys.fingerprint = append([]string(nil), names...) }
}

// WithCreatedAtMetadata names the metadata field that holds the creation
// time of messages keyed by WithKeySource, as Unix milliseconds or an RFC
// 3339 time, so the replay horizon (WithReplayHorizon) applies to them. A
// message whose field is absent or unreadable is not checked, like an
// envelope without meta.created_at. It needs WithKeySource.
func WithCreatedAtMetadata(name string) Option {
	return func(c *config) { c.keys.createdAt = name }
}

// keyConfig is the configuration of WithKeySource and its companions.
type keyConfig struct {
	set         bool // WithKeySource was given
	source      KeySource
	fingerprint []string
	createdAt   string
}

// check reports options that make no sense without a key source.
func (k keyConfig) check() error {
	if k.source.key != nil {
		return nil
	}
	if k.set {
		return errors.New("idempotency: WithKeySource: no key source (a nil KeyFromFunc function, or a zero KeySource)")
	}
	if len(k.fingerprint) > 0 || k.createdAt != "" {
		return errors.New("idempotency: WithFingerprintMetadata and WithCreatedAtMetadata need WithKeySource (an envelope's fingerprint and creation time come from its body)")
	}
	return nil
}

// identity reads the identity of msg from the key source. An empty key is
// an error, which the decision reports as a fail-open.
func (k *keyConfig) identity(msg *message.Message, fingerprint bool) (envelope.Identity, error) {
	id := envelope.Identity{ID: k.source.key(msg)}
	if strings.TrimSpace(id.ID) == "" {
		return envelope.Identity{}, errors.New(k.source.what)
	}
	id.HasID = true
	if k.createdAt != "" {
		id.CreatedAt = parseCreatedAt(msg.Metadata.Get(k.createdAt))
	}
	if fingerprint {
		id.Fingerprint = k.fingerprintOf(msg)
	}
	return id, nil
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
		h = mix64(h + mix64(tagMetadataName^f.Sum64()))
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
		return mix64(tagJSONPayload ^ fp)
	}
	f := fnv.New64a()
	_, _ = f.Write(payload)
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(len(payload)))
	_, _ = f.Write(n[:])
	return mix64(tagBytePayload ^ f.Sum64())
}

// mix64 is the splitmix64 finaliser.
func mix64(h uint64) uint64 {
	h ^= h >> 30
	h *= 0xbf58476d1ce4e5b9
	h ^= h >> 27
	h *= 0x94d049bb133111eb
	h ^= h >> 31
	return h
}
