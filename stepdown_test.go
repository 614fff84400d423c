package leader_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/leadertest"
)

// TestStopLetsARenewalInFlightFinish checks that a leader stopped while a
// renewal is in flight lets the renewal finish before it releases, instead
// of cutting it short: a store may end the lease with the call (the
// advisory strategy's session ends with its connection), and a handover
// would become a takeover. A renewal that does not finish holds the
// release back for at most RenewInterval.
func TestStopLetsARenewalInFlightFinish(t *testing.T) {
	t.Parallel()
	for _, mode := range renewModes {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			testStopLetsARenewalInFlightFinish(t, mode.wrap)
		})
	}
}

func testStopLetsARenewalInFlightFinish(t *testing.T, wrap func(*faultStore) leader.Store) {

	leading := func(t *testing.T, name string, edit ...func(*leader.Config)) (*faultStore, *leader.Elector, func()) {
		t.Helper()
		store := newFaultStore(leadertest.NewMemStore())
		cfg := testConfig(name, "a")
		for _, f := range edit {
			f(&cfg)
		}
		e, err := leader.New(wrap(store), cfg)
		if err != nil {
			t.Fatal(err)
		}
		stop := runElector(t, e)
		eventually(t, 3*time.Second, "a to lead", e.IsLeader)
		return store, e, stop
	}

	t.Run("a renewal in flight finishes, then the lease is released", func(t *testing.T) {
		t.Parallel()
		store, e, stop := leading(t, "inflight")
		gate, entered := make(chan struct{}), make(chan struct{}, 1)
		store.set(func(f *faultStore) { f.renewGate, f.renewEntered = gate, entered })
		<-entered
		stopped := make(chan struct{})
		go func() { defer close(stopped); stop() }()
		eventually(t, 3*time.Second, "a to step down", func() bool { return !e.IsLeader() })
		time.Sleep(20 * time.Millisecond)
		close(gate)
		<-stopped
		store.set(func(f *faultStore) {
			if f.renewsCut != 0 {
				t.Errorf("%d renewals cut short by the stop; want the one in flight let finish", f.renewsCut)
			}
			if n := f.calls["release"]; n != 1 {
				t.Errorf("%d releases, want 1", n)
			}
		})
		if l, err := store.Observe(t.Context(), "inflight"); err != nil || l.Held() || l.Term != 1 {
			t.Errorf("Observe after the stop: %+v, %v; want released, term 1", l, err)
		}
	})

	t.Run("a renewal that does not finish holds the release back for at most RenewInterval", func(t *testing.T) {
		t.Parallel()
		// A TTL far longer than the bound below, with the usual
		// RenewInterval: a stop that waited for the lease to run out, or
		// for StopGrace, would exceed the bound.
		store, e, stop := leading(t, "stuck-at-stop", func(c *leader.Config) {
			c.RenewInterval = c.TTL / 3
			c.TTL = 30 * time.Second
		})
		stuck, gate, entered := make(chan struct{}), make(chan struct{}), make(chan struct{}, 1)
		defer close(stuck)
		store.set(func(f *faultStore) { f.renewGate, f.renewEntered = gate, entered })
		<-entered
		// The renewal at the gate now ignores its context too.
		store.set(func(f *faultStore) { f.stuckRenew = stuck })
		start := time.Now()
		stop()
		took := time.Since(start)
		if bound := e.Config().RenewInterval + 5*time.Second; took > bound {
			t.Errorf("Run returned %v after the stop; want within RenewInterval plus 5s (%v)", took, bound)
		}
		if n := store.count("release"); n != 1 {
			t.Errorf("%d releases, want 1", n)
		}
	})
}

// watchSpan is a store whose Release reports whether every watch made on
// it was still open when the release began.
type watchSpan struct {
	leader.Store
	mu      sync.Mutex
	watches []context.Context
	open    []bool // at each Release: were all watches open?
}

func (w *watchSpan) Watch(ctx context.Context, name string) (<-chan struct{}, error) {
	w.mu.Lock()
	w.watches = append(w.watches, ctx)
	w.mu.Unlock()
	return w.Store.Watch(ctx, name)
}

func (w *watchSpan) Release(ctx context.Context, name, token string, term uint64) error {
	w.mu.Lock()
	open := len(w.watches) > 0
	for _, c := range w.watches {
		open = open && c.Err() == nil
	}
	w.open = append(w.open, open)
	w.mu.Unlock()
	return w.Store.Release(ctx, name, token, term)
}

// TestRunWatchesUntilItHasReleased checks that the watch a leader's Run
// keeps open ends only after its release, not when Run's context does: a
// store may cut a watch's blocking statement short as it ends, and that
// work would run beside the release the successor waits for. The watch
// still ends when Run returns.
func TestRunWatchesUntilItHasReleased(t *testing.T) {
	t.Parallel()
	store := &watchSpan{Store: leadertest.NewMemStore()}
	e, err := leader.New(store, testConfig("watch-span", "a"))
	if err != nil {
		t.Fatal(err)
	}
	stop := runElector(t, e)
	eventually(t, 3*time.Second, "a to lead", e.IsLeader)
	stop()
	store.mu.Lock()
	defer store.mu.Unlock()
	if len(store.open) != 1 || !store.open[0] {
		t.Errorf("watches open at each release: %v; want [true] (one release, with the watch still open)", store.open)
	}
	for i, c := range store.watches {
		if c.Err() == nil {
			t.Errorf("watch %d is still open after Run returned", i)
		}
	}
}
