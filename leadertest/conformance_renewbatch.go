package leadertest

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/leaderelect/leader"
)

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
	const grantTTL = 10 * time.Second // far shorter than longTTL; not run out before the renewal
	a, b, stale, other, released, never := newName(), newName(), newName(), newName(), newName(), newName()
	la := mustGrant(t, s, a, alice, grantTTL)
	lb := mustGrant(t, s, b, bob, grantTTL)
	old := mustGrant(t, s, stale, alice, longTTL)
	const heldTTL = 20 * time.Second // a refused renewal with longTTL would exceed it; the test takes far less
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
