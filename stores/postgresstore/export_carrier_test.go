package postgresstore

// GroupQueued is how many calls wait in the queue of s's group of kind
// ("claims", "lookups", "remembers", "extends" or "session"), for a test
// to know a call queued behind a running statement without sleeping.
func (s *Store) GroupQueued(kind string) int {
	g := map[string]*group{"claims": s.claims, "lookups": s.seens, "remembers": s.remembers, "extends": s.extends, "session": s.sessOps}[kind]
	if g == nil {
		return 0
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.queue)
}
