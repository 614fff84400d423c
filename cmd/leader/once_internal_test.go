//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/cmd/leader/internal/supervise"
)

// slowStore answers acquires and renewals as told, ignoring contexts, as a
// store call can under a network partition (pgx answers about a second
// after a deadline when the server does not).
type slowStore struct {
	leader.Store // nil: only the methods below are called
	acquire      func(ctx context.Context) (leader.Lease, bool, error)
	renew        func(ctx context.Context) error
	mu           sync.Mutex
	released     []uint64
}

func (s *slowStore) Acquire(ctx context.Context, _ string, _ leader.Candidate, _ time.Duration) (leader.Lease, bool, error) {
	return s.acquire(ctx)
}

func (s *slowStore) Renew(ctx context.Context, _ string, _ string, _ uint64, _ time.Duration) (leader.Lease, error) {
	return leader.Lease{}, s.renew(ctx)
}

func (s *slowStore) Release(_ context.Context, _ string, _ string, term uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.released = append(s.released, term)
	return nil
}

// fakeChild stands in for a supervised command.
type fakeChild struct {
	done     chan struct{}
	once     sync.Once
	mu       sync.Mutex
	stopped  time.Time
	extended []supervise.Deadline
}

func newFakeChild() *fakeChild { return &fakeChild{done: make(chan struct{})} }

func (c *fakeChild) Done() <-chan struct{} { return c.done }
func (c *fakeChild) Result() supervise.Result {
	<-c.done
	return supervise.Result{ExitCode: -1, Signal: syscall.SIGTERM}
}
func (c *fakeChild) Stop() supervise.Result {
	c.once.Do(func() {
		c.mu.Lock()
		c.stopped = time.Now()
		c.mu.Unlock()
		close(c.done)
	})
	return c.Result()
}
func (c *fakeChild) Extend(d supervise.Deadline) {
	c.mu.Lock()
	c.extended = append(c.extended, d)
	c.mu.Unlock()
}

func testOnceJob(store leader.Store) *onceJob {
	window := time.Second
	return &onceJob{
		opts:  onceOptions{name: "job", id: "me", window: window, grace: defaultGrace(window)},
		store: store,
		log:   slog.New(slog.DiscardHandler),
	}
}

// A renewal that hangs past its deadline must not delay the stop point.
func TestOnceStopsOnTimeWhileARenewalHangs(t *testing.T) {
	t.Parallel()
	unblock := make(chan struct{})
	t.Cleanup(func() { close(unblock) })
	store := &slowStore{renew: func(context.Context) error {
		<-unblock
		return errors.New("unreachable")
	}}
	j := testOnceJob(store)
	child := newFakeChild()
	sent := time.Now()
	type outcome struct {
		err error
	}
	out := make(chan outcome, 1)
	go func() {
		_, err := j.hold(context.Background(), j.log, child, leader.Candidate{ID: "me", Token: "t"}, 1, sent)
		out <- outcome{err}
	}()
	select {
	case o := <-out:
		if o.err == nil {
			t.Error("hold reported no loss")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("hold still waits for a hung renewal 5s later")
	}
	child.mu.Lock()
	late := child.stopped.Sub(j.stopAt(sent))
	child.mu.Unlock()
	// Waiting for the renewal would stop it only once the test ends, 5 s
	// or more later; a second absorbs a busy machine's scheduling.
	if late < 0 || late > time.Second {
		t.Errorf("the command was stopped %v after the stop point", late)
	}
}

// Renewals that succeed extend the stop point, and the command's deadline.
func TestOnceRenewalsExtendTheDeadline(t *testing.T) {
	t.Parallel()
	store := &slowStore{renew: func(context.Context) error { return nil }}
	j := testOnceJob(store)
	child := newFakeChild()
	sent := time.Now()
	// The command ends on its own well after the first stop point.
	end := time.AfterFunc(j.stopAt(sent).Sub(sent)+500*time.Millisecond, func() { child.once.Do(func() { close(child.done) }) })
	defer end.Stop()
	if _, err := j.hold(context.Background(), j.log, child, leader.Candidate{ID: "me", Token: "t"}, 1, sent); err != nil {
		t.Fatalf("hold: %v", err)
	}
	child.mu.Lock()
	defer child.mu.Unlock()
	if !child.stopped.IsZero() || len(child.extended) < 2 || child.extended[1] <= child.extended[0] {
		t.Errorf("stopped at %v; deadlines extended %v", child.stopped, child.extended)
	}
}

// The acquire has a timeout, and a grant that arrives after its stop
// point is released, not used.
func TestOnceReleasesAGrantThatCameTooLate(t *testing.T) {
	t.Parallel()
	store := &slowStore{acquire: func(ctx context.Context) (leader.Lease, bool, error) {
		select {
		case <-ctx.Done():
		case <-time.After(10 * time.Second):
			return leader.Lease{}, false, errors.New("acquire had no timeout")
		}
		time.Sleep(500 * time.Millisecond) // answered late, as pgx does after a deadline
		return leader.Lease{Term: 7, HolderID: "me"}, true, nil
	}}
	j := testOnceJob(store)
	_, _, granted, err := j.acquire(context.Background(), leader.Candidate{ID: "me", Token: "t"})
	if granted || !errors.Is(err, errTooLate) {
		t.Errorf("granted %v, err %v; want errTooLate", granted, err)
	}
	store.mu.Lock()
	defer store.mu.Unlock()
	if len(store.released) != 1 || store.released[0] != 7 {
		t.Errorf("released %v, want term 7", store.released)
	}
}
