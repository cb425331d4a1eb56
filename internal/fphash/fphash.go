// Package fphash holds the hashing steps the kit's content fingerprints are
// built from. Fingerprints are kept in stores and compared across
// processes, machines and releases, so none of these may ever change its
// output.
package fphash

import (
	"encoding/binary"
	"hash/fnv"
	"io"
)

// Mix is the splitmix64 finaliser: every bit of h spreads over the result.
func Mix(h uint64) uint64 {
	h ^= h >> 30
	h *= 0xbf58476d1ce4e5b9
	h ^= h >> 27
	h *= 0x94d049bb133111eb
	h ^= h >> 31
	return h
}

// Bytes is the FNV-1a hash of b followed by its length (8 bytes, little
// endian): the fingerprint of content that is not JSON.
func Bytes(b []byte) uint64 {
	f := fnv.New64a()
	_, _ = f.Write(b)
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(len(b)))
	_, _ = f.Write(n[:])
	return f.Sum64()
}

// WriteString writes s's length (8 bytes, little endian), then s, so that
// the parts of a hash never run together.
func WriteString(w io.Writer, s string) {
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(len(s)))
	_, _ = w.Write(n[:])
	_, _ = w.Write([]byte(s))
}

// String is the FNV-1a hash of s written by WriteString.
func String(s string) uint64 {
	f := fnv.New64a()
	WriteString(f, s)
	return f.Sum64()
}
