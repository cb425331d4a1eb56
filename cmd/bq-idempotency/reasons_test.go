package main

import (
	"strings"
	"testing"

	"github.com/babelqueue/watermill-idempotency/envelope"
)

// TestHelpRedriveListsEveryReason: "help redrive" names every reason the
// dead-letter middleware writes, each with what it means, so an operator
// can select by cause without reading the source.
func TestHelpRedriveListsEveryReason(t *testing.T) {
	t.Parallel()
	code, out, _ := runCLI(t, "help", "redrive")
	if code != 0 {
		t.Fatalf("help redrive exited %d", code)
	}
	for _, reason := range []string{envelope.ReasonFailed, envelope.ReasonUnknownURN, envelope.ReasonPoison,
		envelope.ReasonUnknownOutcome, envelope.ReasonConflict, envelope.ReasonTooOld, envelope.ReasonRejected} {
		found := false
		for _, line := range strings.Split(out, "\n") {
			// A line of the list: the reason, then what it means.
			if f := strings.Fields(line); len(f) > 2 && f[0] == reason {
				found = true
			}
		}
		if !found {
			t.Errorf("help redrive does not list the reason %q with its meaning:\n%s", reason, out)
		}
	}
}
