package memstore

import "time"

// SetWallClock makes s read the wall clock from now, for a test of a
// wall clock that steps.
func SetWallClock(s *Store, now func() time.Time) { s.wall = now }

// NewEffectsWithWallClock returns an Effects store that reads the wall
// clock from wall, for a test of a wall clock that steps.
func NewEffectsWithWallClock(wall func() time.Time, opts ...EffectsOption) *Effects {
	return NewEffects(append(opts, func(e *Effects) { e.wall = wall })...)
}
