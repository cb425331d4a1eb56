//go:build race

package testenv

// raceEnabled reports that the race detector is on.
const raceEnabled = true
