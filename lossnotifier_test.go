package leader_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/leadertest"
)

// lossStore is a MemStore that implements leader.LossNotifier: lose closes
// the channel Lost returned for a term, as a store would on learning that
// the server ended the session holding the lease.
type lossStore struct {
	*faultStore
	mu   sync.Mutex
	lost map[uint64]chan struct{}
}

func (s *lossStore) Lost(_, _ string, term uint64) <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	ch := make(chan struct{})
	s.lost[term] = ch
	return ch
}

func (s *lossStore) lose(t *testing.T, term uint64) {
	t.Helper()
	s.mu.Lock()
	ch := s.lost[term]
	s.mu.Unlock()
	if ch == nil {
		t.Fatalf("Lost was not asked for term %d", term)
	}
	close(ch)
}

func TestLossNotifier(t *testing.T) {
	t.Parallel()
	store := &lossStore{faultStore: newFaultStore(leadertest.NewMemStore()), lost: make(map[uint64]chan struct{})}
	metrics := &recordingMetrics{}
	cfg := testConfig("lossy", "a")
	cfg.TTL = time.Minute // renewals every 20s: none in this test
	cfg.Metrics = metrics
	elected := make(chan context.Context, 2)
	demoted := make(chan time.Time, 2)
	cfg.OnElected = func(ctx context.Context) { elected <- ctx; <-ctx.Done() }
	cfg.OnDemoted = func() { demoted <- time.Now() }
	e, err := leader.New(store, cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := runElector(t, e)
	defer stop()

	lctx := <-elected
	term, _ := leader.TermFrom(lctx)
	lostAt := time.Now()
	store.lose(t, term)
	select {
	case at := <-demoted:
		// Far sooner than any renewal (20s) or the stop point (~45s).
		if took := at.Sub(lostAt); took > 5*time.Second {
			t.Errorf("stepped down %v after the store reported the loss", took)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the Elector did not step down when the store reported the lease lost")
	}
	if lctx.Err() == nil {
		t.Error("leader context not cancelled")
	}
	if e.IsLeader() {
		t.Error("IsLeader still true after the loss")
	}
	if got := metrics.losses(); len(got) != 1 || got[0] != leader.LossConnLost {
		t.Errorf("losses = %v, want [conn_lost]", got)
	}
	if n := store.count("renew"); n != 0 {
		t.Errorf("%d renewals; the loss was reported, not found by a renewal", n)
	}
	if n := store.count("release"); n != 0 {
		t.Errorf("%d releases of a lease the store reported lost", n)
	}
}

// stopWatchStore is a lossStore that implements leader.LossWatchStopper,
// recording each StopLossWatch call's term, and whether OnDemoted had run
// by then.
type stopWatchStore struct {
	*lossStore
	demoted atomic.Bool
	stops   chan stopCall
}

type stopCall struct {
	name, token string
	term        uint64
	demoted     bool // OnDemoted had run when StopLossWatch was called
}

func (s *stopWatchStore) StopLossWatch(name, token string, term uint64) {
	s.stops <- stopCall{name: name, token: token, term: term, demoted: s.demoted.Load()}
}

// TestStopLossWatchBeforeOnDemoted checks that the Elector tells a
// LossWatchStopper that it no longer waits on Lost as soon as leadership
// has ended, IsLeader false, and before OnDemoted runs, once per tenure,
// for that tenure's term, and before the release.
func TestStopLossWatchBeforeOnDemoted(t *testing.T) {
	t.Parallel()
	store := &stopWatchStore{
		lossStore: &lossStore{faultStore: newFaultStore(leadertest.NewMemStore()), lost: make(map[uint64]chan struct{})},
		stops:     make(chan stopCall, 4),
	}
	cfg := testConfig("unwatched", "a")
	cfg.TTL = time.Minute
	elected := make(chan context.Context, 2)
	cfg.OnElected = func(ctx context.Context) { elected <- ctx; <-ctx.Done() }
	cfg.OnDemoted = func() {
		if n := store.count("release"); n != 0 {
			t.Errorf("released %d times before OnDemoted", n)
		}
		store.demoted.Store(true)
	}
	e, err := leader.New(store, cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := runElector(t, e)
	defer stop()

	lctx := <-elected
	term, _ := leader.TermFrom(lctx)
	select {
	case c := <-store.stops:
		t.Fatalf("StopLossWatch called while leading: %+v", c)
	default:
	}
	if err := e.Resign(context.Background()); err != nil {
		t.Fatal(err)
	}
	select {
	case c := <-store.stops:
		if c.name != "unwatched" || c.token == "" || c.term != term || c.demoted {
			t.Fatalf("StopLossWatch(%q, %q, %d) with OnDemoted run %v; want term %d before OnDemoted", c.name, c.token, c.term, c.demoted, term)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("StopLossWatch was not called after the Elector resigned")
	}
	select {
	case c := <-store.stops:
		t.Fatalf("StopLossWatch called twice for one tenure: %+v", c)
	case <-time.After(100 * time.Millisecond):
	}
}
