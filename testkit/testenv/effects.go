package testenv

import (
	"fmt"
	"sync"
)

// Effects counts a handler's runs per meta.id, safe for concurrent use; the
// zero value is ready.
type Effects struct {
	mu sync.Mutex
	n  map[string]int
}

// Add counts one run for id.
func (e *Effects) Add(id string) {
	e.mu.Lock()
	if e.n == nil {
		e.n = map[string]int{}
	}
	e.n[id]++
	e.mu.Unlock()
}

// Count returns the runs counted for id.
func (e *Effects) Count(id string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.n[id]
}

// Total returns the runs counted for all ids.
func (e *Effects) Total() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.total()
}

func (e *Effects) total() int {
	s := 0
	for _, n := range e.n {
		s += n
	}
	return s
}

// ExactlyOnce reports the first of ids not run exactly once, or runs
// counted beyond ids.
func (e *Effects) ExactlyOnce(ids []string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	total := e.total()
	for _, id := range ids {
		if e.n[id] != 1 {
			return fmt.Errorf("message %s ran %d times (%d runs for %d messages)", id, e.n[id], total, len(ids))
		}
	}
	if total != len(ids) {
		return fmt.Errorf("%d runs for %d messages", total, len(ids))
	}
	return nil
}
