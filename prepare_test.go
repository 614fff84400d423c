package leader_test

import (
	"context"
	"errors"
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
