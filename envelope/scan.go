package envelope

// One scanner reads an envelope for a deduplication decision: its identity
// (ReadIdentity), the fingerprint of its intent in the same pass
// (ReadIdentityFingerprint, Fingerprint), the trace id (ReadTraceID), and
// the fingerprint of any JSON value (FingerprintJSON). It validates the
// whole payload as it goes and never materialises data.

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math/big"
	"strconv"
	"unicode/utf8"

	"github.com/babelqueue/watermill-idempotency/internal/fphash"
)

// Identity is what a deduplication decision reads from an envelope: the
// message identity and the two meta fields that decide whether the identity
// may be trusted. [ReadIdentity] fills it without decoding data.
type Identity struct {
	// ID is meta.id. It is empty when meta.id is absent, null or not a
	// string; HasID tells those apart from an empty string.
	ID string
	// HasID reports that meta.id is present as a JSON string (possibly empty).
	HasID bool
	// SchemaVersion is meta.schema_version when HasSchemaVersion is true. A
	// value that is not a whole JSON number is reported as -1.
	SchemaVersion int
	// HasSchemaVersion reports that meta.schema_version is present and not null.
	HasSchemaVersion bool
	// CreatedAt is meta.created_at in Unix milliseconds, or 0 when absent or
	// not a whole number.
	CreatedAt int64
	// Fingerprint is the envelope's Fingerprint when read with
	// ReadIdentityFingerprint; 0 otherwise.
	Fingerprint uint64
}

// maxDepth is the deepest nesting ReadIdentity accepts, the same limit
// encoding/json applies, so that both agree on what is valid JSON.
const maxDepth = 10000

// ReadIdentity reads meta.id, meta.schema_version and meta.created_at from a
// JSON envelope without materialising data or any other member. It validates
// the whole payload as JSON as it skips over it, so it agrees with
// encoding/json about what a JSON object is, and its only allocation is the
// returned ID. Object member names match exactly (case-sensitively); when a
// member appears twice the last one wins, as with encoding/json.
//
// It returns an error matching [ErrNotObject] when the payload is not a
// single JSON object. It does not check the rest of the envelope: use
// [Parse] for that.
func ReadIdentity(payload []byte) (Identity, error) {
	return readIdentity(payload, false)
}

func readIdentity(payload []byte, fingerprint bool) (Identity, error) {
	s := scanner{data: payload}
	var id Identity
	var job, urn, data uint64
	s.skipSpace()
	if !s.consume('{') {
		return Identity{}, errNotObject
	}
	s.skipSpace()
	if s.consume('}') {
		if fingerprint {
			id.Fingerprint = intent(0, 0)
		}
		return id, s.end()
	}
	for {
		name, ok := s.memberName()
		if !ok {
			return Identity{}, errNotObject
		}
		switch {
		case string(name) == "meta":
			// The last "meta" wins, like encoding/json; a non-object meta
			// leaves no identity at all.
			id = Identity{}
			if s.peek() == '{' {
				if !s.readMeta(&id) {
					return Identity{}, errNotObject
				}
			} else if !s.skipValue(1) {
				return Identity{}, errNotObject
			}
		case fingerprint && string(name) == "data":
			if data, ok = s.hashValue(1); !ok {
				return Identity{}, errNotObject
			}
		case fingerprint && (string(name) == "job" || string(name) == "urn") && s.peek() != '"':
			// Not a string (null): no job by that name, as with Parse; the
			// last member wins.
			if !s.skipValue(1) {
				return Identity{}, errNotObject
			}
			if string(name) == "job" {
				job = 0
			} else {
				urn = 0
			}
		case fingerprint && (string(name) == "job" || string(name) == "urn"):
			raw, escaped, ok := s.readString()
			if !ok {
				return Identity{}, errNotObject
			}
			var h uint64
			if len(raw) > 0 {
				if h, ok = hashString(raw, escaped, s.nonASCII); !ok {
					return Identity{}, errNotObject
				}
			}
			if string(name) == "job" {
				job = h
			} else {
				urn = h
			}
		default:
			if !s.skipValue(1) {
				return Identity{}, errNotObject
			}
		}
		s.skipSpace()
		if s.consume(',') {
			s.skipSpace()
			continue
		}
		if s.consume('}') {
			if fingerprint {
				if job == 0 { // no job: the urn alias names the message
					job = urn
				}
				id.Fingerprint = intent(job, data)
			}
			return id, s.end()
		}
		return Identity{}, errNotObject
	}
}

var errNotObject = fmt.Errorf("%w: %w", ErrInvalid, ErrNotObject)

type scanner struct {
	data []byte
	pos  int

	// The members of the objects being fingerprinted, innermost last, to
	// let a later member replace an earlier one of the same name; names
	// indexes the large objects among them by where their members start.
	// The first stackMembers live in the scanner itself (no allocation
	// for the usual payload), the others in more.
	nonASCII bool // the last string read holds a byte that is not ASCII

	nmembers int
	stack    [stackMembers]member
	more     []member
	names    map[int]map[uint64]int
}

func (s *scanner) peek() byte {
	if s.pos < len(s.data) {
		return s.data[s.pos]
	}
	return 0
}

func (s *scanner) consume(c byte) bool {
	if s.pos < len(s.data) && s.data[s.pos] == c {
		s.pos++
		return true
	}
	return false
}

func (s *scanner) skipSpace() {
	for s.pos < len(s.data) {
		switch s.data[s.pos] {
		case ' ', '\t', '\r', '\n':
			s.pos++
		default:
			return
		}
	}
}

// end checks that nothing but white space follows the top-level value.
func (s *scanner) end() error {
	s.skipSpace()
	if s.pos != len(s.data) {
		return errNotObject
	}
	return nil
}

// memberName reads `"name" :` and leaves the scanner before the value. The
// name aliases the payload unless it holds escapes, which are decoded.
func (s *scanner) memberName() ([]byte, bool) {
	raw, escaped, ok := s.readString()
	if !ok {
		return nil, false
	}
	s.skipSpace()
	if !s.consume(':') {
		return nil, false
	}
	s.skipSpace()
	if escaped {
		name, ok := unescape(raw)
		return []byte(name), ok
	}
	return raw, true
}

// readMeta reads the meta object, filling id; the scanner is at '{'.
func (s *scanner) readMeta(id *Identity) bool {
	s.pos++ // '{'
	s.skipSpace()
	if s.consume('}') {
		return true
	}
	for {
		name, ok := s.memberName()
		if !ok {
			return false
		}
		start := s.pos
		switch string(name) {
		case "id":
			if s.peek() == '"' {
				raw, escaped, ok := s.readString()
				if !ok {
					return false
				}
				id.HasID = true
				if escaped {
					if id.ID, ok = unescape(raw); !ok {
						return false
					}
				} else {
					id.ID = string(raw)
				}
			} else {
				if !s.skipValue(2) {
					return false
				}
				id.ID, id.HasID = "", false
			}
		case "schema_version":
			if !s.skipValue(2) {
				return false
			}
			raw := s.data[start:s.pos]
			id.HasSchemaVersion = string(raw) != "null"
			id.SchemaVersion = -1
			if v, ok := wholeNumber(raw); ok && v >= -1<<31 && v < 1<<31 {
				id.SchemaVersion = int(v)
			}
			if !id.HasSchemaVersion {
				id.SchemaVersion = 0
			}
		case "created_at":
			if !s.skipValue(2) {
				return false
			}
			id.CreatedAt, _ = wholeNumber(s.data[start:s.pos])
		default:
			if !s.skipValue(2) {
				return false
			}
		}
		s.skipSpace()
		if s.consume(',') {
			s.skipSpace()
			continue
		}
		return s.consume('}')
	}
}

// readString reads a JSON string at the scanner and returns its raw content
// (without quotes) and whether it holds escapes. It validates escapes and
// rejects raw control characters, as encoding/json does.
func (s *scanner) readString() (raw []byte, escaped bool, ok bool) {
	if !s.consume('"') {
		return nil, false, false
	}
	start := s.pos
	var seen byte // every byte ORed: bit 7 set when one is not ASCII
	for s.pos < len(s.data) {
		c := s.data[s.pos]
		if plainStringByte[c] {
			seen |= c
			s.pos++
			continue
		}
		switch {
		case c == '"':
			raw = s.data[start:s.pos]
			s.pos++
			s.nonASCII = seen >= 0x80
			return raw, escaped, true
		case c == '\\':
			escaped = true
			s.pos++
			if s.pos >= len(s.data) {
				return nil, false, false
			}
			switch s.data[s.pos] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				s.pos++
			case 'u':
				if s.pos+5 > len(s.data) {
					return nil, false, false
				}
				for _, h := range s.data[s.pos+1 : s.pos+5] {
					if !isHex(h) {
						return nil, false, false
					}
				}
				s.pos += 5
			default:
				return nil, false, false
			}
		case c < 0x20:
			return nil, false, false
		default:
			s.pos++
		}
	}
	return nil, false, false
}

// plainStringByte marks the bytes that stand for themselves inside a JSON
// string: everything but '"', '\\' and control characters. It is never
// written after initialisation.
var plainStringByte = func() (t [256]bool) {
	for c := 0x20; c < 256; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

func isHex(c byte) bool {
	return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')
}

// unescape decodes the raw content of a JSON string holding escapes, with
// encoding/json's rules (a lone surrogate becomes U+FFFD).
func unescape(raw []byte) (string, bool) {
	quoted := make([]byte, 0, len(raw)+2)
	quoted = append(append(append(quoted, '"'), raw...), '"')
	var out string
	if err := json.Unmarshal(quoted, &out); err != nil {
		return "", false
	}
	return out, true
}

// skipValue skips one JSON value, validating it, without recursion. depth is
// the nesting depth of the container holding the value.
func (s *scanner) skipValue(depth int) bool {
	var stackBuf [32]byte
	stack := stackBuf[:0] // open containers: '{' or '['
	for {
		// A value starts here.
		s.skipSpace()
		switch s.peek() {
		case '{':
			if depth+len(stack)+1 > maxDepth {
				return false
			}
			s.pos++
			s.skipSpace()
			if !s.consume('}') {
				stack = append(stack, '{')
				if _, _, ok := s.readString(); !ok {
					return false
				}
				s.skipSpace()
				if !s.consume(':') {
					return false
				}
				continue
			}
		case '[':
			if depth+len(stack)+1 > maxDepth {
				return false
			}
			s.pos++
			s.skipSpace()
			if !s.consume(']') {
				stack = append(stack, '[')
				continue
			}
		case '"':
			if _, _, ok := s.readString(); !ok {
				return false
			}
		case 't':
			if !s.literal("true") {
				return false
			}
		case 'f':
			if !s.literal("false") {
				return false
			}
		case 'n':
			if !s.literal("null") {
				return false
			}
		default:
			if !s.number() {
				return false
			}
		}
		// A value ended: close containers until one wants another member.
		for {
			if len(stack) == 0 {
				return true
			}
			s.skipSpace()
			top := stack[len(stack)-1]
			if s.consume(',') {
				if top == '{' {
					s.skipSpace()
					if _, _, ok := s.readString(); !ok {
						return false
					}
					s.skipSpace()
					if !s.consume(':') {
						return false
					}
				}
				break
			}
			if (top == '{' && s.consume('}')) || (top == '[' && s.consume(']')) {
				stack = stack[:len(stack)-1]
				continue
			}
			return false
		}
	}
}

func (s *scanner) literal(word string) bool {
	if len(s.data)-s.pos >= len(word) && string(s.data[s.pos:s.pos+len(word)]) == word {
		s.pos += len(word)
		return true
	}
	return false
}

// number skips a JSON number: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
func (s *scanner) number() bool {
	s.consume('-')
	switch c := s.peek(); {
	case c == '0':
		s.pos++
	case c >= '1' && c <= '9':
		s.digits()
	default:
		return false
	}
	if s.consume('.') {
		if !s.digits() {
			return false
		}
	}
	if c := s.peek(); c == 'e' || c == 'E' {
		s.pos++
		if c := s.peek(); c == '+' || c == '-' {
			s.pos++
		}
		if !s.digits() {
			return false
		}
	}
	return true
}

func (s *scanner) digits() bool {
	start := s.pos
	for s.pos < len(s.data) && s.data[s.pos] >= '0' && s.data[s.pos] <= '9' {
		s.pos++
	}
	return s.pos > start
}

// Fingerprint returns a 64-bit fingerprint of the envelope's intent: its job
// (or urn alias) and its data, insensitive to the order of object members
// and to white space, and blind to everything else (meta, attempts,
// dead_letter, trace_id). Two deliveries with the same meta.id and different
// fingerprints are one id reused for two different messages, which the
// middleware rejects as a conflict rather than skipping as a duplicate.
//
// Strings are compared by their decoded value ("é" and "\u00e9" are equal;
// invalid UTF-8 decodes to U+FFFD, as with encoding/json), numbers by their
// exact decimal value however they are spelled (1, 1.0, 1e0 and 10e-1 are
// equal, -0 is 0, and digits beyond float64's precision count), and an
// object's members as a set of name/value pairs in which the last of two
// members with one name wins, as with encoding/json and Parse. It returns an
// error matching ErrNotObject when the payload is not a JSON object.
func Fingerprint(payload []byte) (uint64, error) {
	id, err := ReadIdentityFingerprint(payload)
	return id.Fingerprint, err
}

// ReadIdentityFingerprint is ReadIdentity that also fills
// Identity.Fingerprint, in the same pass over the payload.
func ReadIdentityFingerprint(payload []byte) (Identity, error) {
	return readIdentity(payload, true)
}

// Hashing: a word-at-a-time variant of FNV over bytes, a splitmix64 finaliser to mix, and a type tag
// per JSON kind so that "1" and 1, or [] and {}, differ.
const (
	fnvOffset = 14695981039346656037
	fnvPrime  = 1099511628211

	tagObject = 0x6f626a6563740000
	tagArray  = 0x6172726179000000
	tagString = 0x737472696e670000
	tagNumber = 0x6e756d6265720000
	tagTrue   = 0x7472756500000001
	tagFalse  = 0x66616c7365000002
	tagNull   = 0x6e756c6c00000003
	tagJob    = 0x6a6f620000000000
	tagData   = 0x6461746100000000
)

// fnv hashes b into h: eight bytes a step (multiply and fold), then FNV-1a
// for the tail. It is deterministic across processes and machines, as kept
// fingerprints must be.
func fnv(h uint64, b []byte) uint64 {
	for len(b) >= 8 {
		h = (h ^ binary.LittleEndian.Uint64(b)) * 0x9e3779b97f4a7c15
		h ^= h >> 32
		b = b[8:]
	}
	for _, c := range b {
		h ^= uint64(c)
		h *= fnvPrime
	}
	return h
}

// intent combines the job and data hashes into the fingerprint. It is never
// 0, which stores use for "no fingerprint kept".
func intent(job, data uint64) uint64 {
	fp := fphash.Mix(fphash.Mix(tagJob^job) + fphash.Mix(tagData^data))
	if fp == 0 {
		fp = 1
	}
	return fp
}

// hashString hashes the decoded value of a JSON string's raw content;
// nonASCII tells that it holds bytes that may be invalid UTF-8.
func hashString(raw []byte, escaped, nonASCII bool) (uint64, bool) {
	if escaped || (nonASCII && !utf8.Valid(raw)) {
		s, ok := unescape(raw)
		if !ok {
			return 0, false
		}
		return fphash.Mix(fnv(fnvOffset^tagString, []byte(s))), true
	}
	return fphash.Mix(fnv(fnvOffset^tagString, raw)), true
}

// hashValue hashes the JSON value at the scanner, validating it as
// skipValue does. depth is the nesting depth of the container holding it.
func (s *scanner) hashValue(depth int) (uint64, bool) {
	s.skipSpace()
	start := s.pos
	switch s.peek() {
	case '{':
		if depth+1 > maxDepth {
			return 0, false
		}
		s.pos++
		s.skipSpace()
		var sum, n uint64
		base := s.nmembers
		if !s.consume('}') {
			for {
				raw, escaped, ok := s.readString()
				if !ok {
					return 0, false
				}
				name, ok := hashString(raw, escaped, s.nonASCII)
				if !ok {
					return 0, false
				}
				s.skipSpace()
				if !s.consume(':') {
					return 0, false
				}
				value, ok := s.hashValue(depth + 1)
				if !ok {
					return 0, false
				}
				// Members combine by addition: their order does not count.
				// A later member with the same name replaces the earlier.
				m := fphash.Mix(name ^ fphash.Mix(value+0x9e3779b97f4a7c15))
				if prev, dup := s.member(base, name, m); dup {
					sum -= prev
				} else {
					n++
				}
				sum += m
				s.skipSpace()
				if s.consume(',') {
					s.skipSpace()
					continue
				}
				if s.consume('}') {
					break
				}
				return 0, false
			}
		}
		s.dropMembers(base)
		return fphash.Mix(tagObject ^ sum ^ n*fnvPrime), true
	case '[':
		if depth+1 > maxDepth {
			return 0, false
		}
		s.pos++
		s.skipSpace()
		h := uint64(tagArray)
		if !s.consume(']') {
			for {
				v, ok := s.hashValue(depth + 1)
				if !ok {
					return 0, false
				}
				h = fphash.Mix(h*fnvPrime ^ v)
				s.skipSpace()
				if s.consume(',') {
					continue
				}
				if s.consume(']') {
					break
				}
				return 0, false
			}
		}
		return h, true
	case '"':
		raw, escaped, ok := s.readString()
		if !ok {
			return 0, false
		}
		return hashString(raw, escaped, s.nonASCII)
	case 't':
		return tagTrue, s.literal("true")
	case 'f':
		return tagFalse, s.literal("false")
	case 'n':
		return tagNull, s.literal("null")
	default:
		if !s.number() {
			return 0, false
		}
		return hashNumber(s.data[start:s.pos]), true
	}
}

// member is an object member already hashed: its name and its share of the
// object's hash.
type member struct{ name, share uint64 }

// smallObject is how many members an object may have before duplicate names
// are looked up in a map rather than by a scan.
const smallObject = 32

// stackMembers is how many members the scanner tracks without allocating.
const stackMembers = 16

// memberAt returns the i-th tracked member.
func (s *scanner) memberAt(i int) *member {
	if i < stackMembers {
		return &s.stack[i]
	}
	return &s.more[i-stackMembers]
}

// member records the member name with share for the object whose members
// start at base, and returns the share of an earlier member of that name.
func (s *scanner) member(base int, name, share uint64) (prev uint64, dup bool) {
	count := s.nmembers - base
	if count < smallObject {
		for i := base; i < s.nmembers; i++ {
			if m := s.memberAt(i); m.name == name {
				prev, m.share = m.share, share
				return prev, true
			}
		}
	} else {
		if s.names == nil {
			s.names = map[int]map[uint64]int{}
		}
		index := s.names[base]
		if index == nil {
			index = make(map[uint64]int, 2*count)
			for i := base; i < s.nmembers; i++ {
				index[s.memberAt(i).name] = i
			}
			s.names[base] = index
		}
		if i, ok := index[name]; ok {
			m := s.memberAt(i)
			prev, m.share = m.share, share
			return prev, true
		}
		index[name] = s.nmembers
	}
	if s.nmembers < stackMembers {
		s.stack[s.nmembers] = member{name, share}
	} else {
		s.more = append(s.more[:s.nmembers-stackMembers], member{name, share})
	}
	s.nmembers++
	return 0, false
}

// dropMembers forgets the members of the object that started at base.
func (s *scanner) dropMembers(base int) {
	s.nmembers = base
	if s.names != nil {
		delete(s.names, base)
	}
}

// hashNumber hashes a valid JSON number by its exact value: the hash of its
// canonical spelling. The canonical spelling has no leading or trailing
// zeros, no plus sign and no negative zero; it is written
//
//   - as an integer when the value is whole and that takes at most 21
//     zeros after its significant digits: 100, 123456789012345678901234567890;
//   - as a decimal fraction when the value is not whole and its first
//     significant digit is at most the sixth after the point: 1.5, 0.000001;
//   - otherwise in exponent form, d.ddde±x: 1e+400, 1.5e-7.
//
// Numbers already spelled that way (the usual integers and decimals) hash as
// their text, without a copy.
func hashNumber(text []byte) uint64 {
	if canonicalNumber(text) {
		return fphash.Mix(fnv(fnvOffset^tagNumber, text))
	}
	var buf [64]byte
	return fphash.Mix(fnv(fnvOffset^tagNumber, appendCanonicalNumber(buf[:0], text)))
}

// canonicalNumber reports whether text, a valid JSON number, is already in
// canonical spelling.
func canonicalNumber(text []byte) bool {
	digits := text
	if len(digits) > 0 && digits[0] == '-' {
		digits = digits[1:]
	}
	dot := -1
	for i, c := range digits {
		switch c {
		case '.':
			dot = i
		case 'e', 'E':
			return false
		}
	}
	if dot < 0 {
		if len(digits) == 1 && digits[0] == '0' {
			return len(text) == 1 // "-0" is 0
		}
		zeros := 0
		for i := len(digits) - 1; i >= 0 && digits[i] == '0'; i-- {
			zeros++
		}
		return zeros <= 21
	}
	if digits[len(digits)-1] == '0' {
		return false
	}
	if dot == 1 && digits[0] == '0' {
		// 0.ddd: at most five zeros before the first significant digit.
		lead := 0
		for _, c := range digits[2:] {
			if c != '0' {
				break
			}
			lead++
		}
		return lead <= 5
	}
	return true
}

// appendCanonicalNumber appends the canonical spelling of text, a valid
// JSON number, to b.
func appendCanonicalNumber(b, text []byte) []byte {
	neg := text[0] == '-'
	if neg {
		text = text[1:]
	}
	intPart, rest := text, []byte(nil)
	for i, c := range text {
		if c == '.' || c == 'e' || c == 'E' {
			intPart, rest = text[:i], text[i:]
			break
		}
	}
	var frac, exp []byte
	if len(rest) > 0 && rest[0] == '.' {
		frac = rest[1:]
		rest = nil
		for i, c := range frac {
			if c == 'e' || c == 'E' {
				frac, rest = frac[:i], frac[i:]
				break
			}
		}
	}
	if len(rest) > 0 {
		exp = rest[1:]
	}
	// The significant digits are intPart then frac, leading and trailing
	// zeros dropped; the value is 0.digits × 10^point.
	lead := 0
	for lead < len(intPart) && intPart[lead] == '0' {
		lead++
	}
	var first, last int // significant digits span [first, last) of intPart+frac
	total := len(intPart) + len(frac)
	at := func(i int) byte {
		if i < len(intPart) {
			return intPart[i]
		}
		return frac[i-len(intPart)]
	}
	for first = lead; first < total && at(first) == '0'; first++ {
	}
	if first == total {
		return append(b, '0')
	}
	for last = total; at(last-1) == '0'; last-- {
	}
	n := last - first
	shift := int64(len(intPart) - first) // the point position before the exponent
	if neg {
		b = append(b, '-')
	}
	point, huge := exponent(exp)
	if !huge {
		point += shift
		switch {
		case point >= int64(n) && point-int64(n) <= 21:
			for i := first; i < last; i++ {
				b = append(b, at(i))
			}
			for range point - int64(n) {
				b = append(b, '0')
			}
			return b
		case point > 0 && point < int64(n):
			for i := first; i < last; i++ {
				if int64(i-first) == point {
					b = append(b, '.')
				}
				b = append(b, at(i))
			}
			return b
		case point <= 0 && point > -6:
			b = append(b, '0', '.')
			for range -point {
				b = append(b, '0')
			}
			for i := first; i < last; i++ {
				b = append(b, at(i))
			}
			return b
		}
	}
	b = append(b, at(first))
	if n > 1 {
		b = append(b, '.')
		for i := first + 1; i < last; i++ {
			b = append(b, at(i))
		}
	}
	b = append(b, 'e')
	if !huge {
		if point-1 >= 0 {
			b = append(b, '+')
		}
		return strconv.AppendInt(b, point-1, 10)
	}
	// An exponent beyond int64: exact arithmetic.
	e, _ := new(big.Int).SetString(string(exp), 10)
	e.Add(e, big.NewInt(shift-1))
	if e.Sign() >= 0 {
		b = append(b, '+')
	}
	return e.Append(b, 10)
}

// exponent reads the exponent digits of a JSON number ("", "5", "+5",
// "-05"); huge reports one too large for exact int64 arithmetic with a
// payload's digit counts.
func exponent(exp []byte) (v int64, huge bool) {
	if len(exp) == 0 {
		return 0, false
	}
	neg := exp[0] == '-'
	if exp[0] == '-' || exp[0] == '+' {
		exp = exp[1:]
	}
	for len(exp) > 1 && exp[0] == '0' {
		exp = exp[1:]
	}
	if len(exp) > 17 {
		return 0, true
	}
	for _, c := range exp {
		v = v*10 + int64(c-'0')
	}
	if neg {
		v = -v
	}
	return v, false
}

// ReadTraceID returns the envelope's trace_id, or "" when there is none. It
// does not decode the rest of the payload.
func ReadTraceID(payload []byte) string {
	s := scanner{data: payload}
	s.skipSpace()
	if !s.consume('{') {
		return ""
	}
	var traceID string
	s.skipSpace()
	if s.consume('}') {
		return ""
	}
	for {
		name, ok := s.memberName()
		if !ok {
			return traceID
		}
		if string(name) == "trace_id" && s.peek() == '"' {
			raw, escaped, ok := s.readString()
			if !ok {
				return traceID
			}
			traceID = string(raw)
			if escaped {
				traceID, _ = unescape(raw)
			}
		} else if !s.skipValue(1) {
			return traceID
		}
		s.skipSpace()
		if !s.consume(',') {
			return traceID
		}
		s.skipSpace()
	}
}

// errNotJSON is returned by FingerprintJSON for a payload that is not one
// JSON value.
var errNotJSON = fmt.Errorf("%w: the payload is not a single JSON value", ErrInvalid)

// FingerprintJSON returns a 64-bit fingerprint of payload, any single JSON
// value, hashed as Fingerprint hashes an envelope's data: insensitive to the
// order of object members, to white space and to string escapes. It is for
// messages that are not envelopes, whose whole payload is their content.
// It validates payload as it goes, agreeing with encoding/json, and returns
// an error matching ErrInvalid when payload is not exactly one JSON value.
func FingerprintJSON(payload []byte) (uint64, error) {
	s := scanner{data: payload}
	h, ok := s.hashValue(0)
	if !ok || s.end() != nil {
		return 0, errNotJSON
	}
	return h, nil
}
