package leadertest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/leaderelect/leader"
)

// preparerCases are the subtests of a store that implements
// leader.HandoverPreparer (and leader.Transferer and
// leader.HandoverWatcher, with which its successors are told).
var preparerCases = []conformanceCase{
	{"a prepared handover keeps the lease held and renewable, and its commit grants the waiting successor the next term", testPreparedCommit},
	{"an aborted preparation changes nothing, and the waiting successor is refused", testPreparedAbort},
	{"a prepared handover ends once, and its commit fails with ErrLeaseLost when the lease was lost", testPreparedOnce},
}

func preparer(t *testing.T, s leader.Store) leader.HandoverPreparer {
	t.Helper()
	hp, ok := s.(leader.HandoverPreparer)
	if !ok {
		t.Fatalf("%T does not implement leader.HandoverPreparer", s)
	}
	return hp
}

func mustPrepare(t *testing.T, hp leader.HandoverPreparer, name string, from leader.Candidate, term uint64, to leader.Candidate, wait time.Duration) leader.PreparedHandover {
	t.Helper()
	ctx, cancel := callCtx(t)
	defer cancel()
	p, err := hp.PrepareHandover(ctx, name, from.Token, term, to, wait)
	if err != nil {
		t.Fatalf("PrepareHandover(%s term %d to %s): %v", from.ID, term, to.ID, err)
	}
	return p
}

// successorAttempt is the outcome of a successor's Acquire, and when
// the wake-up that started it came.
type successorAttempt struct {
	lease   leader.Lease
	granted bool
	err     error
	woke    time.Time
}

// attemptOnWake calls Acquire for c, as a follower does, once wake
// receives a value, and sends the outcome on the returned channel.
func attemptOnWake(t *testing.T, s leader.Store, wake <-chan struct{}, name string, c leader.Candidate) <-chan successorAttempt {
	out := make(chan successorAttempt, 1)
	go func() {
		select {
		case <-wake:
		case <-t.Context().Done():
			out <- successorAttempt{err: t.Context().Err()}
			return
		}
		woke := time.Now()
		ctx, cancel := context.WithTimeout(t.Context(), 4*waitTimeout)
		defer cancel()
		l, granted, err := s.Acquire(ctx, name, c, longTTL)
		out <- successorAttempt{l, granted, err, woke}
	}()
	return out
}

// awaitAttempt waits for the successor's Acquire.
func awaitAttempt(t *testing.T, ch <-chan successorAttempt, what string) successorAttempt {
	t.Helper()
	select {
	case a := <-ch:
		if a.err != nil {
			t.Fatalf("%s: the successor's Acquire: %v", what, a.err)
		}
		return a
	case <-time.After(5 * waitTimeout):
		t.Fatalf("%s: the successor's Acquire did not return", what)
		return successorAttempt{}
	}
}

func testPreparedCommit(t *testing.T, s leader.Store) {
	hp := preparer(t, s)
	alice, bob, carol := newCandidate("alice"), newCandidate("bob"), newCandidate("carol")
	name, forBob, _, held := settledWatchers(t, s, alice, bob, carol)
	attempt := attemptOnWake(t, s, forBob, name, bob)

	p := mustPrepare(t, hp, name, alice, held.Term, bob, waitTimeout)
	checkHeld(t, "the lease while the handover is prepared", observe(t, s, name), name, "alice", held.Term, longTTL)
	mustRenew(t, s, name, alice, held.Term, longTTL)
	ctx, cancel := callCtx(t)
	defer cancel()
	committed := time.Now()
	if err := p.Commit(ctx, leader.GrantTransfer, longTTL); err != nil {
		t.Fatalf("Commit: %v", err)
	}
	a := awaitAttempt(t, attempt, "after the commit")
	if !a.woke.Before(committed) {
		t.Fatal("the successor was woken by the commit, not told of the preparation")
	}
	if !a.granted {
		t.Fatalf("the successor's first Acquire after the preparation was refused: %s", fmtLease(a.lease))
	}
	checkHeld(t, "the successor's grant", a.lease, name, "bob", held.Term+1, longTTL)
	if a.lease.Reason != leader.GrantTransfer {
		t.Fatalf("the successor's grant has reason %q; want %q", a.lease.Reason, leader.GrantTransfer)
	}
}

func testPreparedAbort(t *testing.T, s leader.Store) {
	hp := preparer(t, s)
	alice, bob, carol := newCandidate("alice"), newCandidate("bob"), newCandidate("carol")
	name, forBob, _, held := settledWatchers(t, s, alice, bob, carol)
	attempt := attemptOnWake(t, s, forBob, name, bob)

	p := mustPrepare(t, hp, name, alice, held.Term, bob, waitTimeout)
	p.Abort()
	a := awaitAttempt(t, attempt, "after the abort")
	if a.granted {
		t.Fatalf("the successor was granted the lease after the preparation was aborted: %s", fmtLease(a.lease))
	}
	checkHeld(t, "the lease after an aborted preparation", observe(t, s, name), name, "alice", held.Term, longTTL)
	mustRenew(t, s, name, alice, held.Term, longTTL)
	p.Abort() // a second Abort does nothing
}

func testPreparedOnce(t *testing.T, s leader.Store) {
	hp := preparer(t, s)
	alice, bob := newCandidate("alice"), newCandidate("bob")
	name := newName()
	held := mustGrant(t, s, name, alice, longTTL)
	ctx, cancel := callCtx(t)
	defer cancel()

	// Nobody waits: the preparation returns after its wait, and its
	// commit is a handover all the same.
	p := mustPrepare(t, hp, name, alice, held.Term, bob, 10*time.Millisecond)
	if err := p.Commit(ctx, leader.GrantTransfer, longTTL); err != nil {
		t.Fatalf("Commit of a preparation that nobody waited for: %v", err)
	}
	if l := observe(t, s, name); l.Held() || l.Successor != "bob" || l.Term != held.Term {
		t.Fatalf("after the commit the lease is %s; want released with term %d, reserved for bob", fmtLease(l), held.Term)
	}
	if err := p.Commit(ctx, leader.GrantTransfer, longTTL); err == nil {
		t.Fatal("a second Commit of the same preparation succeeded")
	}
	p.Abort() // does nothing after a commit

	held = mustGrant(t, s, name, bob, longTTL)
	p = mustPrepare(t, hp, name, bob, held.Term, alice, 10*time.Millisecond)
	mustRelease(t, s, name, bob, held.Term)
	if err := p.Commit(ctx, leader.GrantTransfer, longTTL); !errors.Is(err, leader.ErrLeaseLost) {
		t.Fatalf("Commit of a lease released meanwhile: %v; want an error wrapping ErrLeaseLost", err)
	}
	checkFree(t, "the lease after a failed commit", observe(t, s, name), name, held.Term)
}
