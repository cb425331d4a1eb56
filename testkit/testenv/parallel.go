package testenv

import (
	"flag"
	"runtime"
	"strconv"
	"testing"
)

// Parallelism is how many parallel tests a package whose TestMain calls
// SetParallelism runs at once, unless -parallel says otherwise or the race
// detector is on. Integration tests spend their time waiting on servers
// (round trips, polls, leases running out), not on the CPU: go test's
// default, GOMAXPROCS, would leave a 2-core machine idle while two tests
// sleep.
const Parallelism = 8

// SetParallelism raises -parallel to Parallelism (or GOMAXPROCS, if that is
// more) when it was not given. Under the race detector it leaves go test's
// default, GOMAXPROCS: there the tests need the CPU, and timing checks
// would suffer. Call it from TestMain before m.Run (RunWithServerExamples
// and Main do).
func SetParallelism() {
	if raceEnabled {
		return
	}
	if !flag.Parsed() {
		flag.Parse()
	}
	given := false
	flag.Visit(func(f *flag.Flag) { given = given || f.Name == "test.parallel" })
	if given {
		return
	}
	if err := flag.Set("test.parallel", strconv.Itoa(max(Parallelism, runtime.GOMAXPROCS(0)))); err != nil {
		panic(err)
	}
}

// Main runs a package's tests with SetParallelism and returns m.Run's exit
// code: func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }.
func Main(m *testing.M) int {
	SetParallelism()
	return m.Run()
}
