package faults_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/fenced"
	"github.com/leaderelect/leader/internal/history"
	"github.com/leaderelect/leader/postgres"
)

// fence is the fenced register (internal/fenced) that the leaders of a
// scenario write their terms to, through a pool that no fault touches, and
// the count of each term's accepted writes.
type fence struct {
	reg  *fenced.Register
	pool *pgxpool.Pool
	// tx, if not nil, makes a fenced transaction in the election's
	// database after each of the work's writes to the register.
	tx         *fencedWork
	mu         sync.Mutex
	acceptedBy map[uint64]int // accepted writes per term
}

// setupFence creates the register's table in pool's database.
func setupFence(t *testing.T, pool *pgxpool.Pool) *fence {
	t.Helper()
	reg, err := fenced.Setup(callCtx(t), pool, "fenced")
	if err != nil {
		t.Fatal(err)
	}
	return &fence{reg: reg, pool: pool, acceptedBy: map[uint64]int{}}
}

// written returns how many writes with term were accepted.
func (f *fence) written(term uint64) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.acceptedBy[term]
}

// work is a leader's work: write the term to the register every writeEvery
// until leadership ends, each time followed by a fenced transaction if f.tx
// is set. A write already sent when it ends is let finish.
func (f *fence) work(t *testing.T, ctx context.Context, id string) {
	term, _ := leader.TermFrom(ctx)
	tick := time.NewTicker(writeEvery)
	defer tick.Stop()
	for i := 0; ; i++ {
		value := fmt.Sprintf("%s/%d/%d", id, term, i)
		wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		accepted, err := f.reg.Write(wctx, f.pool, resource, term, id, value)
		cancel()
		if f.tx != nil {
			fenceTx(t, ctx, f.tx, id, term, value)
		}
		switch {
		case err != nil:
			t.Errorf("%s: %v", id, err)
			return
		case accepted:
			f.mu.Lock()
			f.acceptedBy[term]++
			f.mu.Unlock()
		case ctx.Err() == nil:
			// A greater term was accepted before this write returned,
			// and this instance still believes it leads.
			t.Errorf("%s: write with term %d refused while it believes it leads", id, term)
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// startElector starts an Elector for id on store with a TTL of leaseTTL,
// recording its beliefs in dir; while it leads it writes its term to f.
// metrics may be nil. The Elector stops when stop is called or t ends.
func (f *fence) startElector(t *testing.T, dir, id string, store leader.Store, leaseTTL time.Duration, metrics leader.Metrics) (e *leader.Elector, rec *history.Recorder, stop func()) {
	t.Helper()
	rec, err := history.Create(dir, election)
	if err != nil {
		t.Fatal(err)
	}
	onElected, onDemoted := rec.Hooks(id)
	e, err = leader.New(rec.Store(store, id), leader.Config{
		Name:    election,
		ID:      id,
		TTL:     leaseTTL,
		Logger:  testLogger(id),
		Metrics: metrics,
		OnElected: func(ctx context.Context) {
			onElected(ctx)
			f.work(t, ctx, id)
		},
		OnDemoted: onDemoted,
	})
	if err != nil {
		t.Fatal(err)
	}
	return e, rec, electortest.Run(t, e)
}

// checkBeliefs checks the history of beliefs of this process's Electors:
// any overlap, term regression or slow takeover fails the test, with what
// the stall probe saw around each overlap.
func checkBeliefs(t *testing.T, evs []history.Event, b history.Bounds) history.Report {
	t.Helper()
	rep := history.Check(evs, b)
	if !rep.OK() {
		t.Errorf("the history of beliefs fails (takeover bound %v):\n%v%s", b.MaxTakeover, rep, probe.explain(rep.Overlaps))
	}
	return rep
}

// lateWrite makes a late write with the deposed leader id's term, as a
// leader that missed its demotion would make, after its successor's term
// nextTerm has written: the fence must refuse it.
func (f *fence) lateWrite(t *testing.T, trial int, id string, term, nextTerm uint64) {
	t.Helper()
	accepted, err := f.reg.Write(callCtx(t), f.pool, resource, term, id+"-late", "late")
	if err != nil {
		t.Fatal(err)
	}
	if accepted {
		t.Errorf("trial %d: a write with the deposed leader's term %d was accepted after term %d had written", trial, term, nextTerm)
	}
}

// check checks the register's history: it must be linearizable, and no
// stale write may have been accepted. It returns the writes accepted, those
// refused, and the stale ones accepted.
func (f *fence) check(t *testing.T) (accepted, refused, stale int) {
	t.Helper()
	ops := f.reg.History()
	if ok, _ := fenced.CheckLinearizable(ops); !ok {
		t.Errorf("the fenced register's history of %d operations is not linearizable", len(ops))
	}
	staleOps := staleAccepted(ops)
	for _, op := range staleOps {
		t.Errorf("a stale write was accepted: %v", op)
	}
	accepted, refused = countWrites(ops)
	return accepted, refused, len(staleOps)
}

// countWrites counts the writes in ops that were accepted and those that
// were refused (a write is refused only when a greater term had been
// accepted: every refusal is of a stale write). Writes whose outcome is
// unknown are in neither.
func countWrites(ops []fenced.Op) (accepted, refused int) {
	for _, op := range ops {
		switch {
		case op.Kind != fenced.Write || op.Unknown:
		case op.Accepted:
			accepted++
		default:
			refused++
		}
	}
	return accepted, refused
}

// staleAccepted returns the accepted writes whose term is smaller than that
// of a write accepted before they were sent: what a deposed leader attempted
// after its successor wrote, and the fence should have refused.
func staleAccepted(ops []fenced.Op) []fenced.Op {
	var done []fenced.Op // accepted writes, by return time
	for _, op := range ops {
		if op.Kind == fenced.Write && op.Accepted && !op.Unknown {
			done = append(done, op)
		}
	}
	sort.Slice(done, func(i, j int) bool { return done[i].Return < done[j].Return })
	maxTerm := make([]uint64, len(done)) // greatest term of done[:i+1]
	for i, op := range done {
		maxTerm[i] = op.Term
		if i > 0 {
			maxTerm[i] = max(maxTerm[i], maxTerm[i-1])
		}
	}
	var stale []fenced.Op
	for _, op := range done {
		n := sort.Search(len(done), func(i int) bool { return done[i].Return >= op.Invoke })
		if n > 0 && maxTerm[n-1] > op.Term {
			stale = append(stale, op)
		}
	}
	return stale
}

func testLogger(instance string) *slog.Logger {
	if os.Getenv("LEADER_TEST_LOG") == "" {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})).With("instance", instance)
}

// callCtx returns a context for one call, bounded generously.
func callCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// newStore returns a store of the strategy on pool, closed when t ends.
func newStore(t *testing.T, strategy string, pool *pgxpool.Pool) leader.Store {
	t.Helper()
	switch strategy {
	case "lease":
		ls, err := postgres.NewLeaseStore(pool, postgres.Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(ls.Close)
		return ls
	case "advisory":
		as, err := postgres.NewAdvisoryStore(callCtx(t), pool, postgres.Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(as.Close)
		return as
	}
	t.Fatalf("unknown strategy %q", strategy)
	return nil
}
