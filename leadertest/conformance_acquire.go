package leadertest

import (
	"testing"

	"github.com/leaderelect/leader"
)

func testObserveNeverGranted(t *testing.T, s leader.Store) {
	name := newName()
	l := observe(t, s, name)
	if l.Name != name || l.HolderID != "" || l.Term != 0 || !l.AcquiredAt.IsZero() ||
		!l.ExpiresAt.IsZero() || l.Remaining != 0 || l.Held() {
		t.Fatalf("Observe of a name never granted = %s; want a zero Lease with Name %q", fmtLease(l), name)
	}
}

func testFirstAcquire(t *testing.T, s leader.Store) {
	name := newName()
	alice := newCandidate("alice")
	l := mustGrant(t, s, name, alice, longTTL)
	if l.Term < 1 {
		t.Fatalf("first grant has term %d; want at least 1", l.Term)
	}
	checkHeld(t, "granted lease", l, name, alice.ID, l.Term, longTTL)
	checkHeld(t, "Observe after the grant", observe(t, s, name), name, alice.ID, l.Term, longTTL)
}

func testAcquireHeld(t *testing.T, s leader.Store) {
	name := newName()
	alice, bob := newCandidate("alice"), newCandidate("bob")
	held := mustGrant(t, s, name, alice, longTTL)

	l, granted := acquire(t, s, name, bob, 2*longTTL)
	if granted {
		t.Fatalf("second candidate was granted a held lease: %s", fmtLease(l))
	}
	checkHeld(t, "lease returned to the refused candidate", l, name, alice.ID, held.Term, longTTL)
	checkHeld(t, "Observe after the refusal", observe(t, s, name), name, alice.ID, held.Term, longTTL)
	// The holder still holds it under its term.
	mustRenew(t, s, name, alice, held.Term, longTTL)
}

func testReacquireByHolder(t *testing.T, s leader.Store) {
	name := newName()
	alice := newCandidate("alice")
	first := mustGrant(t, s, name, alice, longTTL)
	second := mustGrant(t, s, name, alice, longTTL)
	if second.Term != first.Term+1 {
		t.Fatalf("re-acquire by the holder got term %d after %d; want %d", second.Term, first.Term, first.Term+1)
	}
	checkHeld(t, "re-granted lease", second, name, alice.ID, first.Term+1, longTTL)
	checkHeld(t, "Observe after the re-grant", observe(t, s, name), name, alice.ID, first.Term+1, longTTL)
	// The old term is no longer the holder's.
	_, err := s.Renew(t.Context(), name, alice.Token, first.Term, longTTL)
	wantLost(t, err, "renew with the term of the previous grant")
}

func testSameIDOtherToken(t *testing.T, s leader.Store) {
	name := newName()
	first := newCandidate("twin")
	second := newCandidate("twin") // same ID, another token
	held := mustGrant(t, s, name, first, longTTL)

	l, granted := acquire(t, s, name, second, longTTL)
	if granted {
		t.Fatalf("a candidate with the holder's ID and another token was granted the held lease: %s", fmtLease(l))
	}
	_, err := s.Renew(t.Context(), name, second.Token, held.Term, 2*longTTL)
	wantLost(t, err, "renew by the holder's ID with another token")
	err = s.Release(t.Context(), name, second.Token, held.Term)
	wantLost(t, err, "release by the holder's ID with another token")

	checkHeld(t, "Observe after the other token's attempts", observe(t, s, name), name, first.ID, held.Term, longTTL)
	mustRenew(t, s, name, first, held.Term, longTTL)
}

func testNamesIndependent(t *testing.T, s leader.Store) {
	a, b := newName(), newName()
	alice, bob := newCandidate("alice"), newCandidate("bob")
	la := mustGrant(t, s, a, alice, longTTL)
	la = mustGrant(t, s, a, alice, longTTL) // term of a moves on; b's must not

	checkNeverGranted(t, s, b)
	lb := mustGrant(t, s, b, bob, longTTL)
	checkHeld(t, "Observe of a", observe(t, s, a), a, alice.ID, la.Term, longTTL)
	la = mustGrant(t, s, a, alice, longTTL)
	checkHeld(t, "Observe of b after a was granted again", observe(t, s, b), b, bob.ID, lb.Term, longTTL)

	// A token's term on one name means nothing on another.
	_, err := s.Renew(t.Context(), b, alice.Token, la.Term, longTTL)
	wantLost(t, err, "renew of b by a's holder")
	mustRelease(t, s, a, alice, la.Term)
	checkHeld(t, "Observe of b after a was released", observe(t, s, b), b, bob.ID, lb.Term, longTTL)
	mustRenew(t, s, b, bob, lb.Term, longTTL)
}
