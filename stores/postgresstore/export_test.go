package postgresstore

// Statements returns the SQL the store issues, by name, so the benchmarks can
// issue the very same statements bare beside the middleware.
func (s *Store) Statements() map[string]string {
	return map[string]string{
		"seen-fingerprint": s.seenFingerprintSQL,
		"remember":         s.rememberSQL,
		"claim":            s.claimSQL,
		"claim-row":        s.claimRowSQL,
	}
}
