package leader_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
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
		for i := range 3 {
			cfg := testConfig("handover", fmt.Sprint("c", i))
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
			eventually(t, 3*time.Second, "a new leader", func() bool { return len(leaders(es)) == 1 })
			took := time.Since(start)
			newTerm := leaders(es)[0].Status().Term
			t.Logf("round %d: handover took %v", round, took)
			if took > 500*time.Millisecond { // far below the 1s TTL: woken, not expired
				t.Errorf("handover took %v; want well under the TTL", took)
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

// TestSafety checks DESIGN.md invariants 1 and 5 under faults: a leader that
// cannot renew steps down before anyone else can be granted the lease.
func TestSafety(t *testing.T) {
	t.Parallel()
	for _, mode := range renewModes {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			testSafety(t, mode.wrap)
		})
	}
}

func testSafety(t *testing.T, wrap func(*faultStore) leader.Store) {

	// partitionedLeader sets up two electors on one store, lets a lead,
	// applies fault to a's view of the store, and checks that a demotes
	// before b is elected. It returns how long b took to lead after the fault.
	partitionedLeader := func(t *testing.T, name string, fault func(f *faultStore)) (*recordingMetrics, time.Duration) {
		store := leadertest.NewMemStore()
		h := newHistory()
		faulty := newFaultStore(store)
		cfgA := testConfig(name, "a")
		cfgA.OnElected, cfgA.OnDemoted = h.Hooks(t, "a")
		m := &recordingMetrics{}
		cfgA.Metrics = m
		a, err := leader.New(wrap(faulty), cfgA)
		if err != nil {
			t.Fatal(err)
		}
		runElector(t, a)
		eventually(t, 3*time.Second, "a to lead", a.IsLeader)
		cfgB := testConfig(name, "b")
		cfgB.OnElected, cfgB.OnDemoted = h.Hooks(t, "b")
		b, err := leader.New(store, cfgB)
		if err != nil {
			t.Fatal(err)
		}
		runElector(t, b)
		eventually(t, 3*time.Second, "b to follow a", func() bool { return b.Status().Leader == "a" })

		start := time.Now()
		faulty.set(fault)
		eventually(t, 5*time.Second, "b to lead", b.IsLeader)
		took := time.Since(start)
		demoted, ok := h.Find(func(e event) bool { return e.Instance == "a" && !e.Elected })
		if !ok {
			t.Fatal("a never demoted")
		}
		var elected event
		eventually(t, 5*time.Second, "b's OnElected", func() bool {
			elected, ok = h.Find(func(e event) bool { return e.Instance == "b" && e.Elected })
			return ok
		})
		if !demoted.At.Before(elected.At) {
			t.Errorf("a demoted at %v, after b was elected at %v", demoted.At, elected.At)
		}
		if elected.Term <= 1 {
			t.Errorf("b's term = %d, want > a's", elected.Term)
		}
		return m, took
	}

	t.Run("a leader cut off from the store demotes before another is elected", func(t *testing.T) {
		t.Parallel()
		m, took := partitionedLeader(t, "partition", func(f *faultStore) { f.partitioned = true })
		t.Logf("failover after the leader was cut off: %v (TTL 1s)", took)
		if took > 2*time.Second {
			t.Errorf("failover took %v, want about the TTL", took)
		}
		if got := m.losses(); !slices.Equal(got, []leader.LossReason{leader.LossConnLost}) {
			t.Errorf("losses = %v, want [conn_lost]", got)
		}
	})

	t.Run("a renewal that hangs makes the leader demote before another is elected", func(t *testing.T) {
		t.Parallel()
		m, _ := partitionedLeader(t, "hang", func(f *faultStore) { f.hangRenew = true })
		if got := m.losses(); got[0] != leader.LossConnLost {
			t.Errorf("losses = %v, want conn_lost first", got)
		}
	})

	t.Run("a renewal that ignores its context cannot keep the leader past its deadline", func(t *testing.T) {
		t.Parallel()
		stuck := make(chan struct{})
		partitionedLeader(t, "stuck", func(f *faultStore) { f.stuckRenew = stuck })
		close(stuck)
	})

	t.Run("a logger that blocks cannot keep a leader past its stop point", func(t *testing.T) {
		t.Parallel()
		// Logs shipped over the network stall in the same outage that cut
		// the leader off from its store; stepping down must not wait for
		// them.
		store := leadertest.NewMemStore()
		faulty := newFaultStore(store)
		logs := &blockingHandler{unblock: make(chan struct{})}
		var aCtx atomic.Value
		cfgA := testConfig("blocked-log", "a")
		cfgA.Logger = slog.New(logs)
		cfgA.OnElected = func(ctx context.Context) { aCtx.Store(ctx) }
		a, err := leader.New(wrap(faulty), cfgA)
		if err != nil {
			t.Fatal(err)
		}
		runElector(t, a)
		t.Cleanup(logs.release) // before a is stopped: cleanups run last first
		eventually(t, 3*time.Second, "a to lead", a.IsLeader)
		eventually(t, 3*time.Second, "a's OnElected", func() bool { return aCtx.Load() != nil })

		type seen struct {
			aLeads    bool
			aCtxEnded bool
		}
		atElection := make(chan seen, 1)
		cfgB := testConfig("blocked-log", "b")
		cfgB.OnElected = func(context.Context) {
			atElection <- seen{aLeads: a.IsLeader(), aCtxEnded: aCtx.Load().(context.Context).Err() != nil}
		}
		b, err := leader.New(store, cfgB)
		if err != nil {
			t.Fatal(err)
		}
		runElector(t, b)
		eventually(t, 3*time.Second, "b to follow", func() bool { return b.Status().Leader == "a" })

		logs.block()
		faulty.set(func(f *faultStore) { f.partitioned = true })
		select {
		case got := <-atElection:
			if got.aLeads || !got.aCtxEnded {
				t.Errorf("when b was elected, a still led (IsLeader %v, leader context ended %v)", got.aLeads, got.aCtxEnded)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("b was never elected")
		}
	})

	t.Run("a leader told its lease is gone demotes at once without releasing", func(t *testing.T) {
		t.Parallel()
		store := newFaultStore(leadertest.NewMemStore())
		m := &recordingMetrics{}
		cfg := testConfig("lost", "a")
		cfg.Metrics = m
		e, err := leader.New(wrap(store), cfg)
		if err != nil {
			t.Fatal(err)
		}
		runElector(t, e)
		eventually(t, 3*time.Second, "leadership", e.IsLeader)
		store.set(func(f *faultStore) { f.renewErr = fmt.Errorf("x: %w", leader.ErrLeaseLost) })
		eventually(t, 3*time.Second, "demotion", func() bool { return len(m.losses()) == 1 })
		if got := m.losses()[0]; got != leader.LossExpired {
			t.Errorf("reason = %s, want expired", got)
		}
		if n := store.count("release"); n != 0 {
			t.Errorf("released %d times a lease that was not ours", n)
		}
	})

	t.Run("stopping during a campaign attempt does not leave the lease to an instance that has gone", func(t *testing.T) {
		t.Parallel()
		// A store that commits a grant even when its caller gave up, as a
		// database does with a statement whose client went away. If Run's
		// end cut the attempt short, the grant would hold the lease for a
		// whole TTL with nobody leading.
		inner := leadertest.NewMemStore()
		store := newFaultStore(inner)
		gate := make(chan struct{})
		store.set(func(f *faultStore) { f.acquireGate, f.acquireEntered = gate, make(chan struct{}, 1) })
		e, err := leader.New(wrap(store), leader.Config{Name: "inflight", ID: "a", TTL: 30 * time.Second, Logger: testLogger()})
		if err != nil {
			t.Fatal(err)
		}
		stop := runElector(t, e)
		<-store.acquireEntered
		stopped := make(chan struct{})
		go func() { stop(); close(stopped) }()
		time.Sleep(50 * time.Millisecond) // let the stop reach Run while the attempt waits
		close(gate)
		<-stopped
		l, err := inner.Observe(context.Background(), "inflight")
		if err != nil {
			t.Fatal(err)
		}
		if l.Held() {
			t.Errorf("after Run returned, the lease is held by %q for another %v: nobody can lead until it runs out", l.HolderID, l.Remaining)
		}
	})

	t.Run("a read-only store makes the leader step down at once and say why", func(t *testing.T) {
		t.Parallel()
		store := newFaultStore(leadertest.NewMemStore())
		var logs electortest.LogBuffer
		m := &recordingMetrics{}
		cfg := testConfig("readonly", "a")
		cfg.Metrics = m
		cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
		cfg.TTL = 30 * time.Second
		cfg.RenewInterval = 50 * time.Millisecond
		e, err := leader.New(wrap(store), cfg)
		if err != nil {
			t.Fatal(err)
		}
		runElector(t, e)
		eventually(t, 3*time.Second, "leadership", e.IsLeader)
		start := time.Now()
		store.set(func(f *faultStore) { f.renewErr = fmt.Errorf("x: %w", leader.ErrReadOnly) })
		eventually(t, 3*time.Second, "demotion", func() bool { return len(m.losses()) == 1 })
		if took := time.Since(start); took > 2*time.Second {
			t.Errorf("stepped down after %v; want at once, not at the 30s TTL", took)
		}
		if got := m.losses()[0]; got != leader.LossError {
			t.Errorf("reason = %s, want error", got)
		}
		if !strings.Contains(logs.String(), "read-only") {
			t.Errorf("log does not say the store is read-only:\n%s", logs.String())
		}
	})

	t.Run("the local deadline counts from when the acquire was sent", func(t *testing.T) {
		t.Parallel()
		// The store grants at once but the answer arrives 300ms late; and
		// every renewal fails (from the first, which may come at once: see
		// Config.RenewInterval). If the deadline counted from the answer,
		// the leader would believe it leads after the store's lease ran out.
		store := newFaultStore(leadertest.NewMemStore())
		store.set(func(f *faultStore) {
			f.acquireDelay = 300 * time.Millisecond
			f.renewErr = leader.ErrUnavailable
		})
		var demotedAt atomic.Int64
		cfg := testConfig("sent", "a")
		cfg.OnDemoted = func() { demotedAt.Store(time.Now().UnixNano()) }
		e, err := leader.New(wrap(store), cfg)
		if err != nil {
			t.Fatal(err)
		}
		runElector(t, e)
		eventually(t, 3*time.Second, "leadership", e.IsLeader)
		store.set(func(f *faultStore) { f.partitioned = true })
		eventually(t, 3*time.Second, "demotion", func() bool { return demotedAt.Load() != 0 })
		store.mu.Lock()
		granted := store.grants[0]
		store.mu.Unlock()
		expiry := granted.Add(cfg.TTL)
		if at := time.Unix(0, demotedAt.Load()); !at.Before(expiry) {
			t.Errorf("demoted %v after the store's lease ran out", at.Sub(expiry))
		}
	})
}

// blockingHandler is a slog.Handler whose Handle blocks, once block has been
// called, until release.
type blockingHandler struct {
	blocked atomic.Bool
	unblock chan struct{}
	once    sync.Once
}

func (h *blockingHandler) block()   { h.blocked.Store(true) }
func (h *blockingHandler) release() { h.once.Do(func() { close(h.unblock) }) }

func (h *blockingHandler) Enabled(context.Context, slog.Level) bool { return true }

func (h *blockingHandler) Handle(context.Context, slog.Record) error {
	if h.blocked.Load() {
		<-h.unblock
	}
	return nil
}

func (h *blockingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *blockingHandler) WithGroup(string) slog.Handler      { return h }

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

	leading := func(t *testing.T, name string) (*faultStore, *leader.Elector, func()) {
		t.Helper()
		store := newFaultStore(leadertest.NewMemStore())
		e, err := leader.New(wrap(store), testConfig(name, "a"))
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
		store, e, stop := leading(t, "stuck-at-stop")
		stuck, gate, entered := make(chan struct{}), make(chan struct{}), make(chan struct{}, 1)
		defer close(stuck)
		store.set(func(f *faultStore) { f.renewGate, f.renewEntered = gate, entered })
		<-entered
		// The renewal at the gate now ignores its context too.
		store.set(func(f *faultStore) { f.stuckRenew = stuck })
		start := time.Now()
		stop()
		took := time.Since(start)
		if bound := e.Config().RenewInterval + time.Second; took > bound {
			t.Errorf("Run returned %v after the stop; want within RenewInterval plus a second (%v)", took, bound)
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
