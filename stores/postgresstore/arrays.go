package postgresstore

import (
	"strconv"
	"strings"
)

// The grouped statements take their arrays as PostgreSQL array literals in
// plain string parameters ('{a,b}' cast to uuid[], bigint[] or text[] in
// the statement): every database/sql driver passes a string, where a Go
// slice needs driver-specific support (pgx encodes one, lib/pq refuses it),
// and the server parses the same text either way.

// uuidArray writes keys (RowKey values: hexadecimal and dashes, nothing to
// quote) as an array literal.
func uuidArray(keys []string) string {
	return arrayLiteral(keys, 37, func(b *strings.Builder, k string) { b.WriteString(k) })
}

// int64Array writes values as a bigint array literal; with null, a value
// for which null reports true is written as NULL.
func int64Array(values []int64, null func(int64) bool) string {
	return arrayLiteral(values, 21, func(b *strings.Builder, v int64) {
		if null != nil && null(v) {
			b.WriteString("NULL")
			return
		}
		b.WriteString(strconv.FormatInt(v, 10))
	})
}

// textArray writes values as a text array literal, every element quoted
// (backslash and double quote escaped), so that any string, empty, NULL
// or with commas and braces included, comes back as itself.
func textArray(values []string) string {
	return arrayLiteral(values, 0, func(b *strings.Builder, v string) {
		b.WriteByte('"')
		for j := 0; j < len(v); j++ {
			if c := v[j]; c == '"' || c == '\\' {
				b.WriteByte('\\')
			}
			b.WriteByte(v[j])
		}
		b.WriteByte('"')
	})
}

// arrayLiteral writes {e1,e2,…}, each element by write; size is a guess of
// an element's length, to size the buffer once.
func arrayLiteral[T any](values []T, size int, write func(*strings.Builder, T)) string {
	var b strings.Builder
	b.Grow(2 + len(values)*size)
	b.WriteByte('{')
	for i, v := range values {
		if i > 0 {
			b.WriteByte(',')
		}
		write(&b, v)
	}
	b.WriteByte('}')
	return b.String()
}
