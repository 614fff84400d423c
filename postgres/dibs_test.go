package postgres

import (
	"fmt"
	"testing"
	"time"

	"github.com/leaderelect/leader"
)

// enlistForDibs enlists, for name on s, candidates of which the release
// must name the last: one of a lower priority, an entry that has run out
// with the highest priority, the holder's own entry (if holder is not
// nil) with a higher priority still, and two of priority 1, first and
// last, of which the release wakes the one enlisted last.
func enlistForDibs(t *testing.T, s leader.Transferer, name string, holder *leader.Candidate) (first, last leader.Candidate) {
	t.Helper()
	enlist := func(c leader.Candidate, prio int, ttl time.Duration) leader.Candidate {
		c.Priority = prio
		if err := s.Enlist(callCtx(t), name, c, ttl); err != nil {
			t.Fatalf("Enlist %s: %v", c.ID, err)
		}
		return c
	}
	enlist(candidate("low"), 0, time.Minute)
	enlist(candidate("gone"), 5, time.Millisecond)
	if holder != nil {
		enlist(*holder, 9, time.Minute)
	}
	first = enlist(candidate("first"), 1, time.Minute)
	time.Sleep(2 * time.Millisecond) // so that "gone" has run out, and "last" is enlisted later
	last = enlist(candidate("last"), 1, time.Minute)
	return first, last
}

// dibsNotice is the payload of a plain release of name that wakes c first.
func dibsNotice(name string, c leader.Candidate) string {
	return fmt.Sprintf("%s%d,%d:%s%s", payloadHandover, dibsHold/time.Microsecond, len(c.Token), c.Token, name)
}

// TestReleaseNamesTheCandidateToWakeFirst checks the NOTIFY of a plain
// release: with candidates enlisted, a handover's notice to the one of
// the highest priority, enlisted last, never the holder itself or an entry
// that has run out, and without a reservation (anyone may take the
// lease at once); with none, the plain release's.
func TestReleaseNamesTheCandidateToWakeFirst(t *testing.T) {
	t.Parallel()
	b := setup(t)
	s := b.store
	alice := candidate("alice")
	heard := heardOn(t, b, s.opts.Channel)

	l := mustGrant(t, s, "dibs", alice, time.Minute)
	_, last := enlistForDibs(t, s, "dibs", &alice)
	mustRelease(t, s, "dibs", alice, l.Term)
	if got, want := heard(time.Second), dibsNotice("dibs", last); len(got) != 1 || got[0] != want {
		t.Fatalf("a plain release with candidates notified %q; want [%q]", got, want)
	}
	// Not reserved: a candidate that was not named takes it at once.
	bob := candidate("bob")
	l = mustGrant(t, s, "dibs", bob, time.Minute)
	heard(time.Second) // its grant notice

	// Without candidates, the plain release's notice.
	solo := "solo"
	ls := mustGrant(t, s, solo, alice, time.Minute)
	heard(time.Second)
	mustRelease(t, s, solo, alice, ls.Term)
	if got := heard(time.Second); len(got) != 1 || got[0] != solo {
		t.Fatalf("a plain release without candidates notified %q; want [%q]", got, solo)
	}
}

// watchFor returns s.WatchFreeFor(name, c) with the wake-up sent once
// listening drained.
func watchFor(t *testing.T, s leader.HandoverWatcher, name string, c leader.Candidate) <-chan struct{} {
	t.Helper()
	ch, err := s.WatchFreeFor(t.Context(), name, c)
	if err != nil {
		t.Fatal(err)
	}
	return ch
}

// wokenInOrder checks that first is woken, and then other, no sooner
// than dibsHold after first (nobody takes the lease, so the candidates
// that the release did not name are woken once their turn has passed).
func wokenInOrder(t *testing.T, first, other <-chan struct{}) {
	t.Helper()
	waitWake(t, first, "for the candidate named by the release")
	at := time.Now()
	waitWake(t, other, "for a candidate the release did not name, nobody having taken the lease")
	if d := time.Since(at); d < dibsHold {
		t.Fatalf("the other candidate was woken %v after the named one; want at least dibsHold (%v)", d, dibsHold)
	}
}

// TestReleaseWakesTheNamedCandidateFirst checks the wake-ups of a plain
// release in a follower's store: the candidate it names at once, and the
// others once dibsHold has passed without a grant.
func TestReleaseWakesTheNamedCandidateFirst(t *testing.T) {
	t.Parallel()
	a := setup(t)
	f := setupOn(t, a.pool, Options{}) // the followers' process
	alice := candidate("alice")
	l := mustGrant(t, a.store, "dibs", alice, time.Minute)
	first, last := enlistForDibs(t, a.store, "dibs", nil)
	chLast, chFirst := watchFor(t, f.store, "dibs", last), watchFor(t, f.store, "dibs", first)
	waitListening(t, f)
	time.Sleep(100 * time.Millisecond) // the wake-up sent once listening
	drain(chLast)
	drain(chFirst)
	mustRelease(t, a.store, "dibs", alice, l.Term)
	wokenInOrder(t, chLast, chFirst)
}
