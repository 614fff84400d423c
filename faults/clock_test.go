package faults_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/history"
	"github.com/leaderelect/leader/internal/pgtest"
	"github.com/leaderelect/leader/internal/wallclock"
	"github.com/leaderelect/leader/postgres"
)

// clockFault is the name of the wall-clock fault in the table.
const clockFault = "wall clock ±1h"

const (
	// clockTTL is the TTL of the wall-clock scenario, which fails on any
	// change of leader while the clock is stepped: longer than the other
	// scenarios' ttl, so that a busy machine's late renewals do not lose
	// the lease.
	clockTTL = 6 * time.Second
	// clockHold is how long the clock stays at each step: longer than the
	// TTL, so that a lease or deadline judged on the wall clock would have
	// run out.
	clockHold = clockTTL + clockTTL/2
)

// The client's wall clock jumps an hour forward, then two hours back, then
// forward again to where it was, while an Elector leads: it must keep
// leading under the same term through every step (no spurious loss, no
// second leader), and then hand over as usual. Wall time is read through
// internal/wallclock, which the test steps; Status.LastContact, read on it,
// shows that the steps reach the Elector.
func TestWallClockJumps(t *testing.T) {
	t.Parallel()
	rounds(t, 1, 4, func(t *testing.T, trials int) {
		for _, strategy := range strategies {
			t.Run(fmt.Sprintf("the %s store keeps its leader when the wall clock jumps an hour either way", strategy), func(t *testing.T) {
				// Not in parallel: the clock is the process's, and the
				// checks of LastContact assume one stepper at a time.
				record(t, clockFault, strategy, runClockScenario(t, strategy, trials))
			})
		}
	})
}

// clockScenario is three Electors of one name on direct connections, whose
// leaders write their term to a fenced register.
type clockScenario struct {
	cands []*clockCandidate
	fence *fence
}

type clockCandidate struct {
	id   string
	e    *leader.Elector
	rec  *history.Recorder
	stop func()
}

func runClockScenario(t *testing.T, strategy string, trials int) result {
	connString := pgtest.NewDatabase(t)
	workPool := pgtest.OpenPool(t, connString)
	if err := postgres.Migrate(callCtx(t), workPool, postgres.Options{}); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	s := &clockScenario{fence: setupFence(t, workPool)}
	dir := t.TempDir()
	for i := range candidates {
		s.cands = append(s.cands, s.start(t, dir, strategy, connString, fmt.Sprint("c", i)))
	}

	var faultedTerms []uint64
	cur, term := s.nextLeader(t, 0)
	for trial := range trials {
		for _, step := range []time.Duration{time.Hour, -2 * time.Hour, time.Hour} {
			before := wallclock.Now()
			wallclock.Step(step)
			s.holds(t, cur, term, step, before)
		}
		// Then a handover.
		faultedTerms = append(faultedTerms, term)
		if err := cur.e.Resign(callCtx(t)); err != nil {
			t.Fatalf("trial %d: %s: Resign: %v", trial, cur.id, err)
		}
		next, nextTerm := s.nextLeader(t, term)
		s.fence.lateWrite(t, trial, cur.id, term, nextTerm)
		cur, term = next, nextTerm
	}

	var wg sync.WaitGroup
	for _, c := range s.cands {
		wg.Go(c.stop)
	}
	wg.Wait()
	for _, c := range s.cands {
		if err := c.rec.Close(); err != nil {
			t.Fatalf("%s: %v", c.id, err)
		}
	}

	evs, err := history.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	rep := checkBeliefs(t, evs, history.Bounds{MaxTakeover: 3 * clockTTL})
	r := result{trials: trials, overlaps: len(rep.Overlaps), termRegressions: len(rep.TermRegressions)}
	for _, tk := range rep.Takeovers {
		for _, ft := range faultedTerms {
			if tk.From.Term == ft {
				r.takeovers = append(r.takeovers, tk.Gap)
			}
		}
	}
	_, r.staleRefused, r.staleAccepted = s.fence.check(t)
	return r
}

// holds checks that c keeps leading under term, alone, for clockHold after
// the wall clock was stepped by step from before, and that c's
// Status.LastContact follows the step.
func (s *clockScenario) holds(t *testing.T, c *clockCandidate, term uint64, step time.Duration, before time.Time) {
	t.Helper()
	end := time.Now().Add(clockHold)
	for time.Now().Before(end) {
		for _, o := range s.cands {
			st := o.e.Status()
			switch {
			case o == c && (!st.IsLeader || st.Term != term):
				t.Fatalf("%s stopped leading term %d (status: leader %v, term %d) within %v of the wall clock stepping %v",
					c.id, term, st.IsLeader, st.Term, clockHold, step)
			case o != c && st.IsLeader:
				t.Fatalf("%s leads (term %d) while %s leads term %d, after the wall clock stepped %v", o.id, st.Term, c.id, term, step)
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	// Renewals happened after the step, so the last contact is read on the
	// stepped clock: it moved by about step.
	got := c.e.Status().LastContact.Sub(before)
	if lo, hi := step-time.Minute, step+time.Minute+clockHold; got < lo || got > hi {
		t.Errorf("%s: after a step of %v, LastContact is %v from the reading before the step; want it moved by the step", c.id, step, got)
	}
}

// start starts an Elector for id on a store of the strategy of its own.
func (s *clockScenario) start(t *testing.T, dir, strategy, connString, id string) *clockCandidate {
	t.Helper()
	c := &clockCandidate{id: id}
	store := newStore(t, strategy, pgtest.OpenPool(t, connString))
	c.e, c.rec, c.stop = s.fence.startElector(t, dir, id, store, clockTTL, nil)
	return c
}

// nextLeader waits for a leader with a term above after that has written.
func (s *clockScenario) nextLeader(t *testing.T, after uint64) (*clockCandidate, uint64) {
	t.Helper()
	var cur *clockCandidate
	var term uint64
	electortest.Eventually(t, 4*clockTTL, fmt.Sprintf("a leader with a term above %d that has written", after), func() bool {
		for _, c := range s.cands {
			if st := c.e.Status(); st.IsLeader && st.Term > after && s.fence.written(st.Term) >= 3 {
				cur, term = c, st.Term
				return true
			}
		}
		return false
	})
	return cur, term
}
