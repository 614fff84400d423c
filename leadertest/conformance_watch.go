package leadertest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/leaderelect/leader"
)

// freeWatcherCases are the subtests of a store that implements
// leader.FreeWatcher.
var freeWatcherCases = []conformanceCase{
	{"a free-watcher wakes when the holder releases, and not when the lease is granted", testWatchFree},
	{"a free-watch channel is closed after its context ends", testWatchFreeClosed},
}

func testWatchRelease(t *testing.T, s leader.Store) {
	name := newName()
	alice := newCandidate("alice")
	held := mustGrant(t, s, name, alice, longTTL)
	// Watch after the grant, so a wake-up can only come from the release
	// (or be spurious).
	ch := watch(t, s, t.Context(), name)
	mustRelease(t, s, name, alice, held.Term)
	waitWake(t, ch, "after the holder released")
}

func testWatchGrant(t *testing.T, s leader.Store) {
	name := newName()
	alice, bob := newCandidate("alice"), newCandidate("bob")
	ch := watch(t, s, t.Context(), name)
	held := mustGrant(t, s, name, alice, longTTL)
	waitWake(t, ch, "after the first grant")

	mustRelease(t, s, name, alice, held.Term)
	waitWake(t, ch, "after the release")
	ch2 := watch(t, s, t.Context(), name) // fresh, so only the next grant counts
	mustGrant(t, s, name, bob, longTTL)
	waitWake(t, ch2, "after a grant following a release")
}

func testWatchFree(t *testing.T, s leader.Store) {
	fw := s.(leader.FreeWatcher)
	name := newName()
	alice, bob, carol := newCandidate("alice"), newCandidate("bob"), newCandidate("carol")
	free, err := fw.WatchFree(t.Context(), name)
	if err != nil {
		t.Fatalf("WatchFree(%q): %v", name, err)
	}
	all := watch(t, s, t.Context(), name)
	// A first handover, for the wake-ups a store may send once it starts
	// delivering them (spurious ones are allowed); then quiet channels.
	held := mustGrant(t, s, name, alice, longTTL)
	mustRelease(t, s, name, alice, held.Term)
	waitWake(t, free, "a free-watcher after the holder released")
	waitWake(t, all, "a plain watcher after the holder released")
	for i, c := range []leader.Candidate{bob, carol} {
		// A store may wake its watchers more than once for a release
		// (the PostgreSQL advisory store does: for its NOTIFY, then from
		// its lock waiter); let every wake-up of the last one arrive
		// before the grant.
		quiet(free, all)
		held := mustGrant(t, s, name, c, longTTL)
		// Once the plain watcher has woken, the grant's wake-up has been
		// delivered to every watcher it was meant for.
		waitWake(t, all, "a plain watcher after a grant")
		select {
		case <-free:
			t.Fatalf("grant %d woke a free-watcher; WatchFree must not wake on a grant", i+1)
		default:
		}
		mustRelease(t, s, name, c, held.Term)
		waitWake(t, free, "a free-watcher after the holder released")
	}
}

// quiet drains a and b until both have stayed empty for quietPeriod.
func quiet(a, b <-chan struct{}) {
	timer := time.NewTimer(quietPeriod)
	defer timer.Stop()
	for {
		select {
		case <-a:
		case <-b:
		case <-timer.C:
			return
		}
		timer.Reset(quietPeriod)
	}
}

func testWatchFreeClosed(t *testing.T, s leader.Store) {
	name := newName()
	ctx, cancel := context.WithCancel(t.Context())
	ch, err := s.(leader.FreeWatcher).WatchFree(ctx, name)
	if err != nil {
		t.Fatalf("WatchFree(%q): %v", name, err)
	}
	cancel()
	waitClosed(t, ch, "free-watch channel")
}

func testWatchTwoWatchers(t *testing.T, s leader.Store) {
	name := newName()
	alice := newCandidate("alice")
	held := mustGrant(t, s, name, alice, longTTL)
	ch1 := watch(t, s, t.Context(), name)
	ch2 := watch(t, s, t.Context(), name)
	mustRelease(t, s, name, alice, held.Term)
	waitWake(t, ch1, "for the first watcher after release")
	waitWake(t, ch2, "for the second watcher after release")
}

func testWatchTwoNames(t *testing.T, s leader.Store) {
	a, b := newName(), newName()
	alice, bob := newCandidate("alice"), newCandidate("bob")
	la := mustGrant(t, s, a, alice, longTTL)
	lb := mustGrant(t, s, b, bob, longTTL)
	cha := watch(t, s, t.Context(), a)
	chb := watch(t, s, t.Context(), b)
	// Wake-ups for a may reach b's watcher (spurious wake-ups are allowed),
	// so nothing is asserted about b's channel here.
	mustRelease(t, s, a, alice, la.Term)
	waitWake(t, cha, "for a after a was released")
	mustRelease(t, s, b, bob, lb.Term)
	waitWake(t, chb, "for b after b was released")
}

func testWatchSlowReader(t *testing.T, s leader.Store) {
	name := newName()
	alice := newCandidate("alice")
	ch := watch(t, s, t.Context(), name) // never read until the end
	for range 20 {
		ctx, cancel := context.WithTimeout(t.Context(), waitTimeout)
		l, granted, err := s.Acquire(ctx, name, alice, longTTL)
		if err == nil && granted {
			err = s.Release(ctx, name, alice.Token, l.Term)
		} else if err == nil {
			err = fmt.Errorf("not granted a free lease: %s", fmtLease(l))
		}
		cancel()
		if err != nil {
			t.Fatalf("acquire and release with an unread watcher: %v", err)
		}
	}
	waitWake(t, ch, "after many events with an unread channel")
	// The channel still works after the coalesced value was read.
	held := mustGrant(t, s, name, alice, longTTL)
	drain(ch)
	ch2 := watch(t, s, t.Context(), name)
	mustRelease(t, s, name, alice, held.Term)
	waitWake(t, ch2, "after release")
	waitWake(t, ch, "for the drained watcher after release")
}

func testWatchClosed(t *testing.T, s leader.Store) {
	name := newName()
	ctx, cancel := context.WithCancel(t.Context())
	ch := watch(t, s, ctx, name)
	cancel()
	waitClosed(t, ch, "watch channel")
}

// waitClosed waits for ch, whose context has ended, to be closed, reading
// any value still pending.
func waitClosed(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	timer := time.NewTimer(waitTimeout)
	defer timer.Stop()
	for {
		select {
		case _, open := <-ch:
			if !open {
				return
			}
		case <-timer.C:
			t.Fatalf("%s not closed %v after its context ended", what, waitTimeout)
		}
	}
}
