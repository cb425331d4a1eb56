package testenv

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
)

// RunWithServerExamples runs m from a package's TestMain. Examples that talk
// to a server print what they print only when it is there; when probe cannot
// reach it and CI is not set, the named examples are left out (added to
// -test.skip, with a line on stderr saying why), as tests skip. Under CI they
// run, and fail without the server. The tests run with SetParallelism.
func RunWithServerExamples(m *testing.M, what string, probe func(context.Context) error, examples ...string) int {
	SetParallelism()
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	err := probe(ctx)
	cancel()
	if err != nil && os.Getenv("CI") == "" {
		skip := flag.Lookup("test.skip")
		pattern := "^(" + strings.Join(examples, "|") + ")$"
		if current := skip.Value.String(); current != "" {
			pattern = current + "|" + pattern
		}
		if err := skip.Value.Set(pattern); err != nil {
			panic(err)
		}
		fmt.Fprintf(os.Stderr, "%s unreachable (%v): skipping %s\n", what, err, strings.Join(examples, ", "))
	}
	return m.Run()
}
