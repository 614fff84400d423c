package postgres

import (
	"crypto/rand"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/pgtest"
)

// enlistForDibs enlists, for name on s, candidates of which a plain
// release must name the one returned first (named): one of a lower
// priority, an entry that has run out with the highest priority, the
// holder's own entry (if holder is not nil) with a higher priority
// still, and five of priority 1: "stale", which has campaigned the
// longest but was last enlisted over half its entry's life ago (killed,
// or no longer attempting); "lapsed", enlisted before named but run out
// and enlisted again after it (a break: it queues anew); "sharer",
// enlisted before named but without an attempt of its own lately (an
// advisory candidate without a session); named; and other, enlisted after
// named and again last, which a rule of the candidate enlisted last would
// name.
func enlistForDibs(t *testing.T, s leader.Transferer, name string, holder *leader.Candidate) (named, other leader.Candidate) {
	t.Helper()
	stale := candidate("stale")
	stale.Priority = 1
	if err := s.Enlist(callCtx(t), name, stale, time.Hour); err != nil {
		t.Fatal(err)
	}
	pool, opts := storePool(s)
	if _, err := pool.Exec(callCtx(t), "UPDATE "+opts.qualifiedCandidateTable()+
		" SET since = since - interval '3 hours', refreshed_at = refreshed_at - interval '2 hours' WHERE name = $1 AND token = $2",
		name, stale.Token); err != nil {
		t.Fatal(err)
	}
	enlist := func(c leader.Candidate, prio int, ttl time.Duration) leader.Candidate {
		c.Priority = prio
		if err := s.Enlist(callCtx(t), name, c, ttl); err != nil {
			t.Fatalf("Enlist %s: %v", c.ID, err)
		}
		return c
	}
	enlist(candidate("low"), 0, time.Minute)
	enlist(candidate("gone"), 5, time.Millisecond)
	lapsed := enlist(candidate("lapsed"), 1, time.Millisecond)
	if holder != nil {
		enlist(*holder, 9, time.Minute)
	}
	sharer := enlist(candidate("sharer"), 1, time.Minute)
	named = enlist(candidate("named"), 1, time.Minute)
	time.Sleep(2 * time.Millisecond) // so that "gone" and "lapsed" have run out
	enlist(lapsed, 1, time.Minute)
	other = enlist(candidate("other"), 1, time.Minute)
	enlist(other, 1, time.Minute)
	// All but "sharer" attempted on their own lately (Enlist records no
	// such attempt; an Acquire refused does).
	if _, err := pool.Exec(callCtx(t), "UPDATE "+opts.qualifiedCandidateTable()+
		" SET session_at = clock_timestamp() WHERE name = $1 AND token <> $2", name, sharer.Token); err != nil {
		t.Fatal(err)
	}
	return named, other
}

// dibsNotice is the payload of a plain release of name that wakes c first.
func dibsNotice(name string, c leader.Candidate) string {
	return fmt.Sprintf("%s%d,%d:%s%s", payloadHandover, dibsHold/time.Microsecond, len(c.Token), c.Token, name)
}

// TestReleaseNamesTheCandidateToWakeFirst checks the NOTIFY of a plain
// release: with candidates enlisted, a handover's notice to the one of
// the highest priority, that has campaigned the longest, never the holder itself or an entry
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
	named, other := enlistForDibs(t, s, "dibs", &alice)
	for candidateChannel(s.opts.Channel, named.Token) == candidateChannel(s.opts.Channel, other.Token) {
		// Another channel for the other, so that its hears nothing;
		// enlisted anew, it still queues behind the one named.
		if err := s.Withdraw(callCtx(t), "dibs", other.Token); err != nil {
			t.Fatal(err)
		}
		other.Token = rand.Text()
		if err := s.Enlist(callCtx(t), "dibs", other, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	heardNamed := heardOn(t, b, candidateChannel(s.opts.Channel, named.Token))
	heardOther := heardOn(t, b, candidateChannel(s.opts.Channel, other.Token))
	awaitNotice(t, heard, payloadGrant+"dibs") // alice's grant notice
	mustRelease(t, s, "dibs", alice, l.Term)
	if got := heard(200 * time.Millisecond); len(got) != 0 {
		t.Fatalf("a plain release with candidates notified %q on the store's channel before noticeDelay; want nothing", got)
	}
	if got := heardOther(100 * time.Millisecond); len(got) != 0 {
		t.Fatalf("a plain release notified %q on another candidate's channel; want nothing", got)
	}
	if got, want := heardNamed(time.Second), dibsNotice("dibs", named); len(got) != 1 || got[0] != want {
		t.Fatalf("a plain release with candidates notified %q on the named candidate's channel; want [%q]", got, want)
	}
	// Nobody took it: the plain release's notice, noticeDelay later.
	if got := heard(2 * time.Second); len(got) != 1 || got[0] != "dibs" {
		t.Fatalf("an untaken release notified %q on the store's channel; want [%q]", got, "dibs")
	}

	// Taken before noticeDelay, by a candidate that was not named (the
	// lease is not reserved): no release notice on the store's channel.
	l = mustGrant(t, s, "dibs", alice, time.Minute)
	awaitNotice(t, heard, payloadGrant+"dibs") // its grant notice
	mustRelease(t, s, "dibs", alice, l.Term)
	mustGrant(t, s, "dibs", candidate("bob"), time.Minute)
	if got := heardNamed(time.Second); len(got) != 1 {
		t.Fatalf("the second release notified %q on the named candidate's channel; want one notice", got)
	}
	if got := heard(2 * time.Second); len(got) != 1 || got[0] != payloadGrant+"dibs" {
		t.Fatalf("a release taken before noticeDelay notified %q on the store's channel; want its grant's alone, [%q]", got, payloadGrant+"dibs")
	}

	// Without candidates, the plain release's notice.
	solo := "solo"
	ls := mustGrant(t, s, solo, alice, time.Minute)
	awaitNotice(t, heard, payloadGrant+solo) // its grant notice
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
	named, _ := enlistForDibs(t, b.store, "dibs", &alice)
	awaitNotice(t, heard, payloadGrant+"dibs") // alice's grant notice
	mustRelease(t, b.store, "dibs", alice, l.Term)
	if got, want := heard(time.Second), dibsNotice("dibs", named); len(got) != 1 || got[0] != want {
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

// wokenInOrder returns a check, to call after a release, that the store
// of w wakes first's free-watcher of name (the candidate of token
// firstToken), and then other's (of otherToken), no sooner than dibsHold
// after first's (nobody takes the lease, so the candidates that the
// release did not name are woken once their turn has passed). The check
// compares when the store woke each, recorded under its lock from the
// call of wokenInOrder on: what the test's goroutine sees may come late,
// and a stalled test would see both at once.
func wokenInOrder(t *testing.T, w *wakeups, name string, firstToken, otherToken string, first, other <-chan struct{}) func() {
	t.Helper()
	var at map[string]time.Time // guarded by w.mu
	w.mu.Lock()
	at = make(map[string]time.Time)
	w.onWake = func(n, token string) {
		if _, seen := at[token]; n == name && !seen {
			at[token] = time.Now()
		}
	}
	w.mu.Unlock()
	return func() {
		t.Helper()
		waitWake(t, first, "for the candidate named by the release")
		waitWake(t, other, "for a candidate the release did not name, nobody having taken the lease")
		w.mu.Lock()
		defer w.mu.Unlock()
		w.onWake = nil
		named, okNamed := at[firstToken]
		rest, okRest := at[otherToken]
		switch {
		case !okNamed || !okRest:
			t.Fatalf("the store's wake-ups of %q by notice: %v; want one for each of %q (named) and %q (a listener that reconnected wakes every watcher, unrecorded)", name, at, firstToken, otherToken)
		case rest.Sub(named) < dibsHold:
			t.Fatalf("the store woke the other candidate %v after the named one; want at least dibsHold (%v)", rest.Sub(named), dibsHold)
		}
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
	named, other := enlistForDibs(t, a.store, "dibs", nil)
	chNamed, chOther := watchFor(t, f.store, "dibs", named), watchFor(t, f.store, "dibs", other)
	waitListening(t, f)
	quieten(t, chNamed, chOther) // the wake-up sent once listening
	check := wokenInOrder(t, &f.store.wakeups, "dibs", named.Token, other.Token, chNamed, chOther)
	mustRelease(t, a.store, "dibs", alice, l.Term)
	check()
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
	awaitNotice(t, heard, payloadGrant+"closing") // alice's grant notice
	mustRelease(t, b.store, "closing", alice, l.Term)
	b.store.Close()
	if got := heard(time.Second); len(got) != 1 || got[0] != "closing" {
		t.Fatalf("after a release naming a candidate and Close, the store's channel heard %q; want [%q]", got, "closing")
	}
}

// storePool returns the pool and options of s, a store of this package.
func storePool(s leader.Transferer) (*pgxpool.Pool, Options) {
	switch s := s.(type) {
	case *LeaseStore:
		return s.pool, s.opts
	case *AdvisoryStore:
		return s.pool, s.opts
	}
	panic(fmt.Sprintf("storePool: %T", s))
}

// enlisted reports whether c's entry is among name's candidates on s.
func enlisted(t *testing.T, s leader.Transferer, name string, c leader.Candidate) bool {
	t.Helper()
	cands, err := s.Candidates(callCtx(t), name)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range cands {
		if e.Token == c.Token {
			return true
		}
	}
	return false
}

// TestReleaseDropsTheHolderFromTheCandidates checks, on both strategies,
// that a release removes the holder's own entry among the candidates, so
// that a leader that lets go and campaigns again queues behind those that
// waited (see firstCandidate), and leaves the others' entries.
func TestReleaseDropsTheHolderFromTheCandidates(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	lease := setupOn(t, pool, Options{}).store
	for _, s := range []leader.Store{lease, setupAdvisory(t, pool, Options{})} {
		ts := s.(leader.Transferer)
		name := fmt.Sprintf("drop-%T", s)
		alice, bob := candidate("alice"), candidate("bob")
		l := mustGrant(t, s, name, alice, time.Minute)
		for _, c := range []leader.Candidate{alice, bob} {
			if err := ts.Enlist(callCtx(t), name, c, time.Minute); err != nil {
				t.Fatal(err)
			}
		}
		mustRelease(t, s, name, alice, l.Term)
		if enlisted(t, ts, name, alice) {
			t.Errorf("%T: the holder's entry is still among the candidates after its release", s)
		}
		if !enlisted(t, ts, name, bob) {
			t.Errorf("%T: a release removed another candidate's entry", s)
		}
	}
}

// TestAdvisoryReleaseWakesTheNamedCandidateFirst checks the wake-ups of a
// plain release on the advisory strategy: the candidate it names (see
// enlistForDibs) is woken at once, by the notice on its candidate channel, although the
// follower's store has a lock waiter on the holder's mark, which the
// holder keeps for markAfter after it frees the lease's lock; the others
// dibsHold later, nobody having taken the lease.
func TestAdvisoryReleaseWakesTheNamedCandidateFirst(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	holders := setupAdvisory(t, pool, Options{})
	holders.markAfter = time.Second
	followers := setupAdvisory(t, pool, Options{})
	const name = "advisory-dibs"
	alice := candidate("alice")
	l := mustGrant(t, holders, name, alice, time.Minute)
	named, other := enlistForDibs(t, holders, name, &alice)
	chNamed, chOther := watchFor(t, followers, name, named), watchFor(t, followers, name, other)
	key, pid := holders.Key(name), holders.holderPID(t, name)
	electortest.Eventually(t, 10*time.Second, "the lock waiter waiting on the holder's mark", func() bool {
		return requests(t, pool, key, pid).markSharedWaiting == 1
	})
	// The followers' listener LISTENs on the named candidate's channel
	// once a notice there wakes it.
	electortest.Eventually(t, 10*time.Second, "the followers' store woken on the named candidate's channel", func() bool {
		if _, err := pool.Exec(callCtx(t), "SELECT pg_notify($1, $2)",
			candidateChannel(holders.opts.Channel, named.Token), dibsNotice(name, named)); err != nil {
			t.Fatal(err)
		}
		select {
		case <-chNamed:
			return true
		case <-time.After(50 * time.Millisecond):
			return false
		}
	})
	quieten(t, chNamed, chOther) // the other's deferred wake-up, and any late notice's
	check := wokenInOrder(t, &followers.wakeups, name, named.Token, other.Token, chNamed, chOther)
	released := time.Now()
	// Release returns once the mark is freed.
	errc := make(chan error, 1)
	go func() { errc <- holders.Release(callCtx(t), name, alice.Token, l.Term) }()
	check()
	if d := time.Since(released); d > holders.markAfter/2 {
		t.Fatalf("the candidates were woken %v after the release; want well before the mark is freed (%v)", d, holders.markAfter)
	}
	if r := requests(t, pool, key, pid); r.lockExclusive != 0 || r.markExclusive != 1 {
		t.Fatalf("right after a plain release that named a candidate, the holder's backend holds the lease's lock %d times and its mark %d times; want 0 and 1", r.lockExclusive, r.markExclusive)
	}
	if err := <-errc; err != nil {
		t.Fatalf("Release: %v", err)
	}
}

// TestOlderSchemaIsPermanent checks that a store on tables of an older
// version (here, a candidates' table without migration 010's columns)
// fails its calls with leader.ErrPermanent and the advice to migrate,
// rather than an error the Elector would retry forever.
func TestOlderSchemaIsPermanent(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	opts := Options{Schema: "older_schema"}
	if _, err := pool.Exec(callCtx(t), "CREATE SCHEMA IF NOT EXISTS older_schema"); err != nil {
		t.Fatal(err)
	}
	s := setupOn(t, pool, opts).store
	if _, err := pool.Exec(callCtx(t), "ALTER TABLE "+s.opts.qualifiedCandidateTable()+" DROP COLUMN since, DROP COLUMN refreshed_at"); err != nil {
		t.Fatal(err)
	}
	err := s.Enlist(callCtx(t), "older", candidate("bob"), time.Minute)
	if !errors.Is(err, leader.ErrPermanent) || !strings.Contains(err.Error(), "leader migrate") {
		t.Fatalf("Enlist on a candidates' table without since: %v; want leader.ErrPermanent advising a migration", err)
	}
}

// TestOwnAttemptsRecordASession checks that an advisory candidate's
// refused attempt on its own session records it (session_at, see
// firstCandidate), which Enlist then keeps, that Enlist records none, and
// that the lease strategy, which has no sessions, records none.
func TestOwnAttemptsRecordASession(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	for _, s := range []leader.Store{setupOn(t, pool, Options{}).store, setupAdvisory(t, pool, Options{})} {
		ts := s.(leader.Transferer)
		_, opts := storePool(ts)
		name := fmt.Sprintf("session-%T", s)
		alice, bob, carol := candidate("alice"), candidate("bob"), candidate("carol")
		mustGrant(t, s, name, alice, time.Minute)
		if _, granted := mustAcquire(t, s, name, bob, time.Minute); granted {
			t.Fatalf("%T: bob was granted a held lease", s)
		}
		if err := ts.Enlist(callCtx(t), name, carol, time.Minute); err != nil {
			t.Fatal(err)
		}
		// Enlisting again by Enlist keeps bob's.
		if err := ts.Enlist(callCtx(t), name, bob, time.Minute); err != nil {
			t.Fatal(err)
		}
		_, advisory := s.(*AdvisoryStore)
		for _, c := range []struct {
			who  leader.Candidate
			want bool
		}{{bob, advisory}, {carol, false}} {
			var recorded bool
			if err := pool.QueryRow(callCtx(t), "SELECT session_at IS NOT NULL FROM "+opts.qualifiedCandidateTable()+
				" WHERE name = $1 AND token = $2", name, c.who.Token).Scan(&recorded); err != nil {
				t.Fatalf("%T: %s's entry: %v", s, c.who.ID, err)
			}
			if recorded != c.want {
				t.Errorf("%T: %s's entry records an attempt of its own: %v; want %v", s, c.who.ID, recorded, c.want)
			}
		}
	}
}

// TestNamedCandidateTakesTheReleaseAtOnce checks the Acquire of a
// candidate that a plain release named (see wakeups.named): it is
// granted by the grant of a released lease alone, with the next term and
// the reason release; and when another candidate took the lease first,
// it tries that statement, falls back to the acquire statement, which
// refuses it and reports the new holder.
func TestNamedCandidateTakesTheReleaseAtOnce(t *testing.T) {
	t.Parallel()
	a := setup(t)
	a.store.noticeDelay = 3 * time.Second // no grant's notice calls off the mark meanwhile
	b := setupOn(t, a.pool, Options{})
	lengthenNamed(b.store)
	alice, bob, carol := candidate("alice"), candidate("bob"), candidate("carol")
	const ttl = time.Minute
	for _, name := range []string{"named", "taken"} {
		if err := b.store.Enlist(callCtx(t), name, bob, ttl); err != nil {
			t.Fatal(err)
		}
	}
	woken := watchFor(t, b.store, "named", bob)
	wokenTaken := watchFor(t, b.store, "taken", bob)
	waitListening(t, b)
	drain(woken)
	drain(wokenTaken)

	l := mustGrant(t, a.store, "named", alice, ttl)
	mustRelease(t, a.store, "named", alice, l.Term)
	waitWake(t, woken, "after the release that named bob")
	got, granted := mustAcquire(t, b.store, "named", bob, ttl)
	if !granted || got.Term != l.Term+1 || got.Reason != leader.GrantRelease || got.HolderID != "bob" {
		t.Fatalf("the named candidate's Acquire: %+v granted %v; want bob's, term %d, after a release", got, granted, l.Term+1)
	}
	if g, n := b.store.namedGrants.Load(), b.store.namedTries.Load(); g != 1 || n != 1 {
		t.Fatalf("%d grants of a released lease to a named candidate in %d tries; want 1 in 1", g, n)
	}

	l = mustGrant(t, a.store, "taken", alice, ttl)
	mustRelease(t, a.store, "taken", alice, l.Term)
	waitWake(t, wokenTaken, "after the release that named bob")
	mustGrant(t, a.store, "taken", carol, ttl) // the lease is not reserved: carol is first
	got, granted = mustAcquire(t, b.store, "taken", bob, ttl)
	if granted || got.HolderID != "carol" || got.Term != l.Term+1 {
		t.Fatalf("the named candidate's Acquire after carol's grant: %+v granted %v; want refused, carol holding term %d", got, granted, l.Term+1)
	}
	if g, n := b.store.namedGrants.Load(), b.store.namedTries.Load(); g != 1 || n != 2 {
		t.Fatalf("%d grants of a released lease to a named candidate in %d tries; want 1 in 2", g, n)
	}
}

// lengthenNamed has the marks of s's named candidates last a minute, so
// that a slow test machine does not turn a named Acquire into an
// ordinary one.
func lengthenNamed(s *LeaseStore) {
	s.wakeups.mu.Lock()
	defer s.wakeups.mu.Unlock()
	s.wakeups.namedFor = time.Minute
}

// TestWaitedAcquireTriesTheGrantOnce checks that an Acquire that waited
// for a prepared handover and ran the grant of a released lease, which
// granted nothing, does not run it a second time for the mark of a
// handover's notice that named the same candidate: it takes the mark,
// and runs the acquire statement.
func TestWaitedAcquireTriesTheGrantOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	lengthenNamed(b.store)
	alice, bob := candidate("alice"), candidate("bob")
	l := mustGrant(t, b.store, "w", alice, time.Minute)
	// Both marks, as a prepared handover's notice and then its release's
	// would leave them; the handover was not prepared at all (as if
	// aborted), so the waited grant statement runs at once and finds the
	// lease held.
	b.store.wakeups.mu.Lock()
	b.store.wakeups.prepared = map[string]preparation{"w": {token: bob.Token, at: time.Now()}}
	b.store.wakeups.named = map[string]preparation{"w": {token: bob.Token, at: time.Now()}}
	b.store.wakeups.mu.Unlock()
	got, granted := mustAcquire(t, b.store, "w", bob, time.Minute)
	if granted || got.HolderID != "alice" || got.Term != l.Term {
		t.Fatalf("bob's Acquire: %+v granted %v; want refused, alice holding term %d", got, granted, l.Term)
	}
	if n := b.store.namedTries.Load(); n != 0 {
		t.Fatalf("the grant of a released lease ran %d more times after the waited one; want 0", n)
	}
	if b.store.takeNamed("w", bob.Token) {
		t.Fatal("the mark of the handover's notice was left after the Acquire")
	}
}
