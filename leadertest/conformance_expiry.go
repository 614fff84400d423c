package leadertest

import (
	"testing"
	"time"

	"github.com/leaderelect/leader"
)

// --- Expiry -----------------------------------------------------------------

func testExpiry(t *testing.T, s leader.Store) {
	name := newName()
	alice, bob := newCandidate("alice"), newCandidate("bob")
	old := mustGrant(t, s, name, alice, shortTTL)
	free := waitFree(t, s, name, shortTTL)
	checkFree(t, "Observe after expiry", free, name, old.Term)

	l := mustGrant(t, s, name, bob, longTTL)
	if l.Term != old.Term+1 {
		t.Fatalf("grant after expiry has term %d; want %d", l.Term, old.Term+1)
	}
	_, err := s.Renew(t.Context(), name, alice.Token, old.Term, longTTL)
	wantLost(t, err, "renew by the expired holder")
	err = s.Release(t.Context(), name, alice.Token, old.Term)
	wantLost(t, err, "release by the expired holder")
	checkHeld(t, "Observe after the old holder's attempts", observe(t, s, name), name, bob.ID, l.Term, longTTL)
}

// --- Leader safety ----------------------------------------------------------

func testRemainingBounded(t *testing.T, s leader.Store) {
	name := newName()
	alice, bob := newCandidate("alice"), newCandidate("bob")
	// Both far shorter than longTTL, and far longer than the test takes
	// on a busy machine: the lease must not run out before the checks.
	const holderTTL = 20 * time.Second
	held := mustGrant(t, s, name, alice, holderTTL)

	// The follower asks for a far longer TTL; what it is told about the
	// holder's lease must still come from the holder's TTL.
	l, granted := acquire(t, s, name, bob, longTTL)
	if granted {
		t.Fatalf("follower was granted a held lease: %s", fmtLease(l))
	}
	checkHeld(t, "lease reported to the follower", l, name, alice.ID, held.Term, holderTTL)
	checkHeld(t, "Observe by the follower", observe(t, s, name), name, alice.ID, held.Term, holderTTL)

	const renewTTL = 30 * time.Second
	mustRenew(t, s, name, alice, held.Term, renewTTL)
	l, granted = acquire(t, s, name, bob, longTTL)
	if granted {
		t.Fatalf("follower was granted a renewed lease: %s", fmtLease(l))
	}
	checkHeld(t, "lease reported to the follower after a renewal", l, name, alice.ID, held.Term, renewTTL)
	checkHeld(t, "Observe by the follower after a renewal", observe(t, s, name), name, alice.ID, held.Term, renewTTL)
}

func testNoEarlyGrant(t *testing.T, s leader.Store) {
	name := newName()
	alice, bob := newCandidate("alice"), newCandidate("bob")
	const ttl = 500 * time.Millisecond

	// The holder's own deadline is measured from when it sent the request
	// (DESIGN.md invariant 1); the store's expiry can only be later. The
	// grant is for longTTL, so that it cannot run out before the renewal
	// on a busy machine; the renewal sets the deadline.
	held := mustGrant(t, s, name, alice, longTTL)
	sent := time.Now()
	mustRenew(t, s, name, alice, held.Term, ttl)
	deadline := sent.Add(ttl)

	give := time.Now().Add(ttl + waitTimeout)
	for {
		l, granted := acquire(t, s, name, bob, longTTL)
		recv := time.Now()
		if granted {
			if early := deadline.Sub(recv); early > clockSlack {
				t.Fatalf("follower was granted the lease %v before the holder's deadline", early)
			}
			if l.Term != held.Term+1 {
				t.Fatalf("follower was granted term %d; want %d", l.Term, held.Term+1)
			}
			return
		}
		if l.Remaining > ttl {
			t.Fatalf("follower told Remaining %v; the holder's ttl is %v", l.Remaining, ttl)
		}
		if early := deadline.Sub(recv.Add(l.Remaining)); early > clockSlack {
			t.Fatalf("follower told the lease ends %v before the holder's deadline (Remaining %v)", early, l.Remaining)
		}
		if recv.After(give) {
			t.Fatalf("follower not granted the lease %v after its ttl of %v", waitTimeout, ttl)
		}
		time.Sleep(pollEvery)
	}
}
