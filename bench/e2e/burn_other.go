//go:build !linux

package main

import "time"

// burn spends about d of CPU time (elsewhere than Linux, by the wall
// clock: a preempted burn spends less).
func burn(d time.Duration) {
	for until := time.Now().Add(d); time.Now().Before(until); {
	}
}
