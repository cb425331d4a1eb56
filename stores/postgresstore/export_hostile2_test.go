package postgresstore

// PoolStatements returns, by name, the statements the store runs on db's
// pool besides those of Statements: the plans of all of them are checked
// on a table grown from empty.
func (s *Store) PoolStatements() map[string]string {
	return map[string]string{
		"extend":           s.extendSQL,
		"extend-many":      s.extendManySQL,
		"claim-many":       s.claimManySQL,
		"takeover":         s.takeoverSQL,
		"release":          s.releaseSQL,
		"remember-tx":      s.rememberTxSQL,
		"forget":           s.forgetSQL,
		"fail":             s.failure.fail,
		"fail-row":         s.failure.failRow,
		"reopen":           s.failure.reopen,
		"remember-failing": s.failure.rememberFailing,
	}
}
