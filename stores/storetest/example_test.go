package storetest_test

import (
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/stores/storetest"
)

// Run the suite from a test in your store's package:
//
//	func TestContract(t *testing.T) { storetest.Run(t, newStore, options...) }
//
// Here it runs on memstore, through testing.RunTests so that the example can
// report the verdict; go test reports it for your TestContract.
func ExampleRun() {
	contract := func(t *testing.T) {
		storetest.Run(t,
			func(t *testing.T) stores.Store { return memstore.New() },
			storetest.WithTTLStore(func(t *testing.T, ttl time.Duration) stores.Store {
				return memstore.New(memstore.WithTTL(ttl))
			}))
	}
	passed := runTest("TestContract", contract)
	fmt.Println("memstore keeps the contract:", passed)
	// Output:
	// memstore keeps the contract: true
}

// runTest runs test as go test runs a Test function and reports whether it
// passed. The test's own progress lines (printed with go test -v) go to
// /dev/null rather than into the example's output.
func runTest(name string, test func(*testing.T)) bool {
	stdout := os.Stdout
	if devNull, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0); err == nil {
		os.Stdout = devNull
		defer func() { os.Stdout = stdout; _ = devNull.Close() }()
	}
	all := func(string, string) (bool, error) { return true, nil }
	return testing.RunTests(all, []testing.InternalTest{{Name: name, F: test}})
}
