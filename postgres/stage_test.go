package postgres

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leaderelect/leader"
)

// TestLeaseStagedHandover checks the LeaseStore's staged release
// (preparedHandover.Stage): once staged, nobody sees the lease released
// or granted (Observe names the holder, the waiting successor waits on),
// and Commit makes the grant visible, which the successor's waiting
// statement only reads (claimStaged), with the next term; a fenced write
// of the old term while staged neither waits for the staged release nor
// commits after it; a fenced transaction open before Stage declines it;
// Abort leaves the lease held and renewable; a Commit later than half of
// the hold releases afresh; and a lease whose TTL the store does not know
// (it neither granted nor renewed it) is not staged.
func TestLeaseStagedHandover(t *testing.T) {
	t.Parallel()
	const ttl = time.Minute
	alice, bob := candidate("alice"), candidate("bob")
	// prepared grants name to alice, under her store's heartbeat, and
	// prepares its handover to bob, whose Acquire waits for it.
	// preparedWith is prepared with the successor's TTL succTTL, whose
	// quarter its wait for the handover lasts at most.
	preparedWith := func(t *testing.T, name string, succTTL time.Duration) (a testBundle, succ *positioned, p *preparedHandover, l leader.Lease) {
		t.Helper()
		a = setup(t)
		l = mustGrant(t, a.store, name, alice, ttl)
		mustRenewBatch(t, a.store, renewals(alice, ttl, l))
		succ = position(t, a, name, bob, succTTL)
		p = mustPrepare(t, a.store, name, alice, l.Term, bob)
		return a, succ, p, l
	}
	prepared := func(t *testing.T, name string) (a testBundle, succ *positioned, p *preparedHandover, l leader.Lease) {
		t.Helper()
		return preparedWith(t, name, ttl)
	}
	// staged is prepared, staged with hold.
	staged := func(t *testing.T, name string, hold time.Duration) (a testBundle, succ *positioned, p *preparedHandover, l leader.Lease) {
		t.Helper()
		a, succ, p, l = prepared(t, name)
		if err := p.Stage(callCtx(t), leader.GrantTransfer, hold); err != nil {
			t.Fatalf("Stage: %v", err)
		}
		if !p.staged {
			t.Fatal("Stage returned without staging the release")
		}
		if o := mustObserve(t, a.store, name); o.HolderID != "alice" || o.Term != l.Term {
			t.Fatalf("Observe once staged: %+v; want alice's, term %d", o, l.Term)
		}
		time.Sleep(50 * time.Millisecond)
		succ.notReturned(t, "once staged")
		if err := p.Stage(callCtx(t), leader.GrantTransfer, hold); err == nil {
			t.Fatal("a second Stage succeeded")
		}
		return a, succ, p, l
	}
	granted := func(t *testing.T, succ *positioned, term uint64) acquireResult {
		t.Helper()
		r := succ.result(t)
		if !r.granted || r.lease.Term != term || r.lease.HolderID != "bob" || r.lease.Reason != leader.GrantTransfer {
			t.Fatalf("the successor's Acquire: %+v granted %v; want bob granted term %d for a transfer", r.lease, r.granted, term)
		}
		return r
	}

	t.Run("committed", func(t *testing.T) {
		t.Parallel()
		a, succ, p, l := staged(t, "c", ttl)
		waited, claimed := succ.b.store.waitedGrants.Load(), succ.b.store.stagedClaims.Load()
		if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
			t.Fatalf("Commit: %v", err)
		}
		r := granted(t, succ, l.Term+1)
		if r.lease.Remaining <= 0 || r.lease.Remaining > ttl {
			t.Fatalf("the successor's lease has %v left; want up to its TTL, %v", r.lease.Remaining, ttl)
		}
		if got := succ.b.store.stagedClaims.Load() - claimed; got != 1 {
			t.Fatalf("the successor's Acquire claimed %d staged grants; want its own, read", got)
		}
		if got := succ.b.store.waitedGrants.Load() - waited; got != 1 {
			t.Fatalf("the successor's Acquire was granted %d times after waiting; want 1", got)
		}
		if o := mustObserve(t, a.store, "c"); o.HolderID != "bob" || o.Term != l.Term+1 {
			t.Fatalf("Observe after the commit: %+v; want bob's, term %d", o, l.Term+1)
		}
		if _, err := succ.b.store.Renew(callCtx(t), "c", bob.Token, l.Term+1, ttl); err != nil {
			t.Fatalf("the successor's Renew: %v", err)
		}
		if _, err := a.store.Renew(callCtx(t), "c", alice.Token, l.Term, ttl); !errors.Is(err, leader.ErrLeaseLost) {
			t.Fatalf("alice's Renew after the commit: %v; want ErrLeaseLost", err)
		}
	})
	t.Run("the commit's statement planned before the gap", func(t *testing.T) {
		// PrepareHandover plans the staged commit's statement (a generic
		// plan, kept with the prepared statement), so that the commit
		// does not plan it between OnDemoted and the successor's grant.
		t.Parallel()
		_, _, p, _ := prepared(t, "plan")
		conn := p.conn.Conn()
		var version int
		if err := conn.QueryRow(callCtx(t), "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
			t.Fatal(err)
		}
		if version < 140000 {
			t.Skip("pg_prepared_statements.generic_plans is PostgreSQL 14's")
		}
		var plans int64
		if err := conn.QueryRow(callCtx(t), "SELECT generic_plans FROM pg_prepared_statements WHERE name = $1",
			handoverStagedUnlockStmt).Scan(&plans); err != nil {
			t.Fatalf("the staged commit's statement on the preparation's connection: %v", err)
		}
		if plans < 1 {
			t.Fatalf("the staged commit's statement has %d generic plans after PrepareHandover; want it planned", plans)
		}
		p.Abort()
	})
	t.Run("aborted", func(t *testing.T) {
		t.Parallel()
		a, succ, p, l := staged(t, "a", ttl)
		p.Abort()
		if r := succ.result(t); r.granted {
			t.Fatalf("the successor's Acquire after the abort: %+v; want refused", r.lease)
		}
		if o := mustObserve(t, a.store, "a"); o.HolderID != "alice" || o.Term != l.Term {
			t.Fatalf("Observe after the abort: %+v; want alice's, term %d", o, l.Term)
		}
		if _, err := a.store.Renew(callCtx(t), "a", alice.Token, l.Term, ttl); err != nil {
			t.Fatalf("alice's Renew after the abort: %v", err)
		}
	})
	t.Run("a fenced write while staged", func(t *testing.T) {
		t.Parallel()
		a, succ, p, l := staged(t, "f", ttl)
		ctx := callCtx(t)
		tx, err := a.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		fenced := make(chan error, 1)
		go func() { fenced <- Fence(ctx, tx, a.store.opts, "f", l.Term) }()
		select {
		case err := <-fenced:
			if err != nil {
				t.Fatalf("Fence with the old term while staged: %v; want it to hold", err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("Fence with the old term while staged did not return: it waits for the staged release")
		}
		committed := make(chan error, 1)
		go func() { committed <- p.Commit(callCtx(t), leader.GrantTransfer, ttl) }()
		select {
		case err := <-committed:
			t.Fatalf("Commit returned while a fenced transaction of the old term was open: %v", err)
		case <-time.After(300 * time.Millisecond):
		}
		succ.notReturned(t, "while a fenced transaction of the old term was open")
		if err := tx.Commit(ctx); err != nil {
			t.Fatalf("committing the fenced transaction: %v", err)
		}
		if err := <-committed; err != nil {
			t.Fatalf("Commit: %v", err)
		}
		granted(t, succ, l.Term+1)
		for _, c := range []struct {
			term uint64
			held bool
		}{{l.Term, false}, {l.Term + 1, true}} {
			tx, err := a.pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			err = Fence(ctx, tx, a.store.opts, "f", c.term)
			tx.Rollback(ctx)
			if (err == nil) != c.held {
				t.Fatalf("Fence with term %d after the commit: %v; want it to hold: %v", c.term, err, c.held)
			}
		}
	})
	t.Run("a repeatable read snapshot from before the commit", func(t *testing.T) {
		t.Parallel()
		a, succ, p, l := staged(t, "rr", ttl)
		ctx := callCtx(t)
		tx, err := a.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, "SELECT 1"); err != nil {
			t.Fatal(err)
		}
		if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
			t.Fatalf("Commit: %v", err)
		}
		granted(t, succ, l.Term+1)
		err = Fence(ctx, tx, a.store.opts, "rr", l.Term)
		if err == nil || (!errors.Is(err, leader.ErrLeaseLost) && sqlState(err) != "40001") {
			t.Fatalf("Fence with the old term on a snapshot from before the commit: %v; want ErrLeaseLost or a serialization failure", err)
		}
	})
	t.Run("declined under a fenced transaction", func(t *testing.T) {
		t.Parallel()
		a, succ, p, l := prepared(t, "d")
		ctx := callCtx(t)
		tx, err := a.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if err := Fence(ctx, tx, a.store.opts, "d", l.Term); err != nil {
			t.Fatalf("Fence: %v", err)
		}
		if err := p.Stage(callCtx(t), leader.GrantTransfer, ttl); err != nil {
			t.Fatalf("Stage under a fenced transaction: %v; want it declined without an error", err)
		}
		if p.staged {
			t.Fatal("Stage staged the release under an open fenced transaction")
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatalf("committing the fenced transaction: %v", err)
		}
		if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
			t.Fatalf("Commit: %v", err)
		}
		granted(t, succ, l.Term+1)
	})
	t.Run("declined while a transaction holds the staged lock", func(t *testing.T) {
		// The staged lock alone, held in shared mode (as a fenced
		// transaction holds it), declines the staging.
		t.Parallel()
		a, succ, p, l := prepared(t, "sl")
		ctx := callCtx(t)
		tx, err := a.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock_shared($1)", a.store.opts.stagedKey("sl")); err != nil {
			t.Fatal(err)
		}
		if err := p.Stage(callCtx(t), leader.GrantTransfer, ttl); err != nil || p.staged {
			t.Fatalf("Stage while the staged lock is held: staged %v, %v; want it declined", p.staged, err)
		}
		tx.Rollback(ctx)
		if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
			t.Fatalf("Commit: %v", err)
		}
		granted(t, succ, l.Term+1)
	})
	t.Run("a fenced write while staged holds up the grant of a late commit", func(t *testing.T) {
		// A fenced transaction that judged the row while the release was
		// staged (FOR KEY SHARE) is not waited for by the row's lock: a
		// release that is not the staged one's commit (here a Commit
		// past half the hold, which rolls the staged release back and
		// releases afresh) grants only once it has ended (fenceAfterGrant).
		t.Parallel()
		const hold = 400 * time.Millisecond
		a, succ, p, l := staged(t, "lf", hold)
		ctx := callCtx(t)
		tx, err := a.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if err := Fence(ctx, tx, a.store.opts, "lf", l.Term); err != nil {
			t.Fatalf("Fence while staged: %v", err)
		}
		time.Sleep(hold/2 + 50*time.Millisecond)
		// Commit itself waits for the fenced transaction too (its
		// deferred notice locks the row FOR UPDATE), as an unstaged one
		// always did.
		committed := make(chan error, 1)
		go func() { committed <- p.Commit(callCtx(t), leader.GrantTransfer, hold) }()
		time.Sleep(300 * time.Millisecond)
		succ.notReturned(t, "while a fenced transaction of the old term was open")
		if _, err := tx.Exec(ctx, "SELECT 1"); err != nil {
			t.Fatalf("the fenced transaction: %v", err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatalf("committing the fenced transaction: %v", err)
		}
		if err := <-committed; err != nil {
			t.Fatalf("Commit: %v", err)
		}
		granted(t, succ, l.Term+1)
	})
	t.Run("a second fence in a transaction that judged the row while staged", func(t *testing.T) {
		// After the staged release was rolled back (a late commit) and a
		// grant waits for this transaction's fence lock, a second Fence
		// in it judges the row as the first did, without a FOR SHARE that
		// would wait for that grant (a deadlock, which the server would
		// break by failing the grant or the Fence).
		t.Parallel()
		const hold = 400 * time.Millisecond
		a, succ, p, l := staged(t, "twice", hold)
		ctx := callCtx(t)
		tx, err := a.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if err := Fence(ctx, tx, a.store.opts, "twice", l.Term); err != nil {
			t.Fatalf("Fence while staged: %v", err)
		}
		time.Sleep(hold/2 + 50*time.Millisecond)
		committed := make(chan error, 1)
		go func() { committed <- p.Commit(callCtx(t), leader.GrantTransfer, hold) }()
		time.Sleep(300 * time.Millisecond) // the successor's grant waits for the fence lock
		succ.notReturned(t, "while a fenced transaction of the old term was open")
		// The late commit's release (no grant: it waits for no fence) has
		// committed: the second Fence may find the term released, and
		// refuse it; it must neither wait for the grant nor deadlock with
		// it (SQLSTATE 40P01).
		switch err := Fence(ctx, tx, a.store.opts, "twice", l.Term); {
		case err == nil:
			if err := tx.Commit(ctx); err != nil {
				t.Fatalf("committing the fenced transaction: %v", err)
			}
		case errors.Is(err, leader.ErrLeaseLost):
			tx.Rollback(ctx)
		default:
			t.Fatalf("the second Fence: %v", err)
		}
		if err := <-committed; err != nil {
			t.Fatalf("Commit: %v", err)
		}
		granted(t, succ, l.Term+1)
	})
	t.Run("a successor with a longer TTL is not held to the holder's", func(t *testing.T) {
		// The staged grant has the holder's TTL; a successor whose own
		// is longer does not claim it, and is granted again for its own.
		t.Parallel()
		a := setup(t)
		l := mustGrant(t, a.store, "ttl", alice, ttl)
		succ := position(t, a, "ttl", bob, 2*ttl)
		p := mustPrepare(t, a.store, "ttl", alice, l.Term, bob)
		if err := p.Stage(callCtx(t), leader.GrantTransfer, ttl); err != nil || !p.staged {
			t.Fatalf("Stage: staged %v, %v", p.staged, err)
		}
		claimed := succ.b.store.stagedClaims.Load()
		if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
			t.Fatalf("Commit: %v", err)
		}
		r := succ.result(t)
		if !r.granted || r.lease.HolderID != "bob" || r.lease.Remaining <= ttl+ttl/2 {
			t.Fatalf("the successor's Acquire: %+v granted %v; want bob granted for its own TTL, %v", r.lease, r.granted, 2*ttl)
		}
		if got := succ.b.store.stagedClaims.Load() - claimed; got != 0 {
			t.Fatalf("the successor claimed %d staged grants of the holder's shorter TTL; want none", got)
		}
	})
	t.Run("another candidate's attempt while staged is refused without waiting", func(t *testing.T) {
		// An attempt that finds the lease held in its snapshot refuses
		// without locking the row: it does not wait for the staged
		// release's row lock, to run beside the successor once the
		// commit lets both go. It reports the holder its snapshot saw.
		t.Parallel()
		a, succ, p, l := staged(t, "other", ttl)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		carol := candidate("carol")
		got, ok, err := a.store.Acquire(ctx, "other", carol, ttl)
		if err != nil || ok || got.HolderID != "alice" || got.Term != l.Term || got.Remaining <= 0 {
			t.Fatalf("carol's Acquire while staged: %+v granted %v, %v; want refused at once, alice's term %d", got, ok, err, l.Term)
		}
		succ.notReturned(t, "after carol's attempt")
		if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
			t.Fatalf("Commit: %v", err)
		}
		granted(t, succ, l.Term+1)
		got, ok, err = a.store.Acquire(callCtx(t), "other", carol, ttl)
		if err != nil || ok || got.HolderID != "bob" || got.Term != l.Term+1 {
			t.Fatalf("carol's Acquire after the commit: %+v granted %v, %v; want refused, bob's term %d", got, ok, err, l.Term+1)
		}
	})
	t.Run("a successor whose wait ran out waits for the staged release's row", func(t *testing.T) {
		// The successor's wait for the prepared handover (a quarter of
		// its TTL) runs out before the commit: its attempt after it must
		// wait for the row's lock, and be granted once the staged
		// release commits, not be refused from its snapshot (which shows
		// alice) and left to learn of its grant only when alice's lease
		// would have run out.
		t.Parallel()
		a, succ, p, l := preparedWith(t, "ran-out", 2*time.Second) // a wait of 500 ms
		if err := p.Stage(callCtx(t), leader.GrantTransfer, ttl); err != nil || !p.staged {
			t.Fatalf("Stage: %v (staged %v)", err, p.staged)
		}
		awaitRowWait(t, a, func() { succ.notReturned(t, "once its wait ran out, before the commit") })
		if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
			t.Fatalf("Commit: %v", err)
		}
		r := succ.result(t)
		if !r.granted || r.lease.HolderID != "bob" || r.lease.Term <= l.Term {
			t.Fatalf("the successor's Acquire after the commit: %+v granted %v; want bob granted a term above %d", r.lease, r.granted, l.Term)
		}
	})
	t.Run("not staged once the successor's wait ran out", func(t *testing.T) {
		// The successor's wait for the prepared handover runs out before
		// Stage: its attempt was refused (the row not yet locked), and
		// no notice would tell it of a staged grant. Stage declines, and
		// Commit releases as unstaged, whose deferred notice wakes it.
		t.Parallel()
		a, succ, p, _ := preparedWith(t, "gone-by", 2*time.Second) // a wait of 500 ms
		if r := succ.result(t); r.granted {
			t.Fatalf("the successor's Acquire before the release: %+v granted", r.lease)
		}
		if err := p.Stage(callCtx(t), leader.GrantTransfer, ttl); err != nil {
			t.Fatalf("Stage: %v", err)
		}
		if p.staged {
			t.Fatal("Stage staged the release although the successor no longer waited for it")
		}
		if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
			t.Fatalf("Commit: %v", err)
		}
		if o := mustObserve(t, a.store, "gone-by"); o.Held() || o.Successor != "bob" {
			t.Fatalf("Observe after the commit: %+v; want released, reserved for bob", o)
		}
	})
	t.Run("a successor's attempt cut short leaves the preparation to its next", func(t *testing.T) {
		// The successor's first attempt ends with its context while it
		// waits for the staged release's row: its next attempt must wait
		// for it too (and be granted at the commit), not be refused from
		// its snapshot and left untold of the staged grant.
		t.Parallel()
		const succTTL = 2 * time.Second
		a := setup(t)
		l := mustGrant(t, a.store, "cut", alice, ttl)
		mustRenewBatch(t, a.store, renewals(alice, ttl, l))
		b := setupOn(t, a.pool, Options{})
		conn, err := b.store.waits.Acquire(callCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		conn.Release()
		ch, err := b.store.WatchFreeFor(t.Context(), "cut", bob)
		if err != nil {
			t.Fatal(err)
		}
		waitListening(t, b)
		drain(ch)
		first := make(chan error, 1)
		go func() {
			select {
			case <-ch:
			case <-t.Context().Done():
				first <- t.Context().Err()
				return
			}
			// A wait of 500 ms for the handover, then the row's lock
			// until the context ends.
			ctx, cancel := context.WithTimeout(t.Context(), 1500*time.Millisecond)
			defer cancel()
			_, _, err := b.store.Acquire(ctx, "cut", bob, succTTL)
			first <- err
		}()
		p := mustPrepare(t, a.store, "cut", alice, l.Term, bob)
		if err := p.Stage(callCtx(t), leader.GrantTransfer, ttl); err != nil || !p.staged {
			t.Fatalf("Stage: %v (staged %v)", err, p.staged)
		}
		if err := <-first; !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("the successor's first Acquire: %v; want its deadline exceeded", err)
		}
		// The first attempt's statement, cancelled, may still wait for
		// the row: its wait must not pass for the next one's.
		for deadline := time.Now().Add(10 * time.Second); rowWaits(t, a) > 0; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("the first attempt's statement still waits for the row's lock 10 s after its context ended")
			}
		}
		next := &positioned{b: b, c: bob, done: make(chan acquireResult, 1)}
		go func() {
			l, granted, err := b.store.Acquire(callCtx(t), "cut", bob, succTTL)
			next.done <- acquireResult{lease: l, granted: granted, err: err, at: time.Now()}
		}()
		awaitRowWait(t, a, func() { next.notReturned(t, "before the commit") })
		if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
			t.Fatalf("Commit: %v", err)
		}
		if r := next.result(t); !r.granted || r.lease.HolderID != "bob" || r.lease.Term <= l.Term {
			t.Fatalf("the successor's next Acquire after the commit: %+v granted %v; want bob granted a term above %d", r.lease, r.granted, l.Term)
		}
	})
	t.Run("committed late", func(t *testing.T) {
		t.Parallel()
		const hold = 400 * time.Millisecond
		_, succ, p, l := staged(t, "late", hold)
		time.Sleep(hold/2 + 50*time.Millisecond)
		claimed := succ.b.store.stagedClaims.Load()
		before := time.Now()
		if err := p.Commit(callCtx(t), leader.GrantTransfer, hold); err != nil {
			t.Fatalf("Commit: %v", err)
		}
		r := granted(t, succ, l.Term+1)
		if r.lease.AcquiredAt.Before(before.Add(-20 * time.Millisecond)) {
			t.Fatalf("granted at %v, %v before Commit was called; want the grant made after Commit, not by the stale staged release",
				r.lease.AcquiredAt, before.Sub(r.lease.AcquiredAt))
		}
		if got := succ.b.store.stagedClaims.Load() - claimed; got != 0 {
			t.Fatalf("the successor claimed %d staged grants; want the grant of the release made at the commit", got)
		}
	})
	t.Run("granted, not yet under a heartbeat", func(t *testing.T) {
		// The grant's TTL is the one its Acquire asked for.
		t.Parallel()
		a := setup(t)
		l := mustGrant(t, a.store, "g", alice, ttl) // not renewed: under no heartbeat
		succ := position(t, a, "g", bob, ttl)
		p := mustPrepare(t, a.store, "g", alice, l.Term, bob)
		if err := p.Stage(callCtx(t), leader.GrantTransfer, ttl); err != nil || !p.staged {
			t.Fatalf("Stage of a lease granted by the store: staged %v, %v; want it staged", p.staged, err)
		}
		if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
			t.Fatalf("Commit: %v", err)
		}
		if r := granted(t, succ, l.Term+1); r.lease.Remaining <= ttl/2 {
			t.Fatalf("the successor's lease has %v left; want about the holder's TTL, %v", r.lease.Remaining, ttl)
		}
	})
	t.Run("a TTL the store does not know", func(t *testing.T) {
		// A store that neither granted nor renewed the lease does not
		// know its TTL, and stages nothing.
		t.Parallel()
		a := setup(t)
		l := mustGrant(t, a.store, "h", alice, ttl)
		other := setupOn(t, a.pool, Options{})
		succ := position(t, a, "h", bob, ttl)
		p := mustPrepare(t, other.store, "h", alice, l.Term, bob)
		if err := p.Stage(callCtx(t), leader.GrantTransfer, ttl); err != nil || p.staged {
			t.Fatalf("Stage on a store that does not know the lease: staged %v, %v; want it declined", p.staged, err)
		}
		if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
			t.Fatalf("Commit: %v", err)
		}
		granted(t, succ, l.Term+1)
	})
	t.Run("stage bounded by its context", func(t *testing.T) {
		// A Stage whose context has ended stages nothing, and leaves the
		// handover as it was: committed after, it hands over.
		t.Parallel()
		_, succ, p, l := prepared(t, "x")
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if err := p.Stage(ctx, leader.GrantTransfer, ttl); err != nil || p.staged {
			t.Fatalf("Stage under an ended context: staged %v, %v; want nothing staged", p.staged, err)
		}
		if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
			t.Fatalf("Commit: %v", err)
		}
		granted(t, succ, l.Term+1)
	})
}

// awaitRowWait waits, for 10 s at most, until a session of b's database
// waits for a row's lock (the transaction that wrote it), calling check
// between looks.
func awaitRowWait(t *testing.T, b testBundle, check func()) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if rowWaits(t, b) > 0 {
			return
		}
		check()
		if time.Now().After(deadline) {
			t.Fatal("no session waited for the staged release's row lock")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// rowWaits returns how many sessions of b's database wait for a row's
// lock (the transaction that wrote it).
func rowWaits(t *testing.T, b testBundle) int {
	t.Helper()
	var waiting int
	if err := b.pool.QueryRow(callCtx(t), `SELECT count(*) FROM pg_stat_activity
		WHERE wait_event_type = 'Lock' AND wait_event = 'transactionid' AND datname = current_database()`).Scan(&waiting); err != nil {
		t.Fatal(err)
	}
	return waiting
}
