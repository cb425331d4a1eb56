// Package proccpu reads how much CPU time a process on this machine has
// used, for the benchmark programs that weigh a variant by the CPU it costs
// the consumer, Redis and PostgreSQL.
package proccpu

import (
	"os"
	"strconv"
	"strings"
	"time"
)

// Of returns the CPU time (user and system) process pid used so far, from
// /proc (Linux); 0 if it cannot tell.
func Of(pid int) time.Duration {
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	// pid (comm) state ...: utime and stime are the 14th and 15th fields,
	// counted after the command, which may hold spaces.
	end := strings.LastIndexByte(string(stat), ')')
	if end < 0 {
		return 0
	}
	fields := strings.Fields(string(stat[end+1:]))
	if len(fields) < 13 {
		return 0
	}
	utime, _ := strconv.ParseInt(fields[11], 10, 64)
	stime, _ := strconv.ParseInt(fields[12], 10, 64)
	return time.Duration(utime+stime) * time.Second / 100 // USER_HZ
}
