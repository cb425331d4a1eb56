package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"github.com/redis/go-redis/v9"
	"golang.org/x/sys/unix"

	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// placer moves this process and the local Redis server between the
// placements -placements names: "shared" (both on every core this process
// may use, as started) and "separate" (Redis on the last of those cores,
// this process on the others with GOMAXPROCS to match, the nearest one
// machine comes to separate hosts). It restores what it changed when done,
// and on an interrupt.
type placer struct {
	self, redis   unix.CPUSet // as they were
	redisPID      int
	maxProcs      int
	stopInterrupt func()
}

func newPlacer(ctx context.Context, admin *redis.Client, names []string) (*placer, error) {
	p := &placer{maxProcs: runtime.GOMAXPROCS(0)}
	if err := unix.SchedGetaffinity(0, &p.self); err != nil {
		return nil, fmt.Errorf("placement: %w", err)
	}
	needRedis := false
	for _, n := range names {
		switch n {
		case "shared":
		case "separate":
			needRedis = true
		default:
			return nil, fmt.Errorf("-placements: %q: want shared or separate", n)
		}
	}
	if !needRedis {
		return p, nil
	}
	if p.self.Count() < 2 {
		return nil, fmt.Errorf("-placements separate: this process may use %d core, want at least 2", p.self.Count())
	}
	info, err := testenv.RedisInfo(ctx, admin, "server")
	if err != nil {
		return nil, fmt.Errorf("placement: %w", err)
	}
	if p.redisPID, err = strconv.Atoi(info["process_id"]); err != nil {
		return nil, fmt.Errorf("placement: Redis reports no process_id: %w", err)
	}
	if comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", p.redisPID)); err != nil || !strings.HasPrefix(string(comm), "redis") {
		return nil, fmt.Errorf("-placements separate needs Redis on this machine: process %d is not redis-server here (%q, %v)", p.redisPID, comm, err)
	}
	if err := unix.SchedGetaffinity(p.redisPID, &p.redis); err != nil {
		return nil, fmt.Errorf("-placements separate needs Redis on this machine (process %d): %w", p.redisPID, err)
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	stop := make(chan struct{})
	go func() {
		select {
		case <-sig:
			p.restore()
			os.Exit(1)
		case <-stop:
		}
	}()
	p.stopInterrupt = func() { signal.Stop(sig); close(stop) }
	return p, nil
}

// place applies the named placement.
func (p *placer) place(name string) error {
	if name == "shared" {
		if p.redisPID != 0 {
			if err := setAffinity(p.redisPID, &p.redis); err != nil {
				return err
			}
		}
		runtime.GOMAXPROCS(p.maxProcs)
		return setAffinity(os.Getpid(), &p.self)
	}
	last := -1
	for c := range 1024 {
		if p.self.IsSet(c) {
			last = c
		}
	}
	var redisCores, own unix.CPUSet
	redisCores.Set(last)
	own = p.self
	own.Clear(last)
	if err := setAffinity(p.redisPID, &redisCores); err != nil {
		return err
	}
	runtime.GOMAXPROCS(own.Count())
	return setAffinity(os.Getpid(), &own)
}

// restore puts this process and Redis back where they were.
func (p *placer) restore() {
	if p.redisPID != 0 {
		_ = setAffinity(p.redisPID, &p.redis)
	}
	_ = setAffinity(os.Getpid(), &p.self)
	runtime.GOMAXPROCS(p.maxProcs)
	if p.stopInterrupt != nil {
		p.stopInterrupt()
	}
}

// setAffinity sets the cores of every thread of process pid (twice, to
// catch threads started meanwhile, which inherit their creator's).
func setAffinity(pid int, set *unix.CPUSet) error {
	for range 2 {
		tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		if err != nil {
			return fmt.Errorf("placement: %w", err)
		}
		for _, t := range tasks {
			tid, err := strconv.Atoi(t.Name())
			if err != nil {
				continue
			}
			if err := unix.SchedSetaffinity(tid, set); err != nil && err != unix.ESRCH {
				return fmt.Errorf("placement: process %d thread %d: %w", pid, tid, err)
			}
		}
	}
	return nil
}
