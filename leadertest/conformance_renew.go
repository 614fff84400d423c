package leadertest

import (
	"fmt"
	"testing"
	"time"

	"github.com/leaderelect/leader"
)

func testRenewExtends(t *testing.T, s leader.Store) {
	name := newName()
	alice := newCandidate("alice")
	const grantTTL = 10 * time.Second // far shorter than longTTL; not run out before the renewal
	held := mustGrant(t, s, name, alice, grantTTL)

	// Renewing with a longer TTL proves the expiry moved: Remaining can
	// only exceed grantTTL if the renewal took effect.
	l := mustRenew(t, s, name, alice, held.Term, longTTL)
	checkHeld(t, "renewed lease", l, name, alice.ID, held.Term, longTTL)
	if l.Remaining <= grantTTL {
		t.Errorf("renewed with ttl %v: Remaining = %v; want more than the grant's %v", longTTL, l.Remaining, grantTTL)
	}
	if !l.AcquiredAt.Equal(held.AcquiredAt) {
		t.Errorf("renewal changed AcquiredAt from %v to %v; it is the time of the grant", held.AcquiredAt, l.AcquiredAt)
	}
	if l.ExpiresAt.Before(held.ExpiresAt) {
		t.Errorf("renewal moved ExpiresAt back from %v to %v", held.ExpiresAt, l.ExpiresAt)
	}
	o := observe(t, s, name)
	checkHeld(t, "Observe after the renewal", o, name, alice.ID, held.Term, longTTL)
	if o.Remaining <= grantTTL {
		t.Errorf("Observe after renewing with ttl %v: Remaining = %v; want more than %v", longTTL, o.Remaining, grantTTL)
	}

	// Renewing with a shorter TTL sets the expiry from now by that TTL.
	l = mustRenew(t, s, name, alice, held.Term, grantTTL)
	checkHeld(t, "lease renewed with a shorter ttl", l, name, alice.ID, held.Term, grantTTL)
}

func testRenewWrongToken(t *testing.T, s leader.Store) {
	name := newName()
	alice, mallory := newCandidate("alice"), newCandidate("mallory")
	held := mustGrant(t, s, name, alice, longTTL)

	_, err := s.Renew(t.Context(), name, mallory.Token, held.Term, 2*longTTL)
	wantLost(t, err, "renew with another token")
	_, err = s.Renew(t.Context(), name, "", held.Term, 2*longTTL)
	wantLost(t, err, "renew with an empty token")
	checkHeld(t, "Observe after the refused renewals", observe(t, s, name), name, alice.ID, held.Term, longTTL)
}

func testRenewStaleTerm(t *testing.T, s leader.Store) {
	name := newName()
	alice := newCandidate("alice")
	old := mustGrant(t, s, name, alice, longTTL)
	const heldTTL = 20 * time.Second // a refused renewal with longTTL would exceed it; the test takes far less
	held := mustGrant(t, s, name, alice, heldTTL)

	_, err := s.Renew(t.Context(), name, alice.Token, old.Term, longTTL)
	wantLost(t, err, "renew with the previous term")
	_, err = s.Renew(t.Context(), name, alice.Token, held.Term+1, longTTL)
	wantLost(t, err, "renew with a term not yet granted")
	_, err = s.Renew(t.Context(), name, alice.Token, 0, longTTL)
	wantLost(t, err, "renew with term 0")

	o := observe(t, s, name)
	checkHeld(t, "Observe after the refused renewals", o, name, alice.ID, held.Term, heldTTL)
}

func testRenewNeverGranted(t *testing.T, s leader.Store) {
	name := newName()
	alice := newCandidate("alice")
	for _, term := range []uint64{0, 1, 2} {
		_, err := s.Renew(t.Context(), name, alice.Token, term, longTTL)
		wantLost(t, err, fmt.Sprintf("renew of a name never granted with term %d", term))
	}
	checkNeverGranted(t, s, name)
	// The name is still free for a first grant.
	l := mustGrant(t, s, name, alice, longTTL)
	checkHeld(t, "first grant after refused renewals", l, name, alice.ID, l.Term, longTTL)
}

func testRenewAfterExpiry(t *testing.T, s leader.Store) {
	name := newName()
	alice := newCandidate("alice")
	held := mustGrant(t, s, name, alice, shortTTL)
	waitFree(t, s, name, shortTTL)

	_, err := s.Renew(t.Context(), name, alice.Token, held.Term, longTTL)
	wantLost(t, err, "renew after expiry")
	checkFree(t, "Observe after the refused renewal", observe(t, s, name), name, held.Term)
}
