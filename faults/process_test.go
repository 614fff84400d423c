package faults_test

import (
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader/internal/childproc"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/fenced"
	"github.com/leaderelect/leader/internal/history"
	"github.com/leaderelect/leader/internal/pgtest"
	"github.com/leaderelect/leader/postgres"
)

// Bounds of the process faults.
const (
	// minPause and maxPause bound the random length of a SIGSTOP pause:
	// past the TTL, so that the lease passes to another candidate during
	// it.
	minPause = 3 * ttl / 2
	maxPause = 5 * ttl / 2
	// maxProcessTakeover bounds a takeover after a kill, from the death
	// of the killed leader to its successor's OnElected, and after a pause,
	// from the start of the pause to the successor's OnElected. Generous:
	// the point is to catch a takeover that does not happen.
	maxProcessTakeover = 3 * ttl
	// maxStepDownAfterResume bounds how long a leader resumed from a pause
	// past its deadline goes on believing it leads: its stop timer is long
	// overdue and fires as soon as the process runs, which on a busy
	// machine may take a while.
	maxStepDownAfterResume = ttl
	// firstLeaderWithin bounds the first election of a scenario, which
	// includes starting the child processes.
	firstLeaderWithin = 30 * time.Second
	// childStopWithin bounds how long a child takes to exit once its
	// standard input closes: it steps down, releases and closes its
	// connections.
	childStopWithin = 3 * ttl
)

// Every process fault on every strategy, a few times each in CI mode, for as
// long as LEADER_SOAK says in soak mode. See the package documentation.
func TestProcessFaults(t *testing.T) {
	t.Parallel()
	rounds(t, ciTrials, soakTrials, func(t *testing.T, trials int) {
		for _, strategy := range strategies {
			t.Run(fmt.Sprintf("a %s leader killed with SIGKILL is succeeded by a greater term and its late write is refused", strategy), func(t *testing.T) {
				t.Parallel()
				record(t, "SIGKILL", strategy, runKillScenario(t, strategy, trials))
			})
			t.Run(fmt.Sprintf("a %s leader paused past the TTL overlaps only its successor, has its write on resuming refused and steps down", strategy), func(t *testing.T) {
				t.Parallel()
				record(t, "SIGSTOP past the TTL", strategy, runPauseScenario(t, strategy, trials))
			})
		}
	})
}

// runKillScenario runs trials of SIGKILL on the strategy's leader and checks
// the histories: no overlap, no term regression, every killed leader
// succeeded within maxProcessTakeover, the register's history
// linearizable, no stale write accepted.
func runKillScenario(t *testing.T, strategy string, trials int) result {
	s := newProcessScenario(t, strategy)
	killedAt := make(map[string]int64) // instance -> CLOCK_MONOTONIC reading after the kill
	var killedTerms []uint64
	cur, term := s.waitForLeader(t, 0, firstLeaderWithin)
	for trial := range trials {
		// The kill's timing relative to the renewals, at random.
		time.Sleep(rand.N(maxInjectDelay + 1))
		killedTerms = append(killedTerms, term)
		at, err := cur.Kill()
		if err != nil {
			t.Fatal(err)
		}
		killedAt[cur.id] = at
		next, nextTerm := s.waitForLeader(t, term, maxProcessTakeover+2*ttl)
		s.lateWrite(t, trial, cur.id, term, nextTerm)
		s.start(t) // a replacement, so that three candidates campaign
		cur, term = next, nextTerm
	}
	s.stopAll(t)

	evs, err := history.Load(s.dir)
	if err != nil {
		t.Fatal(err)
	}
	rep := history.Check(evs, history.Bounds{
		MaxTakeover: maxProcessTakeover,
		// A killed process believes nothing once it is dead, and it is
		// dead by the time kill(2) has returned, bar a thread running on
		// another CPU until the interrupt that stops it lands: some
		// microseconds, far less than any successor needs (with the
		// advisory strategy the server must first see the dead
		// process's connection close; with the lease strategy the lease
		// must run out). EndOpenAtDeadline would be an upper bound too,
		// the timers of a killed process having run until it died, but
		// a loose one: an advisory successor starts long before the dead
		// leader's deadline, and the check would report overlaps that
		// did not happen.
		OpenEnd: func(iv history.Interval) (int64, bool) {
			at, ok := killedAt[iv.Instance]
			return at, ok
		},
	})
	if !rep.OK() {
		t.Errorf("the history of beliefs fails:\n%v", rep)
	}
	r := result{trials: len(killedTerms), overlaps: len(rep.Overlaps), termRegressions: len(rep.TermRegressions)}
	// Only the takeovers from the killed leaders are the fault's.
	for _, tk := range rep.Takeovers {
		if slices.Contains(killedTerms, tk.From.Term) {
			r.takeovers = append(r.takeovers, tk.Gap)
		}
	}
	if len(r.takeovers) != len(killedTerms) {
		t.Errorf("%d takeovers from the %d killed leaders (terms %v):\n%v", len(r.takeovers), len(killedTerms), killedTerms, rep)
	}
	s.checkRegister(t, &r)
	// No trial's own stale transaction: a killed leader makes none.
	r.fenceTx = s.checkFencedWork(t, rep.Intervals, nil)
	return r
}

// pauseTrial is one trial of the SIGSTOP fault.
type pauseTrial struct {
	instance string
	term     uint64 // the paused leader's
	// successor and successorTerm are those of the leader elected during
	// the pause, which had written before the paused one was resumed.
	successor     string
	successorTerm uint64
	// pausedAt is a CLOCK_MONOTONIC reading taken once the process was
	// stopped, resumedAt one taken just before it was sent SIGCONT.
	pausedAt, resumedAt int64
}

// runPauseScenario runs trials of SIGSTOP on the strategy's leader, past the
// TTL, then SIGCONT, and checks the histories: every overlap is between a
// paused leader and its successor, terms never regress, each successor is
// elected within maxProcessTakeover of the pause, each resumed leader stops
// believing within maxStepDownAfterResume and has the write it had in
// flight refused, by the register and by postgres.Fence, the register's
// history is linearizable, and no stale write is accepted by either.
func runPauseScenario(t *testing.T, strategy string, trials int) result {
	s := newProcessScenario(t, strategy)
	var pauses []pauseTrial
	cur, term := s.waitForLeader(t, 0, firstLeaderWithin)
	for trial := range trials {
		time.Sleep(rand.N(maxInjectDelay + 1))
		resumeAt := time.Now().Add(minPause + rand.N(maxPause-minPause+1))
		p := pauseTrial{instance: cur.id, term: term}
		p.pausedAt = cur.Pause(t, s.dir)
		next, nextTerm := s.waitForLeader(t, term, maxProcessTakeover+2*ttl)
		p.successor, p.successorTerm = next.id, nextTerm
		time.Sleep(time.Until(resumeAt))
		p.resumedAt = cur.Resume(t)
		s.awaitResumedWrite(t, trial, p)
		s.awaitEnd(t, p)
		// A write with the paused term now, whatever the resumed
		// process does: the fence must refuse it too.
		s.lateWrite(t, trial, p.instance, p.term, p.successorTerm)
		pauses = append(pauses, p)
		cur, term = next, nextTerm
	}
	s.stopAll(t)

	evs, err := history.Load(s.dir)
	if err != nil {
		t.Fatal(err)
	}
	// No OpenEnd: no candidate was killed, and every one was stopped and
	// recorded the end of its last leadership, so an open interval fails.
	rep := history.Check(evs, history.Bounds{MaxTakeover: maxProcessTakeover})
	if len(rep.TermRegressions) > 0 || len(rep.SlowTakeovers) > 0 || len(rep.Unended) > 0 || len(rep.Invalid) > 0 {
		t.Errorf("the history of beliefs fails:\n%v", rep)
	}
	r := result{trials: len(pauses), overlaps: len(rep.Overlaps), termRegressions: len(rep.TermRegressions)}
	find := func(instance string, term uint64) (history.Interval, bool) {
		for _, iv := range rep.Intervals {
			if iv.Instance == instance && iv.Term == term {
				return iv, true
			}
		}
		return history.Interval{}, false
	}
	isPause := func(o history.Overlap, p pauseTrial) bool {
		return o.First.Instance == p.instance && o.First.Term == p.term &&
			o.Second.Instance == p.successor && o.Second.Term == p.successorTerm
	}
	for trial, p := range pauses {
		paused, ok1 := find(p.instance, p.term)
		successor, ok2 := find(p.successor, p.successorTerm)
		if !ok1 || !ok2 {
			t.Errorf("trial %d: no interval recorded for %s term %d (%v) or for %s term %d (%v):\n%v",
				trial, p.instance, p.term, ok1, p.successor, p.successorTerm, ok2, rep)
			continue
		}
		elected := successor.Start
		if successor.Elected {
			elected = successor.ElectedAt
		}
		takeover := time.Duration(elected - p.pausedAt)
		r.takeovers = append(r.takeovers, takeover)
		if takeover > maxProcessTakeover {
			t.Errorf("trial %d: %s was elected with term %d %v after %s was paused; want at most %v", trial, p.successor, p.successorTerm, takeover, p.instance, maxProcessTakeover)
		}
		if stepDown := time.Duration(paused.End - p.resumedAt); paused.Open || stepDown > maxStepDownAfterResume {
			t.Errorf("trial %d: %s believed it led with term %d until %v after SIGCONT; want at most %v: %v", trial, p.instance, p.term, stepDown, maxStepDownAfterResume, paused)
		}
		t.Logf("trial %d: %s paused with term %d for %v; %s elected with term %d %v after the pause; %s stopped believing %v after SIGCONT",
			trial, p.instance, p.term, time.Duration(p.resumedAt-p.pausedAt), p.successor, p.successorTerm, takeover, p.instance, time.Duration(paused.End-p.resumedAt))
		// The overlap the pause causes: the paused leader believes
		// until it resumes, its successor from its election on.
		if !slices.ContainsFunc(rep.Overlaps, func(o history.Overlap) bool { return isPause(o, p) }) {
			t.Errorf("trial %d: %v and %v do not overlap: the paused process should have believed it led until it resumed", trial, paused, successor)
		}
	}
	for _, o := range rep.Overlaps {
		if !slices.ContainsFunc(pauses, func(p pauseTrial) bool { return isPause(o, p) }) {
			t.Errorf("an overlap that no pause explains (not between a paused leader and its successor): %v", o)
		}
	}
	ops := s.checkRegister(t, &r)
	for trial, p := range pauses {
		// Besides the write in flight, the leader work may write again
		// on resuming, if it checks its leader context before the
		// Elector's overdue timer has cancelled it: the race no check
		// can close. Shown, not asserted (the fence refuses them all).
		var again []fenced.Op
		for _, op := range ops {
			if op.Kind == fenced.Write && op.Client == p.instance && op.Term == p.term && op.Invoke > p.resumedAt && op.Value != resumedValue(p.instance, p.term) {
				again = append(again, op)
			}
		}
		t.Logf("trial %d: %d more writes by %s's leader work with term %d after SIGCONT: %v", trial, len(again), p.instance, p.term, again)
	}
	// The fenced transactions the paused leader made with its term after
	// SIGCONT: its lease was lost before, since its successor had been
	// elected and written. Among them is the one in flight.
	var txTrials []txTrial
	for trial, p := range pauses {
		txTrials = append(txTrials, txTrial{
			fault: "SIGSTOP past the TTL", strategy: strategy, trial: trial,
			deposed:   tenure{p.instance, p.term},
			successor: tenure{p.successor, p.successorTerm},
			lostAt:    p.resumedAt,
			wantValue: resumedValue(p.instance, p.term),
		})
	}
	r.fenceTx = s.checkFencedWork(t, rep.Intervals, txTrials)
	return r
}

// checkFencedWork checks the fenced transactions of every process of the
// scenario (see the package-level checkFencedWork) and returns the count of
// stale ones.
func (s *processScenario) checkFencedWork(t *testing.T, intervals []history.Interval, trials []txTrial) staleTx {
	t.Helper()
	ops, err := loadTxOps(s.dir)
	if err != nil {
		t.Fatal(err)
	}
	return checkFencedWork(t, s.pool, ops, intervals, trials)
}

// awaitResumedWrite waits for the write that p's leader makes when it
// resumes, with the term it led under, and fails the test unless the
// register refused it. It is the write that was in flight when the pause
// hit; finding it proves that the fault did what it should.
func (s *processScenario) awaitResumedWrite(t *testing.T, trial int, p pauseTrial) {
	t.Helper()
	var op fenced.Op
	electortest.Eventually(t, 10*time.Second, fmt.Sprintf("%s's write with term %d on resuming", p.instance, p.term), func() bool {
		ops, err := fenced.LoadOps(s.dir)
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range ops {
			// A return line (not Unknown, or failed) ends the wait.
			if o.Kind == fenced.Write && o.Client == p.instance && o.Value == resumedValue(p.instance, p.term) && (!o.Unknown || o.Err != "") {
				op = o
				return true
			}
		}
		return false
	})
	switch {
	case op.Unknown:
		t.Errorf("trial %d: the write %s made on resuming failed: %v", trial, p.instance, op)
	case op.Accepted:
		t.Errorf("trial %d: the write %s made on resuming with term %d was accepted after term %d had written: %v", trial, p.instance, p.term, p.successorTerm, op)
	}
}

// awaitEnd waits until p's paused leader has recorded the end of the
// leadership it was paused in. How soon after SIGCONT is checked on the
// whole history, at the end.
func (s *processScenario) awaitEnd(t *testing.T, p pauseTrial) {
	t.Helper()
	electortest.Eventually(t, 10*time.Second, fmt.Sprintf("%s to record the end of term %d after resuming", p.instance, p.term), func() bool {
		evs, err := history.Load(s.dir)
		if err != nil {
			t.Fatal(err)
		}
		return slices.ContainsFunc(evs, func(e history.Event) bool {
			return e.Instance == p.instance && e.Term == p.term &&
				(e.Kind == history.Ended || e.Kind == history.Demoted || e.Kind == history.Released)
		})
	})
}

// processScenario is one process fault on one strategy: candidates in child
// processes, a database of their own, and the directory they share with the
// test.
type processScenario struct {
	strategy   string
	connString string
	dir        string
	pool       *pgxpool.Pool    // the test's own: reads the register, makes late writes
	reg        *fenced.Register // the test's, logged to dir
	children   map[string]*childProcess
	started    int // children started, for their names
}

// newProcessScenario prepares a database and starts candidates child
// processes on it.
func newProcessScenario(t *testing.T, strategy string) *processScenario {
	t.Helper()
	connString := pgtest.NewDatabase(t)
	s := &processScenario{
		strategy:   strategy,
		connString: connString,
		dir:        t.TempDir(),
		pool:       pgtest.OpenPool(t, connString),
		children:   make(map[string]*childProcess),
	}
	ctx := callCtx(t)
	if err := postgres.Migrate(ctx, s.pool, postgres.Options{}); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	setupWorkTable(t, s.pool)
	var err error
	if s.reg, err = fenced.Setup(ctx, s.pool, registerTable); err != nil {
		t.Fatal(err)
	}
	if err := s.reg.LogTo(s.dir); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.reg.Close() })
	// Registered before the children's kills: runs after them (t.Cleanup
	// is LIFO), when their logs are complete.
	t.Cleanup(func() { s.dumpLogs(t) })
	for range candidates {
		s.start(t)
	}
	return s
}

// childProcess is a running candidate child process.
type childProcess struct {
	*childproc.Process
	id string
}

// start starts a candidate child process, killed when the test ends if it
// is still running.
func (s *processScenario) start(t *testing.T) *childProcess {
	t.Helper()
	id := fmt.Sprint("c", s.started)
	s.started++
	env := append(childproc.Env(envSoak, childURL, childInstance, childStore, childDir),
		childURL+"="+s.connString,
		childInstance+"="+id,
		childStore+"="+s.strategy,
		childDir+"="+s.dir,
	)
	c := &childProcess{childproc.Start(t, id, "TestCandidateChildProcess", filepath.Join(s.dir, id+".log"), env), id}
	s.children[id] = c
	return c
}

// procs returns the children's processes, by ID.
func (s *processScenario) procs() []*childproc.Process {
	var ps []*childproc.Process
	for _, id := range slices.Sorted(maps.Keys(s.children)) {
		ps = append(ps, s.children[id].Process)
	}
	return ps
}

// stopAll stops every child that was not killed, all at once, and fails
// the test unless each exits within childStopWithin and its test
// (campaign, writes, no goroutine leaked) passed.
func (s *processScenario) stopAll(t *testing.T) {
	t.Helper()
	childproc.StopAll(t, s.procs(), childStopWithin)
}

// dumpLogs shows the end of every child's log when the test failed.
func (s *processScenario) dumpLogs(t *testing.T) { childproc.DumpLogs(t, s.procs()) }

// waitForLeader waits for a leader with a term above after that has had at
// least three writes accepted, as the register shows, and returns it.
func (s *processScenario) waitForLeader(t *testing.T, after uint64, within time.Duration) (*childProcess, uint64) {
	t.Helper()
	var (
		cur  *childProcess
		term uint64
	)
	electortest.Eventually(t, within, fmt.Sprintf("a leader with a term above %d that has written", after), func() bool {
		writer, latest, writes := s.latestWrite(t)
		if c := s.children[writer]; c != nil && !c.Killed() && latest > after && writes >= 3 {
			cur, term = c, latest
			return true
		}
		return false
	})
	return cur, term
}

// latestWrite returns the writer and the term of the register's latest
// accepted write, and how many writes that leader had made in that term
// by then (from the write's value, "instance/term/sequence"). All are zero
// if the register was never written.
func (s *processScenario) latestWrite(t *testing.T) (writer string, term uint64, writes int) {
	t.Helper()
	var (
		t64   int64
		value string
	)
	err := s.pool.QueryRow(callCtx(t), `SELECT term, writer, value FROM `+pgx.Identifier{registerTable}.Sanitize()+` WHERE resource = $1`, resource).Scan(&t64, &writer, &value)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", 0, 0
	}
	if err != nil {
		t.Fatalf("reading the register: %v", err)
	}
	if parts := strings.Split(value, "/"); len(parts) == 3 {
		if seq, err := strconv.Atoi(parts[2]); err == nil {
			writes = seq + 1
		}
	}
	return writer, uint64(t64), writes
}

// lateWrite writes with the deposed leader's term, after its successor's
// term has written, as a deposed leader that missed its demotion would,
// and fails the test unless the fence refuses it.
func (s *processScenario) lateWrite(t *testing.T, trial int, deposed string, term, successorTerm uint64) {
	t.Helper()
	accepted, err := s.reg.Write(callCtx(t), s.pool, resource, term, deposed+"-late", "late")
	if err != nil {
		t.Fatal(err)
	}
	if accepted {
		t.Errorf("trial %d: a write with %s's deposed term %d was accepted after term %d had written", trial, deposed, term, successorTerm)
	}
}

// checkRegister checks the register's history, every process's operations
// together: linearizable, and no stale write accepted. It counts the writes
// refused and the stale writes accepted into r, and returns the history.
func (s *processScenario) checkRegister(t *testing.T, r *result) []fenced.Op {
	t.Helper()
	ops, err := fenced.LoadOps(s.dir)
	if err != nil {
		t.Fatal(err)
	}
	if ok, _ := fenced.CheckLinearizable(ops); !ok {
		t.Errorf("the fenced register's history of %d operations is not linearizable", len(ops))
	}
	stale := staleAccepted(ops)
	for _, op := range stale {
		t.Errorf("a stale write was accepted: %v", op)
	}
	accepted, refused := countWrites(ops)
	r.staleRefused, r.staleAccepted = refused, len(stale)
	t.Logf("takeovers %v; fenced register: %d writes accepted, %d refused", history.Summarize(r.takeovers), accepted, refused)
	return ops
}

// monoNow returns a CLOCK_MONOTONIC reading, the clock of the histories.
func monoNow(t *testing.T) int64 {
	t.Helper()
	return childproc.Now(t)
}
