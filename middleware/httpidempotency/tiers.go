package httpidempotency

import (
	"context"
	"database/sql"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"net/http"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
)

// HeaderResponse is set on a compact replay (a retry answered from the
// identity record, see WithResponseStore) to say why the full saved
// response was not sent: ResponseExpired or ResponseUnavailable.
const HeaderResponse = "Idempotency-Response"

// The values of HeaderResponse.
const (
	// ResponseExpired: the response store holds no full response of the
	// request's run: its retention (the response lifetime) lapsed, or it
	// could not be saved when the request ran. Sending the key again gives
	// the same compact answer until the identity lifetime ends.
	ResponseExpired = "expired"
	// ResponseUnavailable: the response store could not be read (down, or
	// slower than WithStoreTimeout). A later retry may get the full
	// response again.
	ResponseUnavailable = "unavailable"
)

// maxReference is the longest resource reference an identity record keeps,
// in bytes; a longer one is not kept (the compact replay then names none).
const maxReference = 2048

// WithResponseStore keeps responses in two tiers. The full saved response
// (status, headers, body) goes to responses, under the same record key
// (RecordKey), and lives as long as responses keeps records (its TTL: the
// response lifetime, hours or a day). The Guard's own store keeps a compact
// identity record per key instead: the request's 64-bit fingerprint, the
// status, the time it was saved, the subject, the resource reference the
// response named (Identity) and a 32-bit digest of the full response (a
// retry is given only the full response of its own run), for its own TTL (the identity lifetime:
// the whole replay horizon, weeks). A retry within the response lifetime
// gets the full response; after it, within the identity lifetime, a
// compact replay (see Operation.Compact); another intent gets 422 for the
// whole identity lifetime.
//
// responses must keep values, keep records for a positive TTL no longer
// than the Guard's store's (whose TTL may be 0, forever), and be another
// store than the Guard's: another Redis prefix (redisstore.WithPrefix),
// another table (postgresstore.WithTable). It takes no claims: the claim
// is taken on the Guard's store. New refuses a store that breaks one of
// these with an error matching ErrInvalidOption.
//
// In the transactional mode (WrapTx), when responses is a stores.TxStore
// too (a postgresstore), the full response is written in the handler's
// transaction with the identity record, so the three commit together; it
// must then be on the WithTransaction database. Otherwise, or if that
// write fails in the transaction (under a savepoint, so the transaction
// goes on), it is written just before the commit, outside the
// transaction, on a best-effort basis: a failure is logged and leaves a
// retry the compact replay, never a second run; a response written by a
// transaction that then rolls back is never replayed.
func WithResponseStore(responses stores.Store) Option {
	return func(c *config) { c.responses, c.responsesSet = responses, true }
}

// Identity is the compact record a key keeps in the identity tier (see
// WithResponseStore): what a compact replay is built from once the full
// response is no longer kept.
type Identity struct {
	// Ref names the record: tenant, operation and key.
	Ref Ref
	// Status is the status of the response the request was answered with.
	Status int
	// Reference is the resource the response named (its Location header,
	// else its Content-Location, or what Operation.Reference returned); ""
	// when it named none.
	Reference string
	// SavedAt is when the response was saved.
	SavedAt time.Time
	// Subject is who the request was made for, as WithSubject read it.
	Subject string

	digest    uint32 // of the full response's value, when one was written
	hasDigest bool
}

// flagDigest marks an identity record that keeps the digest of the full
// response written for its run.
const flagDigest = 1

// digestOf returns the digest binding an identity record to the full
// response of its run: FNV-1a (32 bits) of the response's value.
func digestOf(value []byte) uint32 {
	f := fnv.New32a()
	_, _ = f.Write(value)
	return f.Sum32()
}

// identityVersion is the first byte of an identity record, unlike a saved
// response's (encodingVersion): DecodeResponse refuses one and
// decodeIdentity refuses a saved response, so neither is misread.
const identityVersion = 2

// encodeIdentity returns the identity record's value: a version byte,
// flags, the save time (Unix milliseconds), the status, the subject, the
// reference and, with flagDigest, the full response's digest (4 bytes).
// The fingerprint is the record's own.
func encodeIdentity(id *Identity) []byte {
	b := make([]byte, 0, 1+3*binary.MaxVarintLen64+2*binary.MaxVarintLen32+len(id.Subject)+len(id.Reference)+4)
	b = append(b, identityVersion)
	var flags uint64
	if id.hasDigest {
		flags |= flagDigest
	}
	b = appendHead(b, flags, id.SavedAt, id.Status, id.Subject)
	b = appendString(b, id.Reference)
	if id.hasDigest {
		b = binary.BigEndian.AppendUint32(b, id.digest)
	}
	return b
}

// decodeIdentity reads a value encodeIdentity wrote. An error matches
// ErrUnknownEncoding.
func decodeIdentity(value []byte) (*Identity, error) {
	if len(value) == 0 || value[0] != identityVersion {
		return nil, fmt.Errorf("%w (first byte %s)", ErrUnknownEncoding, firstByte(value))
	}
	d := decoder{b: value[1:]}
	flags := d.uvarint()
	savedAt := d.varint()
	status := d.uvarint()
	id := &Identity{Subject: d.string(), Reference: d.string()}
	if flags&flagDigest != 0 && !d.err {
		if len(d.b) < 4 {
			d.err = true
		} else {
			id.digest, id.hasDigest = binary.BigEndian.Uint32(d.b), true
		}
	}
	if d.err || status < 100 || status > 999 {
		return nil, fmt.Errorf("%w (truncated or malformed identity record)", ErrUnknownEncoding)
	}
	id.Status = int(status)
	if savedAt != 0 {
		id.SavedAt = time.UnixMilli(savedAt)
	}
	return id, nil
}

// DecodeIdentity reads the compact identity record a Guard with
// WithResponseStore keeps in its own store (for tools that inspect
// records). An error matches ErrUnknownEncoding; a saved response
// (DecodeResponse) is not one.
func DecodeIdentity(value []byte) (Identity, error) {
	id, err := decodeIdentity(value)
	if err != nil {
		return Identity{}, err
	}
	return *id, nil
}

// checkResponses validates WithResponseStore's store against the Guard's.
func checkResponses(store, responses stores.Store, caps stores.Capabilities) (stores.Capabilities, error) {
	if responses == nil {
		return stores.Capabilities{}, fmt.Errorf("%w: WithResponseStore(nil)", ErrInvalidOption)
	}
	if responses == store {
		return stores.Capabilities{}, fmt.Errorf("%w: WithResponseStore is given the Guard's own store: the two tiers need two stores (another prefix or table)", ErrInvalidOption)
	}
	rc := responses.Capabilities()
	switch {
	case rc.MaxValue <= 0:
		return rc, fmt.Errorf("%w: the response store keeps no values", ErrInvalidOption)
	case rc.TTL <= 0:
		return rc, fmt.Errorf("%w: the response store keeps records forever (TTL 0): give it the response lifetime as its TTL, shorter than the identity store's", ErrInvalidOption)
	case caps.TTL > 0 && rc.TTL > caps.TTL:
		return rc, fmt.Errorf("%w: the response store keeps responses for %v, longer than the identity store keeps their identities (%v): a response would outlive the record that replays it", ErrInvalidOption, rc.TTL, caps.TTL)
	}
	return rc, nil
}

// tiered reports whether the Guard keeps responses in two tiers.
func (g *Guard) tiered() bool { return g.responses != nil }

// identityOf returns the identity record of the response resp, saved for
// the call.
func (h *guarded) identityOf(c *call, resp *Response, header http.Header, body []byte) *Identity {
	ref := h.op.Reference(resp.Status, header, body)
	if len(ref) > maxReference {
		h.g.logger().Warn("httpidempotency: the response's resource reference is too long to keep in the identity record; a compact replay names none",
			"operation", h.op.Name, "bytes", len(ref), "limit", maxReference)
		ref = ""
	}
	return &Identity{Ref: c.ref, Status: resp.Status, Reference: ref, SavedAt: resp.SavedAt, Subject: resp.Subject}
}

// defaultReference is Operation.Reference's default: Location, else
// Content-Location.
func defaultReference(_ int, header http.Header, _ []byte) string {
	if v := header.Get("Location"); v != "" {
		return v
	}
	return header.Get("Content-Location")
}

// saveResponse writes the full response to the response store (the first
// of the two tiered writes), once, within the store timeout. A failure is
// logged: a retry then gets the compact replay.
func (g *Guard) saveResponse(c *call, value []byte) {
	if value == nil {
		return
	}
	ctx, cancel := g.storeCtx(c)
	err := g.responses.Remember(ctx, c.key, c.fp, value)
	cancel()
	if err != nil {
		g.logger().Warn("httpidempotency: the full response could not be saved in the response store; a retry gets the compact replay",
			"operation", c.ref.Operation, "error", err)
	}
}

// saveResponseTx writes the full response in tx when the response store
// is a stores.TxStore, under a savepoint so that a failure (a response
// store on another database) leaves the transaction usable. It reports
// whether the response is written in tx; if not, the caller writes it
// outside the transaction, before the commit.
func (g *Guard) saveResponseTx(ctx context.Context, tx *sql.Tx, c *call, value []byte) bool {
	txs, ok := g.responses.(stores.TxStore)
	if !ok {
		return false
	}
	if _, err := tx.ExecContext(ctx, "SAVEPOINT httpidempotency_response"); err != nil {
		return false
	}
	recorded, _, err := txs.RememberTx(ctx, tx, c.key, c.fp, value)
	if err == nil && recorded {
		return true
	}
	// A response of an earlier run of the key (its identity record
	// forgotten), or an error: written outside the transaction instead.
	if _, rerr := tx.ExecContext(ctx, "ROLLBACK TO SAVEPOINT httpidempotency_response"); rerr != nil {
		g.logger().Warn("httpidempotency: could not roll back to the savepoint after writing the response in the transaction", "operation", c.ref.Operation, "error", rerr)
	}
	if err != nil {
		g.logger().Warn("httpidempotency: the full response could not be written in the transaction; it is written outside it, before the commit",
			"operation", c.ref.Operation, "error", err)
	}
	return false
}

// tieredValues returns the two values of a response saved in two tiers:
// the full response for the response store (nil when its body is over
// what is kept: a retry gets the compact replay, more use than a body-less
// record), the identity record for the Guard's store.
func (h *guarded) tieredValues(c *call, cw *capture) (full, identity []byte) {
	full, resp := h.encodeResponse(c, cw, h.g.responseCaps.MaxValue)
	id := h.identityOf(c, resp, cw.header, cw.body)
	if resp.BodyNotKept {
		full = nil
	} else {
		id.digest, id.hasDigest = digestOf(full), true
	}
	return full, encodeIdentity(id)
}

// replayIdentity answers a retry whose key holds an identity record: the
// full response from the response store when it still holds this run's,
// else the compact replay. Another intent is refused before the response
// store is read.
func (h *guarded) replayIdentity(w http.ResponseWriter, r *http.Request, c *call, id *Identity, keptFP uint64) {
	g := h.g
	id.Ref = c.ref
	compact := compactResponse(id)
	if h.op.ExpiresAfter > 0 && !id.SavedAt.IsZero() && time.Since(id.SavedAt) > h.op.ExpiresAfter {
		h.expired(w, r, c, compact)
		return
	}
	if !g.caps.Matches(keptFP, c.fp) {
		h.answer(w, r, c, compact, keptFP) // 403 or 422; the response store is not read
		return
	}
	if g.responses == nil { // the record of a Guard that had WithResponseStore
		h.answer(w, r, c, h.compact(r, c, id, ResponseExpired), keptFP)
		return
	}
	ctx, cancel := g.storeCtx(c)
	found, err := g.responses.Lookup(ctx, c.key)
	cancel()
	why := ResponseExpired
	switch {
	case err != nil:
		g.logger().Warn("httpidempotency: the response store could not be read; the retry gets the compact replay",
			"operation", h.op.Name, "error", err)
		why = ResponseUnavailable
	case found.State == stores.StateRemembered:
		if full := sameRun(found, id, keptFP); full != nil {
			h.answer(w, r, c, full, keptFP)
			return
		}
	}
	resp := h.compact(r, c, id, why)
	h.answer(w, r, c, resp, keptFP)
}

// sameRun returns the full response found in the response store when it
// is the one the identity record's run wrote (the same fingerprint, and
// the digest of its value the identity record keeps), nil otherwise: a
// response left by an earlier run of the key (its identity record
// forgotten, the later run's response not saved) is never replayed for a
// later one, even one saved in the same millisecond.
func sameRun(found stores.Record, id *Identity, keptFP uint64) *Response {
	if found.Fingerprint != keptFP || !id.hasDigest || digestOf(found.Value) != id.digest {
		return nil
	}
	resp, err := DecodeResponse(found.Value)
	if err != nil || resp.BodyNotKept {
		return nil
	}
	return resp
}

// compact returns the compact replay of id: the operation's own
// (Operation.Compact), or the default one. Either way it carries
// HeaderResponse.
func (h *guarded) compact(r *http.Request, c *call, id *Identity, why string) *Response {
	var resp *Response
	if h.op.Compact != nil {
		var err error
		resp, err = h.op.Compact(c.request(r, r.Context()), *id)
		if err != nil {
			h.g.logger().Warn("httpidempotency: the operation's Compact failed; the retry gets the default compact replay",
				"operation", h.op.Name, "error", err)
			resp = nil
		}
	}
	if resp == nil {
		resp = compactResponse(id)
		resp.Header.Set("Content-Type", "application/json")
		resp.Body = compactBody(id, why)
	}
	if resp.Subject == "" {
		resp.Subject = id.Subject
	}
	if resp.SavedAt.IsZero() {
		resp.SavedAt = id.SavedAt
	}
	resp.Header = resp.Header.Clone()
	if resp.Header == nil {
		resp.Header = http.Header{}
	}
	resp.Header.Set(HeaderResponse, why)
	return resp
}

// compactResponse returns the status, the reference as Location and the
// subject of id, with no body: what Authorize sees of a compact replay.
func compactResponse(id *Identity) *Response {
	resp := &Response{Status: id.Status, SavedAt: id.SavedAt, Subject: id.Subject, Header: http.Header{}}
	if id.Reference != "" {
		resp.Header.Set("Location", id.Reference)
	}
	return resp
}

// compactJSON is the body of the default compact replay.
type compactJSON struct {
	Status    int    `json:"status"`
	Location  string `json:"location,omitempty"`
	Response  string `json:"response"`
	Operation string `json:"operation"`
}

// compactBody returns the default compact replay's body (application/json).
func compactBody(id *Identity, why string) []byte {
	b, _ := json.Marshal(compactJSON{Status: id.Status, Location: id.Reference, Response: why, Operation: id.Ref.Operation})
	return append(b, '\n')
}
