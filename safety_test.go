package leader_test

import (
	"context"
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
		eventually(t, 10*time.Second, "b to lead", b.IsLeader)
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
		if took > 5*time.Second { // generous for a busy machine; a few TTLs
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
		// The store grants at once but the answer arrives 1.5 s late; and
		// every renewal fails (from the first, which may come at once: see
		// Config.RenewInterval). If the deadline counted from the answer,
		// the leader would believe it leads after the store's lease ran
		// out: it would stop 1.5 s + TTL - DriftMargin - StopGrace (5.25
		// s) after the grant, never sooner. Counted from the send, it
		// stops 3.75 s after it, which leaves a busy machine 1.25 s to run
		// OnDemoted in (with a TTL of 1 s, its first form, 250 ms).
		store := newFaultStore(leadertest.NewMemStore())
		store.set(func(f *faultStore) {
			f.acquireDelay = 1500 * time.Millisecond
			f.renewErr = leader.ErrUnavailable
		})
		var demotedAt atomic.Int64
		cfg := testConfig("sent", "a")
		cfg.TTL = 5 * time.Second
		cfg.OnDemoted = func() { demotedAt.Store(time.Now().UnixNano()) }
		e, err := leader.New(wrap(store), cfg)
		if err != nil {
			t.Fatal(err)
		}
		runElector(t, e)
		eventually(t, 10*time.Second, "leadership", e.IsLeader)
		store.set(func(f *faultStore) { f.partitioned = true })
		eventually(t, 10*time.Second, "demotion", func() bool { return demotedAt.Load() != 0 })
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
