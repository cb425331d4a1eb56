package envelope

import "encoding/binary"

// Fingerprint returns a 64-bit fingerprint of the envelope's intent: its job
// (or urn alias) and its data, insensitive to the order of object members
// and to white space, and blind to everything else (meta, attempts,
// dead_letter, trace_id). Two deliveries with the same meta.id and different
// fingerprints are one id reused for two different messages (SPEC §7).
//
// Strings are compared by their decoded value ("é" and "\u00e9" are equal),
// numbers by their text (1 and 1.0 differ), and an object's members as a set
// of name/value pairs. It returns an error matching ErrNotObject when the
// payload is not a JSON object.
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

func mix(h uint64) uint64 {
	h ^= h >> 30
	h *= 0xbf58476d1ce4e5b9
	h ^= h >> 27
	h *= 0x94d049bb133111eb
	h ^= h >> 31
	return h
}

// intent combines the job and data hashes into the fingerprint. It is never
// 0, which stores use for "no fingerprint kept".
func intent(job, data uint64) uint64 {
	fp := mix(mix(tagJob^job) + mix(tagData^data))
	if fp == 0 {
		fp = 1
	}
	return fp
}

// hashString hashes the decoded value of a JSON string's raw content.
func hashString(raw []byte, escaped bool) (uint64, bool) {
	if escaped {
		s, ok := unescape(raw)
		if !ok {
			return 0, false
		}
		return mix(fnv(fnvOffset^tagString, []byte(s))), true
	}
	return mix(fnv(fnvOffset^tagString, raw)), true
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
		if !s.consume('}') {
			for {
				raw, escaped, ok := s.readString()
				if !ok {
					return 0, false
				}
				name, ok := hashString(raw, escaped)
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
				sum += mix(name ^ mix(value+0x9e3779b97f4a7c15))
				n++
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
		return mix(tagObject ^ sum ^ n*fnvPrime), true
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
				h = mix(h*fnvPrime ^ v)
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
		return hashString(raw, escaped)
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
		return mix(fnv(fnvOffset^tagNumber, s.data[start:s.pos])), true
	}
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
