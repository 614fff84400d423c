package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
)

// bothStrategies returns a lease store and an advisory store on one fresh,
// migrated database, and its pool.
func bothStrategies(t *testing.T) (*LeaseStore, *AdvisoryStore, *pgxpool.Pool) {
	t.Helper()
	b := setup(t)
	return b.store, setupAdvisory(t, b.pool, Options{}), b.pool
}

// storeOf returns the store of strategy s.
func storeOf(s Strategy, lease *LeaseStore, advisory *AdvisoryStore) leader.Store {
	if s == StrategyLease {
		return lease
	}
	return advisory
}

// storeFor returns a store of strategy on pool (migrated), closed when t
// ends.
func storeFor(t *testing.T, strategy Strategy, pool *pgxpool.Pool) leader.Store {
	t.Helper()
	if strategy == StrategyLease {
		s, err := NewLeaseStore(pool, Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Close)
		return s
	}
	return setupAdvisory(t, pool, Options{})
}

// wantConflict checks that err is a refusal of a want candidate because
// the other strategy uses name (held now if held), naming the name and
// both strategies, and wrapping leader.ErrPermanent.
func wantConflict(t *testing.T, err error, name string, want Strategy, held bool) *StrategyConflictError {
	t.Helper()
	var c *StrategyConflictError
	if !errors.As(err, &c) {
		t.Fatalf("Acquire by a %s candidate of %q: %v; want a *StrategyConflictError", want, name, err)
	}
	if c.Name != name || c.Want != want || c.InUse != want.other() || c.Held != held {
		t.Errorf("conflict %+v; want name %q, want %s, in use %s, held %v", *c, name, want, want.other(), held)
	}
	if errors.Is(err, leader.ErrPermanent) != held {
		t.Errorf("conflict %v wraps leader.ErrPermanent: %v; want %v (only while the name is held)", err, errors.Is(err, leader.ErrPermanent), held)
	}
	for _, s := range []string{fmt.Sprintf("%q", name), string(StrategyLease), string(StrategyAdvisory), "one strategy only"} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("conflict %q does not say %q", err, s)
		}
	}
	return c
}

func TestOneStrategyPerName(t *testing.T) {
	t.Parallel()
	const ttl = time.Minute

	for _, first := range []Strategy{StrategyLease, StrategyAdvisory} {
		second := first.other()
		t.Run(fmt.Sprintf("a %s candidate is refused while a %s leader holds the name", second, first), func(t *testing.T) {
			t.Parallel()
			lease, advisory, pool := bothStrategies(t)
			c := candidate("first")
			holder := mustGrant(t, storeOf(first, lease, advisory), "mixed", c, ttl)
			_, granted, err := storeOf(second, lease, advisory).Acquire(callCtx(t), "mixed", candidate("second"), ttl)
			if granted {
				t.Fatalf("a %s candidate was granted %q while a %s leader holds it", second, "mixed", first)
			}
			wantConflict(t, err, "mixed", second, true)
			if got, err := StrategyOf(callCtx(t), pool, Options{}, "mixed"); err != nil || got != first {
				t.Errorf("StrategyOf = %q, %v; want %q", got, err, first)
			}
			// The holder is untouched: it renews under its term.
			if _, err := storeOf(first, lease, advisory).Renew(callCtx(t), "mixed", c.Token, holder.Term, ttl); err != nil {
				t.Errorf("the %s holder's renewal after the refusal: %v", first, err)
			}
		})
	}

	t.Run("candidates of both strategies racing for new names: one strategy wins each", func(t *testing.T) {
		t.Parallel()
		lease, advisory, pool := bothStrategies(t)
		for i := range 5 {
			name := fmt.Sprintf("race-%d", i)
			var (
				mu      sync.Mutex
				granted = map[Strategy]int{}
				wg      sync.WaitGroup
			)
			for j := range 6 {
				s := []Strategy{StrategyLease, StrategyAdvisory}[j%2]
				wg.Go(func() {
					_, ok, err := storeOf(s, lease, advisory).Acquire(callCtx(t), name, candidate(fmt.Sprintf("%s-%d", s, j)), ttl)
					var c *StrategyConflictError
					if err != nil && !errors.As(err, &c) && !errors.Is(err, errStrategyMoved) {
						t.Errorf("Acquire(%q) by a %s candidate: %v", name, s, err)
					}
					if ok {
						mu.Lock()
						granted[s]++
						mu.Unlock()
					}
				})
			}
			wg.Wait()
			if granted[StrategyLease]+granted[StrategyAdvisory] != 1 {
				t.Errorf("%q: grants by strategy %v; want exactly one grant", name, granted)
			}
			winner, err := StrategyOf(callCtx(t), pool, Options{}, name)
			if err != nil || granted[winner] != 1 {
				t.Errorf("%q: StrategyOf = %q, %v, with grants %v", name, winner, err, granted)
				continue
			}
			// A late candidate of the losing strategy is refused too.
			loser := winner.other()
			_, ok, err := storeOf(loser, lease, advisory).Acquire(callCtx(t), name, candidate("late"), ttl)
			if ok {
				t.Errorf("%q: a late %s candidate was granted the name the %s strategy holds", name, loser, winner)
			}
			wantConflict(t, err, name, loser, true)
		}
	})

	t.Run("a name moves once the other strategy has been idle for a TTL, with a higher term", func(t *testing.T) {
		t.Parallel()
		// Long beside what an attempt takes on a busy machine: the
		// advisory store's first opens its session, which can take a
		// second under load, before it reaches the strategy table.
		const short = 3 * time.Second
		lease, advisory, _ := bothStrategies(t)
		term := uint64(0)
		for i, s := range []Strategy{StrategyLease, StrategyAdvisory, StrategyLease} {
			store := storeOf(s, lease, advisory)
			cand := candidate(fmt.Sprintf("%s-%d", s, i))
			var l leader.Lease
			if i == 0 {
				l = mustGrant(t, store, "moving", cand, short)
			} else {
				// Refused within a TTL of the other strategy's release,
				// then granted.
				_, granted, err := store.Acquire(callCtx(t), "moving", candidate("early"), short)
				if granted {
					t.Fatalf("%s candidate granted within a TTL of the %s release", s, s.other())
				}
				c := wantConflict(t, err, "moving", s, false)
				time.Sleep(time.Until(c.Until.Add(100 * time.Millisecond)))
				l = mustGrant(t, store, "moving", cand, short)
			}
			if l.Term <= term {
				t.Errorf("grant %d (%s) has term %d; want above %d", i, s, l.Term, term)
			}
			term = l.Term
			mustRelease(t, store, "moving", cand, l.Term)
		}
	})

	t.Run("an advisory holder gone without a release keeps the name for a TTL after it was seen gone", func(t *testing.T) {
		t.Parallel()
		const short = time.Second
		lease, advisory, pool := bothStrategies(t)
		holder := mustGrant(t, advisory, "gone", candidate("holder"), short)
		advisory.cutConnection(t, "gone")
		waitUnlocked(t, pool, "gone")
		_, granted, err := lease.Acquire(callCtx(t), "gone", candidate("lease"), short)
		if granted {
			t.Fatal("a lease candidate was granted a name whose advisory holder just went")
		}
		c := wantConflict(t, err, "gone", StrategyLease, false)
		time.Sleep(time.Until(c.Until.Add(100 * time.Millisecond)))
		l := mustGrant(t, lease, "gone", candidate("lease"), short)
		if l.Term <= holder.Term {
			t.Errorf("the lease grant's term %d is not above the advisory holder's %d", l.Term, holder.Term)
		}
	})

	t.Run("a name granted before the strategy table existed is refused to the other strategy", func(t *testing.T) {
		t.Parallel()
		lease, advisory, pool := bothStrategies(t)
		mustGrant(t, lease, "old", candidate("old"), ttl)
		if _, err := pool.Exec(callCtx(t), "DELETE FROM "+Options{}.withDefaults().qualifiedStrategyTable()); err != nil {
			t.Fatal(err)
		}
		if got, err := StrategyOf(callCtx(t), pool, Options{}, "old"); err != nil || got != StrategyLease {
			t.Errorf("StrategyOf without a row = %q, %v; want lease", got, err)
		}
		_, granted, err := advisory.Acquire(callCtx(t), "old", candidate("new"), ttl)
		if granted {
			t.Fatal("an advisory candidate was granted a name held under the lease strategy before the strategy table")
		}
		wantConflict(t, err, "old", StrategyAdvisory, true)
	})

	t.Run("an Elector of the other strategy stops at once with the conflict", func(t *testing.T) {
		t.Parallel()
		lease, advisory, _ := bothStrategies(t)
		mustGrant(t, lease, "elector", candidate("holder"), ttl)
		e, err := leader.New(advisory, leader.Config{Name: "elector", TTL: 5 * time.Second, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		err = e.Run(ctx)
		wantConflict(t, err, "elector", StrategyAdvisory, true)
	})

	t.Run("StrategyOf a name never elected is empty", func(t *testing.T) {
		t.Parallel()
		_, _, pool := bothStrategies(t)
		if got, err := StrategyOf(callCtx(t), pool, Options{}, "never"); err != nil || got != "" {
			t.Errorf("StrategyOf = %q, %v; want \"\"", got, err)
		}
	})
}

// waitUnlocked waits until no backend holds the advisory lock of name.
func waitUnlocked(t *testing.T, pool *pgxpool.Pool, name string) {
	t.Helper()
	hi, lo := keyHalves(AdvisoryKey(name))
	deadline := time.Now().Add(30 * time.Second)
	for {
		var held bool
		if err := pool.QueryRow(callCtx(t), "SELECT EXISTS ("+heldBy("$1", "$2")+")", hi, lo).Scan(&held); err != nil {
			t.Fatal(err)
		}
		if !held {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the advisory lock of %q is still held after 30s", name)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
