package envelope

import (
	"encoding/json"
	"fmt"
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
