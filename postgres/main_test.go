package postgres

import (
	"context"
	"crypto/rand"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// testBundle is what setup gives a test: a migrated store on a fresh
// database and the pool it uses.
type testBundle struct {
	store *LeaseStore
	pool  *pgxpool.Pool
	// listening receives the listener's backend PID each time it LISTENs.
	listening chan uint32
}

// setup returns a LeaseStore with default options on a fresh, migrated
// database, closed when t ends.
func setup(t *testing.T) testBundle {
	t.Helper()
	pool := pgtest.NewPool(t)
	return setupOn(t, pool, Options{})
}

func setupOn(t *testing.T, pool *pgxpool.Pool, opts Options) testBundle {
	t.Helper()
	if err := Migrate(callCtx(t), pool, opts); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	s, err := NewLeaseStore(pool, opts)
	if err != nil {
		t.Fatalf("NewLeaseStore: %v", err)
	}
	b := testBundle{store: s, pool: pool, listening: make(chan uint32, 16)}
	s.onListen = func(pid uint32) {
		select {
		case b.listening <- pid:
		default:
		}
	}
	t.Cleanup(s.Close)
	return b
}

// callCtx returns a context for one call, bounded generously.
func callCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// candidate returns a candidate with id and a fresh random token.
func candidate(id string) leader.Candidate {
	return leader.Candidate{ID: id, Token: rand.Text()}
}
