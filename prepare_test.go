package leader_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/leadertest"
)

// preparingStore is a MemStore that prepares handovers the way a test
// says: PrepareHandover fails with prepareErr if set, and a prepared
// handover's Commit fails with commitErr if set, else hands over with
// ReleaseTo. It counts the calls.
type preparingStore struct {
	*leadertest.MemStore
	prepareErr, commitErr            error
	prepares, commits, aborts, plain atomic.Int32
}

func (s *preparingStore) PrepareHandover(ctx context.Context, name, token string, term uint64, successor leader.Candidate, wait time.Duration) (leader.PreparedHandover, error) {
	s.prepares.Add(1)
	if s.prepareErr != nil {
		return nil, s.prepareErr
	}
	return &fakePrepared{s: s, name: name, token: token, term: term, successor: successor}, nil
}

// ReleaseTo counts the handovers made without a preparation's Commit.
func (s *preparingStore) ReleaseTo(ctx context.Context, name, token string, term uint64, successor leader.Candidate, reason leader.GrantReason, hold time.Duration) error {
	s.plain.Add(1)
	return s.MemStore.ReleaseTo(ctx, name, token, term, successor, reason, hold)
}

type fakePrepared struct {
	s           *preparingStore
	name, token string
	term        uint64
	successor   leader.Candidate
}

func (p *fakePrepared) Commit(ctx context.Context, reason leader.GrantReason, hold time.Duration) error {
	p.s.commits.Add(1)
	if p.s.commitErr != nil {
		return p.s.commitErr
	}
	return p.s.MemStore.ReleaseTo(ctx, p.name, p.token, p.term, p.successor, reason, hold)
}

func (p *fakePrepared) Abort() { p.s.aborts.Add(1) }

// TestElectorPreparesHandovers checks how the Elector uses a
// HandoverPreparer: a transfer is prepared and committed, not released
// with ReleaseTo; a preparation that fails, and a commit that fails for
// another reason than a lost lease, fall back to ReleaseTo; and every
// transfer reaches its successor with the next term.
func TestElectorPreparesHandovers(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name                  string
		prepareErr, commitErr error
		commits, plain        int32
	}{
		{"prepared and committed", nil, nil, 1, 0},
		{"a failed preparation hands over with ReleaseTo", errors.New("no session"), nil, 0, 1},
		{"a failed commit hands over with ReleaseTo", nil, errors.New("connection reset"), 1, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			store := &preparingStore{MemStore: leadertest.NewMemStore(), prepareErr: c.prepareErr, commitErr: c.commitErr}
			h := newHistory()
			es := map[string]*leader.Elector{}
			for _, id := range []string{"a", "b"} {
				cfg := testConfig("prep", id)
				cfg.OnElected, cfg.OnDemoted = h.Hooks(t, id)
				e, err := leader.New(store, cfg)
				if err != nil {
					t.Fatal(err)
				}
				es[id] = e
				runElector(t, e)
			}
			var from string
			var term uint64
			eventually(t, 10*time.Second, "a leader and an enlisted follower", func() bool {
				for id, e := range es {
					if st := e.Status(); st.IsLeader {
						from, term = id, st.Term
						cands, err := store.Candidates(t.Context(), "prep")
						return err == nil && len(cands) >= 1
					}
				}
				return false
			})
			to := map[string]string{"a": "b", "b": "a"}[from]
			l, err := es[from].Transfer(callCtx(t), to)
			if err != nil {
				t.Fatalf("Transfer: %v", err)
			}
			if l.HolderID != to || l.Term != term+1 {
				t.Fatalf("Transfer returned %+v; want %s leading with term %d", l, to, term+1)
			}
			if n := store.prepares.Load(); n != 1 {
				t.Errorf("%d preparations; want 1", n)
			}
			if n := store.commits.Load(); n != c.commits {
				t.Errorf("%d commits; want %d", n, c.commits)
			}
			if n := store.plain.Load(); n != c.plain {
				t.Errorf("%d handovers with ReleaseTo; want %d", n, c.plain)
			}
			if n := store.aborts.Load(); n != 0 {
				t.Errorf("%d aborts; want none", n)
			}
		})
	}
}

// stagingPrepared is a fakePrepared that is a leader.HandoverStager: it
// records each Stage call (and whether the old leader's OnDemoted had run
// by then), and fails it with stageErr if set.
type stagingPrepared struct {
	*fakePrepared
	stageErr error
	staged   chan stageCall // capacity 1
	demoted  *atomic.Bool
}

type stageCall struct {
	reason       leader.GrantReason
	hold         time.Duration
	afterDemoted bool
}

func (p *stagingPrepared) Stage(ctx context.Context, reason leader.GrantReason, hold time.Duration) error {
	p.staged <- stageCall{reason, hold, p.demoted.Load()}
	return p.stageErr
}

// TestElectorStagesAPreparedHandover checks that the Elector stages a
// prepared handover that is a HandoverStager before the old leader's
// OnDemoted, for the transfer's reason and one RenewInterval's
// reservation, and commits it afterwards; and that a Stage that fails
// leaves the handover to Commit as usual.
func TestElectorStagesAPreparedHandover(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name     string
		stageErr error
	}{
		{"staged, then committed", nil},
		{"a failed Stage leaves the handover to Commit", errors.New("connection reset")},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			store := &stagingStore{preparingStore: preparingStore{MemStore: leadertest.NewMemStore()}, stageErr: c.stageErr, staged: make(chan stageCall, 1)}
			var aDemoted atomic.Bool
			store.demoted = &aDemoted
			a, b := testConfig("stage", "a"), testConfig("stage", "b")
			a.OnDemoted = func() { aDemoted.Store(true) }
			ea, err := leader.New(store, a)
			if err != nil {
				t.Fatal(err)
			}
			runElector(t, ea)
			eventually(t, 10*time.Second, "a leading", func() bool { return ea.Status().IsLeader })
			eb, err := leader.New(store, b)
			if err != nil {
				t.Fatal(err)
			}
			runElector(t, eb)
			eventually(t, 10*time.Second, "b enlisted", func() bool {
				cands, err := store.Candidates(t.Context(), "stage")
				return err == nil && len(cands) >= 1
			})
			term := ea.Status().Term
			l, err := ea.Transfer(callCtx(t), "b")
			if err != nil {
				t.Fatalf("Transfer: %v", err)
			}
			if l.HolderID != "b" || l.Term != term+1 {
				t.Fatalf("Transfer returned %+v; want b leading with term %d", l, term+1)
			}
			select {
			case sc := <-store.staged:
				want := stageCall{reason: leader.GrantTransfer, hold: ea.Config().RenewInterval}
				if sc != want {
					t.Errorf("Stage(%+v); want %+v, before a's OnDemoted", sc, want)
				}
			default:
				t.Fatal("the prepared handover was not staged")
			}
			if n := store.commits.Load(); n != 1 {
				t.Errorf("%d commits; want 1", n)
			}
			if n := store.plain.Load(); n != 0 {
				t.Errorf("%d handovers with ReleaseTo; want none", n)
			}
		})
	}
}

// stagingStore is a preparingStore whose prepared handovers are
// stagingPrepared.
type stagingStore struct {
	preparingStore
	stageErr error
	staged   chan stageCall
	demoted  *atomic.Bool
}

func (s *stagingStore) PrepareHandover(ctx context.Context, name, token string, term uint64, successor leader.Candidate, wait time.Duration) (leader.PreparedHandover, error) {
	p, err := s.preparingStore.PrepareHandover(ctx, name, token, term, successor, wait)
	if err != nil {
		return nil, err
	}
	return &stagingPrepared{fakePrepared: p.(*fakePrepared), stageErr: s.stageErr, staged: s.staged, demoted: s.demoted}, nil
}

// heldRenewalStore is a stagingStore whose RenewBatch, once armed, blocks
// until released: a renewal in flight.
type heldRenewalStore struct {
	*stagingStore
	armed    atomic.Bool
	renewing chan struct{} // closed as the armed renewal begins
	hold     chan struct{} // closed to let it go on
}

func (s *heldRenewalStore) RenewBatch(ctx context.Context, batch []leader.Renewal) {
	if s.armed.CompareAndSwap(true, false) {
		close(s.renewing)
		select {
		case <-s.hold:
		case <-ctx.Done():
		}
	}
	s.stagingStore.RenewBatch(ctx, batch)
}

// TestElectorStagesNothingWhileARenewalIsInFlight checks that a prepared
// handover is not staged while a renewal of the lease is in flight (a
// renewal may write the lease's row, which a staged release holds locked
// until its commit, after the renewal is waited for): Commit releases it
// as an unstaged handover.
func TestElectorStagesNothingWhileARenewalIsInFlight(t *testing.T) {
	t.Parallel()
	store := &heldRenewalStore{
		stagingStore: &stagingStore{preparingStore: preparingStore{MemStore: leadertest.NewMemStore()}, staged: make(chan stageCall, 1)},
		renewing:     make(chan struct{}), hold: make(chan struct{}),
	}
	var aDemoted atomic.Bool
	store.demoted = &aDemoted
	var letGo sync.Once
	a, b := testConfig("inflight", "a"), testConfig("inflight", "b")
	a.OnDemoted = func() {
		aDemoted.Store(true)
		letGo.Do(func() { close(store.hold) }) // the renewal ends after the step-down
	}
	ea, err := leader.New(store, a)
	if err != nil {
		t.Fatal(err)
	}
	runElector(t, ea)
	eventually(t, 10*time.Second, "a leading", func() bool { return ea.Status().IsLeader })
	eb, err := leader.New(store, b)
	if err != nil {
		t.Fatal(err)
	}
	runElector(t, eb)
	eventually(t, 10*time.Second, "b enlisted", func() bool {
		cands, err := store.Candidates(t.Context(), "inflight")
		return err == nil && len(cands) >= 1
	})
	store.armed.Store(true)
	select {
	case <-store.renewing:
	case <-time.After(10 * time.Second):
		t.Fatal("no renewal began")
	}
	term := ea.Status().Term
	l, err := ea.Transfer(callCtx(t), "b")
	if err != nil {
		t.Fatalf("Transfer: %v", err)
	}
	if l.HolderID != "b" || l.Term != term+1 {
		t.Fatalf("Transfer returned %+v; want b leading with term %d", l, term+1)
	}
	select {
	case sc := <-store.staged:
		t.Fatalf("Stage(%+v) while a renewal of the lease was in flight", sc)
	default:
	}
	if n := store.commits.Load(); n != 1 {
		t.Errorf("%d commits; want 1", n)
	}
}
