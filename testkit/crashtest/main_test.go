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
// processes, kill intervals, leases and drains, not on the CPU: under
// -race the package took 324 s with the chaos and crash tests one after
// the other, 173 s two at a time (a 2-core machine's default) and about
// 60 s eight at a time, the test binary and its consumers using about 50
// CPU-seconds each way. Every deadline the tests check is minutes, except
// the handover's 10 s (about 5 s eight at a time, as one at a time).
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
