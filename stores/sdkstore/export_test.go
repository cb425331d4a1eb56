package sdkstore

import "time"

// SetWallClock makes s read the worker's wall clock from now, for a test
// of a worker whose clock is off.
func SetWallClock(s *PHPPDOStore, now func() time.Time) { s.now = now }

// FillClaimMemory makes s remember n claims of other holders, live for
// an hour by the database clock, as a busy instance does.
func FillClaimMemory(s *PHPPDOStore, n int) {
	for i := range n {
		s.keepGen("filler", string(rune(i)), time.Now().Add(time.Hour).Unix(), 3600)
	}
}

// ClaimMemory is how many claims s remembers.
func ClaimMemory(s *PHPPDOStore) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.gens)
}
