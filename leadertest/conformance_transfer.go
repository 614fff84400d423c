package leadertest

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/leaderelect/leader"
)

// transfererCases check the contract of leader.Transferer, for stores that
// implement it.
var transfererCases = []conformanceCase{
	{"a grant records the holder's priority and why it was made", testGrantReasons},
	{"enlisted candidates are listed until their entries run out or they withdraw", testCandidates},
	{"an Acquire that does not grant enlists its candidate, with its priority", testAcquireEnlists},
	{"a lease handed to a named successor is granted to it alone, with the next term", testReleaseToNamed},
	{"a lease handed to a gone successor is an ordinary released one once its reservation runs out", testReleaseToGone},
	{"a handover that races the lease's expiry (a crashed leader) is refused and reserves nothing", testReleaseToRacingExpiry},
	{"a request to hand over is reported until it lapses, is cleared, or a grant or handover ends it", testTransferRequest},
	{"of concurrent requests to hand over, one is pending, and one handover ends it", testConcurrentRequests},
}

func transferer(t *testing.T, s leader.Store) leader.Transferer {
	t.Helper()
	ts, ok := s.(leader.Transferer)
	if !ok {
		t.Fatalf("%T does not implement leader.Transferer", s)
	}
	return ts
}

func mustEnlist(t *testing.T, ts leader.Transferer, name string, c leader.Candidate, ttl time.Duration) {
	t.Helper()
	ctx, cancel := callCtx(t)
	defer cancel()
	if err := ts.Enlist(ctx, name, c, ttl); err != nil {
		t.Fatalf("Enlist(%s): %v", c.ID, err)
	}
}

func mustReleaseTo(t *testing.T, ts leader.Transferer, name string, from leader.Candidate, term uint64, to leader.Candidate, why leader.GrantReason, hold time.Duration) {
	t.Helper()
	ctx, cancel := callCtx(t)
	defer cancel()
	if err := ts.ReleaseTo(ctx, name, from.Token, term, to, why, hold); err != nil {
		t.Fatalf("ReleaseTo(%s term %d to %s): %v", from.ID, term, to.ID, err)
	}
}

func request(t *testing.T, ts leader.Transferer, name string, req leader.TransferRequest, ttl time.Duration) (leader.Lease, error) {
	t.Helper()
	ctx, cancel := callCtx(t)
	defer cancel()
	return ts.RequestTransfer(ctx, name, req, ttl)
}

func candidateIDs(t *testing.T, ts leader.Transferer, name string) []string {
	t.Helper()
	ctx, cancel := callCtx(t)
	defer cancel()
	cands, err := ts.Candidates(ctx, name)
	if err != nil {
		t.Fatalf("Candidates: %v", err)
	}
	var ids []string
	for _, c := range cands {
		ids = append(ids, fmt.Sprintf("%s/%d", c.ID, c.Priority))
	}
	slices.Sort(ids)
	return ids
}

func testGrantReasons(t *testing.T, s leader.Store) {
	transferer(t, s)
	name := newName()
	alice, bob := newCandidate("alice"), newCandidate("bob")
	alice.Priority, bob.Priority = 7, -3
	l := mustGrant(t, s, name, alice, longTTL)
	if l.Priority != 7 {
		t.Fatalf("grant to alice (priority 7) reports priority %d: %s", l.Priority, fmtLease(l))
	}
	if o := observe(t, s, name); o.Priority != 7 {
		t.Fatalf("Observe of alice's lease (priority 7) reports priority %d: %s", o.Priority, fmtLease(o))
	}
	mustRelease(t, s, name, alice, l.Term)
	l = mustGrant(t, s, name, bob, shortTTL)
	if l.Reason != leader.GrantRelease || l.Priority != -3 {
		t.Fatalf("grant after a release reports reason %q, priority %d; want %q, -3: %s", l.Reason, l.Priority, leader.GrantRelease, fmtLease(l))
	}
	waitFree(t, s, name, shortTTL)
	l = mustGrant(t, s, name, alice, longTTL)
	if l.Reason != leader.GrantExpiry {
		t.Fatalf("grant after the lease ran out reports reason %q; want %q: %s", l.Reason, leader.GrantExpiry, fmtLease(l))
	}
	if o := observe(t, s, name); o.Reason != leader.GrantExpiry {
		t.Fatalf("Observe after a grant over an expired lease reports reason %q; want %q", o.Reason, leader.GrantExpiry)
	}
}

func testCandidates(t *testing.T, s leader.Store) {
	ts := transferer(t, s)
	name := newName()
	if ids := candidateIDs(t, ts, name); len(ids) != 0 {
		t.Fatalf("Candidates of a name nobody enlisted for = %v; want none", ids)
	}
	alice, bob, carol := newCandidate("alice"), newCandidate("bob"), newCandidate("carol")
	alice.Priority, bob.Priority, carol.Priority = 1, 2, 3
	mustEnlist(t, ts, name, alice, longTTL)
	mustEnlist(t, ts, name, bob, longTTL)
	// Carol's entry runs out below, but not before the first look: a busy
	// machine may take shortTTL between the two.
	mustEnlist(t, ts, name, carol, entryTTL)
	mustEnlist(t, ts, newName(), newCandidate("elsewhere"), longTTL)
	if ids, want := candidateIDs(t, ts, name), []string{"alice/1", "bob/2", "carol/3"}; !slices.Equal(ids, want) {
		t.Fatalf("Candidates = %v; want %v", ids, want)
	}
	bob.Priority = 5 // enlisting again replaces the entry
	mustEnlist(t, ts, name, bob, longTTL)
	ctx, cancel := callCtx(t)
	defer cancel()
	if err := ts.Withdraw(ctx, name, alice.Token); err != nil {
		t.Fatalf("Withdraw(alice): %v", err)
	}
	if err := ts.Withdraw(ctx, name, "never-enlisted"); err != nil {
		t.Fatalf("Withdraw of a token never enlisted: %v; want nil", err)
	}
	deadline := time.Now().Add(entryTTL + waitTimeout)
	for {
		ids := candidateIDs(t, ts, name)
		if slices.Equal(ids, []string{"bob/5"}) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Candidates after alice withdrew, bob enlisted again with priority 5 and carol's entry ran out = %v; want [bob/5]", ids)
		}
		time.Sleep(pollEvery)
	}
}

func testAcquireEnlists(t *testing.T, s leader.Store) {
	ts := transferer(t, s)
	name := newName()
	alice, bob, carol, dave := newCandidate("alice"), newCandidate("bob"), newCandidate("carol"), newCandidate("dave")
	bob.Priority, dave.Priority = 4, -2
	held := mustGrant(t, s, name, alice, longTTL)
	if l, granted := acquire(t, s, name, bob, longTTL); granted {
		t.Fatalf("bob was granted alice's lease: %s", fmtLease(l))
	}
	if ids := candidateIDs(t, ts, name); !slices.Contains(ids, "bob/4") {
		t.Fatalf("after bob's refused Acquire, Candidates = %v; want bob/4 among them", ids)
	}
	// Refused because the lease is reserved for another: enlisted too.
	mustEnlist(t, ts, name, carol, longTTL)
	mustReleaseTo(t, ts, name, alice, held.Term, carol, leader.GrantTransfer, longTTL)
	if l, granted := acquire(t, s, name, dave, longTTL); granted {
		t.Fatalf("dave was granted a lease reserved for carol: %s", fmtLease(l))
	}
	if ids := candidateIDs(t, ts, name); !slices.Contains(ids, "dave/-2") {
		t.Fatalf("after dave's Acquire refused for carol's reservation, Candidates = %v; want dave/-2 among them", ids)
	}
}

func testReleaseToNamed(t *testing.T, s leader.Store) {
	ts := transferer(t, s)
	name := newName()
	alice, bob, carol := newCandidate("alice"), newCandidate("bob"), newCandidate("carol")
	held := mustGrant(t, s, name, alice, longTTL)
	wake := watch(t, s, t.Context(), name)
	drain(wake)
	mustReleaseTo(t, ts, name, alice, held.Term, bob, leader.GrantTransfer, longTTL)
	waitWake(t, wake, "after a handover")

	l, granted := acquire(t, s, name, carol, longTTL)
	if granted {
		t.Fatalf("carol was granted a lease handed to bob: %s", fmtLease(l))
	}
	if l.Held() || l.Successor != bob.ID || l.Reserved <= 0 || l.Reserved > longTTL+clockSlack || l.Term != held.Term {
		t.Fatalf("a lease handed to bob, as carol's acquire reports it = %s; want not held, term %d, reserved for bob for at most %v", fmtLease(l), held.Term, longTTL)
	}
	_, err := s.Renew(t.Context(), name, alice.Token, held.Term, longTTL)
	wantLost(t, err, "renewal of a lease handed over")
	l = mustGrant(t, s, name, bob, longTTL)
	if l.Term != held.Term+1 || l.Reason != leader.GrantTransfer {
		t.Fatalf("bob's grant of the lease handed to him = %s; want term %d, reason %q", fmtLease(l), held.Term+1, leader.GrantTransfer)
	}
	checkHeld(t, "Observe after the successor took the lease", observe(t, s, name), name, bob.ID, held.Term+1, longTTL)
	if o := observe(t, s, name); o.Successor != "" || o.Reason != leader.GrantTransfer {
		t.Fatalf("Observe after the successor took the lease = %s; want no successor, reason %q", fmtLease(o), leader.GrantTransfer)
	}

	// Handed on again, for priority: the reason is the handover's.
	mustReleaseTo(t, ts, name, bob, held.Term+1, carol, leader.GrantPriority, longTTL)
	if l := mustGrant(t, s, name, carol, longTTL); l.Term != held.Term+2 || l.Reason != leader.GrantPriority {
		t.Fatalf("carol's grant of the lease handed to her for priority = %s; want term %d, reason %q", fmtLease(l), held.Term+2, leader.GrantPriority)
	}
}

func testReleaseToGone(t *testing.T, s leader.Store) {
	ts := transferer(t, s)
	// An early grant answered later than the reservation may have run out
	// cannot be judged: on a machine too busy for that, the case runs again
	// with a new name, up to three times.
	const attempts = 3
	for i := 1; !releaseToGoneOnce(t, s, ts); i++ {
		if i == attempts {
			t.Fatalf("%d times, an Acquire right after a handover to a gone successor for %v was answered too late to judge whether it came within the reservation", attempts, shortTTL)
		}
		t.Logf("attempt %d: an Acquire right after the handover was answered too late to judge; again with a new name", i)
	}
}

// releaseToGoneOnce runs testReleaseToGone once, on a new name. It reports
// false, having judged nothing, if an Acquire made right after the handover
// was granted but answered so late that the reservation may have run out
// by then.
func releaseToGoneOnce(t *testing.T, s leader.Store, ts leader.Transferer) bool {
	t.Helper()
	name := newName()
	alice, ghost, carol := newCandidate("alice"), newCandidate("ghost"), newCandidate("carol")
	held := mustGrant(t, s, name, alice, longTTL)
	// The reservation starts as the store handles ReleaseTo, no earlier
	// than its call: a grant answered less than shortTTL after the call
	// came before the reservation ran out. (Counted from ReleaseTo's
	// return, a grant in time could seem early by as long as ReleaseTo
	// took.)
	reserved := time.Now()
	within := func() bool { return time.Since(reserved) < shortTTL-clockSlack }
	mustReleaseTo(t, ts, name, alice, held.Term, ghost, leader.GrantTransfer, shortTTL)
	if l, granted := acquire(t, s, name, carol, longTTL); granted {
		if !within() {
			return false
		}
		t.Fatalf("carol was granted a lease handed to ghost before its reservation ran out (%v after the ReleaseTo call, reserved for %v): %s", time.Since(reserved), shortTTL, fmtLease(l))
	}
	// The holder cannot take it back either: it is released.
	if l, granted := acquire(t, s, name, alice, longTTL); granted {
		if !within() {
			return false
		}
		t.Fatalf("alice was granted the lease she handed to ghost, before its reservation ran out (%v after the ReleaseTo call, reserved for %v): %s", time.Since(reserved), shortTTL, fmtLease(l))
	}
	deadline := time.Now().Add(shortTTL + waitTimeout)
	for {
		l, granted := acquire(t, s, name, carol, longTTL)
		if granted {
			if within() {
				t.Fatalf("carol was granted the lease %v after it was handed to ghost for %v (counted from the ReleaseTo call)", time.Since(reserved), shortTTL)
			}
			if l.Term != held.Term+1 || l.Reason != leader.GrantRelease {
				t.Fatalf("carol's grant once ghost's reservation ran out = %s; want term %d, reason %q", fmtLease(l), held.Term+1, leader.GrantRelease)
			}
			return true
		}
		if time.Now().After(deadline) {
			t.Fatalf("carol was not granted the lease within %v of its handover to ghost for %v: %s", waitTimeout, shortTTL, fmtLease(l))
		}
		time.Sleep(pollEvery)
	}
}

func testReleaseToRacingExpiry(t *testing.T, s leader.Store) {
	ts := transferer(t, s)
	name := newName()
	alice, bob, carol := newCandidate("alice"), newCandidate("bob"), newCandidate("carol")
	held := mustGrant(t, s, name, alice, shortTTL)
	waitFree(t, s, name, shortTTL)
	ctx, cancel := callCtx(t)
	defer cancel()
	wantLost(t, ts.ReleaseTo(ctx, name, alice.Token, held.Term, bob, leader.GrantTransfer, longTTL), "handover of an expired lease")
	wantLost(t, ts.ReleaseTo(ctx, name, carol.Token, held.Term, bob, leader.GrantTransfer, longTTL), "handover with another token")
	if o := observe(t, s, name); o.Successor != "" || o.Held() {
		t.Fatalf("Observe after a refused handover = %s; want free, reserved for nobody", fmtLease(o))
	}
	l := mustGrant(t, s, name, carol, longTTL)
	if l.Term != held.Term+1 || l.Reason != leader.GrantExpiry {
		t.Fatalf("carol's grant after a refused handover of an expired lease = %s; want term %d, reason %q", fmtLease(l), held.Term+1, leader.GrantExpiry)
	}
	wantLost(t, ts.ReleaseTo(ctx, name, carol.Token, held.Term, bob, leader.GrantTransfer, longTTL), "handover with a stale term")
	checkHeld(t, "Observe after a handover with a stale term", observe(t, s, name), name, carol.ID, held.Term+1, longTTL)
}

func testTransferRequest(t *testing.T, s leader.Store) {
	ts := transferer(t, s)
	name := newName()
	alice, bob := newCandidate("alice"), newCandidate("bob")
	if _, err := request(t, ts, name, leader.TransferRequest{Reason: leader.GrantTransfer}, longTTL); !errors.Is(err, leader.ErrNoLeader) {
		t.Fatalf("request to hand over a lease never granted: %v; want an error wrapping ErrNoLeader", err)
	}
	held := mustGrant(t, s, name, alice, longTTL)
	if l := observe(t, s, name); l.Transfer.Pending() {
		t.Fatalf("a new grant reports a pending request: %+v", l.Transfer)
	}
	l, err := request(t, ts, name, leader.TransferRequest{To: bob.ID, Reason: leader.GrantTransfer}, longTTL)
	if err != nil {
		t.Fatalf("RequestTransfer: %v", err)
	}
	check := func(what string, l leader.Lease, to string, why leader.GrantReason, ttl time.Duration) {
		t.Helper()
		if r := l.Transfer; r.To != to || r.Reason != why || !r.Pending() || r.Remaining > ttl+clockSlack {
			t.Fatalf("%s reports the request %+v; want to %q, reason %q, pending for at most %v", what, r, to, why, ttl)
		}
	}
	check("RequestTransfer", l, bob.ID, leader.GrantTransfer, longTTL)
	check("Observe", observe(t, s, name), bob.ID, leader.GrantTransfer, longTTL)
	check("Renew", mustRenew(t, s, name, alice, held.Term, longTTL), bob.ID, leader.GrantTransfer, longTTL)
	// Replaced by a later one; cleared by one with ttl 0.
	if _, err := request(t, ts, name, leader.TransferRequest{Reason: leader.GrantPriority}, longTTL); err != nil {
		t.Fatalf("RequestTransfer: %v", err)
	}
	check("Observe after a second request", observe(t, s, name), "", leader.GrantPriority, longTTL)
	if _, err := request(t, ts, name, leader.TransferRequest{}, 0); err != nil {
		t.Fatalf("RequestTransfer with ttl 0: %v", err)
	}
	if l := observe(t, s, name); l.Transfer.Pending() {
		t.Fatalf("Observe after a request with ttl 0 reports the request %+v; want none", l.Transfer)
	}
	// Lapses.
	if _, err := request(t, ts, name, leader.TransferRequest{Reason: leader.GrantTransfer}, shortTTL); err != nil {
		t.Fatalf("RequestTransfer: %v", err)
	}
	time.Sleep(shortTTL + clockSlack)
	if l := mustRenew(t, s, name, alice, held.Term, longTTL); l.Transfer.Pending() {
		t.Fatalf("a renewal after the request's ttl reports it pending: %+v", l.Transfer)
	}
	// Ended by a grant (the holder's own, here) and by a handover.
	if _, err := request(t, ts, name, leader.TransferRequest{Reason: leader.GrantTransfer}, longTTL); err != nil {
		t.Fatalf("RequestTransfer: %v", err)
	}
	again := mustGrant(t, s, name, alice, longTTL)
	if again.Transfer.Pending() || observe(t, s, name).Transfer.Pending() {
		t.Fatalf("a grant did not end the pending request: %s", fmtLease(again))
	}
	if _, err := request(t, ts, name, leader.TransferRequest{To: bob.ID, Reason: leader.GrantTransfer}, longTTL); err != nil {
		t.Fatalf("RequestTransfer: %v", err)
	}
	mustReleaseTo(t, ts, name, alice, again.Term, bob, leader.GrantTransfer, longTTL)
	if l := mustGrant(t, s, name, bob, longTTL); l.Transfer.Pending() {
		t.Fatalf("the successor's grant reports the request its predecessor acted on: %+v", l.Transfer)
	}
}

func testConcurrentRequests(t *testing.T, s leader.Store) {
	ts := transferer(t, s)
	name := newName()
	alice := newCandidate("alice")
	held := mustGrant(t, s, name, alice, longTTL)
	const n = 8
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			ctx, cancel := callCtx(t)
			defer cancel()
			_, err := ts.RequestTransfer(ctx, name, leader.TransferRequest{To: fmt.Sprint("c", i), Reason: leader.GrantTransfer}, longTTL)
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("concurrent RequestTransfer: %v", err)
		}
	}
	l := mustRenew(t, s, name, alice, held.Term, longTTL)
	var to int
	if _, err := fmt.Sscanf(l.Transfer.To, "c%d", &to); err != nil || !l.Transfer.Pending() || to < 0 || to >= n {
		t.Fatalf("after %d concurrent requests the renewal reports %+v; want one of them pending", n, l.Transfer)
	}
	successor := newCandidate(l.Transfer.To)
	mustReleaseTo(t, ts, name, alice, held.Term, successor, leader.GrantTransfer, longTTL)
	got := mustGrant(t, s, name, successor, longTTL)
	if got.Term != held.Term+1 || got.Transfer.Pending() {
		t.Fatalf("the successor's grant = %s; want term %d and no request pending", fmtLease(got), held.Term+1)
	}
}
