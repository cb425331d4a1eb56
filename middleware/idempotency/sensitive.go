package idempotency

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/babelqueue/watermill-idempotency/envelope"
)

// FieldCipher opens the data fields a BabelQueue producer encrypted: the
// Decrypt half of the SDKs' field cipher. The Go SDK's gdpr.Cipher
// implementations (its gdpr.AESGCMCipher among them) are FieldCiphers as
// they are. Decrypt returns the JSON encoding of the field's value, and an
// error for a string it did not produce or produced under another key (the
// guard keeps that error in its own error's chain without printing it). It
// must be safe for concurrent use.
type FieldCipher interface {
	Decrypt(ciphertext string) ([]byte, error)
}

// MinFingerprintKey is the shortest key SensitiveFields accepts, in bytes.
const MinFingerprintKey = 32

// SensitiveFields tells the middleware which data fields BabelQueue
// producers encrypt in place (the fields a job's schema marks
// x-gdpr-sensitive, which the SDKs' gdpr Protect encrypts with a random
// nonce per call, so that each retry of one message carries other
// ciphertext). Give it to WithSensitiveFields.
type SensitiveFields struct {
	// Jobs maps each job (the envelope's job, or its urn alias) to the
	// data paths its schema marks sensitive, written as the SDKs' schemas
	// list them (the Go SDK's Schema.SensitivePaths, the Python SDK's
	// schema.sensitive_paths): "email", "card.number" (a member of an
	// object), "items[].note" (the member of every element of an array),
	// "tags[]" (every element). A path "" (a mark on the schema's root) is
	// skipped, as the SDKs skip it. Messages of other jobs are
	// fingerprinted as they are.
	Jobs map[string][]string
	// Cipher, with Key, makes each sensitive value count by its
	// cleartext: it is decrypted (a value that is not a string is taken as
	// the cleartext itself, as the SDKs' Unprotect leaves it) and enters
	// the fingerprint as an HMAC-SHA256 under Key of the value's meaning
	// (member order, white space, string escapes and number spelling
	// aside, so the Go and Python SDKs' encodings of one value agree).
	// Without a Cipher the sensitive values do not count at all: their
	// presence does, their content does not.
	Cipher FieldCipher
	// Key keys the hash of each cleartext: at least MinFingerprintKey
	// random bytes, kept secret, the same on every consumer that shares a
	// store, and not the cipher's key. A fingerprint is 64 bits: without a
	// secret key, that of a card number would be found by trying every
	// number.
	Key []byte
	// PreviousKeys are keys used as Key before: a redelivery of a message
	// remembered under one of them is still recognised. Drop a key once
	// the records written under it have expired.
	PreviousKeys [][]byte
}

// WithSensitiveFields makes the content fingerprint blind to the
// ciphertext of fields BabelQueue producers encrypt, so that a producer's
// retry of a message (the same meta.id and cleartext, new ciphertext) is
// a duplicate and not a conflict. With f.Cipher and f.Key each sensitive
// value counts by its cleartext through a keyed hash: a message reusing
// the id with another card number is still a conflict. Without them the
// sensitive values do not count: such a message is skipped as a duplicate.
// No record, log or dead letter holds a cleartext either way.
//
// A record kept before the option was given (its fingerprint covered the
// ciphertext) still matches a redelivery of the very same bytes, and one
// kept under a key of f.PreviousKeys, or without a cipher, matches its
// message's redeliveries. A value at a sensitive path that f.Cipher cannot
// open (a wrong key, a tampered value, a string the producer did not
// encrypt) rejects the message with an error matching ErrUndecryptable,
// which says where and never what. It applies to messages keyed by their
// envelope (KeyFromEnvelope); it replaces an earlier WithSensitiveFields.
func WithSensitiveFields(f SensitiveFields) Option {
	return func(c *config) {
		f.Jobs = cloneJobs(f.Jobs)
		f.Key = bytes.Clone(f.Key)
		f.PreviousKeys = cloneKeys(f.PreviousKeys)
		c.keys.sensitive = &f
	}
}

func cloneJobs(jobs map[string][]string) map[string][]string {
	if jobs == nil {
		return nil
	}
	out := make(map[string][]string, len(jobs))
	for job, paths := range jobs {
		out[job] = append([]string(nil), paths...)
	}
	return out
}

func cloneKeys(keys [][]byte) [][]byte {
	var out [][]byte
	for _, k := range keys {
		out = append(out, bytes.Clone(k))
	}
	return out
}

// sensitiveFields is SensitiveFields checked and parsed.
type sensitiveFields struct {
	jobs   map[string][]sensitivePath
	cipher FieldCipher
	keys   [][]byte // the key, then the previous keys
}

// sensitivePath is one parsed path: its text, for errors, and its steps.
type sensitivePath struct {
	text  string
	steps []pathStep
}

// pathStep is one member of a path; array: descend into every element of
// the member's array.
type pathStep struct {
	name  string
	array bool
}

// compile checks f and parses its paths.
func (f *SensitiveFields) compile() (*sensitiveFields, error) {
	const prefix = "idempotency: WithSensitiveFields: "
	if len(f.Jobs) == 0 {
		return nil, errors.New(prefix + "no job: Jobs names the jobs whose producers encrypt fields")
	}
	out := &sensitiveFields{jobs: map[string][]sensitivePath{}, cipher: f.Cipher}
	for job, paths := range f.Jobs {
		if strings.TrimSpace(job) == "" {
			return nil, errors.New(prefix + "an empty job in Jobs")
		}
		for _, p := range paths {
			if p == "" {
				continue // a mark on the schema's root: nothing in data to address
			}
			sp, err := parseSensitivePath(p)
			if err != nil {
				return nil, fmt.Errorf(prefix+"job %q: %w", job, err)
			}
			out.jobs[job] = append(out.jobs[job], sp)
		}
	}
	switch {
	case f.Cipher == nil && (len(f.Key) > 0 || len(f.PreviousKeys) > 0):
		return nil, errors.New(prefix + "Key and PreviousKeys need a Cipher (without one, sensitive values do not count)")
	case f.Cipher != nil && len(f.Key) < MinFingerprintKey:
		return nil, fmt.Errorf(prefix+"the Key is %d bytes; give at least %d random bytes, kept secret (an unkeyed or short-keyed 64-bit fingerprint of a card number is found by trying every number)", len(f.Key), MinFingerprintKey)
	}
	if f.Cipher != nil {
		out.keys = append(out.keys, f.Key)
		for i, k := range f.PreviousKeys {
			if len(k) < MinFingerprintKey {
				return nil, fmt.Errorf(prefix+"PreviousKeys[%d] is %d bytes, under %d", i, len(k), MinFingerprintKey)
			}
			out.keys = append(out.keys, k)
		}
	}
	return out, nil
}

func parseSensitivePath(p string) (sensitivePath, error) {
	sp := sensitivePath{text: p}
	for _, part := range strings.Split(p, ".") {
		name, array := strings.CutSuffix(part, "[]")
		if name == "" {
			return sp, fmt.Errorf("path %q: an empty member name", p)
		}
		sp.steps = append(sp.steps, pathStep{name: name, array: array})
	}
	return sp, nil
}

// leaf is one sensitive value found in a message's data.
type leaf struct {
	path  string
	value any
	set   func(any)
}

// Markers put in place of a sensitive value before the data is
// fingerprinted: values that count not at all, or by a keyed hash.
const (
	markerUncounted = "\x00bq-sensitive-field"
	markerKeyed     = "\x00bq-sensitive-field:"
)

// fingerprint returns the fingerprint of the envelope in payload with its
// sensitive values replaced by their markers, and also the fingerprints a
// record kept under an earlier configuration may hold for it: plain (the
// envelope as it is), without counting the values, under each previous
// key. A message of another job, or without a sensitive value, keeps
// plain. The payload has been read as a JSON object already.
func (s *sensitiveFields) fingerprint(id string, payload []byte, plain uint64) (fp uint64, also []uint64, err error) {
	var top map[string]json.RawMessage
	if json.Unmarshal(payload, &top) != nil {
		return plain, nil, nil
	}
	paths := s.jobs[jobOf(top)]
	raw, ok := top["data"]
	if len(paths) == 0 || !ok {
		return plain, nil, nil
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var data any
	if dec.Decode(&data) != nil {
		return plain, nil, nil
	}
	var leaves []leaf
	for _, p := range paths {
		collect(data, p.steps, p.text, &leaves)
	}
	if len(leaves) == 0 {
		return plain, nil, nil
	}
	// What each leaf is replaced with, in each variant: the current key
	// first, then no count, then the previous keys.
	var variants [][]string
	if s.cipher != nil {
		sums := make([]uint64, len(leaves))
		for i, l := range leaves {
			if sums[i], err = s.cleartextSum(l); err != nil {
				return 0, nil, fmt.Errorf("idempotency: message %q: %w", id, err)
			}
		}
		variants = append(variants, keyedMarkers(s.keys[0], sums), uncountedMarkers(len(leaves)))
		for _, k := range s.keys[1:] {
			variants = append(variants, keyedMarkers(k, sums))
		}
	} else {
		variants = append(variants, uncountedMarkers(len(leaves)))
	}
	job, urn := top["job"], top["urn"]
	for i, markers := range variants {
		for j, l := range leaves {
			l.set(markers[j])
		}
		v, err := fingerprintOfData(job, urn, data)
		if err != nil {
			return plain, nil, nil
		}
		if i == 0 {
			fp = v
			continue
		}
		also = append(also, v)
	}
	return fp, append(also, plain), nil
}

// jobOf returns the job that names an envelope: job when it is a
// non-empty string, its urn alias otherwise, as the fingerprint reads them.
func jobOf(top map[string]json.RawMessage) string {
	var job string
	if json.Unmarshal(top["job"], &job) == nil && job != "" {
		return job
	}
	var urn string
	_ = json.Unmarshal(top["urn"], &urn)
	return urn
}

// collect appends the values of node at steps to leaves, as the SDKs walk
// a path: an absent member, or a node of another kind, holds none.
func collect(node any, steps []pathStep, path string, leaves *[]leaf) {
	obj, ok := node.(map[string]any)
	if !ok || len(steps) == 0 {
		return
	}
	step := steps[0]
	child, ok := obj[step.name]
	if !ok {
		return
	}
	last := len(steps) == 1
	if !step.array {
		if last {
			*leaves = append(*leaves, leaf{path: path, value: child, set: func(v any) { obj[step.name] = v }})
			return
		}
		collect(child, steps[1:], path, leaves)
		return
	}
	list, ok := child.([]any)
	if !ok {
		return
	}
	for i, elem := range list {
		if last {
			*leaves = append(*leaves, leaf{path: path, value: elem, set: func(v any) { list[i] = v }})
			continue
		}
		collect(elem, steps[1:], path, leaves)
	}
}

// cleartextSum returns the fingerprint of a sensitive value's cleartext
// (its meaning, as FingerprintJSON reads it).
func (s *sensitiveFields) cleartextSum(l leaf) (uint64, error) {
	var clear []byte
	if ct, ok := l.value.(string); ok {
		var err error
		if clear, err = s.cipher.Decrypt(ct); err != nil {
			return 0, &fieldError{path: l.path, why: "does not open with the cipher (a wrong key, a tampered value, or a value the producer did not encrypt)", cause: err}
		}
	} else {
		var err error
		if clear, err = json.Marshal(l.value); err != nil {
			return 0, &fieldError{path: l.path, why: "cannot be encoded", cause: err}
		}
	}
	sum, err := envelope.FingerprintJSON(clear)
	if err != nil {
		return 0, &fieldError{path: l.path, why: "decrypts to something that is not JSON"}
	}
	return sum, nil
}

// fieldError is a sensitive value that cannot be read. Its message names
// the path, never the value; the cipher's own error stays in the chain
// (errors.Is, errors.As) but is not printed, since a cipher may quote what
// it was given, and a value the producer did not encrypt is a cleartext.
type fieldError struct {
	path, why string
	cause     error
}

func (e *fieldError) Error() string {
	return fmt.Sprintf("%v: the value at data.%s %s", ErrUndecryptable, e.path, e.why)
}

func (e *fieldError) Unwrap() []error {
	if e.cause == nil {
		return []error{ErrUndecryptable}
	}
	return []error{ErrUndecryptable, e.cause}
}

func uncountedMarkers(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = markerUncounted
	}
	return out
}

// keyedMarkers returns the marker of each cleartext fingerprint in sums
// under key: HMAC-SHA256 of a domain tag and the fingerprint.
func keyedMarkers(key []byte, sums []uint64) []string {
	out := make([]string, len(sums))
	mac := hmac.New(sha256.New, key)
	for i, sum := range sums {
		mac.Reset()
		var b [8]byte
		binary.LittleEndian.PutUint64(b[:], sum)
		mac.Write([]byte("bq-sensitive-field\x00"))
		mac.Write(b[:])
		out[i] = markerKeyed + hex.EncodeToString(mac.Sum(nil)[:16])
	}
	return out
}

// fingerprintOfData fingerprints an envelope of job, urn and data, as
// envelope.Fingerprint does the message's own.
func fingerprintOfData(job, urn json.RawMessage, data any) (uint64, error) {
	doc := map[string]any{"data": data}
	if job != nil {
		doc["job"] = job
	}
	if urn != nil {
		doc["urn"] = urn
	}
	b, err := json.Marshal(doc)
	if err != nil {
		return 0, err
	}
	return envelope.Fingerprint(b)
}
