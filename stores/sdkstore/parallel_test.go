package sdkstore_test

import (
	"os"
	"testing"

	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestMain runs the tests with testenv.SetParallelism: they wait on
// servers more than on the CPU.
func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }
