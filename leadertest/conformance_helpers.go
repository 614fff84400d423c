package leadertest

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/leaderelect/leader"
)

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
	return fmt.Sprintf("Lease{Name:%q HolderID:%q Term:%d Remaining:%v AcquiredAt:%v ExpiresAt:%v Priority:%d Reason:%q Transfer:%+v Successor:%q Reserved:%v}",
		l.Name, l.HolderID, l.Term, l.Remaining, l.AcquiredAt.Format(time.RFC3339Nano), l.ExpiresAt.Format(time.RFC3339Nano),
		l.Priority, l.Reason, l.Transfer, l.Successor, l.Reserved)
}
