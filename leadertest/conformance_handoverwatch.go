package leadertest

import (
	"context"
	"testing"
	"time"

	"github.com/leaderelect/leader"
)

// handoverWatcherCases are the subtests of a store that implements
// leader.HandoverWatcher (and leader.Transferer, which it needs).
var handoverWatcherCases = []conformanceCase{
	{"a handover wakes its successor's watcher, and no other candidate's when the successor takes the lease", testHandoverWakesSuccessor},
	{"a handover that its successor does not take wakes the other candidates once the reservation has run out", testHandoverNotTaken},
	{"a watcher for a candidate still wakes at a plain release", testWatchFreeForRelease},
}

func watchFreeFor(t *testing.T, s leader.Store, ctx context.Context, name string, c leader.Candidate) <-chan struct{} {
	t.Helper()
	hw, ok := s.(leader.HandoverWatcher)
	if !ok {
		t.Fatalf("%T does not implement leader.HandoverWatcher", s)
	}
	ch, err := hw.WatchFreeFor(ctx, name, c)
	if err != nil {
		t.Fatalf("WatchFreeFor(%q, %s): %v", name, c.ID, err)
	}
	return ch
}

// settledWatchers returns the free-watch channels of bob and carol for a
// new name, and that name's lease granted to alice, once a first release
// has woken both and their channels have stayed quiet since: a store may
// send wake-ups once it starts delivering them.
func settledWatchers(t *testing.T, s leader.Store, alice, bob, carol leader.Candidate) (name string, forBob, forCarol <-chan struct{}, held leader.Lease) {
	t.Helper()
	name = newName()
	forBob = watchFreeFor(t, s, t.Context(), name, bob)
	forCarol = watchFreeFor(t, s, t.Context(), name, carol)
	first := mustGrant(t, s, name, alice, longTTL)
	mustRelease(t, s, name, alice, first.Term)
	waitWake(t, forBob, "for bob after a release")
	waitWake(t, forCarol, "for carol after a release")
	held = mustGrant(t, s, name, alice, longTTL)
	quiet(forBob, forCarol)
	return name, forBob, forCarol, held
}

func testHandoverWakesSuccessor(t *testing.T, s leader.Store) {
	ts := transferer(t, s)
	alice, bob, carol := newCandidate("alice"), newCandidate("bob"), newCandidate("carol")
	name, forBob, forCarol, held := settledWatchers(t, s, alice, bob, carol)

	mustReleaseTo(t, ts, name, alice, held.Term, bob, leader.GrantTransfer, waitTimeout+quietPeriod)
	waitWake(t, forBob, "for bob after a handover to him")
	mustGrant(t, s, name, bob, longTTL)
	select {
	case <-forCarol:
		t.Fatal("a handover to bob, which he took, woke carol's watcher")
	case <-time.After(quietPeriod):
	}
}

func testHandoverNotTaken(t *testing.T, s leader.Store) {
	ts := transferer(t, s)
	alice, bob, carol := newCandidate("alice"), newCandidate("bob"), newCandidate("carol")
	name, forBob, forCarol, held := settledWatchers(t, s, alice, bob, carol)

	const hold = time.Second
	reserved := time.Now() // before the store can start the hold
	mustReleaseTo(t, ts, name, alice, held.Term, bob, leader.GrantTransfer, hold)
	waitWake(t, forBob, "for bob after a handover to him")
	// A wake-up of carol's at the handover would come within a round trip
	// or two, long before the reservation runs out.
	// Carol's own, once the reservation has run out, may come in this
	// window if bob's was seen late (a busy machine): only a wake-up
	// seen before the hold has passed since the handover began fails.
	select {
	case <-forCarol:
		if d := time.Since(reserved); d < hold {
			t.Fatalf("a handover to bob for %v woke carol's watcher after %v, while it was reserved for him", hold, d)
		}
	case <-time.After(hold * 3 / 10):
		waitWake(t, forCarol, "for carol after bob's reservation ran out untaken")
	}
	if l, granted := acquire(t, s, name, carol, longTTL); !granted {
		t.Fatalf("carol, woken once bob's reservation ran out, was refused: %s", fmtLease(l))
	}
}

func testWatchFreeForRelease(t *testing.T, s leader.Store) {
	alice, bob, carol := newCandidate("alice"), newCandidate("bob"), newCandidate("carol")
	name, forBob, forCarol, held := settledWatchers(t, s, alice, bob, carol)
	mustRelease(t, s, name, alice, held.Term)
	waitWake(t, forBob, "for bob after a release")
	waitWake(t, forCarol, "for carol after a release")
}
