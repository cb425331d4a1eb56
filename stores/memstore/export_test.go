package memstore

import "time"

// SetWallClock makes s read the wall clock from now, for a test of a
// wall clock that steps.
func SetWallClock(s *Store, now func() time.Time) { s.wall = now }
