package postgres

import (
	"crypto/rand"
	"fmt"
	"strings"
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
// lease at once), sent on that candidate's channel alone; then, once
// noticeDelay has passed, the plain release's notice on the store's
// channel, only if the lease is still free. With no candidate, the plain
// release's notice at once.
func TestReleaseNamesTheCandidateToWakeFirst(t *testing.T) {
	t.Parallel()
	b := setup(t)
	s := b.store
	s.noticeDelay = time.Second
	alice := candidate("alice")
	heard := heardOn(t, b, s.opts.Channel)

	l := mustGrant(t, s, "dibs", alice, time.Minute)
	first, last := enlistForDibs(t, s, "dibs", &alice)
	for candidateChannel(s.opts.Channel, first.Token) == candidateChannel(s.opts.Channel, last.Token) {
		// Another channel for the one named, so that first's hears
		// nothing; enlisted anew, it is still the one enlisted last.
		last.Token = rand.Text()
		if err := s.Enlist(callCtx(t), "dibs", last, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	heardLast := heardOn(t, b, candidateChannel(s.opts.Channel, last.Token))
	heardFirst := heardOn(t, b, candidateChannel(s.opts.Channel, first.Token))
	heard(2 * time.Second) // alice's grant notice
	mustRelease(t, s, "dibs", alice, l.Term)
	if got := heard(200 * time.Millisecond); len(got) != 0 {
		t.Fatalf("a plain release with candidates notified %q on the store's channel before noticeDelay; want nothing", got)
	}
	if got := heardFirst(100 * time.Millisecond); len(got) != 0 {
		t.Fatalf("a plain release notified %q on another candidate's channel; want nothing", got)
	}
	if got, want := heardLast(time.Second), dibsNotice("dibs", last); len(got) != 1 || got[0] != want {
		t.Fatalf("a plain release with candidates notified %q on the named candidate's channel; want [%q]", got, want)
	}
	// Nobody took it: the plain release's notice, noticeDelay later.
	if got := heard(2 * time.Second); len(got) != 1 || got[0] != "dibs" {
		t.Fatalf("an untaken release notified %q on the store's channel; want [%q]", got, "dibs")
	}

	// Taken before noticeDelay, by a candidate that was not named (the
	// lease is not reserved): no release notice on the store's channel.
	l = mustGrant(t, s, "dibs", alice, time.Minute)
	heard(2 * time.Second) // its grant notice
	mustRelease(t, s, "dibs", alice, l.Term)
	mustGrant(t, s, "dibs", candidate("bob"), time.Minute)
	if got := heardLast(time.Second); len(got) != 1 {
		t.Fatalf("the second release notified %q on the named candidate's channel; want one notice", got)
	}
	if got := heard(2 * time.Second); len(got) != 1 || got[0] != payloadGrant+"dibs" {
		t.Fatalf("a release taken before noticeDelay notified %q on the store's channel; want its grant's alone, [%q]", got, payloadGrant+"dibs")
	}

	// Without candidates, the plain release's notice.
	solo := "solo"
	ls := mustGrant(t, s, solo, alice, time.Minute)
	heard(2 * time.Second)
	mustRelease(t, s, solo, alice, ls.Term)
	if got := heard(time.Second); len(got) != 1 || got[0] != solo {
		t.Fatalf("a plain release without candidates notified %q; want [%q]", got, solo)
	}
}

// TestReleaseNoticeOnALongChannel checks that a channel too long to have
// candidate channels (see maxCandidateChannel) hears a plain release's
// notice that names a candidate at once, and no second notice.
func TestReleaseNoticeOnALongChannel(t *testing.T) {
	t.Parallel()
	a := setup(t)
	long := strings.Repeat("c", maxCandidateChannel+1)
	b := setupOn(t, a.pool, Options{Channel: long})
	if got := candidateChannel(long, "token"); got != "" {
		t.Fatalf("candidateChannel of a %d-byte channel = %q; want none", len(long), got)
	}
	heard := heardOn(t, b, long)
	alice := candidate("alice")
	l := mustGrant(t, b.store, "dibs", alice, time.Minute)
	_, last := enlistForDibs(t, b.store, "dibs", &alice)
	heard(time.Second) // alice's grant notice
	mustRelease(t, b.store, "dibs", alice, l.Term)
	if got, want := heard(time.Second), dibsNotice("dibs", last); len(got) != 1 || got[0] != want {
		t.Fatalf("a plain release on a long channel notified %q; want [%q] alone", got, want)
	}
}

// TestListenerListensOnCandidateChannels checks that a store's listener,
// already listening, LISTENs on the candidate channel of a candidate for
// which a free-watcher is added: a NOTIFY there wakes the watcher.
func TestListenerListensOnCandidateChannels(t *testing.T) {
	t.Parallel()
	b := setup(t)
	other, err := b.store.Watch(t.Context(), "other")
	if err != nil {
		t.Fatal(err)
	}
	pid := waitListening(t, b)
	time.Sleep(50 * time.Millisecond) // the wake-up sent once listening
	drain(other)
	c := candidate("c")
	ch := watchFor(t, b.store, "late", c)
	time.Sleep(50 * time.Millisecond)
	drain(ch)
	channel := candidateChannel(b.store.opts.Channel, c.Token)
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := b.pool.Exec(callCtx(t), `SELECT pg_notify($1, $2)`, channel, "late"); err != nil {
			t.Fatal(err)
		}
		select {
		case <-ch:
			// Woken by the notice, not by a new connection's wake-up
			// of every watcher.
			select {
			case again := <-b.listening:
				t.Fatalf("the listener (backend %d) connected again (backend %d) to LISTEN on a candidate channel; want it to LISTEN on its connection", pid, again)
			case <-other:
				t.Fatal("the watcher of another name was woken with the candidate's: the listener connected again, or woke every watcher")
			case <-time.After(100 * time.Millisecond):
			}
			return
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("a NOTIFY on the candidate channel %q did not wake the candidate's free-watcher", channel)
		}
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
	// The later release notice on the store's channel must not come
	// before the named candidate's store wakes the other: this checks
	// that store's own deferral.
	a.store.noticeDelay = time.Second
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

// TestCloseSendsTheLaterReleaseNotice checks that Close, called right
// after a plain release whose notice named a candidate (which does not
// listen, here), waits for the later release notice on the store's
// channel and sends it: the other candidates would otherwise wait for
// the expiry they last saw.
func TestCloseSendsTheLaterReleaseNotice(t *testing.T) {
	t.Parallel()
	a := setup(t)
	b := setupOn(t, a.pool, Options{})
	b.store.noticeDelay = 300 * time.Millisecond
	heard := heardOn(t, a, b.store.opts.Channel)
	alice := candidate("alice")
	l := mustGrant(t, b.store, "closing", alice, time.Minute)
	bob := candidate("bob")
	if err := b.store.Enlist(callCtx(t), "closing", bob, time.Minute); err != nil {
		t.Fatal(err)
	}
	heard(time.Second) // alice's grant notice
	mustRelease(t, b.store, "closing", alice, l.Term)
	b.store.Close()
	if got := heard(time.Second); len(got) != 1 || got[0] != "closing" {
		t.Fatalf("after a release naming a candidate and Close, the store's channel heard %q; want [%q]", got, "closing")
	}
}
