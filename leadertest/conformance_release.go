package leadertest

import (
	"fmt"
	"testing"

	"github.com/leaderelect/leader"
)

func testRelease(t *testing.T, s leader.Store) {
	name := newName()
	alice, bob := newCandidate("alice"), newCandidate("bob")
	held := mustGrant(t, s, name, alice, longTTL)
	mustRelease(t, s, name, alice, held.Term)
	checkFree(t, "Observe after release", observe(t, s, name), name, held.Term)

	_, err := s.Renew(t.Context(), name, alice.Token, held.Term, longTTL)
	wantLost(t, err, "renew of a released lease")
	checkFree(t, "Observe after renewing a released lease", observe(t, s, name), name, held.Term)

	l := mustGrant(t, s, name, bob, longTTL)
	if l.Term != held.Term+1 {
		t.Fatalf("grant after release has term %d; want %d", l.Term, held.Term+1)
	}
	checkHeld(t, "lease granted after release", l, name, bob.ID, held.Term+1, longTTL)
}

func testReleaseWrongToken(t *testing.T, s leader.Store) {
	name := newName()
	alice, mallory := newCandidate("alice"), newCandidate("mallory")
	held := mustGrant(t, s, name, alice, longTTL)
	wantLost(t, s.Release(t.Context(), name, mallory.Token, held.Term), "release with another token")
	wantLost(t, s.Release(t.Context(), name, "", held.Term), "release with an empty token")
	checkHeld(t, "Observe after the refused releases", observe(t, s, name), name, alice.ID, held.Term, longTTL)
	mustRenew(t, s, name, alice, held.Term, longTTL)
}

func testReleaseStaleTerm(t *testing.T, s leader.Store) {
	name := newName()
	alice := newCandidate("alice")
	old := mustGrant(t, s, name, alice, longTTL)
	held := mustGrant(t, s, name, alice, longTTL)
	wantLost(t, s.Release(t.Context(), name, alice.Token, old.Term), "release with the previous term")
	wantLost(t, s.Release(t.Context(), name, alice.Token, held.Term+1), "release with a term not yet granted")
	wantLost(t, s.Release(t.Context(), name, alice.Token, 0), "release with term 0")
	checkHeld(t, "Observe after the refused releases", observe(t, s, name), name, alice.ID, held.Term, longTTL)
	mustRenew(t, s, name, alice, held.Term, longTTL)
}

func testReleaseTwice(t *testing.T, s leader.Store) {
	name := newName()
	alice := newCandidate("alice")
	held := mustGrant(t, s, name, alice, longTTL)
	mustRelease(t, s, name, alice, held.Term)
	wantLost(t, s.Release(t.Context(), name, alice.Token, held.Term), "second release of the same grant")
	// A freed lease has no holder token, so an empty one does not match it.
	wantLost(t, s.Release(t.Context(), name, "", held.Term), "release of a freed lease with an empty token")
	_, err := s.Renew(t.Context(), name, "", held.Term, longTTL)
	wantLost(t, err, "renew of a freed lease with an empty token")
	checkFree(t, "Observe after the refused releases", observe(t, s, name), name, held.Term)
}

func testReleaseNeverGranted(t *testing.T, s leader.Store) {
	name := newName()
	alice := newCandidate("alice")
	for _, term := range []uint64{0, 1} {
		wantLost(t, s.Release(t.Context(), name, alice.Token, term), fmt.Sprintf("release of a name never granted with term %d", term))
	}
	checkNeverGranted(t, s, name)
}

func testReleaseAfterExpiry(t *testing.T, s leader.Store) {
	name := newName()
	alice := newCandidate("alice")
	held := mustGrant(t, s, name, alice, shortTTL)
	waitFree(t, s, name, shortTTL)
	// An expired lease is not held (Lease.Held), so it is not held by the
	// token under the term either.
	wantLost(t, s.Release(t.Context(), name, alice.Token, held.Term), "release after expiry")
	checkFree(t, "Observe after the refused release", observe(t, s, name), name, held.Term)
	l := mustGrant(t, s, name, alice, longTTL)
	if l.Term != held.Term+1 {
		t.Fatalf("grant after expiry has term %d; want %d", l.Term, held.Term+1)
	}
}
