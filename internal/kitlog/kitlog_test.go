package kitlog_test

import (
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/babelqueue/watermill-idempotency/internal/kitlog"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestDefaultWritesToTheSlogDefaultOfTheMoment: Default() writes where
// slog.Default() points when the line is written, warnings at WARN, fields
// of With included. It replaces the process's slog default: not parallel.
func TestDefaultWritesToTheSlogDefaultOfTheMoment(t *testing.T) {
	l := kitlog.Default().With(watermill.LogFields{"worker": "w1"})
	logs := testenv.CaptureSlog(t)
	kitlog.Warn(l, "careful", errors.New("boom"), watermill.LogFields{"case": "warn"})
	l.Debug("detail", watermill.LogFields{"case": "debug"})
	for c, want := range map[string]string{"warn": "WARN careful boom w1", "debug": "DEBUG detail <nil> w1"} {
		lines := logs.Where(t, "case", c)
		if len(lines) != 1 {
			t.Fatalf("%s: %d lines:\n%s", c, len(lines), logs)
		}
		l := lines[0]
		if got := l["level"].(string) + " " + l["msg"].(string) + " " + toString(l["error"]) + " " + toString(l["worker"]); got != want {
			t.Errorf("%s: %q, want %q", c, got, want)
		}
	}
}

func toString(v any) string {
	if s, ok := v.(string); ok {
		return s
	}
	return "<nil>"
}

// TestWarnOnAnAdapterIsAnError: Watermill's adapters have no warning
// level; a warning goes to Error, with its error.
func TestWarnOnAnAdapterIsAnError(t *testing.T) {
	t.Parallel()
	capture := watermill.NewCaptureLogger()
	boom := errors.New("boom")
	kitlog.Warn(capture, "careful", boom, nil)
	if got := capture.Captured()[watermill.ErrorLogLevel]; len(got) != 1 || got[0].Msg != "careful" || got[0].Err != boom {
		t.Fatalf("captured %+v", capture.Captured())
	}
	if !kitlog.Silent(watermill.NopLogger{}) || kitlog.Silent(capture) || kitlog.Silent(kitlog.Default()) {
		t.Fatal("Silent tells NopLogger from the others wrongly")
	}
}
