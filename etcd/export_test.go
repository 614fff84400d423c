package etcd

import "time"

// Settle is settle, for tests.
func (s *Store) Settle(name, token string, term uint64, began time.Time, ttl time.Duration) {
	s.settle(name, token, term, began, ttl)
}

// Forget makes the Store forget its grant of name to token under term, as
// if the write that made it had failed with an unknown outcome, for tests.
func (s *Store) Forget(name, token string, term uint64) {
	s.forget(name, token, term)
}
