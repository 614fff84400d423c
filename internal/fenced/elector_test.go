package fenced_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/fenced"
	"github.com/leaderelect/leader/internal/history"
	"github.com/leaderelect/leader/internal/pgtest"
	"github.com/leaderelect/leader/postgres"
)

// crashable forwards to a store until crashed, then fails every call that
// could change the lease, as if its process had died: its Elector keeps
// believing it leads until its local deadline, and the lease runs out on
// the store.
type crashable struct {
	leader.Store
	crashed atomic.Bool
}

func (s *crashable) err(op string) error {
	return fmt.Errorf("%w: %s: simulated crash", leader.ErrUnavailable, op)
}

func (s *crashable) Acquire(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) (leader.Lease, bool, error) {
	if s.crashed.Load() {
		return leader.Lease{}, false, s.err("acquire")
	}
	return s.Store.Acquire(ctx, name, c, ttl)
}

func (s *crashable) Renew(ctx context.Context, name, token string, term uint64, ttl time.Duration) (leader.Lease, error) {
	if s.crashed.Load() {
		return leader.Lease{}, s.err("renew")
	}
	return s.Store.Renew(ctx, name, token, term, ttl)
}

func (s *crashable) Release(ctx context.Context, name, token string, term uint64) error {
	if s.crashed.Load() {
		return s.err("release")
	}
	return s.Store.Release(ctx, name, token, term)
}

// member is one Elector of the combined test.
type member struct {
	id    string
	e     *leader.Elector
	rec   *history.Recorder
	store *crashable
	stop  func()
}

// writeLog counts the writes each term got accepted.
type writeLog struct {
	mu       sync.Mutex
	accepted map[uint64]int
}

func (w *writeLog) add(term uint64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.accepted[term]++
}

func (w *writeLog) count(term uint64) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.accepted[term]
}

// Three Electors on the PostgreSQL lease store; each, while it leads, writes
// to a fenced register with its term. Leadership passes by Resign and by
// simulated crashes. The history of beliefs must show no overlap, growing
// terms and bounded takeovers; the register's history must be linearizable;
// and a write with a crashed leader's term, made after its successor wrote,
// must be refused.
func TestLeadersWriteThroughTheFence(t *testing.T) {
	t.Parallel()
	const (
		election = "fenced-job"
		resource = "job-output"
		// Long enough that renewals keep up on a busy machine, and that
		// a takeover within it (see MaxTakeover below) has room.
		ttl = 5 * time.Second
	)
	connString := pgtest.NewDatabase(t)
	storePool := pgtest.OpenPool(t, connString)
	workPool := pgtest.OpenPool(t, connString)
	ctx := callCtx(t)
	if err := postgres.Migrate(ctx, storePool, postgres.Options{}); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	leases, err := postgres.NewLeaseStore(storePool, postgres.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(leases.Close)
	reg, err := fenced.Setup(ctx, workPool, "fenced")
	if err != nil {
		t.Fatal(err)
	}

	written := &writeLog{accepted: map[uint64]int{}}
	// work is each leader's work: write with the term until leadership
	// ends. A write already sent when it ends is let finish.
	work := func(ctx context.Context, id string) {
		term, _ := leader.TermFrom(ctx)
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			accepted, err := reg.Write(wctx, workPool, resource, term, id, fmt.Sprintf("%s/%d/%d", id, term, i))
			cancel()
			switch {
			case err != nil:
				t.Errorf("%s: %v", id, err)
				return
			case accepted:
				written.add(term)
			case ctx.Err() == nil:
				// A greater term was accepted before this write, and
				// this instance still believes it leads.
				t.Errorf("%s: write with term %d refused while leading", id, term)
			}
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}

	dir := t.TempDir()
	logger := slog.New(slog.DiscardHandler)
	if os.Getenv("LEADER_TEST_LOG") != "" {
		logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	var members []*member
	for i := range 3 {
		m := &member{id: fmt.Sprint("m", i), store: &crashable{Store: leases}}
		if m.rec, err = history.Create(dir, election); err != nil {
			t.Fatal(err)
		}
		onElected, onDemoted := m.rec.Hooks(m.id)
		m.e, err = leader.New(m.rec.Store(m.store, m.id), leader.Config{
			Name:   election,
			ID:     m.id,
			TTL:    ttl,
			Logger: logger.With("instance", m.id),
			OnElected: func(ctx context.Context) {
				onElected(ctx)
				work(ctx, m.id)
			},
			OnDemoted: onDemoted,
		})
		if err != nil {
			t.Fatal(err)
		}
		m.stop = electortest.Run(t, m.e)
		members = append(members, m)
	}

	// A reader beside the leaders, so that the register's history has
	// reads to check too.
	readCtx, stopReading := context.WithCancel(t.Context())
	var reading sync.WaitGroup
	reading.Go(func() {
		for readCtx.Err() == nil {
			if _, _, err := reg.Read(readCtx, workPool, resource, "observer"); err != nil && readCtx.Err() == nil {
				t.Errorf("observer: %v", err)
				return
			}
			time.Sleep(10 * time.Millisecond) // the reading pace, not a wait for a condition
		}
	})

	// nextLeader waits for a leader with a term above after, which has had
	// a few writes accepted.
	nextLeader := func(after uint64, within time.Duration) (*member, uint64) {
		t.Helper()
		var cur *member
		var term uint64
		electortest.Eventually(t, within, fmt.Sprintf("a leader with a term above %d that has written", after), func() bool {
			for _, m := range members {
				if st := m.e.Status(); st.IsLeader && st.Term > after && written.count(st.Term) >= 3 {
					cur, term = m, st.Term
					return true
				}
			}
			return false
		})
		return cur, term
	}
	resign := func(m *member) {
		t.Helper()
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel()
		if err := m.e.Resign(ctx); err != nil {
			t.Fatalf("%s: Resign: %v", m.id, err)
		}
	}
	crash := func(m *member, term uint64) (*member, uint64) {
		t.Helper()
		m.store.crashed.Store(true)
		next, nextTerm := nextLeader(term, 10*ttl)
		if m.e.IsLeader() {
			t.Fatalf("%s still leads after %s was elected with term %d", m.id, next.id, nextTerm)
		}
		// A late write from the crashed leader, as a paused process
		// would make on resuming: the fence must refuse it.
		accepted, err := reg.Write(callCtx(t), workPool, resource, term, m.id+"-zombie", "late")
		if err != nil {
			t.Fatal(err)
		}
		if accepted {
			t.Errorf("a write with the crashed leader's term %d was accepted after term %d had written", term, nextTerm)
		}
		m.store.crashed.Store(false)
		return next, nextTerm
	}

	cur, term := nextLeader(0, 10*time.Second)
	for _, handover := range []string{"resign", "resign", "crash", "resign", "crash", "resign"} {
		switch handover {
		case "resign":
			resign(cur)
			cur, term = nextLeader(term, 10*time.Second)
		case "crash":
			cur, term = crash(cur, term)
		}
	}

	for _, m := range members {
		m.stop()
	}
	stopReading()
	reading.Wait()
	for _, m := range members {
		if err := m.rec.Close(); err != nil {
			t.Fatalf("%s: %v", m.id, err)
		}
	}

	evs, err := history.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	// A crash is taken over when the lease runs out on the store, which is
	// DriftMargin + StopGrace after the crashed leader stopped believing:
	// well within a TTL.
	rep := history.Check(evs, history.Bounds{MaxTakeover: ttl})
	if !rep.OK() {
		t.Errorf("the history of beliefs fails:\n%v", rep)
	}
	if len(rep.Takeovers) < 6 {
		t.Errorf("want at least 6 takeovers:\n%v", rep)
	}
	for _, tk := range rep.Takeovers {
		t.Logf("takeover in %v: %s term %d -> %s term %d", tk.Gap, tk.From.Instance, tk.From.Term, tk.To.Instance, tk.To.Term)
	}
	t.Logf("takeovers: %v", rep.TakeoverSummary())

	ops := reg.History()
	checkLinearizable(t, ops)
	var accepted, refused int
	for _, op := range ops {
		if op.Kind == fenced.Write && op.Accepted {
			accepted++
		} else if op.Kind == fenced.Write {
			refused++
		}
	}
	t.Logf("fenced register: %d operations, %d writes accepted, %d refused", len(ops), accepted, refused)
}
