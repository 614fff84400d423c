//go:build unix

package faults_test

import (
	"bufio"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader/etcd/etcdtest"
	"github.com/leaderelect/leader/internal/childproc"
	"github.com/leaderelect/leader/internal/fenced"
	"github.com/leaderelect/leader/internal/history"
	"github.com/leaderelect/leader/internal/pgtest"
)

// Bounds of the process faults.
const (
	// minPause and maxPause bound the random length of a SIGSTOP pause:
	// past the TTL, so that the lease passes to another candidate during
	// it.
	minPause = 3 * ttl / 2
	maxPause = 5 * ttl / 2
	// resumeSlack is how long after the later of SIGCONT and its stop
	// point (its last successful call's send time plus TTL less
	// DriftMargin less StopGrace) a leader resumed from a pause may still
	// be recorded as believing it leads. Its stop timer (and its Store's
	// expiry timer) is overdue when it resumes and fires within
	// milliseconds as a rule; the slack is for the runtime to be
	// scheduled again, the timer's goroutine to run, and the end to be
	// recorded, under -race on two cores that three etcd members, the
	// other children and other scenarios share. It is far below the
	// RenewInterval and a TTL, so an Elector that believed on past its
	// stop point by a fraction of a TTL would be caught.
	resumeSlack = 500 * time.Millisecond
	// firstLeaderWithin bounds the first election of a scenario, which
	// includes starting a child process.
	firstLeaderWithin = 30 * time.Second
	// childStopWithin bounds how long a child takes to exit once its
	// standard input closes: it steps down, releases and closes its
	// connections.
	childStopWithin = 3 * ttl
)

// The leader's process is killed with SIGKILL, or paused with SIGSTOP
// past the TTL and then resumed: its candidates are child processes that
// campaign for two names each and renew them with RenewBatch. See the
// package documentation.
func TestLeaderProcess(t *testing.T) {
	t.Parallel()
	rounds(t, func(t *testing.T, trials int) {
		t.Run("kill", func(t *testing.T) {
			t.Parallel()
			record(t, "leader-kill", runLeaderKill(t, trials))
		})
		t.Run("pause", func(t *testing.T) {
			t.Parallel()
			record(t, "leader-pause", runLeaderPause(t, trials))
		})
	})
}

// successor is the leadership that took over a faulted one.
type successor struct {
	id   string
	term uint64
}

// runLeaderKill kills the process that leads processNames[0] (and
// perhaps the other name) with SIGKILL, waits for every name it led to
// have a leader with a greater term that has written, and starts a
// replacement child. The killed process's open intervals end at the later
// of the kill and its local deadline: no other may be granted a name
// before the deadline of a holder that might still have been alive.
func runLeaderKill(t *testing.T, trials int) result {
	s := newProcessEnv(t)
	var fs []faulted
	killedAt := map[string]int64{} // instance → CLOCK_MONOTONIC reading after the kill
	next := map[faulted]successor{}
	cur, term := s.leaderOf(processNames[0], 0, firstLeaderWithin)
	if cur == nil {
		t.FailNow()
	}
trials:
	for trial := range trials {
		if cur, term = s.settle(cur, term); cur == nil {
			break
		}
		led := s.leads(cur)
		led[processNames[0]] = term // it led it a moment ago (settle)
		victim := cur.id
		at, err := cur.Kill()
		if err != nil {
			t.Fatal(err)
		}
		killedAt[cur.id] = at
		var these []faulted
		for _, name := range processNames {
			if lt, ok := led[name]; ok {
				these = append(these, faulted{name, cur.id, lt, at})
			}
		}
		fs = append(fs, these...)
		for _, f := range these {
			c, nt := s.leaderOf(f.name, f.term, maxTakeover+2*ttl)
			if c == nil {
				break trials
			}
			next[f] = successor{c.id, nt}
			s.lateWrite(trial, f.name, f.id, f.term, nt)
			if f.name == processNames[0] {
				cur, term = c, nt
			}
		}
		t.Logf("trial %d: %s killed leading %v; successors %v", trial, victim, led, successorsOf(these, next))
		s.start() // a replacement, so that three candidates campaign
	}
	s.stopAll()

	openEnd := func(iv history.Interval) (int64, bool) {
		at, ok := killedAt[iv.Instance]
		if !ok || iv.LastSent == 0 {
			return 0, false
		}
		return max(at, iv.LastSent+int64(ttl-driftMargin)), true
	}
	evs := s.events()
	r, rep := judge(t, evs, history.Bounds{MaxTakeover: maxTakeover, OpenEnd: openEnd}, fs, s.ops())
	for _, f := range fs {
		n, ok := next[f]
		if !ok {
			continue // no successor: reported already
		}
		iv, ok := interval(rep, f.name, n.id, n.term)
		if !ok {
			t.Errorf("no interval of %s with term %d of %s", n.id, n.term, f.name)
			continue
		}
		gap := time.Duration(iv.ElectedAt - f.at)
		t.Logf("%s (%s term %d) killed; %s elected with term %d %v after the kill", f.id, f.name, f.term, n.id, n.term, gap.Round(time.Millisecond))
		if gap > maxTakeover {
			t.Errorf("%s elected leader of %s %v after %s was killed; want within %v", n.id, f.name, gap, f.id, maxTakeover)
		}
	}
	s.checkBatches()
	r.trials, r.unprovoked = len(killedAt), s.unprovoked
	return r
}

// successorsOf lists the successors of fs, for a log.
func successorsOf(fs []faulted, next map[faulted]successor) []string {
	var out []string
	for _, f := range fs {
		if n, ok := next[f]; ok {
			out = append(out, fmt.Sprintf("%s: %s term %d", f.name, n.id, n.term))
		}
	}
	return out
}

// pauseTrial is one trial of the SIGSTOP fault.
type pauseTrial struct {
	id string
	// led are the leaderships of the paused process when it was paused.
	led []faulted
	// pausedAt is a CLOCK_MONOTONIC reading taken once the process was
	// stopped, resumedAt one taken just before it was sent SIGCONT.
	pausedAt, resumedAt int64
}

// runLeaderPause pauses the process that leads processNames[0] (and
// perhaps the other name) with SIGSTOP for minPause to maxPause, waits
// for every name it led to have a leader with a greater term that has
// written, resumes it, and waits for the write it makes on resuming,
// which the register must refuse, and for its leadership's end. A paused
// process acts on nothing until it resumes, and then steps down at once,
// its deadline long past: its belief is judged to end at its local
// deadline (its last successful call's send time plus TTL less
// DriftMargin), and with that end there must be no overlap.
func runLeaderPause(t *testing.T, trials int) result {
	s := newProcessEnv(t)
	var pauses []pauseTrial
	cur, term := s.leaderOf(processNames[0], 0, firstLeaderWithin)
	if cur == nil {
		t.FailNow()
	}
trials:
	for trial := range trials {
		if cur, term = s.settle(cur, term); cur == nil {
			break
		}
		led := s.leads(cur)
		led[processNames[0]] = term // it led it a moment ago (settle)
		p := pauseTrial{id: cur.id}
		resumeAt := time.Now().Add(minPause + rand.N(maxPause-minPause+1))
		p.pausedAt = cur.Pause(s.t, s.dir)
		for _, name := range processNames {
			if lt, ok := led[name]; ok {
				p.led = append(p.led, faulted{name, cur.id, lt, p.pausedAt})
			}
		}
		pauses = append(pauses, p)
		var next successor
		for _, f := range p.led {
			c, nt := s.leaderOf(f.name, f.term, maxTakeover+2*ttl)
			if c == nil {
				cur.Resume(t)
				break trials
			}
			if f.name == processNames[0] {
				next = successor{c.id, nt}
			}
		}
		time.Sleep(time.Until(resumeAt))
		resumedAt := cur.Resume(t)
		pauses[len(pauses)-1].resumedAt = resumedAt
		s.awaitResumedWrite(trial, cur.id, term)
		s.awaitEnd(cur.id, processNames[0], term)
		for _, f := range p.led {
			// A write with the paused term now, whatever the resumed
			// process does: the fence must refuse it too.
			_, nt, _ := s.latest(f.name)
			s.lateWrite(trial, f.name, f.id, f.term, nt)
		}
		t.Logf("trial %d: %s paused for %v leading %v; %s then led %s with term %d",
			trial, cur.id, time.Duration(resumedAt-p.pausedAt).Round(time.Millisecond), led, next.id, processNames[0], next.term)
		cur, term = s.children[next.id], next.term
	}
	s.stopAll()

	evs := s.events()
	// As recorded, a paused leader believes until it has resumed and its
	// overdue stop timer has fired: its recorded end (the leader context
	// seen cancelled, or OnDemoted) must be no later than resumeSlack
	// after the later of SIGCONT and its stop point.
	recorded := history.Check(evs, history.Bounds{})
	ends := map[faulted]int64{}
	var fs []faulted
	for trial, p := range pauses {
		for _, f := range p.led {
			fs = append(fs, f)
			iv, ok := interval(recorded, f.name, f.id, f.term)
			if ok && !iv.Open {
				ends[f] = iv.End
			}
			switch {
			case !ok:
				t.Errorf("trial %d: no interval of %s with term %d of %s", trial, f.id, f.term, f.name)
				continue
			case p.resumedAt == 0:
				continue
			}
			stopPoint := iv.LastSent + int64(ttl-driftMargin-stopGrace)
			bound := max(p.resumedAt, stopPoint) + int64(resumeSlack)
			switch {
			case iv.Open || iv.End > bound:
				t.Errorf("trial %d: %s believed it led %s with term %d until %v after SIGCONT, %v after its stop point; want at most %v after the later of the two: %v",
					trial, f.id, f.name, f.term, time.Duration(iv.End-p.resumedAt), time.Duration(iv.End-stopPoint), resumeSlack, iv)
			default:
				t.Logf("trial %d: %s stopped believing it led %s with term %d %v after SIGCONT",
					trial, f.id, f.name, f.term, time.Duration(iv.End-p.resumedAt).Round(time.Millisecond))
			}
		}
	}
	for _, o := range recorded.Overlaps {
		t.Logf("as recorded, not judged: %v", o)
	}
	// As judged: the end each paused leadership recorded after the
	// pause is left out, and the leadership ends at its local deadline
	// instead (or at its recorded end, if that is sooner).
	endsAfterPause := func(e history.Event) bool {
		if e.Kind != history.Ended && e.Kind != history.Demoted && e.Kind != history.Released {
			return false
		}
		for _, p := range pauses {
			for _, f := range p.led {
				if e.Name == f.name && e.Instance == f.id && e.Term == f.term && e.At > p.pausedAt {
					return true
				}
			}
		}
		return false
	}
	var judged []history.Event
	for _, e := range evs {
		if !endsAfterPause(e) {
			judged = append(judged, e)
		}
	}
	openEnd := func(iv history.Interval) (int64, bool) {
		for _, f := range fs {
			if iv.Name == f.name && iv.Instance == f.id && iv.Term == f.term && iv.LastSent != 0 {
				end := iv.LastSent + int64(ttl-driftMargin)
				if e, ok := ends[f]; ok {
					end = min(end, e)
				}
				return end, true
			}
		}
		return 0, false
	}
	r, _ := judge(t, judged, history.Bounds{MaxTakeover: maxTakeover, OpenEnd: openEnd}, fs, s.ops())
	s.checkBatches()
	r.trials, r.unprovoked = len(pauses), s.unprovoked
	return r
}

// processEnv is a scenario whose candidates are child processes: a
// 3-member etcd cluster, the fenced registers their leaders write to, and
// the directory the test and its children share.
type processEnv struct {
	t          *testing.T
	cluster    *etcdtest.Cluster
	connString string
	dir        string
	pool       *pgxpool.Pool    // the test's own: reads the register, makes late writes
	reg        *fenced.Register // the test's, logged to dir
	children   map[string]*child
	started    int // children started, for their names
	unprovoked int // leaderships lost without a fault
}

// newProcessEnv starts a cluster of three members and a fenced register
// on a fresh PostgreSQL database, then a child process, which it waits for
// to lead every name of processNames, and then two more.
func newProcessEnv(t *testing.T) *processEnv {
	t.Helper()
	cluster := etcdtest.StartCluster(t, members)
	connString := pgtest.NewDatabase(t)
	s := &processEnv{
		t:          t,
		cluster:    cluster,
		connString: connString,
		dir:        t.TempDir(),
		pool:       pgtest.OpenPool(t, connString),
		children:   map[string]*child{},
	}
	var err error
	if s.reg, err = fenced.Setup(callCtx(t), s.pool, registerTable); err != nil {
		t.Fatal(err)
	}
	if err := s.reg.LogTo(s.dir); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.reg.Close() })
	// Registered before the children's kills: run after them (t.Cleanup
	// is LIFO), when their logs and fail files are complete; the fail
	// files are read first, so that dumpLogs sees their failures.
	t.Cleanup(s.dumpLogs)
	t.Cleanup(s.checkFailFiles)
	first := s.start()
	for _, name := range processNames {
		if c, _ := s.leaderOf(name, 0, firstLeaderWithin); c != first {
			t.FailNow()
		}
	}
	for range candidates - 1 {
		s.start()
	}
	return s
}

// child is a candidate child process.
type child struct {
	*childproc.Process
	id string
}

// start starts a candidate child process, killed when the test ends if
// it is still running.
func (s *processEnv) start() *child {
	t := s.t
	t.Helper()
	id := fmt.Sprint("c", s.started)
	s.started++
	env := append(childproc.Env(envSoak, childEndpoints, childURL, childInstance, childDir),
		childEndpoints+"="+strings.Join(s.cluster.Endpoints(), ","),
		childURL+"="+s.connString,
		childInstance+"="+id,
		childDir+"="+s.dir,
	)
	c := &child{childproc.Start(t, id, "TestCandidateChildProcess", filepath.Join(s.dir, id+".log"), env), id}
	s.children[id] = c
	return c
}

// procs returns the children's processes, by ID.
func (s *processEnv) procs() []*childproc.Process {
	var ps []*childproc.Process
	for _, id := range slices.Sorted(maps.Keys(s.children)) {
		ps = append(ps, s.children[id].Process)
	}
	return ps
}

// stopAll stops every child that was not killed, all at once, and fails
// the test unless each exits within childStopWithin and its test
// (campaign, writes, no goroutine leaked) passed.
func (s *processEnv) stopAll() {
	s.t.Helper()
	childproc.StopAll(s.t, s.procs(), childStopWithin)
}

// checkFailFiles fails the test with the contents of every child's fail
// file, killed children's too: the failures each child reported.
func (s *processEnv) checkFailFiles() {
	for _, id := range slices.Sorted(maps.Keys(s.children)) {
		b, err := os.ReadFile(failFile(s.dir, id))
		switch {
		case errors.Is(err, os.ErrNotExist):
		case err != nil:
			s.t.Errorf("%s: reading its fail file: %v", id, err)
		default:
			s.t.Errorf("%s (killed: %v) reported failures:\n%s", id, s.children[id].Killed(), strings.TrimSpace(string(b)))
		}
	}
}

// dumpLogs shows the end of every child's log when the test failed.
func (s *processEnv) dumpLogs() { childproc.DumpLogs(s.t, s.procs()) }

// latest returns the writer and the term of the latest accepted write to
// name's register, and how many writes that leader had made in that term
// by then (from the write's value, "instance/term/sequence"). All are
// zero if the register was never written.
func (s *processEnv) latest(name string) (writer string, term uint64, writes int) {
	t := s.t
	t.Helper()
	var (
		t64   int64
		value string
	)
	err := s.pool.QueryRow(callCtx(t), `SELECT term, writer, value FROM `+pgx.Identifier{registerTable}.Sanitize()+` WHERE resource = $1`,
		resourceOf(name)).Scan(&t64, &writer, &value)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", 0, 0
	}
	if err != nil {
		t.Fatalf("reading the register of %s: %v", name, err)
	}
	if parts := strings.Split(value, "/"); len(parts) == 3 {
		if seq, err := strconv.Atoi(parts[2]); err == nil {
			writes = seq + 1
		}
	}
	return writer, uint64(t64), writes
}

// leaderOf waits for a leader of name with a term above after that has
// had at least three writes accepted, as the register shows, and returns
// it. If none comes within the given time, it fails the test and returns
// nil, so that the scenario stops injecting faults but still checks the
// histories, which tell what happened instead.
func (s *processEnv) leaderOf(name string, after uint64, within time.Duration) (*child, uint64) {
	t := s.t
	t.Helper()
	var (
		writer string
		term   uint64
		writes int
	)
	for deadline := time.Now().Add(within); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		writer, term, writes = s.latest(name)
		if c := s.children[writer]; c != nil && !c.Killed() && term > after && writes >= 3 {
			return c, term
		}
	}
	t.Errorf("no leader of %s with a term above %d that has written within %v; the register's latest write: %q, term %d, write %d",
		name, after, within, writer, term, writes)
	return nil, 0
}

// leading reports whether c leads name with term, as the register shows:
// it is the latest writer, with term, and writes again, with nobody
// writing in between, within a TTL (a child's writer stalled for longer
// than a few writeEvery on a busy machine still leads, and a fixed wait
// of 5 writeEvery, the first form, took it for a lost leader).
func (s *processEnv) leading(c *child, name string, term uint64) bool {
	w1, t1, n1 := s.latest(name)
	if w1 != c.id || t1 != term {
		return false
	}
	for deadline := time.Now().Add(ttl); time.Now().Before(deadline); time.Sleep(writeEvery) {
		w2, t2, n2 := s.latest(name)
		switch {
		case w2 != c.id || t2 != term:
			return false
		case n2 > n1:
			return true
		}
	}
	return false
}

// leads returns the names whose latest write was c's, and their terms:
// those c leads, or just lost.
func (s *processEnv) leads(c *child) map[string]uint64 {
	led := map[string]uint64{}
	for _, name := range processNames {
		if w, term, _ := s.latest(name); w == c.id {
			led[name] = term
		}
	}
	return led
}

// settle lets the leader of processNames[0] with term lead for 1.5 TTL,
// then a random 0 to maxInjectDelay (see env.settle), and returns the
// leader then: the same one, unless leadership changed without a fault,
// which is counted and logged. It returns nil if no leader came.
func (s *processEnv) settle(cur *child, term uint64) (*child, uint64) {
	s.t.Helper()
	time.Sleep(settleFor())
	if s.leading(cur, processNames[0], term) {
		return cur, term
	}
	s.unprovoked++
	s.t.Logf("%s lost its leadership of %s, term %d, without a fault", cur.id, processNames[0], term)
	return s.leaderOf(processNames[0], term, maxTakeover+2*ttl)
}

// lateWrite writes to name's register with a deposed leader's term, and
// fails the test unless the fence refuses it.
func (s *processEnv) lateWrite(trial int, name, id string, term, nextTerm uint64) {
	s.t.Helper()
	lateWrite(s.t, s.reg, s.pool, trial, name, id, term, nextTerm)
}

// awaitResumedWrite waits for the write that id makes when it resumes,
// with the term it led processNames[0] under, and fails the test unless
// the register refused it. It is the write that was in flight when the
// pause hit; finding it proves that the fault did what it should.
func (s *processEnv) awaitResumedWrite(trial int, id string, term uint64) {
	t := s.t
	t.Helper()
	want := resumedValue(id, term)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		for _, op := range s.ops() {
			// A return line (not Unknown, or failed) ends the wait.
			if op.Kind == fenced.Write && op.Client == id && op.Value == want && op.Resource == resourceOf(processNames[0]) && (!op.Unknown || op.Err != "") {
				switch {
				case op.Unknown:
					t.Errorf("trial %d: the write %s made on resuming failed: %v", trial, id, op)
				case op.Accepted:
					t.Errorf("trial %d: the write %s made on resuming with term %d was accepted after its successor had written: %v", trial, id, term, op)
				}
				return
			}
		}
		if time.Now().After(deadline) {
			t.Errorf("trial %d: %s made no write with term %d on resuming within %v", trial, id, term, 10*time.Second)
			return
		}
	}
}

// awaitEnd waits until id has recorded the end of its leadership of name
// with term. How soon after SIGCONT is checked on the whole history, at
// the end.
func (s *processEnv) awaitEnd(id, name string, term uint64) {
	t := s.t
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if slices.ContainsFunc(s.events(), func(e history.Event) bool {
			return e.Name == name && e.Instance == id && e.Term == term &&
				(e.Kind == history.Ended || e.Kind == history.Demoted || e.Kind == history.Released)
		}) {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("%s recorded no end of its leadership of %s with term %d within %v of resuming", id, name, term, 10*time.Second)
			return
		}
	}
}

// events loads the history of beliefs of every process.
func (s *processEnv) events() []history.Event {
	s.t.Helper()
	evs, err := history.Load(s.dir)
	if err != nil {
		s.t.Fatal(err)
	}
	return evs
}

// ops loads the register's history, every process's operations
// together.
func (s *processEnv) ops() []fenced.Op {
	s.t.Helper()
	ops, err := fenced.LoadOps(s.dir)
	if err != nil {
		s.t.Fatal(err)
	}
	return ops
}

// checkBatches reads the children's RenewBatch traces and fails the test
// unless they renewed with RenewBatch alone, never Renew, and some of
// their RenewBatch calls renewed both names at once.
func (s *processEnv) checkBatches() {
	t := s.t
	t.Helper()
	var batches, renewals, multiName, renews int
	for _, id := range slices.Sorted(maps.Keys(s.children)) {
		f, err := os.Open(traceFile(s.dir, id))
		if errors.Is(err, os.ErrNotExist) {
			continue // stopped before it campaigned
		}
		if err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if sc.Text() == "renew" {
				renews++
				continue
			}
			n, err := strconv.Atoi(sc.Text())
			if err != nil {
				continue // a line cut short by a kill
			}
			batches++
			renewals += n
			if n > 1 {
				multiName++
			}
		}
		f.Close()
	}
	t.Logf("the children renewed with %d RenewBatch calls (%d renewals; %d calls renewed both names) and %d Renew calls",
		batches, renewals, multiName, renews)
	if batches == 0 || multiName == 0 || renews > 0 {
		t.Errorf("want RenewBatch calls, some of both names at once, and no Renew call")
	}
}
