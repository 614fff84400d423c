package leadertest

import (
	"cmp"
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/leaderelect/leader"
)

// TestStore runs the conformance suite for leader.Store against the stores
// newStore returns. Every Store implementation must pass it; a store's own
// tests call it from a test function:
//
//	func TestConformance(t *testing.T) {
//		leadertest.TestStore(t, func(t *testing.T) leader.Store {
//			s := openMyStore(t)
//			t.Cleanup(func() { s.Close() })
//			return s
//		})
//	}
//
// newStore is called once per subtest, from that subtest's goroutine, and
// must return a store that is empty or at least shares no election names
// with other stores (the suite uses random names, so one database may back
// every store). It arranges its own cleanup with t.Cleanup. Subtests run in
// parallel, each with a fresh store, and read as sentences: a failure names
// the clause of the contract (the doc comments of leader.Store and
// leader.Lease) that the store broke.
//
// The suite judges time on the test's monotonic clock and assumes only that
// the store's clock runs at the same rate; it never asserts tight timings.
// Expiry tests use TTLs of a few hundred milliseconds and the whole suite
// takes a few seconds.
//
// The Watch subtests need wake-ups to be delivered for events after Watch
// returns. The contract lets a store that cannot deliver them at the moment
// (for example behind a transaction-pooling proxy) keep its channels silent;
// run the suite with the store in its normal mode.
//
// A store that implements leader.FreeWatcher (the suite asks the first
// store newStore returns) must also pass the WatchFree subtests, and one
// that implements leader.BatchRenewer the RenewBatch subtests, which also
// run the Renew subtests again with each renewal made by RenewBatch.
func TestStore(t *testing.T, newStore func(t *testing.T) leader.Store) {
	t.Helper()
	cases := conformanceCases
	first := newStore(t)
	if _, ok := first.(leader.FreeWatcher); ok {
		cases = append(slices.Clip(cases), freeWatcherCases...)
	}
	if _, ok := first.(leader.BatchRenewer); ok {
		cases = append(slices.Clip(cases), batchRenewerCases()...)
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.run(t, newStore(t))
		})
	}
}

// Timing of the suite. Expiry tests use shortTTL; tests that must not see an
// expiry use longTTL. Nothing is asserted to happen faster than waitTimeout.
const (
	// quietPeriod is how long a watch channel must stay empty for the
	// wake-ups of an event to be taken as all delivered.
	quietPeriod = 300 * time.Millisecond
	shortTTL    = 400 * time.Millisecond
	longTTL     = time.Minute
	waitTimeout = 5 * time.Second
	pollEvery   = 10 * time.Millisecond
	// clockSlack absorbs the rounding of a store that keeps times at
	// microsecond precision, and the tiny difference in rate between the
	// store's clock and ours, when comparing deadlines.
	clockSlack = 2 * time.Millisecond
)

type conformanceCase struct {
	name string
	run  func(t *testing.T, s leader.Store)
}

// conformanceCases is the suite, grouped by the clause of the contract each
// case checks.
var conformanceCases = []conformanceCase{
	// Acquire and Observe.
	{"a name never granted is observed as a zero lease with its name", testObserveNeverGranted},
	{"a first acquire of a name is granted with a term of at least one", testFirstAcquire},
	{"a second candidate cannot acquire a held lease", testAcquireHeld},
	{"the holder acquiring again is a new grant with the next term", testReacquireByHolder},
	{"a candidate with the holder's ID but another token is another candidate", testSameIDOtherToken},
	{"names are independent", testNamesIndependent},

	// Renew.
	{"a renewal by the holder extends the lease and keeps the term", testRenewExtends},
	{"a renewal with another token is refused and changes nothing", testRenewWrongToken},
	{"a renewal with a stale term is refused and changes nothing", testRenewStaleTerm},
	{"a renewal of a name never granted is refused and creates nothing", testRenewNeverGranted},
	{"a renewal after the lease expired is refused and does not revive it", testRenewAfterExpiry},

	// Expiry.
	{"an expired lease is free and the next grant has the next term", testExpiry},

	// Release.
	{"a release frees the lease and the next grant has the next term", testRelease},
	{"a release with another token is refused and changes nothing", testReleaseWrongToken},
	{"a release with a stale term is refused and changes nothing", testReleaseStaleTerm},
	{"a second release of the same grant is refused", testReleaseTwice},
	{"a release of a name never granted is refused and creates nothing", testReleaseNeverGranted},
	{"a release after the lease expired is refused", testReleaseAfterExpiry},

	// Terms.
	{"terms grow by one at every grant over many handovers", testTermsGrow},

	// Watch.
	{"a watcher wakes when the holder releases", testWatchRelease},
	{"a watcher wakes when the lease is granted", testWatchGrant},
	{"every watcher of a name wakes", testWatchTwoWatchers},
	{"watchers of different names each wake for their own name", testWatchTwoNames},
	{"a watcher that does not read never blocks the store", testWatchSlowReader},
	{"a watch channel is closed after its context ends", testWatchClosed},

	// Concurrency.
	{"exactly one of many racing candidates is granted a free lease", testAcquireRace},
	{"a history of racing grants, renewals and releases is consistent", testRaceHistory},

	// Context.
	{"every method returns promptly with an error when its context is cancelled", testCancelledContext},
	{"every method returns promptly with an error when its deadline has passed", testExpiredContext},

	// Leader safety.
	{"the remaining time reported to a follower never exceeds the holder's ttl", testRemainingBounded},
	{"a follower is never granted the lease before the holder's deadline", testNoEarlyGrant},
}

// --- Acquire and Observe ----------------------------------------------------

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

// --- Renew ------------------------------------------------------------------

func testRenewExtends(t *testing.T, s leader.Store) {
	name := newName()
	alice := newCandidate("alice")
	const grantTTL = time.Second
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
	const heldTTL = 3 * time.Second // a refused renewal with longTTL would exceed it
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

// --- Release ----------------------------------------------------------------

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

// --- Terms ------------------------------------------------------------------

func testTermsGrow(t *testing.T, s leader.Store) {
	name := newName()
	candidates := []leader.Candidate{newCandidate("alice"), newCandidate("bob"), newCandidate("carol")}
	var last uint64
	grant := func(c leader.Candidate, ttl time.Duration) leader.Lease {
		t.Helper()
		l := mustGrant(t, s, name, c, ttl)
		if last != 0 && l.Term != last+1 {
			t.Fatalf("grant to %s has term %d after term %d; want %d", c.ID, l.Term, last, last+1)
		}
		if l.Term <= last {
			t.Fatalf("grant to %s has term %d after term %d; terms never go back", c.ID, l.Term, last)
		}
		last = l.Term
		if o := observe(t, s, name); o.Term != last {
			t.Fatalf("Observe after granting term %d reports term %d", last, o.Term)
		}
		return l
	}
	for i := range 12 {
		c := candidates[i%len(candidates)]
		l := grant(c, longTTL)
		switch i % 3 {
		case 0: // handed over by release
			mustRelease(t, s, name, c, l.Term)
		case 1: // re-granted to the holder, then released
			l = grant(c, longTTL)
			mustRelease(t, s, name, c, l.Term)
		case 2: // renewed, then released
			mustRenew(t, s, name, c, l.Term, longTTL)
			mustRelease(t, s, name, c, l.Term)
		}
		if o := observe(t, s, name); o.Term != last || o.Held() {
			t.Fatalf("Observe after releasing term %d = %s; want a free lease with the same term", last, fmtLease(o))
		}
	}
	// Handed over by expiry, twice, to alternating candidates.
	for i := range 2 {
		grant(candidates[i%2], shortTTL)
		waitFree(t, s, name, shortTTL)
		if o := observe(t, s, name); o.Term != last {
			t.Fatalf("Observe after term %d expired reports term %d", last, o.Term)
		}
	}
	grant(candidates[2], longTTL)
}

// freeWatcherCases are the subtests of a store that implements
// leader.FreeWatcher.
var freeWatcherCases = []conformanceCase{
	{"a free-watcher wakes when the holder releases, and not when the lease is granted", testWatchFree},
	{"a free-watch channel is closed after its context ends", testWatchFreeClosed},
}

// --- Watch ------------------------------------------------------------------

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
	quiet(free, all)
	for i, c := range []leader.Candidate{bob, carol} {
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
		// A store may wake its watchers more than once for a release
		// (the PostgreSQL advisory store does: for its NOTIFY, then from
		// its lock waiter); let every wake-up of this one arrive before
		// the next grant.
		quiet(free, all)
	}
}

// quiet drains chs until they have stayed empty for quietPeriod.
func quiet(chs ...<-chan struct{}) {
	for _, ch := range chs {
		timer := time.NewTimer(quietPeriod)
		for drained := false; !drained; {
			select {
			case <-ch:
				timer.Reset(quietPeriod)
			case <-timer.C:
				drained = true
			}
		}
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

// --- Concurrency ------------------------------------------------------------

func testAcquireRace(t *testing.T, s leader.Store) {
	name := newName()
	const racers = 20
	candidates := make([]leader.Candidate, racers)
	for i := range candidates {
		candidates[i] = newCandidate(fmt.Sprintf("racer-%d", i))
	}
	race := func(round int) (leader.Candidate, leader.Lease) {
		t.Helper()
		type result struct {
			lease   leader.Lease
			granted bool
			err     error
		}
		results := make([]result, racers)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i, c := range candidates {
			wg.Go(func() {
				<-start
				ctx, cancel := context.WithTimeout(t.Context(), waitTimeout)
				defer cancel()
				l, granted, err := s.Acquire(ctx, name, c, longTTL)
				results[i] = result{l, granted, err}
			})
		}
		close(start)
		wg.Wait()
		winner := -1
		for i, r := range results {
			switch {
			case r.err != nil:
				t.Fatalf("round %d: racer %d: Acquire: %v", round, i, r.err)
			case r.granted && winner >= 0:
				t.Fatalf("round %d: racers %d and %d were both granted the lease (terms %d and %d)",
					round, winner, i, results[winner].lease.Term, r.lease.Term)
			case r.granted:
				winner = i
			}
		}
		if winner < 0 {
			t.Fatalf("round %d: none of %d racers was granted a free lease", round, racers)
		}
		w := results[winner].lease
		for i, r := range results {
			// A refused racer ran after the grant, so it saw the winner.
			if !r.granted && (r.lease.HolderID != candidates[winner].ID || r.lease.Term != w.Term || !r.lease.Held()) {
				t.Errorf("round %d: racer %d was refused but told %s; the winner holds term %d", round, i, fmtLease(r.lease), w.Term)
			}
		}
		checkHeld(t, "Observe after the race", observe(t, s, name), name, candidates[winner].ID, w.Term, longTTL)
		return candidates[winner], w
	}
	c, l := race(1)
	mustRelease(t, s, name, c, l.Term)
	_, l2 := race(2)
	if l2.Term != l.Term+1 {
		t.Fatalf("second race granted term %d after %d; want %d", l2.Term, l.Term, l.Term+1)
	}
}

// historyEvent is one successful call in testRaceHistory.
type historyEvent struct {
	op         string // "grant", "renew" or "release"
	term       uint64
	token      string
	sent, recv time.Time
}

func testRaceHistory(t *testing.T, s leader.Store) {
	name := newName()
	const (
		workers  = 4
		duration = time.Second
		ttl      = 150 * time.Millisecond
	)
	var (
		mu      sync.Mutex
		history []historyEvent
	)
	record := func(op string, term uint64, token string, sent, recv time.Time) {
		mu.Lock()
		history = append(history, historyEvent{op, term, token, sent, recv})
		mu.Unlock()
	}
	deadline := time.Now().Add(duration)
	pause := func() { time.Sleep(time.Duration(rand.Int64N(int64(3 * time.Millisecond)))) } // follower pacing
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			ctx := t.Context()
			c := newCandidate(fmt.Sprintf("worker-%d", w))
			for time.Now().Before(deadline) && ctx.Err() == nil {
				sent := time.Now()
				l, granted, err := s.Acquire(ctx, name, c, ttl)
				recv := time.Now()
				if err != nil {
					t.Errorf("worker %d: Acquire: %v", w, err)
					return
				}
				if !granted {
					pause()
					continue
				}
				record("grant", l.Term, c.Token, sent, recv)
				term := l.Term
				for range rand.IntN(3) {
					sent := time.Now()
					r, err := s.Renew(ctx, name, c.Token, term, ttl)
					recv := time.Now()
					if errors.Is(err, leader.ErrLeaseLost) {
						break
					}
					if err != nil {
						t.Errorf("worker %d: Renew: %v", w, err)
						return
					}
					if r.Term != term {
						t.Errorf("worker %d: renewal of term %d reports term %d", w, term, r.Term)
					}
					record("renew", term, c.Token, sent, recv)
				}
				switch rand.IntN(6) {
				case 0: // crash: abandon the lease and come back as a new instance
					c = newCandidate(c.ID)
				case 1: // acquire again at once while holding: a re-grant
					continue
				default:
					sent := time.Now()
					err := s.Release(ctx, name, c.Token, term)
					recv := time.Now()
					switch {
					case err == nil:
						record("release", term, c.Token, sent, recv)
					case !errors.Is(err, leader.ErrLeaseLost):
						t.Errorf("worker %d: Release: %v", w, err)
						return
					}
				}
				pause()
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	counts := make(map[string]int)
	for _, e := range history {
		counts[e.op]++
	}
	t.Logf("history: %d grants, %d renewals, %d releases", counts["grant"], counts["renew"], counts["release"])
	checkHistory(t, history, ttl)
}

// checkHistory checks the successful calls of testRaceHistory.
func checkHistory(t *testing.T, history []historyEvent, ttl time.Duration) {
	t.Helper()
	var grants []historyEvent
	byTerm := make(map[uint64]*historyEvent) // the grant of each term
	for i, e := range history {
		if e.op != "grant" {
			continue
		}
		if g, ok := byTerm[e.term]; ok {
			t.Fatalf("term %d was granted twice: to %s and to %s", e.term, g.token, e.token)
		}
		byTerm[e.term] = &history[i]
		grants = append(grants, e)
	}
	if len(grants) < 2 {
		t.Fatalf("only %d grants in %d calls; the history proves nothing", len(grants), len(history))
	}
	for _, e := range history {
		if g, ok := byTerm[e.term]; !ok || g.token != e.token {
			t.Fatalf("%s of term %d by token %s, but that term was not granted to that token", e.op, e.term, e.token)
		}
	}

	slices.SortFunc(grants, func(a, b historyEvent) int { return cmp.Compare(a.term, b.term) })
	for i := 1; i < len(grants); i++ {
		if grants[i].term != grants[i-1].term+1 {
			t.Fatalf("grants skipped from term %d to term %d; every grant adds one", grants[i-1].term, grants[i].term)
		}
	}
	// Real-time order: a grant that returned before another was sent has
	// the lower term. Walking terms downwards, keep the earliest return of
	// any higher term.
	earliest := time.Time{}
	var earliestTerm uint64
	for i := len(grants) - 1; i >= 0; i-- {
		g := grants[i]
		if !earliest.IsZero() && earliest.Before(g.sent) {
			t.Fatalf("grant of term %d returned before the grant of term %d was sent; terms went back", earliestTerm, g.term)
		}
		if earliest.IsZero() || g.recv.Before(earliest) {
			earliest, earliestTerm = g.recv, g.term
		}
	}
	// Leader safety: another token's grant never returns before the previous
	// holder's lease could have run out, unless that holder released it.
	lastSent := make(map[uint64]time.Time) // latest successful grant or renewal sent
	released := make(map[uint64]time.Time) // release sent
	for _, e := range history {
		switch e.op {
		case "grant", "renew":
			if e.sent.After(lastSent[e.term]) {
				lastSent[e.term] = e.sent
			}
		case "release":
			released[e.term] = e.sent
		}
	}
	for i := 1; i < len(grants); i++ {
		prev, next := grants[i-1], grants[i]
		if prev.token == next.token {
			continue
		}
		if rel, ok := released[prev.term]; ok {
			if next.recv.Before(rel) {
				t.Fatalf("term %d was granted before term %d's holder sent its release", next.term, prev.term)
			}
			continue
		}
		if mustEnd := lastSent[prev.term].Add(ttl - clockSlack); next.recv.Before(mustEnd) {
			t.Fatalf("term %d was granted to another token %v before term %d could have expired",
				next.term, mustEnd.Sub(next.recv), prev.term)
		}
	}
}

// --- Context ----------------------------------------------------------------

func testCancelledContext(t *testing.T, s leader.Store) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	checkContextHonoured(t, s, ctx, context.Canceled)
}

func testExpiredContext(t *testing.T, s leader.Store) {
	ctx, cancel := context.WithDeadline(t.Context(), time.Now().Add(-time.Second))
	defer cancel()
	checkContextHonoured(t, s, ctx, context.DeadlineExceeded)
}

// checkContextHonoured calls every method with ended on a held name, where
// each call would succeed if it ignored its context.
func checkContextHonoured(t *testing.T, s leader.Store, ended context.Context, want error) {
	t.Helper()
	name := newName()
	alice := newCandidate("alice")
	held := mustGrant(t, s, name, alice, longTTL)
	calls := []struct {
		method string
		call   func() error
	}{
		{"Acquire", func() error { _, _, err := s.Acquire(ended, name, alice, longTTL); return err }},
		{"Renew", func() error { _, err := s.Renew(ended, name, alice.Token, held.Term, longTTL); return err }},
		{"Release", func() error { return s.Release(ended, name, alice.Token, held.Term) }},
		{"Observe", func() error { _, err := s.Observe(ended, name); return err }},
		{"Watch", func() error { _, err := s.Watch(ended, name); return err }},
	}
	for _, c := range calls {
		done := make(chan error, 1)
		go func() { done <- c.call() }()
		select {
		case err := <-done:
			if !errors.Is(err, want) {
				t.Errorf("%s with an ended context returned %v; want an error wrapping %v", c.method, err, want)
			}
		case <-time.After(waitTimeout):
			t.Errorf("%s with an ended context has not returned after %v", c.method, waitTimeout)
		}
	}
}

// --- RenewBatch ---------------------------------------------------------------

// batchRenewerCases are the subtests of a store that implements
// leader.BatchRenewer: its own, and every Renew subtest with Renew made by
// RenewBatch (a batch of the lease alone, and a batch where other leases
// come first).
func batchRenewerCases() []conformanceCase {
	cases := []conformanceCase{
		{"RenewBatch renews or refuses each lease of a batch on its own terms", testRenewBatchMixed},
		{"RenewBatch with an ended context sets every outcome to an error", testRenewBatchEndedContext},
		{"RenewBatch with an empty batch does nothing", testRenewBatchEmpty},
	}
	renewCases := []conformanceCase{
		{"a renewal by the holder extends the lease and keeps the term", testRenewExtends},
		{"a renewal with another token is refused and changes nothing", testRenewWrongToken},
		{"a renewal with a stale term is refused and changes nothing", testRenewStaleTerm},
		{"a renewal of a name never granted is refused and creates nothing", testRenewNeverGranted},
		{"a renewal after the lease expired is refused and does not revive it", testRenewAfterExpiry},
		{"the remaining time reported to a follower never exceeds the holder's ttl", testRemainingBounded},
		{"a history of racing grants, renewals and releases is consistent", testRaceHistory},
	}
	for _, c := range renewCases {
		cases = append(cases, conformanceCase{"by RenewBatch: " + c.name, func(t *testing.T, s leader.Store) {
			c.run(t, batchOfOne{s})
		}})
	}
	return cases
}

// batchOfOne is a store whose Renew calls RenewBatch, with a lease of
// another name before the one asked for, so that a store answering the
// batch's outcomes out of order is caught.
type batchOfOne struct{ leader.Store }

func (b batchOfOne) Renew(ctx context.Context, name, token string, term uint64, ttl time.Duration) (leader.Lease, error) {
	batch := []leader.Renewal{
		{Name: newName(), Token: token, Term: term, TTL: ttl},
		{Name: name, Token: token, Term: term, TTL: ttl},
	}
	b.Store.(leader.BatchRenewer).RenewBatch(ctx, batch)
	if !errors.Is(batch[0].Err, leader.ErrLeaseLost) && ctx.Err() == nil {
		return leader.Lease{}, fmt.Errorf("RenewBatch renewed a name never granted: %s, %v", fmtLease(batch[0].Lease), batch[0].Err)
	}
	return batch[1].Lease, batch[1].Err
}

func testRenewBatchMixed(t *testing.T, s leader.Store) {
	alice, bob, mallory := newCandidate("alice"), newCandidate("bob"), newCandidate("mallory")
	const grantTTL = time.Second
	a, b, stale, other, released, never := newName(), newName(), newName(), newName(), newName(), newName()
	la := mustGrant(t, s, a, alice, grantTTL)
	lb := mustGrant(t, s, b, bob, grantTTL)
	old := mustGrant(t, s, stale, alice, longTTL)
	const heldTTL = 3 * time.Second // a refused renewal with longTTL would exceed it
	current := mustGrant(t, s, stale, alice, heldTTL)
	lo := mustGrant(t, s, other, alice, heldTTL)
	lr := mustGrant(t, s, released, alice, longTTL)
	mustRelease(t, s, released, alice, lr.Term)

	batch := []leader.Renewal{
		{Name: a, Token: alice.Token, Term: la.Term, TTL: longTTL},
		{Name: stale, Token: alice.Token, Term: old.Term, TTL: longTTL},
		{Name: other, Token: mallory.Token, Term: lo.Term, TTL: longTTL},
		{Name: released, Token: alice.Token, Term: lr.Term, TTL: longTTL},
		{Name: never, Token: alice.Token, Term: 1, TTL: longTTL},
		{Name: b, Token: bob.Token, Term: lb.Term, TTL: longTTL},
	}
	ctx, cancel := callCtx(t)
	defer cancel()
	s.(leader.BatchRenewer).RenewBatch(ctx, batch)

	for _, r := range []leader.Renewal{batch[0], batch[5]} {
		if r.Err != nil {
			t.Errorf("RenewBatch of %s's held lease: %v; want it renewed", r.Name, r.Err)
			continue
		}
		who := map[string]string{a: alice.ID, b: bob.ID}[r.Name]
		checkHeld(t, "lease renewed by RenewBatch", r.Lease, r.Name, who, r.Term, longTTL)
		if r.Lease.Remaining <= grantTTL {
			t.Errorf("RenewBatch with ttl %v: Remaining = %v; want more than the grant's %v", longTTL, r.Lease.Remaining, grantTTL)
		}
		checkHeld(t, "Observe after RenewBatch", observe(t, s, r.Name), r.Name, who, r.Term, longTTL)
	}
	for i, what := range map[int]string{1: "a stale term", 2: "another token", 3: "a released lease", 4: "a name never granted"} {
		wantLost(t, batch[i].Err, "RenewBatch with "+what)
	}
	checkHeld(t, "Observe after a refused renewal with a stale term", observe(t, s, stale), stale, alice.ID, current.Term, heldTTL)
	checkHeld(t, "Observe after a refused renewal with another token", observe(t, s, other), other, alice.ID, lo.Term, heldTTL)
	checkFree(t, "Observe after a refused renewal of a released lease", observe(t, s, released), released, lr.Term)
	checkNeverGranted(t, s, never)
}

func testRenewBatchEndedContext(t *testing.T, s leader.Store) {
	name := newName()
	alice := newCandidate("alice")
	held := mustGrant(t, s, name, alice, longTTL)
	for _, c := range []struct {
		what string
		ctx  func() (context.Context, context.CancelFunc)
		want error
	}{
		{"a cancelled context", func() (context.Context, context.CancelFunc) {
			ctx, cancel := context.WithCancel(t.Context())
			cancel()
			return ctx, cancel
		}, context.Canceled},
		{"a deadline passed", func() (context.Context, context.CancelFunc) {
			return context.WithDeadline(t.Context(), time.Now().Add(-time.Second))
		}, context.DeadlineExceeded},
	} {
		ctx, cancel := c.ctx()
		batch := []leader.Renewal{
			{Name: name, Token: alice.Token, Term: held.Term, TTL: longTTL},
			{Name: newName(), Token: alice.Token, Term: 1, TTL: longTTL},
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			s.(leader.BatchRenewer).RenewBatch(ctx, batch)
		}()
		select {
		case <-done:
			for _, r := range batch {
				if !errors.Is(r.Err, c.want) {
					t.Errorf("RenewBatch with %s: %s's outcome is %v; want an error wrapping %v", c.what, r.Name, r.Err, c.want)
				}
			}
		case <-time.After(waitTimeout):
			t.Errorf("RenewBatch with %s has not returned after %v", c.what, waitTimeout)
		}
		cancel()
	}
}

func testRenewBatchEmpty(t *testing.T, s leader.Store) {
	ctx, cancel := callCtx(t)
	defer cancel()
	s.(leader.BatchRenewer).RenewBatch(ctx, nil)
	s.(leader.BatchRenewer).RenewBatch(ctx, []leader.Renewal{})
}

// --- Leader safety ----------------------------------------------------------

func testRemainingBounded(t *testing.T, s leader.Store) {
	name := newName()
	alice, bob := newCandidate("alice"), newCandidate("bob")
	const holderTTL = 2 * time.Second
	held := mustGrant(t, s, name, alice, holderTTL)

	// The follower asks for a far longer TTL; what it is told about the
	// holder's lease must still come from the holder's TTL.
	l, granted := acquire(t, s, name, bob, longTTL)
	if granted {
		t.Fatalf("follower was granted a held lease: %s", fmtLease(l))
	}
	checkHeld(t, "lease reported to the follower", l, name, alice.ID, held.Term, holderTTL)
	checkHeld(t, "Observe by the follower", observe(t, s, name), name, alice.ID, held.Term, holderTTL)

	const renewTTL = 3 * time.Second
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
	// (DESIGN.md invariant 1); the store's expiry can only be later.
	sent := time.Now()
	held := mustGrant(t, s, name, alice, ttl)
	deadline := sent.Add(ttl)
	sent = time.Now()
	mustRenew(t, s, name, alice, held.Term, ttl)
	deadline = sent.Add(ttl)

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

// --- Helpers ----------------------------------------------------------------

// newName returns an election name no other test uses, so that stores
// backed by one database do not interfere.
func newName() string { return "leadertest-" + randomHex(8) }

// newCandidate returns a candidate with id and a fresh random token.
func newCandidate(id string) leader.Candidate {
	return leader.Candidate{ID: id, Token: randomHex(16)}
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = crand.Read(b) // never fails (crypto/rand)
	return hex.EncodeToString(b)
}

func callCtx(t *testing.T) (context.Context, context.CancelFunc) {
	return context.WithTimeout(t.Context(), waitTimeout)
}

func acquire(t *testing.T, s leader.Store, name string, c leader.Candidate, ttl time.Duration) (leader.Lease, bool) {
	t.Helper()
	ctx, cancel := callCtx(t)
	defer cancel()
	l, granted, err := s.Acquire(ctx, name, c, ttl)
	if err != nil {
		t.Fatalf("Acquire(%q, %s): %v", name, c.ID, err)
	}
	if l.Name != name {
		t.Fatalf("Acquire(%q) returned a lease named %q", name, l.Name)
	}
	return l, granted
}

func mustGrant(t *testing.T, s leader.Store, name string, c leader.Candidate, ttl time.Duration) leader.Lease {
	t.Helper()
	l, granted := acquire(t, s, name, c, ttl)
	if !granted {
		t.Fatalf("Acquire(%q, %s) not granted: %s", name, c.ID, fmtLease(l))
	}
	checkHeld(t, "granted lease", l, name, c.ID, l.Term, ttl)
	return l
}

func mustRenew(t *testing.T, s leader.Store, name string, c leader.Candidate, term uint64, ttl time.Duration) leader.Lease {
	t.Helper()
	ctx, cancel := callCtx(t)
	defer cancel()
	l, err := s.Renew(ctx, name, c.Token, term, ttl)
	if err != nil {
		t.Fatalf("Renew(%q, %s, term %d) by the holder: %v", name, c.ID, term, err)
	}
	checkHeld(t, "renewed lease", l, name, c.ID, term, ttl)
	return l
}

func mustRelease(t *testing.T, s leader.Store, name string, c leader.Candidate, term uint64) {
	t.Helper()
	ctx, cancel := callCtx(t)
	defer cancel()
	if err := s.Release(ctx, name, c.Token, term); err != nil {
		t.Fatalf("Release(%q, %s, term %d) by the holder: %v", name, c.ID, term, err)
	}
}

func observe(t *testing.T, s leader.Store, name string) leader.Lease {
	t.Helper()
	ctx, cancel := callCtx(t)
	defer cancel()
	l, err := s.Observe(ctx, name)
	if err != nil {
		t.Fatalf("Observe(%q): %v", name, err)
	}
	if l.Name != name {
		t.Fatalf("Observe(%q) returned a lease named %q", name, l.Name)
	}
	return l
}

func watch(t *testing.T, s leader.Store, ctx context.Context, name string) <-chan struct{} {
	t.Helper()
	ch, err := s.Watch(ctx, name)
	if err != nil {
		t.Fatalf("Watch(%q): %v", name, err)
	}
	return ch
}

// waitWake waits for a value on ch.
func waitWake(t *testing.T, ch <-chan struct{}, when string) {
	t.Helper()
	timer := time.NewTimer(waitTimeout)
	defer timer.Stop()
	select {
	case _, open := <-ch:
		if !open {
			t.Fatalf("watch channel closed %s while its context is live", when)
		}
	case <-timer.C:
		t.Fatalf("no wake-up %v %s", waitTimeout, when)
	}
}

// drain empties ch of a pending value without waiting.
func drain(ch <-chan struct{}) {
	select {
	case <-ch:
	default:
	}
}

// waitFree polls Observe until the lease granted for ttl is no longer held,
// and returns what Observe reported then.
func waitFree(t *testing.T, s leader.Store, name string, ttl time.Duration) leader.Lease {
	t.Helper()
	give := time.Now().Add(ttl + waitTimeout)
	for {
		l := observe(t, s, name)
		if !l.Held() {
			return l
		}
		if l.Remaining > ttl {
			t.Fatalf("lease granted for %v reports Remaining %v", ttl, l.Remaining)
		}
		if time.Now().After(give) {
			t.Fatalf("lease granted for %v still held after %v: %s", ttl, ttl+waitTimeout, fmtLease(l))
		}
		time.Sleep(min(pollEvery, l.Remaining+time.Millisecond))
	}
}

func wantLost(t *testing.T, err error, what string) {
	t.Helper()
	if !errors.Is(err, leader.ErrLeaseLost) {
		t.Fatalf("%s: got error %v; want an error wrapping leader.ErrLeaseLost", what, err)
	}
}

// checkHeld checks that l reports name held by holderID under term, with
// 0 < Remaining <= ttl.
func checkHeld(t *testing.T, what string, l leader.Lease, name, holderID string, term uint64, ttl time.Duration) {
	t.Helper()
	switch {
	case l.Name != name:
		t.Fatalf("%s: Name = %q; want %q", what, l.Name, name)
	case l.HolderID != holderID:
		t.Fatalf("%s: HolderID = %q; want %q (%s)", what, l.HolderID, holderID, fmtLease(l))
	case l.Term != term:
		t.Fatalf("%s: Term = %d; want %d (%s)", what, l.Term, term, fmtLease(l))
	case l.Remaining <= 0 || l.Remaining > ttl:
		t.Fatalf("%s: Remaining = %v; want more than 0 and at most the ttl %v", what, l.Remaining, ttl)
	case !l.ExpiresAt.After(l.AcquiredAt):
		t.Fatalf("%s: ExpiresAt %v is not after AcquiredAt %v", what, l.ExpiresAt, l.AcquiredAt)
	case !l.Held():
		t.Fatalf("%s: Held() = false for %s", what, fmtLease(l))
	}
}

// checkFree checks that l reports name free after a grant of term.
func checkFree(t *testing.T, what string, l leader.Lease, name string, term uint64) {
	t.Helper()
	if l.Name != name || l.HolderID != "" || l.Term != term || l.Remaining != 0 || l.Held() {
		t.Fatalf("%s: %s; want a free lease (no holder, Remaining 0) with term %d", what, fmtLease(l), term)
	}
}

// checkNeverGranted checks that Observe reports name as never granted.
func checkNeverGranted(t *testing.T, s leader.Store, name string) {
	t.Helper()
	l := observe(t, s, name)
	if l.HolderID != "" || l.Term != 0 || l.Remaining != 0 || l.Held() {
		t.Fatalf("Observe(%q) = %s; want a name never granted (term 0, no holder)", name, fmtLease(l))
	}
}

func fmtLease(l leader.Lease) string {
	return fmt.Sprintf("Lease{Name:%q HolderID:%q Term:%d Remaining:%v AcquiredAt:%v ExpiresAt:%v}",
		l.Name, l.HolderID, l.Term, l.Remaining, l.AcquiredAt.Format(time.RFC3339Nano), l.ExpiresAt.Format(time.RFC3339Nano))
}
