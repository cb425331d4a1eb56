package envelope_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/babelqueue/watermill-idempotency/envelope"
)

func benchPayload(b *testing.B) []byte {
	p, err := os.ReadFile(filepath.Join(conformanceDir, "fixtures", "unicode-and-numbers.json"))
	if err != nil {
		b.Fatal(err)
	}
	var v any
	_ = json.Unmarshal(p, &v)
	compact, _ := json.Marshal(v)
	return compact
}

// BenchmarkReadIdentity compares the identity read with what it replaces.
func BenchmarkReadIdentity(b *testing.B) {
	payload := benchPayload(b)
	b.SetBytes(int64(len(payload)))
	b.Run("ReadIdentity", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := envelope.ReadIdentity(payload); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("ReadIdentityFingerprint", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := envelope.ReadIdentityFingerprint(payload); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("json.Valid", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if !json.Valid(payload) {
				b.Fatal("invalid")
			}
		}
	})
	b.Run("Parse", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := envelope.Parse(payload); err != nil {
				b.Fatal(err)
			}
		}
	})
}
