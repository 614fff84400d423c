package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/pgtest"
	"github.com/leaderelect/leader/postgres"
)

// These tests run Electors on the PostgreSQL lease store against a real
// server and check DESIGN.md's invariants 1 to 5 end to end.

// electionSetup is what newElection gives a test.
type electionSetup struct {
	pool    *pgxpool.Pool
	store   *postgres.LeaseStore
	history *electortest.History
}

// newElection migrates a fresh database and returns a store on it.
func newElection(t testing.TB) electionSetup {
	t.Helper()
	pool := pgtest.NewPool(t)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if err := postgres.Migrate(ctx, pool, postgres.Options{}); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	store, err := postgres.NewLeaseStore(pool, postgres.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(store.Close)
	return electionSetup{pool: pool, store: store, history: electortest.NewHistory()}
}

// elector returns an Elector for instance on store, recording its history.
func (s electionSetup) elector(t testing.TB, store leader.Store, name, instance, id string, ttl time.Duration, edit ...func(*leader.Config)) *leader.Elector {
	t.Helper()
	logger := slog.New(slog.DiscardHandler)
	if os.Getenv("LEADER_TEST_LOG") != "" {
		logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})).With("instance", instance)
	}
	cfg := leader.Config{Name: name, ID: id, TTL: ttl, Logger: logger}
	cfg.OnElected, cfg.OnDemoted = s.history.Hooks(t, instance)
	for _, f := range edit {
		f(&cfg)
	}
	e, err := leader.New(store, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func TestElectorsOnPostgres(t *testing.T) {
	t.Parallel()

	t.Run("five electors elect exactly one leader", func(t *testing.T) {
		t.Parallel()
		s := newElection(t)
		var es []*leader.Elector
		for i := range 5 {
			id := fmt.Sprint("c", i)
			// A TTL long enough that no renewal misses it on a busy
			// machine: the test counts elections.
			e := s.elector(t, s.store, "five", id, id, 10*time.Second)
			es = append(es, e)
			electortest.Run(t, e)
		}
		electortest.Eventually(t, 10*time.Second, "a leader", func() bool { return len(electortest.Leaders(es)) == 1 })
		electortest.Never(t, 2*time.Second, "two leaders at once", func() bool { return len(electortest.Leaders(es)) > 1 })
		if n := len(s.history.Elections()); n != 1 {
			t.Errorf("%d elections while the leader renewed, want 1", n)
		}
	})

	t.Run("a graceful stop hands over through NOTIFY in well under a second, with growing terms", func(t *testing.T) {
		t.Parallel()
		s := newElection(t)
		// A handover that waited for expiry would take up to the TTL:
		// maxHandover is generous for a busy machine and still well under
		// it.
		const (
			ttl         = 30 * time.Second
			maxHandover = 5 * time.Second
		)
		var es []*leader.Elector
		stops := map[*leader.Elector]func(){}
		for i := range 4 {
			id := fmt.Sprint("c", i)
			e := s.elector(t, s.store, "handover", id, id, ttl)
			es = append(es, e)
			stops[e] = electortest.Run(t, e)
		}
		var took []time.Duration
		for range 3 {
			electortest.Eventually(t, 15*time.Second, "a leader", func() bool { return len(electortest.Leaders(es)) == 1 })
			old := electortest.Leaders(es)[0]
			oldTerm := old.Status().Term
			start := time.Now()
			stops[old]()
			es = slices.DeleteFunc(es, func(e *leader.Elector) bool { return e == old })
			electortest.Eventually(t, 3*maxHandover, "a new leader", func() bool { return len(electortest.Leaders(es)) == 1 })
			took = append(took, time.Since(start))
			if term := electortest.Leaders(es)[0].Status().Term; term <= oldTerm {
				t.Errorf("term went from %d to %d", oldTerm, term)
			}
		}
		t.Logf("graceful handover (stop of the old leader to the new one leading): %v", took)
		for _, d := range took {
			if d > maxHandover {
				t.Errorf("handover took %v with a %v TTL: followers were not woken", d, ttl)
			}
		}
	})

	t.Run("after a crash without release another leads within the TTL plus a small bound", func(t *testing.T) {
		t.Parallel()
		s := newElection(t)
		// The follower waits out the lease: a TTL long enough for a busy
		// machine to renew it, and a bound of half a TTL more, which a
		// follower that waited a second TTL would exceed.
		const ttl = 5 * time.Second
		crashable := &crashStore{Store: s.store}
		a := s.elector(t, crashable, "crash", "a", "a", ttl)
		stopA := electortest.Run(t, a)
		electortest.Eventually(t, 10*time.Second, "a to lead", a.IsLeader)
		b := s.elector(t, s.store, "crash", "b", "b", ttl)
		electortest.Run(t, b)
		electortest.Eventually(t, 10*time.Second, "b to follow a", func() bool { return b.Status().Leader == "a" })

		// The process dies: no more renewals and no release.
		crashable.crash()
		start := time.Now()
		stopA()
		electortest.Eventually(t, 3*ttl, "b to lead", b.IsLeader)
		took := time.Since(start)
		t.Logf("failover after a crash: %v (TTL %v)", took, ttl)
		if took > ttl+ttl/2 {
			t.Errorf("failover took %v; want at most TTL %v plus half a TTL", took, ttl)
		}
	})

	t.Run("instances sharing an ID still elect one leader", func(t *testing.T) {
		t.Parallel()
		s := newElection(t)
		var es []*leader.Elector
		for i := range 3 {
			// A TTL long enough that no renewal misses it on a busy
			// machine: the test counts elections.
			e := s.elector(t, s.store, "dup", fmt.Sprint("instance", i), "same-id", 10*time.Second)
			es = append(es, e)
			electortest.Run(t, e)
		}
		electortest.Eventually(t, 10*time.Second, "a leader", func() bool { return len(electortest.Leaders(es)) == 1 })
		electortest.Never(t, 2*time.Second, "two leaders with one ID", func() bool { return len(electortest.Leaders(es)) > 1 })
		if n := len(s.history.Elections()); n != 1 {
			t.Errorf("%d elections, want 1: instances with the same ID took the lease from each other", n)
		}
	})

	t.Run("a renewal blocked by a row lock makes the leader demote before anyone else is granted the lease", func(t *testing.T) {
		t.Parallel()
		s := newElection(t)
		const ttl = 2 * time.Second
		a := s.elector(t, s.store, "locked", "a", "a", ttl)
		electortest.Run(t, a)
		electortest.Eventually(t, 10*time.Second, "a to lead", a.IsLeader)
		b := s.elector(t, s.store, "locked", "b", "b", ttl)
		electortest.Run(t, b)
		electortest.Eventually(t, 10*time.Second, "b to follow a", func() bool { return b.Status().Leader == "a" })

		// a's renewals write its store's heartbeat row once its first
		// round has moved the lease under it: wait for that, so that the
		// lock below is on the row its renewals write.
		electortest.Eventually(t, 10*time.Second, "a's lease under its heartbeat", func() bool {
			var moved bool
			err := s.pool.QueryRow(t.Context(), "SELECT heartbeat IS NOT NULL FROM leader_leases WHERE name = 'locked'").Scan(&moved)
			if err != nil {
				t.Fatal(err)
			}
			return moved
		})
		// Another transaction takes the locks of the heartbeat row and the
		// lease row, in the store's order: a's renewals (and b's attempts)
		// now wait on them.
		tx, err := s.pool.Begin(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(context.Background()) // if the test ends early: the pool waits for its connection
		for _, lock := range []string{
			"SELECT FROM leader_heartbeats WHERE id = (SELECT heartbeat FROM leader_leases WHERE name = 'locked') FOR UPDATE",
			"SELECT FROM leader_leases WHERE name = 'locked' FOR UPDATE",
		} {
			if _, err := tx.Exec(t.Context(), lock); err != nil {
				t.Fatal(err)
			}
		}
		lockedAt := time.Now()
		electortest.Eventually(t, 3*ttl, "a to demote", func() bool { return !a.IsLeader() })
		demotedAfter := time.Since(lockedAt)
		if b.IsLeader() {
			t.Fatal("b leads while the row is still locked")
		}
		if err := tx.Rollback(t.Context()); err != nil {
			t.Fatal(err)
		}
		// Wait for the history, not IsLeader: OnElected, which records the
		// election, runs on its own goroutine after IsLeader turns true.
		electortest.Eventually(t, 3*ttl, "a new leader", func() bool {
			_, ok := s.history.Find(func(e electortest.Event) bool { return e.Elected && e.Term > 1 })
			return ok
		})
		t.Logf("a demoted %v after the row was locked (TTL %v)", demotedAfter, ttl)
		if demotedAfter >= ttl {
			t.Errorf("a demoted %v after its last possible renewal; its lease could have run out", demotedAfter)
		}
		demoted, _ := s.history.Find(func(e electortest.Event) bool { return e.Instance == "a" && !e.Elected })
		second, ok := s.history.Find(func(e electortest.Event) bool { return e.Elected && e.Term > 1 })
		if !ok || !demoted.At.Before(second.At) {
			t.Errorf("a demoted at %v, not before the next election %+v", demoted.At, second)
		}
	})

	t.Run("a leader on a database turned read-only steps down at once and says why", func(t *testing.T) {
		t.Parallel()
		s := newElection(t)
		var logs electortest.LogBuffer
		a := s.elector(t, s.store, "ro", "a", "a", 30*time.Second, func(c *leader.Config) {
			c.RenewInterval = 100 * time.Millisecond
			c.Logger = slog.New(slog.NewTextHandler(&logs, nil))
		})
		electortest.Run(t, a)
		electortest.Eventually(t, 10*time.Second, "a to lead", a.IsLeader)

		db := s.pool.Config().ConnConfig.Database
		pgtest.Shared(t).Exec(t, "ALTER DATABASE "+pgx.Identifier{db}.Sanitize()+" SET default_transaction_read_only = on")
		s.pool.Reset() // new connections pick up the setting, as after a failover to a replica
		s.store.ResetConnections()
		start := time.Now()
		electortest.Eventually(t, 10*time.Second, "a to step down", func() bool { return !a.IsLeader() })
		if took := time.Since(start); took > 5*time.Second {
			t.Errorf("stepped down after %v; want at once, not at the 30s TTL", took)
		}
		electortest.Eventually(t, 5*time.Second, "the log to say why", func() bool {
			return strings.Contains(logs.String(), "read-only")
		})
	})

	t.Run("under random stops, restarts and resignations no two lead at once and terms only grow", func(t *testing.T) {
		t.Parallel()
		s := newElection(t)
		const n = 4
		type slot struct {
			e    *leader.Elector
			stop func()
		}
		slots := make([]slot, n)
		start := func(i, gen int) {
			id := fmt.Sprintf("c%d", i)
			e := s.elector(t, s.store, "churn", fmt.Sprintf("%s.%d", id, gen), id, time.Second)
			slots[i] = slot{e: e, stop: electortest.Run(t, e)}
		}
		for i := range n {
			start(i, 0)
		}
		rng := rand.New(rand.NewPCG(1, 2))
		for gen := 1; gen <= 30; gen++ {
			i := rng.IntN(n)
			if rng.IntN(2) == 0 { // aim at the leader half the time
				for j, sl := range slots {
					if sl.e.IsLeader() {
						i = j
					}
				}
			}
			act := rng.IntN(3)
			t.Logf("gen %d: slot %d leader=%v act=%d elections=%d", gen, i, slots[i].e.IsLeader(), act, len(s.history.Elections()))
			switch act {
			case 0:
				slots[i].stop()
				start(i, gen)
			case 1:
				if err := slots[i].e.Resign(t.Context()); err != nil && !errors.Is(err, leader.ErrNotLeader) {
					t.Fatal(err)
				}
			case 2:
				time.Sleep(time.Duration(rng.IntN(150)) * time.Millisecond) // let the cluster settle a little
			}
		}
		for i := range n {
			slots[i].stop()
		}
		if len(s.history.Elections()) < 5 {
			t.Errorf("only %d elections: the churn did not exercise handovers", len(s.history.Elections()))
		}
	})
}

// crashStore simulates a process that dies: after crash, calls fail at
// once and nothing reaches the database, so the lease is not released.
type crashStore struct {
	leader.Store
	mu      sync.Mutex
	crashed bool
}

func (c *crashStore) crash() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.crashed = true
}

func (c *crashStore) dead() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.crashed
}

var errCrashed = errors.New("crashed")

func (c *crashStore) Renew(ctx context.Context, name, token string, term uint64, ttl time.Duration) (leader.Lease, error) {
	if c.dead() {
		return leader.Lease{}, errCrashed
	}
	return c.Store.Renew(ctx, name, token, term, ttl)
}

func (c *crashStore) Release(ctx context.Context, name, token string, term uint64) error {
	if c.dead() {
		return errCrashed
	}
	return c.Store.Release(ctx, name, token, term)
}
