package envelope

import (
	"encoding/binary"
	"math/big"
	"strconv"
	"unicode/utf8"
)

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

// hashString hashes the decoded value of a JSON string's raw content;
// nonASCII tells that it holds bytes that may be invalid UTF-8.
func hashString(raw []byte, escaped, nonASCII bool) (uint64, bool) {
	if escaped || (nonASCII && !utf8.Valid(raw)) {
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
				m := mix(name ^ mix(value+0x9e3779b97f4a7c15))
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
		return mix(fnv(fnvOffset^tagNumber, text))
	}
	var buf [64]byte
	return mix(fnv(fnvOffset^tagNumber, appendCanonicalNumber(buf[:0], text)))
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
