package crashtest

import (
	"flag"
	"os"
	"strconv"
	"testing"
)

// parallel is how many crash tests run at once when -parallel is not
// given, with the race detector too (where testenv.SetParallelism leaves
// go test's default, GOMAXPROCS). The tests wait on their consumer
// processes, leases, kill intervals and drains, not on the CPU: the whole
// package, every test at once under -race, keeps two cores about a third
// busy. Two at a time, it took five minutes of mostly idle waiting.
const parallel = 8

// TestMain raises -parallel to parallel unless it was given. The consumer
// processes the tests start are this binary too (TestConsumerProcess).
func TestMain(m *testing.M) {
	flag.Parse()
	given := false
	flag.Visit(func(f *flag.Flag) { given = given || f.Name == "test.parallel" })
	if !given {
		if err := flag.Set("test.parallel", strconv.Itoa(parallel)); err != nil {
			panic(err)
		}
	}
	os.Exit(m.Run())
}
