package main

import (
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// burn spends d of this thread's CPU time, on this thread: a cost known
// exactly, whatever the machine's speed and whoever else runs, against
// which a measurement of what the kit costs can be checked.
func burn(d time.Duration) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var ts unix.Timespec
	if unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts) != nil {
		return
	}
	until := time.Duration(ts.Nano()) + d
	for x := 0; ; x++ {
		if x%64 == 0 {
			if unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts) != nil || time.Duration(ts.Nano()) >= until {
				return
			}
		}
	}
}
