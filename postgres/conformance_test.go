package postgres

import (
	"testing"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/pgtest"
	"github.com/leaderelect/leader/leadertest"
)

// TestConformance runs the Store conformance suite, each subtest on a store
// of its own in a fresh database.
func TestConformance(t *testing.T) {
	t.Parallel()
	leadertest.TestStore(t, func(t *testing.T) leader.Store {
		return setupOn(t, pgtest.NewPool(t), Options{}).store
	})
}
