package leader_test

import (
	"context"
	"fmt"
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
	attempts := func() int {
		n := 0
		for _, fs := range stores {
			n += fs.count("acquire")
		}
		return n
	}
	// Every follower has tried once and now waits for the expiry.
	time.Sleep(300 * time.Millisecond)
	before := attempts()
	if err := old.Resign(t.Context()); err != nil {
		t.Fatal(err)
	}
	electortest.Eventually(t, 10*time.Second, "a new leader", func() bool {
		ls := electortest.Leaders(es)
		return len(ls) == 1 && ls[0] != old
	})
	time.Sleep(300 * time.Millisecond) // for any attempt a grant's wake-up would cause
	if n := attempts() - before; n > followers {
		t.Errorf("%d acquire attempts at a handover to one of %d followers; want at most one each", n, followers)
	}
}
