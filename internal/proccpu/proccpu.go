// Package proccpu reads how much CPU time a process on this machine has
// used, for the benchmark programs that weigh a variant by the CPU it costs
// the consumer, Redis and PostgreSQL, and the PostgreSQL server's counters
// of the work behind it (transactions, WAL, checkpoints).
package proccpu

import (
	"context"
	"database/sql"
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

// Postgres reads the CPU time of the PostgreSQL processes that serve one
// program: the backends of its connections (those whose application_name
// is App) and the server's own processes (WAL writer, checkpointer,
// autovacuum), not the backends of other work on the same server. DB is
// any connection to that server.
type Postgres struct {
	DB  *sql.DB
	App string
}

// CPU returns the CPU time each of those processes used so far, by pid
// (nil when the server cannot be asked).
func (p Postgres) CPU(ctx context.Context) map[int]time.Duration {
	rows, err := p.DB.QueryContext(ctx, `SELECT pid FROM pg_stat_activity WHERE application_name = $1 OR backend_type <> 'client backend'`, p.App)
	if err != nil {
		return nil
	}
	defer rows.Close()
	used := map[int]time.Duration{}
	for rows.Next() {
		var pid int
		if rows.Scan(&pid) == nil {
			used[pid] = Of(pid)
		}
	}
	return used
}

// Used returns the CPU time those processes used since before (a CPU
// reading): a process that started meanwhile counts whole, one that ended
// is lost.
func (p Postgres) Used(ctx context.Context, before map[int]time.Duration) time.Duration {
	var total time.Duration
	for pid, t := range p.CPU(ctx) {
		total += t - before[pid]
	}
	return total
}

// Counters are a PostgreSQL server's running totals of the work that goes
// with the CPU time: what one run cost is the difference of two readings
// (Sub).
type Counters struct {
	Transactions int64 // committed or rolled back in DB's current database
	WALBytes     int64 // WAL written (PostgreSQL 14 and later)
	WALFullPages int64 // full-page images in it: a page's first change after a checkpoint writes the whole page
	Checkpoints  int64 // checkpoints begun
}

// Counters reads the server's counters; a counter the server cannot tell
// reads 0. A backend reports its transactions to them about once a second,
// so a run shorter than a few seconds reads fewer than it made.
func (p Postgres) Counters(ctx context.Context) Counters {
	var c Counters
	_ = p.DB.QueryRowContext(ctx, `SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()`).Scan(&c.Transactions)
	_ = p.DB.QueryRowContext(ctx, `SELECT wal_bytes::int8, wal_fpi FROM pg_stat_wal`).Scan(&c.WALBytes, &c.WALFullPages)
	// The checkpoints' counters moved to pg_stat_checkpointer in
	// PostgreSQL 17.
	if p.DB.QueryRowContext(ctx, `SELECT num_timed + num_requested FROM pg_stat_checkpointer`).Scan(&c.Checkpoints) != nil {
		_ = p.DB.QueryRowContext(ctx, `SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter`).Scan(&c.Checkpoints)
	}
	return c
}

// Sub returns the work counted between an earlier reading and c.
func (c Counters) Sub(earlier Counters) Counters {
	return Counters{
		Transactions: c.Transactions - earlier.Transactions,
		WALBytes:     c.WALBytes - earlier.WALBytes,
		WALFullPages: c.WALFullPages - earlier.WALFullPages,
		Checkpoints:  c.Checkpoints - earlier.Checkpoints,
	}
}
