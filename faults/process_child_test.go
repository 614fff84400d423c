package faults_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/childproc"
	"github.com/leaderelect/leader/internal/fenced"
	"github.com/leaderelect/leader/internal/history"
	"github.com/leaderelect/leader/internal/monotime"
	"github.com/leaderelect/leader/postgres"
)

// The candidates of TestProcessFaults are real processes: this test binary,
// re-executed to run TestCandidateChildProcess with the environment below.

// Environment of a candidate child process. TestCandidateChildProcess does
// nothing unless childURL is set.
const (
	childURL      = "LEADER_FAULTS_CHILD_DATABASE_URL"
	childInstance = "LEADER_FAULTS_CHILD_INSTANCE"
	childStore    = "LEADER_FAULTS_CHILD_STORE" // "lease" or "advisory"
	// childDir is the directory the candidates and the test share: history
	// files, fenced register logs, pause files and the children's logs.
	childDir = "LEADER_FAULTS_CHILD_DIR"
)

// registerTable is the table of the fenced register in a process
// scenario's database.
const registerTable = "fenced"

// resumedValue is the value of the write a candidate makes when it resumes
// from a pause during which it led with term.
func resumedValue(instance string, term uint64) string {
	return fmt.Sprintf("%s/%d/resumed", instance, term)
}

// TestCandidateChildProcess is a candidate of TestProcessFaults, when run as
// its child process; otherwise it returns at once. It campaigns with an
// Elector on the store named by childStore, records its beliefs with
// internal/history in the shared directory and, while it leads, writes its
// term to the fenced register every writeEvery, logging the register's
// operations to the shared directory too. When it is resumed (SIGCONT)
// from a pause during which it led, it makes one write with the term it led
// under: the write a leader had decided on when the pause hit. It runs
// until its standard input closes (the test stops it, or the test binary
// died) or it is killed, and fails if a write fails or if goroutines leak
// (TestMain's check).
func TestCandidateChildProcess(t *testing.T) {
	url := os.Getenv(childURL)
	if url == "" {
		return
	}
	id, strategy, dir := os.Getenv(childInstance), os.Getenv(childStore), os.Getenv(childDir)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})).With("instance", id)

	// Started before any leadership can start, so that no resumption
	// goes unnoticed.
	ctx, resumed, stop := childproc.Child()
	defer stop()

	// The store, the register's writes and the fenced transactions have
	// a pool each, so that writes never queue for a connection behind
	// renewals or the other way round, and so that the server's ending a
	// session idle in a fenced transaction touches no other.
	storePool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatalf("%s: store pool: %v", id, err)
	}
	defer storePool.Close()
	workPool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatalf("%s: work pool: %v", id, err)
	}
	defer workPool.Close()
	txCfg, err := txPoolConfig(url)
	if err != nil {
		t.Fatalf("%s: fenced transactions' pool: %v", id, err)
	}
	txPool, err := pgxpool.NewWithConfig(ctx, txCfg)
	if err != nil {
		t.Fatalf("%s: fenced transactions' pool: %v", id, err)
	}
	defer txPool.Close()
	store, closeStore, err := childStoreFor(ctx, strategy, storePool, postgres.Options{Logger: log})
	if err != nil {
		if ctx.Err() != nil {
			// Told to stop while starting (a replacement started just
			// before the scenario ended): err is that stop's doing.
			log.Info("stopped before campaigning", slog.Any("error", err))
			return
		}
		t.Fatalf("%s: %v", id, err)
	}
	defer closeStore()

	rec, err := history.Create(dir, election)
	if err != nil {
		t.Fatalf("%s: %v", id, err)
	}
	defer func() {
		if err := rec.Close(); err != nil {
			t.Errorf("%s: %v", id, err)
		}
	}()
	reg, err := fenced.Open(registerTable)
	if err != nil {
		t.Fatalf("%s: %v", id, err)
	}
	if err := reg.LogTo(dir); err != nil {
		t.Fatalf("%s: %v", id, err)
	}
	defer func() {
		if err := reg.Close(); err != nil {
			t.Errorf("%s: closing the register's log: %v", id, err)
		}
	}()

	work, err := newFencedWork(strategy, txPool, dir, id)
	if err != nil {
		t.Fatalf("%s: %v", id, err)
	}
	defer func() {
		if err := work.close(); err != nil {
			t.Errorf("%s: closing the fenced transactions' log: %v", id, err)
		}
	}()

	c := &candidateProcess{t: t, id: id, dir: dir, log: log, reg: reg, pool: workPool, work: work}
	onElected, onDemoted := rec.Hooks(id)
	e, err := leader.New(rec.Store(store, id), leader.Config{
		Name:   election,
		ID:     id,
		TTL:    ttl,
		Logger: log,
		OnElected: func(lctx context.Context) {
			onElected(lctx)
			c.lead(lctx)
		},
		OnDemoted: onDemoted,
	})
	if err != nil {
		t.Fatalf("%s: %v", id, err)
	}
	var wg sync.WaitGroup
	wg.Go(func() { c.writeOnResume(ctx, resumed) })
	if err := e.Run(ctx); err != nil {
		t.Errorf("%s: Run: %v", id, err)
	}
	wg.Wait()
}

// childStoreFor returns the store of strategy on pool, and how to close it.
func childStoreFor(ctx context.Context, strategy string, pool *pgxpool.Pool, opts postgres.Options) (leader.Store, func(), error) {
	switch strategy {
	case "lease":
		s, err := postgres.NewLeaseStore(pool, opts)
		if err != nil {
			return nil, nil, err
		}
		return s, s.Close, nil
	case "advisory":
		s, err := postgres.NewAdvisoryStore(ctx, pool, opts)
		if err != nil {
			return nil, nil, err
		}
		return s, s.Close, nil
	default:
		return nil, nil, fmt.Errorf("%s %q: want lease or advisory", childStore, strategy)
	}
}

// candidateProcess is the state of the candidate a child process runs.
type candidateProcess struct {
	t    *testing.T
	id   string
	dir  string
	log  *slog.Logger
	reg  *fenced.Register
	pool *pgxpool.Pool // for the register's writes
	work *fencedWork   // the fenced transactions, in the election's database

	mu          sync.Mutex
	leaderships []leadership
}

// leadership is one leadership as the candidate's work saw it: from the
// call of OnElected to the cancellation of the leader context (end 0 until
// then), both CLOCK_MONOTONIC readings. The work may have a write in flight
// at any moment in between.
type leadership struct {
	term       uint64
	start, end int64
}

// lead is the leader work: it writes the term to the register every
// writeEvery until the leader context is cancelled, checking the context
// before each write, as careful leader work does. A write already sent when
// it is cancelled is let finish.
func (c *candidateProcess) lead(lctx context.Context) {
	term, _ := leader.TermFrom(lctx)
	start, err := monotime.Now()
	if err != nil {
		c.t.Errorf("%s: %v", c.id, err)
		return
	}
	c.mu.Lock()
	this := len(c.leaderships)
	c.leaderships = append(c.leaderships, leadership{term: term, start: start})
	c.mu.Unlock()
	context.AfterFunc(lctx, func() {
		end, err := monotime.Now()
		if err != nil {
			c.t.Errorf("%s: %v", c.id, err)
			return
		}
		c.mu.Lock()
		c.leaderships[this].end = end
		c.mu.Unlock()
	})

	tick := time.NewTicker(writeEvery)
	defer tick.Stop()
	for i := 0; lctx.Err() == nil; i++ {
		c.write(lctx, term, fmt.Sprintf("%s/%d/%d", c.id, term, i))
		select {
		case <-lctx.Done():
		case <-tick.C:
		}
	}
}

// ledAt returns the term of the leadership that was on at the
// CLOCK_MONOTONIC reading at, if any.
func (c *candidateProcess) ledAt(at int64) (uint64, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, l := range c.leaderships {
		if l.start <= at && (l.end == 0 || l.end > at) {
			return l.term, true
		}
	}
	return 0, false
}

// writeOnResume waits for the process to be resumed from a pause (SIGCONT)
// until ctx ends. On each resumption, if the candidate led when it was
// paused (at the reading the test left in its pause file), it makes one
// write with the term it led under, as the leader work would have done had
// the pause hit between its check of the leader context and its write: the
// Elector's timers did not fire during the pause, so the work could not
// know that its leadership had ended.
func (c *candidateProcess) writeOnResume(ctx context.Context, resumed <-chan os.Signal) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-resumed:
		}
		pausedAt, err := childproc.ReadPause(c.dir, c.id)
		if err != nil {
			c.t.Errorf("%s: resumed without a readable pause file: %v", c.id, err)
			continue
		}
		term, ok := c.ledAt(pausedAt)
		if !ok {
			c.log.Info("resumed from a pause during which this instance did not lead")
			continue
		}
		c.log.Info("resumed from a pause during which this instance led; sending the write that was in flight", slog.Uint64("term", term))
		c.write(ctx, term, resumedValue(c.id, term))
	}
}

// write writes (term, value) to the register, fails the test if the write
// fails, and logs a refusal; then it makes a fenced transaction with term
// and value (fencedWork.write), which the test checks from its log.
func (c *candidateProcess) write(ctx context.Context, term uint64, value string) {
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	accepted, err := c.reg.Write(wctx, c.pool, resource, term, c.id, value)
	switch {
	case err != nil:
		c.t.Errorf("%s: %v", c.id, err)
	case !accepted:
		// Expected of a deposed leader's late write, which is why the
		// register is fenced; the test counts them.
		c.log.Warn("write refused: a greater term has written", slog.Uint64("term", term), slog.String("value", value))
	}
	fenceTx(c.t, ctx, c.work, c.id, term, value)
}
