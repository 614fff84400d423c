package leader_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/leadertest"
)

func TestElector(t *testing.T) {
	t.Parallel()

	t.Run("a lone candidate is elected, carries the term, and hands over on stop", func(t *testing.T) {
		t.Parallel()
		store := leadertest.NewMemStore()
		var demoted atomic.Int32
		termSeen := make(chan uint64, 1)
		cfg := testConfig("lone", "a")
		cfg.OnElected = func(ctx context.Context) {
			term, _ := leader.TermFrom(ctx)
			termSeen <- term
			<-ctx.Done()
		}
		cfg.OnDemoted = func() { demoted.Add(1) }
		e, err := leader.New(store, cfg)
		if err != nil {
			t.Fatal(err)
		}
		stop := runElector(t, e)
		term := <-termSeen
		if term != 1 {
			t.Errorf("term = %d, want 1", term)
		}
		st := e.Status()
		if !st.IsLeader || st.Leader != "a" || st.Term != 1 || st.Name != "lone" || st.ID != "a" {
			t.Errorf("Status = %+v", st)
		}
		if st.ExpiresAt.IsZero() || st.AcquiredAt.IsZero() || st.LastContact.IsZero() {
			t.Errorf("Status times unset: %+v", st)
		}
		stop()
		if e.IsLeader() {
			t.Error("still leader after Run returned")
		}
		if n := demoted.Load(); n != 1 {
			t.Errorf("OnDemoted called %d times, want 1", n)
		}
		l, err := store.Observe(context.Background(), "lone")
		if err != nil {
			t.Fatal(err)
		}
		if l.Held() {
			t.Errorf("lease still held after Run returned: %+v", l)
		}
	})

	t.Run("five candidates elect exactly one leader", func(t *testing.T) {
		t.Parallel()
		store := leadertest.NewMemStore()
		h := newHistory()
		var es []*leader.Elector
		for i := range 5 {
			cfg := testConfig("five", fmt.Sprint("c", i))
			cfg.TTL = 3 * time.Second
			cfg.OnElected, cfg.OnDemoted = h.Hooks(t, cfg.ID)
			e, err := leader.New(store, cfg)
			if err != nil {
				t.Fatal(err)
			}
			es = append(es, e)
			runElector(t, e)
		}
		eventually(t, 3*time.Second, "a leader", func() bool { return len(leaders(es)) == 1 })
		// Watch for a while: through several renewals, never two.
		electortest.Never(t, 1500*time.Millisecond, "two leaders at once", func() bool { return len(leaders(es)) > 1 })
		if n := len(h.Elections()); n != 1 {
			t.Errorf("%d elections while the leader renewed, want 1", n)
		}
		ld := leaders(es)[0].Status()
		for _, e := range es {
			eventually(t, 3*time.Second, "followers to see the leader", func() bool {
				st := e.Status()
				return st.Leader == ld.ID && st.Term == ld.Term
			})
		}
	})

	t.Run("graceful stop hands over at once and terms grow", func(t *testing.T) {
		t.Parallel()
		store := leadertest.NewMemStore()
		h := newHistory()
		var es []*leader.Elector
		stops := map[*leader.Elector]func(){}
		// A handover that waited for the expiry would take up to the TTL;
		// maxHandover is generous for a busy machine, and well under it.
		const (
			ttl         = 10 * time.Second
			maxHandover = 3 * time.Second
		)
		for i := range 3 {
			cfg := testConfig("handover", fmt.Sprint("c", i))
			cfg.TTL = ttl
			cfg.OnElected, cfg.OnDemoted = h.Hooks(t, cfg.ID)
			e, err := leader.New(store, cfg)
			if err != nil {
				t.Fatal(err)
			}
			es = append(es, e)
			stops[e] = runElector(t, e)
		}
		for round := range 2 {
			eventually(t, 3*time.Second, "a leader", func() bool { return len(leaders(es)) == 1 })
			old := leaders(es)[0]
			oldTerm := old.Status().Term
			start := time.Now()
			stops[old]()
			es = slices.DeleteFunc(es, func(e *leader.Elector) bool { return e == old })
			eventually(t, 2*maxHandover, "a new leader", func() bool { return len(leaders(es)) == 1 })
			took := time.Since(start)
			newTerm := leaders(es)[0].Status().Term
			t.Logf("round %d: handover took %v", round, took)
			if took > maxHandover { // far below the TTL: woken, not expired
				t.Errorf("handover took %v; want well under the %v TTL", took, ttl)
			}
			if newTerm <= oldTerm {
				t.Errorf("term went from %d to %d", oldTerm, newTerm)
			}
		}
	})

	t.Run("resign hands over, demotes first, and keeps campaigning", func(t *testing.T) {
		t.Parallel()
		store := leadertest.NewMemStore()
		h := newHistory()
		metrics := map[string]*recordingMetrics{}
		var es []*leader.Elector
		for _, id := range []string{"a", "b"} {
			cfg := testConfig("resign", id)
			cfg.OnElected, cfg.OnDemoted = h.Hooks(t, id)
			metrics[id] = &recordingMetrics{}
			cfg.Metrics = metrics[id]
			e, err := leader.New(store, cfg)
			if err != nil {
				t.Fatal(err)
			}
			es = append(es, e)
			runElector(t, e)
		}
		eventually(t, 3*time.Second, "a leader", func() bool { return len(leaders(es)) == 1 })
		first := leaders(es)[0]
		if err := first.Resign(context.Background()); err != nil {
			t.Fatalf("Resign: %v", err)
		}
		if first.IsLeader() {
			t.Error("still leader after Resign returned")
		}
		eventually(t, 3*time.Second, "the other to lead", func() bool {
			l := leaders(es)
			return len(l) == 1 && l[0] != first
		})
		if got := metrics[first.Status().ID].losses(); !slices.Equal(got, []leader.LossReason{leader.LossResigned}) {
			t.Errorf("losses = %v, want [resigned]", got)
		}
		// The resigner campaigns again once its sit-out of one RetryInterval
		// has passed: the other resigning then hands the lease back.
		time.Sleep(first.Config().RetryInterval)
		second := leaders(es)[0]
		if err := second.Resign(context.Background()); err != nil {
			t.Fatal(err)
		}
		eventually(t, 3*time.Second, "the first to lead again", first.IsLeader)
		if err := second.Resign(context.Background()); !errors.Is(err, leader.ErrNotLeader) {
			t.Errorf("Resign by a follower = %v, want ErrNotLeader", err)
		}
	})

	t.Run("Resign called from OnElected steps down without deadlocking", func(t *testing.T) {
		t.Parallel()
		store := leadertest.NewMemStore()
		var e *leader.Elector
		resigned := make(chan error, 1)
		cfg := testConfig("resign-inside", "a")
		cfg.OnElected = func(ctx context.Context) {
			// A job that finishes and hands leadership on, with a context
			// of its own rather than the leader context.
			resigned <- e.Resign(context.Background())
		}
		var err error
		e, err = leader.New(store, cfg)
		if err != nil {
			t.Fatal(err)
		}
		runElector(t, e)
		select {
		case err := <-resigned:
			if err != nil {
				t.Fatalf("Resign from OnElected = %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("Resign called from OnElected did not return")
		}
		eventually(t, 3*time.Second, "the lease to be released", func() bool {
			l, err := store.Observe(context.Background(), "resign-inside")
			return err == nil && (!l.Held() || l.Term > 1)
		})
	})

	t.Run("candidates sharing a human ID still elect one leader", func(t *testing.T) {
		t.Parallel()
		store := leadertest.NewMemStore()
		h := newHistory()
		var es []*leader.Elector
		for i := range 3 {
			cfg := testConfig("dup", "same-id")
			cfg.TTL = 3 * time.Second
			cfg.OnElected, cfg.OnDemoted = h.Hooks(t, fmt.Sprint("instance", i))
			e, err := leader.New(store, cfg)
			if err != nil {
				t.Fatal(err)
			}
			es = append(es, e)
			runElector(t, e)
		}
		eventually(t, 3*time.Second, "a leader", func() bool { return len(leaders(es)) == 1 })
		electortest.Never(t, 1500*time.Millisecond, "two leaders with one ID", func() bool { return len(leaders(es)) > 1 })
		if n := len(h.Elections()); n != 1 {
			t.Errorf("%d elections, want 1: instances with the same ID took the lease from each other", n)
		}
	})

	t.Run("OnDemoted is called once per loss and blocks the next campaign", func(t *testing.T) {
		t.Parallel()
		store := newFaultStore(leadertest.NewMemStore())
		release := make(chan struct{})
		var demotions atomic.Int32
		cfg := testConfig("blocking-demote", "a")
		cfg.OnDemoted = func() {
			demotions.Add(1)
			<-release
		}
		e, err := leader.New(store, cfg)
		if err != nil {
			t.Fatal(err)
		}
		runElector(t, e)
		eventually(t, 3*time.Second, "leadership", e.IsLeader)
		store.set(func(f *faultStore) { f.renewErr = fmt.Errorf("renew: %w", leader.ErrLeaseLost) })
		eventually(t, 3*time.Second, "demotion", func() bool { return demotions.Load() == 1 })
		acquires := store.count("acquire")
		time.Sleep(300 * time.Millisecond) // a campaign would have tried by now
		if n := store.count("acquire"); n != acquires {
			t.Errorf("campaigned (%d acquires) while OnDemoted was blocked", n-acquires)
		}
		store.set(func(f *faultStore) { f.renewErr = nil })
		close(release)
		eventually(t, 3*time.Second, "re-election", e.IsLeader)
		if n := demotions.Load(); n != 1 {
			t.Errorf("OnDemoted called %d times, want 1", n)
		}
	})

	t.Run("the leader context is cancelled before OnDemoted runs and IsLeader turns false first", func(t *testing.T) {
		t.Parallel()
		var leaderCtx atomic.Value
		var e *leader.Elector
		ok := make(chan bool, 1)
		cfg := testConfig("order", "a")
		cfg.OnElected = func(ctx context.Context) { leaderCtx.Store(ctx) }
		cfg.OnDemoted = func() {
			ctx, _ := leaderCtx.Load().(context.Context)
			ok <- ctx != nil && ctx.Err() != nil && !e.IsLeader()
		}
		var err error
		e, err = leader.New(leadertest.NewMemStore(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		stop := runElector(t, e)
		eventually(t, 3*time.Second, "OnElected", func() bool { return leaderCtx.Load() != nil })
		stop()
		if !<-ok {
			t.Error("OnDemoted ran before the leader context was cancelled or while IsLeader was true")
		}
		ctx := leaderCtx.Load().(context.Context)
		if cause := context.Cause(ctx); !errors.Is(cause, leader.ErrNotLeader) {
			t.Errorf("leader context cause = %v, want ErrNotLeader", cause)
		}
	})

	t.Run("OnNewLeader reports each new leader", func(t *testing.T) {
		t.Parallel()
		store := leadertest.NewMemStore()
		var mu sync.Mutex
		var seen []string
		cfg := testConfig("observe", "watcher")
		cfg.OnNewLeader = func(st leader.Status) {
			mu.Lock()
			defer mu.Unlock()
			seen = append(seen, fmt.Sprintf("%s/%d", st.Leader, st.Term))
		}
		other, err := leader.New(store, testConfig("observe", "other"))
		if err != nil {
			t.Fatal(err)
		}
		stopOther := runElector(t, other)
		eventually(t, 3*time.Second, "other to lead", other.IsLeader)
		watcher, err := leader.New(store, cfg)
		if err != nil {
			t.Fatal(err)
		}
		runElector(t, watcher)
		eventually(t, 3*time.Second, "the first report", func() bool {
			mu.Lock()
			defer mu.Unlock()
			return slices.Contains(seen, "other/1")
		})
		stopOther()
		eventually(t, 3*time.Second, "watcher to lead", watcher.IsLeader)
		eventually(t, 3*time.Second, "two reports", func() bool {
			mu.Lock()
			defer mu.Unlock()
			return slices.Contains(seen, "other/1") && slices.Contains(seen, "watcher/2")
		})
	})

	t.Run("Run refuses to run twice at once", func(t *testing.T) {
		t.Parallel()
		e, err := leader.New(leadertest.NewMemStore(), testConfig("twice", "a"))
		if err != nil {
			t.Fatal(err)
		}
		runElector(t, e)
		eventually(t, 3*time.Second, "leadership", e.IsLeader)
		if err := e.Run(context.Background()); !errors.Is(err, leader.ErrAlreadyRunning) {
			t.Errorf("second Run = %v, want ErrAlreadyRunning", err)
		}
	})

	t.Run("metrics see acquisitions and losses with reasons", func(t *testing.T) {
		t.Parallel()
		m := &recordingMetrics{}
		cfg := testConfig("metrics", "a")
		cfg.Metrics = m
		e, err := leader.New(leadertest.NewMemStore(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		stop := runElector(t, e)
		eventually(t, 3*time.Second, "leadership", e.IsLeader)
		stop()
		m.mu.Lock()
		defer m.mu.Unlock()
		if !slices.Equal(m.acquired, []uint64{1}) || !slices.Equal(m.lost, []leader.LossReason{leader.LossShutdown}) ||
			!slices.Equal(m.statuses, []bool{true, false}) {
			t.Errorf("metrics: acquired %v lost %v statuses %v", m.acquired, m.lost, m.statuses)
		}
	})
}

func TestRunIfLeader(t *testing.T) {
	t.Parallel()
	store := leadertest.NewMemStore()
	a, err := leader.New(store, testConfig("runif", "a"))
	if err != nil {
		t.Fatal(err)
	}
	b, err := leader.New(store, testConfig("runif", "b"))
	if err != nil {
		t.Fatal(err)
	}
	if err := a.RunIfLeader(context.Background(), func(context.Context) error { return nil }); !errors.Is(err, leader.ErrNotLeader) {
		t.Errorf("before Run: %v, want ErrNotLeader", err)
	}
	runElector(t, a)
	eventually(t, 3*time.Second, "leadership", a.IsLeader)
	runElector(t, b)

	called := false
	err = b.RunIfLeader(context.Background(), func(context.Context) error { called = true; return nil })
	if !errors.Is(err, leader.ErrNotLeader) || called {
		t.Errorf("follower: err %v called %v, want ErrNotLeader and no call", err, called)
	}
	if err := b.Check(context.Background()); !errors.Is(err, leader.ErrNotLeader) {
		t.Errorf("follower Check = %v", err)
	}
	if err := a.Check(context.Background()); err != nil {
		t.Errorf("leader Check = %v", err)
	}

	errBoom := errors.New("boom")
	err = a.RunIfLeader(context.Background(), func(ctx context.Context) error {
		if term, ok := leader.TermFrom(ctx); !ok || term != a.Status().Term {
			t.Errorf("fn ctx term = %d, %v", term, ok)
		}
		go func() { _ = a.Resign(context.Background()) }()
		select {
		case <-ctx.Done():
		case <-time.After(3 * time.Second):
			t.Error("fn ctx not cancelled on loss")
		}
		return errBoom
	})
	if !errors.Is(err, errBoom) {
		t.Errorf("RunIfLeader = %v, want fn's error", err)
	}
	if _, ok := leader.TermFrom(context.Background()); ok {
		t.Error("TermFrom found a term in a plain context")
	}
}
