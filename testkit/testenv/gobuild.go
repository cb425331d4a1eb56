package testenv

import "os/exec"

// GoBuild returns the command of a go build with args that a test runs of
// its own (a command it then runs as a user would, or code it only
// compiles). Under the race detector the build is a -race one: it reuses
// the packages the test's own build compiled, instead of compiling every
// dependency a second time without the detector, and a command the test
// runs is checked for races as the test is.
func GoBuild(args ...string) *exec.Cmd {
	flags := []string{"build"}
	if raceEnabled {
		flags = append(flags, "-race")
	}
	return exec.Command("go", append(flags, args...)...)
}
