package postgres

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/pgtest"
	"github.com/leaderelect/leader/leadertest"
)

// setupAdvisory returns an AdvisoryStore on pool, migrated with opts, closed
// when t ends.
func setupAdvisory(t *testing.T, pool *pgxpool.Pool, opts Options) *AdvisoryStore {
	t.Helper()
	if err := Migrate(callCtx(t), pool, opts); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	s, err := NewAdvisoryStore(callCtx(t), pool, opts)
	if err != nil {
		t.Fatalf("NewAdvisoryStore: %v", err)
	}
	t.Cleanup(s.Close)
	return s
}

// TestAdvisoryConformance runs the Store conformance suite on the advisory
// strategy, each subtest on a store of its own in a fresh database.
func TestAdvisoryConformance(t *testing.T) {
	t.Parallel()
	leadertest.TestStore(t, func(t *testing.T) leader.Store {
		return setupAdvisory(t, pgtest.NewPool(t), Options{})
	})
}

var _ = context.Background
