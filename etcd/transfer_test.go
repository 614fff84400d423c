package etcd_test

import (
	"errors"
	"testing"
	"time"

	"github.com/leaderelect/leader"
)

// A reservation is a key on a lease of the hold: when etcd ends it unused,
// the lease is an ordinary released one, and free-watchers wake for it.
func TestAReservationRunningOutWakesFreeWatchers(t *testing.T) {
	t.Parallel()
	const hold = 500 * time.Millisecond
	s := newStore(t, newClient(t, nil))
	alice, ghost, carol := newCandidate("alice"), newCandidate("ghost"), newCandidate("carol")
	held := mustGrant(t, s, "job", alice, time.Minute)
	free, err := s.WatchFree(t.Context(), "job")
	if err != nil {
		t.Fatal(err)
	}
	if err := s.ReleaseTo(callCtx(t), "job", alice.Token, held.Term, ghost, leader.GrantTransfer, hold); err != nil {
		t.Fatal(err)
	}
	released := time.Now()
	select {
	case <-free: // the release
	case <-time.After(waitTimeout):
		t.Fatal("no wake-up for the handover's release")
	}
	l, granted, err := s.Acquire(callCtx(t), "job", carol, time.Minute)
	if err != nil || granted || l.Successor != ghost.ID || l.Reserved <= 0 || l.Reserved > hold {
		t.Fatalf("carol's Acquire of a lease reserved for ghost: granted %v, %v: %+v", granted, err, l)
	}
	select {
	case <-free:
		if since := time.Since(released); since < hold {
			t.Fatalf("free-watcher woke %v after a handover with a hold of %v", since, hold)
		}
		t.Logf("the reservation ran out %v after the handover (hold %v)", time.Since(released), hold)
	case <-time.After(waitTimeout):
		t.Fatal("no wake-up when the reservation ran out")
	}
	l = mustGrant(t, s, "job", carol, time.Minute)
	if l.Term != held.Term+1 || l.Reason != leader.GrantRelease {
		t.Fatalf("carol's grant after the reservation ran out = %+v; want term %d, reason %q", l, held.Term+1, leader.GrantRelease)
	}
}

// An Acquire refused costs one request, which also enlists the candidate;
// a grant costs a read, a keep-alive of the shared lease and a write.
func TestWhatEachCallCosts(t *testing.T) {
	t.Parallel()
	var n counts
	s := newStore(t, newClient(t, &n))
	alice, bob := newCandidate("alice"), newCandidate("bob")
	mustGrant(t, s, "warm-up", alice, time.Minute) // grants the leases
	if l, granted, err := s.Acquire(callCtx(t), "warm-up", bob, time.Minute); err != nil || granted {
		t.Fatalf("bob's Acquire: granted %v, %v: %+v", granted, err, l)
	}

	unary, ka := n.unary.Load(), n.keepAlives.Load()
	held := mustGrant(t, s, "job", alice, time.Minute)
	if u, k := n.unary.Load()-unary, n.keepAlives.Load()-ka; u != 2 || k != 1 {
		t.Errorf("a grant sent %d requests and %d keep-alives; want 2 and 1", u, k)
	}
	unary, ka = n.unary.Load(), n.keepAlives.Load()
	if l, granted, err := s.Acquire(callCtx(t), "job", bob, time.Minute); err != nil || granted {
		t.Fatalf("bob's Acquire: granted %v, %v: %+v", granted, err, l)
	}
	if u, k := n.unary.Load()-unary, n.keepAlives.Load()-ka; u != 1 || k != 0 {
		t.Errorf("a refused Acquire sent %d requests and %d keep-alives; want 1 and 0", u, k)
	}
	unary = n.unary.Load()
	if err := s.Release(callCtx(t), "job", alice.Token, held.Term); err != nil {
		t.Fatal(err)
	}
	if u := n.unary.Load() - unary; u != 1 {
		t.Errorf("a release sent %d requests; want 1", u)
	}
}

// Names are escaped into keys, so that no name's keys are among
// another's.
func TestNamesThatLookLikeKeysAreIndependent(t *testing.T) {
	t.Parallel()
	s := newStore(t, newClient(t, nil))
	names := []string{"a", "a/holder", "a%2Fholder", "a/candidates/x", "names/a", "..", "ü b"}
	var terms []uint64
	for _, name := range names {
		l := mustGrant(t, s, name, newCandidate("alice"), time.Minute)
		terms = append(terms, l.Term)
	}
	for i, name := range names {
		if terms[i] != 1 {
			t.Errorf("first grant of %q has term %d; want 1", name, terms[i])
		}
		l, err := s.Observe(callCtx(t), name)
		if err != nil || !l.Held() || l.Term != 1 {
			t.Errorf("Observe(%q) = %+v, %v; want held with term 1", name, l, err)
		}
	}
}

// F5: Lease.Reserved reports what remains of the hold, not the hold.
func TestReservedIsWhatRemainsOfTheHold(t *testing.T) {
	t.Parallel()
	const hold = 3 * time.Second
	s := newStore(t, newClient(t, nil))
	alice, bob := newCandidate("alice"), newCandidate("bob")
	l := mustGrant(t, s, "job", alice, time.Minute)
	if err := s.ReleaseTo(callCtx(t), "job", alice.Token, l.Term, bob, leader.GrantTransfer, hold); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	o, err := s.Observe(callCtx(t), "job")
	if err != nil {
		t.Fatal(err)
	}
	if o.Successor != bob.ID || o.Reserved <= 0 || o.Reserved > hold-900*time.Millisecond {
		t.Fatalf("a second after a handover with a hold of %v: %+v; want reserved for bob, with at most %v left", hold, o, hold-time.Second)
	}
}

// F5: a handover that fails (here, the lease is not held under that
// term) revokes the lease it granted for the reservation.
func TestAFailedHandoverRevokesItsReservationsLease(t *testing.T) {
	t.Parallel()
	const hold = 97 * time.Second // no other test's lease has this TTL
	cli := newClient(t, nil)
	s := newStore(t, cli)
	alice, bob := newCandidate("alice"), newCandidate("bob")
	l := mustGrant(t, s, "job", alice, time.Minute)
	if err := s.ReleaseTo(callCtx(t), "job", alice.Token, l.Term+1, bob, leader.GrantTransfer, hold); !errors.Is(err, leader.ErrLeaseLost) {
		t.Fatalf("handover under a term not held: %v; want ErrLeaseLost", err)
	}
	for deadline := time.Now().Add(waitTimeout); ; time.Sleep(50 * time.Millisecond) {
		resp, err := cli.Leases(callCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		left := 0
		for _, ls := range resp.Leases {
			if ttl, err := cli.TimeToLive(callCtx(t), ls.ID); err == nil && ttl.GrantedTTL == int64(hold/time.Second) {
				left++
			}
		}
		if left == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d leases of %v left %v after the failed handover", left, hold, waitTimeout)
		}
	}
}
