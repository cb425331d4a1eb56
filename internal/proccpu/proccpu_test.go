package proccpu_test

import (
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/internal/proccpu"
)

// TestOfCountsThisProcessesWork: the CPU this process spends spinning shows
// in its figure; a process that does not exist reads 0.
func TestOfCountsThisProcessesWork(t *testing.T) {
	t.Parallel()
	if runtime.GOOS != "linux" {
		t.Skip("/proc is Linux's")
	}
	before := proccpu.Of(os.Getpid())
	for start := time.Now(); proccpu.Of(os.Getpid())-before < 50*time.Millisecond; {
		if time.Since(start) > 10*time.Second {
			t.Fatalf("10 s of spinning read as %v of CPU", proccpu.Of(os.Getpid())-before)
		}
	}
	if got := proccpu.Of(1 << 30); got != 0 {
		t.Fatalf("Of(a pid that does not exist) = %v, want 0", got)
	}
}
