package postgres

import (
	"errors"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/pgtest"
)

// TestAdvisoryStagedHandover checks a prepared handover's staged release
// (advisoryPrepared.Stage): once staged, nobody sees the lease released
// (Observe, the row and the lock name the holder, and the waiting
// successor waits on), and the holder's Renew is refused without losing
// the session; Commit then grants the successor the next term, made by
// the staged release; Abort leaves the lease as it was, held and
// renewable, and the successor refused; and a Commit for another reason
// than the staged one aborts.
func TestAdvisoryStagedHandover(t *testing.T) {
	t.Parallel()
	const ttl = time.Minute
	// staged prepares and stages a handover of name from alice to bob,
	// whose Acquire waits for it, and checks what nobody may see yet.
	staged := func(t *testing.T, name string) (a, succ *AdvisoryStore, p *advisoryPrepared, l leader.Lease, alicePID int32, done <-chan acquired) {
		t.Helper()
		pool := pgtest.NewPool(t)
		a = setupAdvisory(t, pool, Options{})
		succ = setupAdvisory(t, pool, Options{})
		alice, bob := candidate("alice"), candidate("bob")
		l = mustGrant(t, a, name, alice, ttl)
		alicePID = sessionPID(t, a, name, alice)
		done = acquireOnNotice(t, succ, name, bob, ttl)
		hp, err := a.PrepareHandover(callCtx(t), name, alice.Token, l.Term, bob, 10*time.Second)
		if err != nil {
			t.Fatalf("PrepareHandover: %v", err)
		}
		p = hp.(*advisoryPrepared)
		if !p.waited || p.waiter == 0 {
			t.Fatalf("PrepareHandover returned with waited %v, waiter %d; want the successor's session found waiting", p.waited, p.waiter)
		}
		if err := p.Stage(callCtx(t), leader.GrantTransfer, ttl); err != nil {
			t.Fatalf("Stage: %v", err)
		}
		if o := mustObserve(t, a, name); o.HolderID != "alice" || o.Term != l.Term {
			t.Fatalf("Observe once staged: %+v; want alice's, term %d", o, l.Term)
		}
		if row := readAdvisoryRow(t, pool, a.opts, name); deref(row.holderToken) != alice.Token || row.term != int64(l.Term) {
			t.Fatalf("the row once staged: %+v; want alice's, term %d", row, l.Term)
		}
		if _, err := a.Renew(callCtx(t), name, alice.Token, l.Term, ttl); err == nil || !errors.Is(err, errStaged) {
			t.Fatalf("Renew once staged: %v; want it refused (errStaged)", err)
		}
		if lock, mark := locksOf(t, pool, a.Key(name), alicePID); !lock || !mark {
			t.Fatalf("once staged and renewed, alice's session holds the lock %v, its mark %v; want both", lock, mark)
		}
		select {
		case r := <-done:
			t.Fatalf("the successor's Acquire returned once staged: %+v", r)
		case <-time.After(100 * time.Millisecond):
		}
		if err := p.Stage(callCtx(t), leader.GrantTransfer, ttl); err == nil {
			t.Fatal("a second Stage succeeded")
		}
		return a, succ, p, l, alicePID, done
	}

	t.Run("committed", func(t *testing.T) {
		t.Parallel()
		a, _, p, l, _, done := staged(t, "c")
		if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
			t.Fatalf("Commit: %v", err)
		}
		r := await(t, done)
		if r.err != nil || !r.granted || r.lease.Term != l.Term+1 || r.lease.HolderID != "bob" || r.lease.Reason != leader.GrantTransfer {
			t.Fatalf("the successor's Acquire: %+v granted %v err %v; want bob granted term %d for a transfer", r.lease, r.granted, r.err, l.Term+1)
		}
		if o := mustObserve(t, a, "c"); o.HolderID != "bob" || o.Term != l.Term+1 {
			t.Fatalf("Observe after the commit: %+v; want bob's, term %d", o, l.Term+1)
		}
		if _, err := a.Renew(callCtx(t), "c", p.token, l.Term, ttl); !errors.Is(err, leader.ErrLeaseLost) {
			t.Fatalf("alice's Renew after the commit: %v; want ErrLeaseLost", err)
		}
	})
	t.Run("aborted", func(t *testing.T) {
		t.Parallel()
		a, _, p, l, alicePID, done := staged(t, "a")
		p.Abort()
		r := await(t, done)
		if r.err != nil || r.granted {
			t.Fatalf("the successor's Acquire after the abort: %+v granted %v err %v; want refused", r.lease, r.granted, r.err)
		}
		if o := mustObserve(t, a, "a"); o.HolderID != "alice" || o.Term != l.Term {
			t.Fatalf("Observe after the abort: %+v; want alice's, term %d", o, l.Term)
		}
		if _, err := a.Renew(callCtx(t), "a", p.token, l.Term, ttl); err != nil {
			t.Fatalf("alice's Renew after the abort: %v", err)
		}
		if lock, mark := locksOf(t, a.pool, a.Key("a"), alicePID); !lock || !mark {
			t.Fatalf("after the abort, alice's session holds the lock %v, its mark %v; want both", lock, mark)
		}
		if err := a.Release(callCtx(t), "a", p.token, l.Term); err != nil {
			t.Fatalf("alice's Release after the abort: %v", err)
		}
	})
	t.Run("committed for another reason", func(t *testing.T) {
		t.Parallel()
		a, _, p, l, _, done := staged(t, "r")
		if err := p.Commit(callCtx(t), leader.GrantPriority, ttl); err == nil {
			t.Fatal("Commit for another reason than the staged one succeeded")
		}
		if r := await(t, done); r.err != nil || r.granted {
			t.Fatalf("the successor's Acquire: %+v granted %v err %v; want refused", r.lease, r.granted, r.err)
		}
		if _, err := a.Renew(callCtx(t), "r", p.token, l.Term, ttl); err != nil {
			t.Fatalf("alice's Renew after the refused commit: %v", err)
		}
	})
}
