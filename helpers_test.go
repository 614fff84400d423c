package leader_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/leadertest"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

var (
	newHistory = electortest.NewHistory
	runElector = electortest.Run
	eventually = electortest.Eventually
	leaders    = electortest.Leaders
)

type event = electortest.Event

// faultStore wraps a Store to inject faults into one elector's view of it.
type faultStore struct {
	leader.Store

	mu           sync.Mutex
	partitioned  bool          // every call fails with ErrUnavailable
	failWith     error         // if set (and not partitioned), every call fails with it
	hangRenew    bool          // Renew blocks until its ctx ends
	stuckRenew   chan struct{} // non-nil: Renew blocks until closed, ignoring ctx
	renewErr     error         // Renew fails with this
	acquireDelay time.Duration // granted Acquire answers this late
	// acquireGate, when set, holds every Acquire until it is closed or the
	// call's ctx ends, and then grants in the inner store regardless (as a
	// database commits a statement whose client went away); the call
	// returns ctx's error if it ended. acquireEntered is signalled as each
	// Acquire reaches the gate.
	acquireGate    chan struct{}
	acquireEntered chan struct{}
	// renewGate, when set, holds every Renew until it is closed (then the
	// renewal goes on) or the call's ctx ends (then it fails, and
	// renewsCut counts it); renewEntered is signalled as each Renew
	// reaches the gate.
	renewGate    chan struct{}
	renewEntered chan struct{}
	renewsCut    int
	calls        map[string]int
	grants       []time.Time // when the inner store granted, as seen here
}

func newFaultStore(inner leader.Store) *faultStore {
	return &faultStore{Store: inner, calls: make(map[string]int)}
}

func (f *faultStore) set(fn func(f *faultStore)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(f)
}

func (f *faultStore) count(op string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls[op]
}

// enter counts a call of op, and returns the error it must fail with, if
// any: ErrUnavailable while partitioned, else failWith.
func (f *faultStore) enter(op string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls[op]++
	if f.partitioned {
		return fmt.Errorf("fault: %w", leader.ErrUnavailable)
	}
	return f.failWith
}

func (f *faultStore) Acquire(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) (leader.Lease, bool, error) {
	if err := f.enter("acquire"); err != nil {
		return leader.Lease{}, false, err
	}
	f.mu.Lock()
	gate, entered := f.acquireGate, f.acquireEntered
	f.mu.Unlock()
	if gate != nil {
		atGate(ctx, gate, entered)
		l, ok, err := f.Store.Acquire(context.WithoutCancel(ctx), name, c, ttl)
		if ctx.Err() != nil {
			return leader.Lease{}, false, fmt.Errorf("fault: acquire answered after its context ended: %w", ctx.Err())
		}
		return l, ok, err
	}
	l, ok, err := f.Store.Acquire(ctx, name, c, ttl)
	if ok {
		f.mu.Lock()
		f.grants = append(f.grants, time.Now())
		delay := f.acquireDelay
		f.mu.Unlock()
		time.Sleep(delay)
	}
	return l, ok, err
}

func (f *faultStore) Renew(ctx context.Context, name, token string, term uint64, ttl time.Duration) (leader.Lease, error) {
	if err := f.enter("renew"); err != nil {
		return leader.Lease{}, err
	}
	f.mu.Lock()
	hang, stuck, renewErr, gate, entered := f.hangRenew, f.stuckRenew, f.renewErr, f.renewGate, f.renewEntered
	f.mu.Unlock()
	if gate != nil && !atGate(ctx, gate, entered) {
		f.mu.Lock()
		f.renewsCut++
		f.mu.Unlock()
		return leader.Lease{}, fmt.Errorf("fault: renewal cut short: %w", ctx.Err())
	}
	switch {
	case stuck != nil:
		<-stuck
		return leader.Lease{}, fmt.Errorf("fault: stuck renewal: %w", leader.ErrUnavailable)
	case hang:
		<-ctx.Done()
		return leader.Lease{}, fmt.Errorf("fault: hung renewal: %w", ctx.Err())
	case renewErr != nil:
		return leader.Lease{}, renewErr
	}
	return f.Store.Renew(ctx, name, token, term, ttl)
}

// atGate signals entered (if no signal is pending) and waits until gate is
// closed, reporting true, or ctx ends, reporting false.
func atGate(ctx context.Context, gate <-chan struct{}, entered chan<- struct{}) bool {
	select {
	case entered <- struct{}{}:
	default:
	}
	select {
	case <-gate:
		return true
	case <-ctx.Done():
		return false
	}
}

func (f *faultStore) Release(ctx context.Context, name, token string, term uint64) error {
	if err := f.enter("release"); err != nil {
		return err
	}
	return f.Store.Release(ctx, name, token, term)
}

// recordingMetrics records what an Elector reports.
type recordingMetrics struct {
	leader.NopMetrics
	mu       sync.Mutex
	acquired []uint64
	lost     []leader.LossReason
	statuses []bool
}

func (m *recordingMetrics) Acquired(_ string, term uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.acquired = append(m.acquired, term)
}

func (m *recordingMetrics) Lost(_ string, r leader.LossReason) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.lost = append(m.lost, r)
}

func (m *recordingMetrics) StatusChanged(_ string, isLeader bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.statuses = append(m.statuses, isLeader)
}

func (m *recordingMetrics) losses() []leader.LossReason {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]leader.LossReason(nil), m.lost...)
}

// testConfig is a fast Config for tests: TTL 1s, so renewals every 333ms.
func testConfig(name, id string) leader.Config {
	return leader.Config{Name: name, ID: id, TTL: time.Second, Logger: testLogger()}
}

var _ = leadertest.NewMemStore

func testLogger() *slog.Logger {
	if os.Getenv("LEADER_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return quiet
}

// renewModes are the two ways a leader's lease is renewed: by Renew calls of
// its own, or, on a store that implements leader.BatchRenewer, by one
// RenewBatch call per round for every Elector of the process on the store.
// Tests of how a leader renews run in both; faults apply to either.
var renewModes = []struct {
	name string
	wrap func(*faultStore) leader.Store
}{
	{"renewed alone", func(f *faultStore) leader.Store { return f }},
	{"renewed in batches", func(f *faultStore) leader.Store { return batchFaultStore{f} }},
}

// transferFaultStore is a faultStore that can hand leases over through
// ts, whose Transferer calls never fail: its faults apply to the Store's
// calls alone.
type transferFaultStore struct {
	*faultStore
	leader.Transferer
}

// batchFaultStore is a faultStore that renews in batches, each lease of a
// batch by faultStore.Renew, so that its faults apply.
type batchFaultStore struct{ *faultStore }

func (b batchFaultStore) RenewBatch(ctx context.Context, batch []leader.Renewal) {
	_ = b.enter("renew batch") // each lease's Renew fails as it must
	for i := range batch {
		r := &batch[i]
		r.Lease, r.Err = b.Renew(ctx, r.Name, r.Token, r.Term, r.TTL)
	}
}
