package testenv

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"
)

// SyncBuffer is a bytes.Buffer safe for concurrent writes and reads.
type SyncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

// Write appends p.
func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.buf.Write(p)
}

// String returns what was written so far.
func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.buf.String()
}

// SlogLines is what CaptureSlog captured: the lines written through
// slog.Default() since, at every level from debug up.
type SlogLines struct{ SyncBuffer }

// Where returns the captured lines (decoded JSON objects: "level", "msg"
// and the attributes) whose attribute key equals value, in order.
func (s *SlogLines) Where(t testing.TB, key, value string) []map[string]any {
	t.Helper()
	text := s.String()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(text), "\n") {
		if line == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("a captured log line is not JSON: %v\n%s", err, line)
		}
		if v, ok := m[key].(string); ok && v == value {
			out = append(out, m)
		}
	}
	return out
}

// CaptureSlog makes slog.Default() write JSON lines, debug included, to the
// returned SlogLines until the test ends, when the previous default comes
// back. slog.Default() is the process's: a test calling it must not run in
// parallel (call it before t.Parallel would, i.e. not at all: a test that
// does not call t.Parallel runs alone, before the parallel ones resume), and
// should look only at lines of its own messages.
func CaptureSlog(t testing.TB) *SlogLines {
	t.Helper()
	lines := &SlogLines{}
	previous := slog.Default()
	slog.SetDefault(slog.New(slog.NewJSONHandler(lines, &slog.HandlerOptions{Level: slog.LevelDebug})))
	t.Cleanup(func() { slog.SetDefault(previous) })
	return lines
}

// Eventually polls cond every 5ms until it holds, and fails the test
// naming what it waited for after 10 seconds.
func Eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after 10s waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
