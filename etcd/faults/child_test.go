//go:build unix

package faults_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/etcd"
	"github.com/leaderelect/leader/internal/childproc"
	"github.com/leaderelect/leader/internal/fenced"
	"github.com/leaderelect/leader/internal/history"
	"github.com/leaderelect/leader/internal/monotime"
)

// The candidates of TestLeaderProcess are real processes: this test
// binary, run again as a child process to run TestCandidateChildProcess
// with the environment below.

// Environment of a candidate child process. TestCandidateChildProcess
// does nothing unless childEndpoints is set.
const (
	// childEndpoints is the etcd client URLs, separated by commas.
	childEndpoints = "LEADER_ETCD_FAULTS_CHILD_ENDPOINTS"
	childURL       = "LEADER_ETCD_FAULTS_CHILD_DATABASE_URL" // of the register's database
	childInstance  = "LEADER_ETCD_FAULTS_CHILD_INSTANCE"
	// childDir is the directory the candidates and the test share:
	// history files, fenced register logs, RenewBatch traces, pause
	// files and the children's logs.
	childDir = "LEADER_ETCD_FAULTS_CHILD_DIR"
)

// processNames are the election names every candidate child process
// campaigns for, with one Elector each on one etcd.Store: when it leads
// both, it renews them with one RenewBatch call per round.
var processNames = []string{election, election + "-b"}

// failFile is the file in dir to which instance appends a line per
// failure, created on the first: the test reads it once the child has
// exited, killed or not, since a killed child's own test output is lost.
func failFile(dir, instance string) string {
	return filepath.Join(dir, instance+".fail")
}

// childFailures reports the failures of a candidate child process: each
// is logged as the child's test failure and appended as a line to its
// fail file, which survives a SIGKILL once the write has returned.
type childFailures struct {
	t       *testing.T
	dir, id string
	mu      sync.Mutex // one line at a time
}

// errorf reports a failure and lets the child go on.
func (f *childFailures) errorf(format string, args ...any) {
	msg := f.id + ": " + fmt.Sprintf(format, args...)
	f.t.Error(msg)
	f.mu.Lock()
	defer f.mu.Unlock()
	file, err := os.OpenFile(failFile(f.dir, f.id), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err == nil {
		_, err = file.WriteString(strings.ReplaceAll(msg, "\n", " ") + "\n")
		err = errors.Join(err, file.Close())
	}
	if err != nil {
		f.t.Errorf("%s: writing the fail file: %v", f.id, err)
	}
}

// fatalf reports a failure and ends the child's test.
func (f *childFailures) fatalf(format string, args ...any) {
	f.errorf(format, args...)
	f.t.FailNow()
}

// traceFile is the file in dir to which instance's recordingStore writes
// a line per RenewBatch call and per Renew call.
func traceFile(dir, instance string) string {
	return filepath.Join(dir, instance+".batches")
}

// resumedValue is the value of the write a candidate makes when it
// resumes from a pause during which it led with term.
func resumedValue(instance string, term uint64) string {
	return fmt.Sprintf("%s/%d/resumed", instance, term)
}

// TestCandidateChildProcess is a candidate of TestLeaderProcess, when run
// as its child process; otherwise it returns at once. It campaigns for
// every name of processNames, with an Elector each on one etcd.Store
// wrapped in a recordingStore (so that they renew together with
// RenewBatch, and record their beliefs with internal/history in the shared
// directory), and, while it leads a name, writes the term to that name's
// fenced register every writeEvery, logging the register's operations to
// the shared directory too. When it is resumed (SIGCONT) from a pause
// during which it led a name, it makes one write with the term it led
// under: the write a leader had decided on when the pause hit. It runs
// until its standard input closes (the test stops it, or the test binary
// died) or it is killed. It fails if a write fails, if its leader work has
// a write refused while the leader context is live (unless the process
// was paused during that leadership), or if goroutines leak (TestMain's
// check); each failure but a leak also goes to its fail file, which the
// test reads.
func TestCandidateChildProcess(t *testing.T) {
	eps := os.Getenv(childEndpoints)
	if eps == "" {
		return
	}
	id, url, dir := os.Getenv(childInstance), os.Getenv(childURL), os.Getenv(childDir)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})).With("instance", id)
	fail := &childFailures{t: t, dir: dir, id: id}

	// Started before any leadership can start, so that no resumption
	// goes unnoticed.
	ctx, resumed, stop := childproc.Child()
	defer stop()

	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		fail.fatalf("register pool: %v", err)
	}
	defer pool.Close()
	cli := newClient(t, strings.Split(eps, ","))
	defer cli.Close()
	store, err := etcd.New(cli, etcd.WithPrefix(prefix), etcd.WithLogger(log.With("component", "store")))
	if err != nil {
		fail.fatalf("%v", err)
	}
	defer store.Close()
	trace, err := os.OpenFile(traceFile(dir, id), os.O_WRONLY|os.O_CREATE|os.O_EXCL|os.O_APPEND, 0o644)
	if err != nil {
		fail.fatalf("%v", err)
	}
	defer trace.Close()
	rs := newRecordingStore(store, trace)
	reg, err := fenced.Open(registerTable)
	if err != nil {
		fail.fatalf("%v", err)
	}
	if err := reg.LogTo(dir); err != nil {
		fail.fatalf("%v", err)
	}
	defer func() {
		if err := reg.Close(); err != nil {
			fail.errorf("closing the register's log: %v", err)
		}
	}()

	c := &childCandidate{fail: fail, id: id, dir: dir, log: log, reg: reg, pool: pool}
	var electors []*leader.Elector
	for _, name := range processNames {
		rec, err := history.Create(dir, name)
		if err != nil {
			fail.fatalf("%v", err)
		}
		defer func() {
			if err := rec.Close(); err != nil {
				fail.errorf("%v", err)
			}
		}()
		rs.add(rec, id)
		onElected, onDemoted := rec.Hooks(id)
		e, err := leader.New(rs, leader.Config{
			Name:   name,
			ID:     id,
			TTL:    ttl,
			Logger: log.With("name", name),
			OnElected: func(lctx context.Context) {
				onElected(lctx)
				c.lead(lctx, name)
			},
			OnDemoted: onDemoted,
		})
		if err != nil {
			fail.fatalf("%v", err)
		}
		electors = append(electors, e)
	}
	var wg sync.WaitGroup
	wg.Go(func() { c.writeOnResume(ctx, resumed) })
	for _, e := range electors {
		wg.Go(func() {
			if err := e.Run(ctx); err != nil {
				fail.errorf("Run: %v", err)
			}
		})
	}
	wg.Wait()
}

// childCandidate is the state of the candidate a child process runs.
type childCandidate struct {
	fail *childFailures
	id   string
	dir  string
	log  *slog.Logger
	reg  *fenced.Register
	pool *pgxpool.Pool

	mu          sync.Mutex
	leaderships []leadership
}

// leadership is one leadership as the candidate's work saw it: from the
// call of OnElected to the cancellation of the leader context (end 0
// until then), both CLOCK_MONOTONIC readings.
type leadership struct {
	name       string
	term       uint64
	start, end int64
}

// lead is the leader work of name: it writes the term to name's register
// every writeEvery until the leader context is cancelled, checking the
// context before each write. A write already sent when it is cancelled
// is let finish. A write refused while the leader context is still live
// is a failure (a greater term wrote while this one was believed), unless
// the process was paused during this leadership: its Elector's timers did
// not fire during the pause, and the judge of the pause scenario bounds
// how long it believes after it.
func (c *childCandidate) lead(lctx context.Context, name string) {
	term, _ := leader.TermFrom(lctx)
	start, err := monotime.Now()
	if err != nil {
		c.fail.errorf("%v", err)
		return
	}
	c.mu.Lock()
	this := len(c.leaderships)
	c.leaderships = append(c.leaderships, leadership{name: name, term: term, start: start})
	c.mu.Unlock()
	context.AfterFunc(lctx, func() {
		end, err := monotime.Now()
		if err != nil {
			c.fail.errorf("%v", err)
			return
		}
		c.mu.Lock()
		c.leaderships[this].end = end
		c.mu.Unlock()
	})

	tick := time.NewTicker(writeEvery)
	defer tick.Stop()
	for i := 0; lctx.Err() == nil; i++ {
		refused := c.write(lctx, name, term, fmt.Sprintf("%s/%d/%d", c.id, term, i))
		if refused && lctx.Err() == nil {
			if pausedAt, ok := c.lastPause(); ok && pausedAt > start {
				c.log.Warn("write refused while the leader context is live, after a pause during this leadership",
					slog.String("name", name), slog.Uint64("term", term))
			} else {
				c.fail.errorf("write %d with term %d to the register of %s refused while the leader context is live", i, term, name)
			}
		}
		select {
		case <-lctx.Done():
		case <-tick.C:
		}
	}
}

// ledAt returns the term of the leadership of name that was on at the
// CLOCK_MONOTONIC reading at, if any.
func (c *childCandidate) ledAt(name string, at int64) (uint64, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, l := range c.leaderships {
		if l.name == name && l.start <= at && (l.end == 0 || l.end > at) {
			return l.term, true
		}
	}
	return 0, false
}

// lastPause returns the CLOCK_MONOTONIC reading the test left in the
// pause file during the process's latest pause, if it was ever paused.
func (c *childCandidate) lastPause() (int64, bool) {
	pausedAt, err := childproc.ReadPause(c.dir, c.id)
	if errors.Is(err, os.ErrNotExist) {
		return 0, false
	}
	if err != nil {
		c.fail.errorf("reading the pause file: %v", err)
		return 0, false
	}
	return pausedAt, true
}

// writeOnResume waits for the process to be resumed from a pause
// (SIGCONT) until ctx ends. On each resumption, for each name it led when
// it was paused (at the reading the test left in its pause file), it
// makes one write with the term it led under, as the leader work would
// have done had the pause hit between its check of the leader context and
// its write: the Elector's timers did not fire during the pause, so the
// work could not know that its leadership had ended.
func (c *childCandidate) writeOnResume(ctx context.Context, resumed <-chan os.Signal) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-resumed:
		}
		pausedAt, ok := c.lastPause()
		if !ok {
			c.fail.errorf("resumed without a pause file")
			continue
		}
		for _, name := range processNames {
			term, ok := c.ledAt(name, pausedAt)
			if !ok {
				c.log.Info("resumed from a pause during which this instance did not lead", slog.String("name", name))
				continue
			}
			c.log.Info("resumed from a pause during which this instance led; sending the write that was in flight",
				slog.String("name", name), slog.Uint64("term", term))
			c.write(ctx, name, term, resumedValue(c.id, term))
		}
	}
}

// write writes (term, value) to name's register, fails the test if the
// write fails, and logs a refusal, which it reports.
func (c *childCandidate) write(ctx context.Context, name string, term uint64, value string) (refused bool) {
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	accepted, err := c.reg.Write(wctx, c.pool, resourceOf(name), term, c.id, value)
	switch {
	case err != nil:
		c.fail.errorf("%v", err)
	case !accepted:
		// Expected of a deposed leader's late write, which is why the
		// register is fenced; the test counts them.
		c.log.Warn("write refused: a greater term has written", slog.String("name", name),
			slog.Uint64("term", term), slog.String("value", value))
		return true
	}
	return false
}
