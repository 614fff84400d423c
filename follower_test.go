package leader_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/leadertest"
)

// freeFaultStore is a faultStore over a store that implements
// leader.FreeWatcher, which it passes on.
type freeFaultStore struct {
	*faultStore
	fw leader.FreeWatcher
}

func (s *freeFaultStore) WatchFree(ctx context.Context, name string) (<-chan struct{}, error) {
	return s.fw.WatchFree(ctx, name)
}

// TestFollowersWatchOnlyForFreeLeases checks that on a store that
// implements leader.FreeWatcher, followers are not woken by a grant: at a
// handover each follower attempts once (the release wakes it; the loser
// learns of the grant from its own attempt), not once more for the grant.
func TestFollowersWatchOnlyForFreeLeases(t *testing.T) {
	t.Parallel()
	const followers = 5
	mem := leadertest.NewMemStore()
	var stores []*faultStore
	var es []*leader.Elector
	for i := range followers + 1 {
		fs := newFaultStore(mem)
		stores = append(stores, fs)
		cfg := testConfig("free", fmt.Sprint("e", i))
		cfg.TTL = time.Minute // no renewal, expiry or retry during the test
		e, err := leader.New(&freeFaultStore{faultStore: fs, fw: mem}, cfg)
		if err != nil {
			t.Fatal(err)
		}
		es = append(es, e)
		stop := runElector(t, e)
		defer stop()
	}
	var old *leader.Elector
	electortest.Eventually(t, 10*time.Second, "a leader", func() bool {
		ls := electortest.Leaders(es)
		if len(ls) == 1 {
			old = ls[0]
		}
		return len(ls) == 1
	})
	attempts := func() []int {
		n := make([]int, len(stores))
		for i, fs := range stores {
			n[i] = fs.count("acquire")
		}
		return n
	}
	// Every follower has tried once and now waits for the expiry.
	electortest.Eventually(t, 10*time.Second, "every instance to have tried once", func() bool {
		return !slices.Contains(attempts(), 0)
	})
	before := attempts()
	if err := old.Resign(t.Context()); err != nil {
		t.Fatal(err)
	}
	electortest.Eventually(t, 10*time.Second, "a new leader", func() bool {
		ls := electortest.Leaders(es)
		return len(ls) == 1 && ls[0] != old
	})
	time.Sleep(300 * time.Millisecond) // for any attempt a grant's wake-up would cause
	for i, n := range attempts() {
		if d := n - before[i]; d > 1 {
			t.Errorf("instance e%d made %d acquire attempts at a handover; want at most one", i, d)
		}
	}
}

// heldElsewhere is a store where the lease is always held by someone else
// for another remaining: every Acquire is refused with that Remaining.
type heldElsewhere struct {
	remaining time.Duration
	mu        sync.Mutex
	attempts  []time.Time
}

func (s *heldElsewhere) lease(name string) leader.Lease {
	return leader.Lease{Name: name, HolderID: "other", Term: 1, AcquiredAt: time.Now(),
		ExpiresAt: time.Now().Add(s.remaining), Remaining: s.remaining}
}

func (s *heldElsewhere) Acquire(_ context.Context, name string, _ leader.Candidate, _ time.Duration) (leader.Lease, bool, error) {
	s.mu.Lock()
	s.attempts = append(s.attempts, time.Now())
	s.mu.Unlock()
	return s.lease(name), false, nil
}

func (s *heldElsewhere) Renew(context.Context, string, string, uint64, time.Duration) (leader.Lease, error) {
	return leader.Lease{}, leader.ErrLeaseLost
}

func (s *heldElsewhere) Release(context.Context, string, string, uint64) error {
	return leader.ErrLeaseLost
}

func (s *heldElsewhere) Observe(_ context.Context, name string) (leader.Lease, error) {
	return s.lease(name), nil
}

func (s *heldElsewhere) Watch(ctx context.Context, _ string) (<-chan struct{}, error) {
	ch := make(chan struct{})
	context.AfterFunc(ctx, func() { close(ch) })
	return ch, nil
}

// TestFollowerTriesAMomentAfterTheExpiry checks that a follower's next
// attempt comes a little after the expiry it was told, not at it: the
// leader's renewal falls there.
func TestFollowerTriesAMomentAfterTheExpiry(t *testing.T) {
	t.Parallel()
	const remaining = 200 * time.Millisecond
	store := &heldElsewhere{remaining: remaining}
	cfg := testConfig("lag", "f")
	cfg.TTL = time.Second // RenewInterval 333ms: a lag of 25ms
	const lag = 25 * time.Millisecond
	e, err := leader.New(store, cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := runElector(t, e)
	electortest.Eventually(t, 10*time.Second, "6 attempts", func() bool {
		store.mu.Lock()
		defer store.mu.Unlock()
		return len(store.attempts) >= 6
	})
	stop()
	store.mu.Lock()
	defer store.mu.Unlock()
	for i := 1; i < len(store.attempts); i++ {
		if gap := store.attempts[i].Sub(store.attempts[i-1]); gap < remaining+lag {
			t.Errorf("attempt %d came %v after the one that reported %v remaining; want at least %v", i, gap, remaining, remaining+lag)
		}
	}
}
