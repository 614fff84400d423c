package postgres

// StagedCommits returns how many staged releases store, a *LeaseStore or
// an *AdvisoryStore, has committed (see "Staged handovers" in the package
// documentation), for the tests of the postgres_test package.
func StagedCommits(store any) int64 {
	switch s := store.(type) {
	case *LeaseStore:
		return s.stagedCommits.Load()
	case *AdvisoryStore:
		return s.stagedCommits.Load()
	}
	return -1
}
