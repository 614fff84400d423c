package postgres

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
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
	var stagedWith func(t *testing.T, name string, hold time.Duration) (a, succ *AdvisoryStore, p *advisoryPrepared, l leader.Lease, alicePID int32, done <-chan acquired)
	// staged prepares and stages a handover of name from alice to bob,
	// whose Acquire waits for it, and checks what nobody may see yet.
	staged := func(t *testing.T, name string) (a, succ *AdvisoryStore, p *advisoryPrepared, l leader.Lease, alicePID int32, done <-chan acquired) {
		t.Helper()
		return stagedWith(t, name, ttl)
	}
	stagedWith = func(t *testing.T, name string, hold time.Duration) (a, succ *AdvisoryStore, p *advisoryPrepared, l leader.Lease, alicePID int32, done <-chan acquired) {
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
		if err := p.Stage(callCtx(t), leader.GrantTransfer, hold); err != nil {
			t.Fatalf("Stage: %v", err)
		}
		if !p.staged {
			t.Fatal("Stage returned without staging the release")
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
		if err := p.Stage(callCtx(t), leader.GrantTransfer, hold); err == nil {
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
	t.Run("a fenced write while staged", func(t *testing.T) {
		// The old leader's fenced write, as its OnDemoted may make, is
		// neither held up by the staged release nor overtaken by it: the
		// release's commit waits for it.
		t.Parallel()
		a, _, p, l, _, done := staged(t, "f")
		ctx := callCtx(t)
		tx, err := a.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		fenced := make(chan error, 1)
		go func() { fenced <- Fence(ctx, tx, a.opts, "f", l.Term) }()
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
		case r := <-done:
			t.Fatalf("the successor was granted while a fenced transaction of the old term was open: %+v", r)
		case <-time.After(300 * time.Millisecond):
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatalf("committing the fenced transaction: %v", err)
		}
		select {
		case err := <-committed:
			if err != nil {
				t.Fatalf("Commit: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("Commit did not return after the fenced transaction ended")
		}
		if r := await(t, done); r.err != nil || !r.granted || r.lease.Term != l.Term+1 {
			t.Fatalf("the successor's Acquire: %+v granted %v err %v; want term %d", r.lease, r.granted, r.err, l.Term+1)
		}
		if err := fenceOnce(t, a, "f", l.Term); !errors.Is(err, leader.ErrLeaseLost) {
			t.Fatalf("Fence with the old term after the commit: %v; want ErrLeaseLost", err)
		}
		if err := fenceOnce(t, a, "f", l.Term+1); err != nil {
			t.Fatalf("Fence with the new term: %v", err)
		}
	})
	t.Run("a repeatable read snapshot from before the commit", func(t *testing.T) {
		// A REPEATABLE READ transaction whose snapshot came before the
		// commit does not judge the old term held by that snapshot.
		t.Parallel()
		a, _, p, l, _, done := staged(t, "rr")
		ctx := callCtx(t)
		tx, err := a.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, "SELECT 1"); err != nil { // the snapshot
			t.Fatal(err)
		}
		if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
			t.Fatalf("Commit: %v", err)
		}
		if r := await(t, done); r.err != nil || !r.granted {
			t.Fatalf("the successor's Acquire: %+v granted %v err %v", r.lease, r.granted, r.err)
		}
		err = Fence(ctx, tx, a.opts, "rr", l.Term)
		if err == nil || (!errors.Is(err, leader.ErrLeaseLost) && sqlState(err) != "40001") {
			t.Fatalf("Fence with the old term on a snapshot from before the commit: %v; want ErrLeaseLost or a serialization failure", err)
		}
	})
	t.Run("declined under a fenced transaction", func(t *testing.T) {
		// A fenced transaction open before the staging (it holds the
		// row FOR SHARE, and the staged lock in shared mode) is not
		// waited for: the release is not staged, and Commit releases it
		// after the fenced transaction.
		t.Parallel()
		pool := pgtest.NewPool(t)
		a := setupAdvisory(t, pool, Options{})
		succ := setupAdvisory(t, pool, Options{})
		alice, bob := candidate("alice"), candidate("bob")
		l := mustGrant(t, a, "d", alice, ttl)
		done := acquireOnNotice(t, succ, "d", bob, ttl)
		hp, err := a.PrepareHandover(callCtx(t), "d", alice.Token, l.Term, bob, 10*time.Second)
		if err != nil {
			t.Fatalf("PrepareHandover: %v", err)
		}
		p := hp.(*advisoryPrepared)
		ctx := callCtx(t)
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if err := Fence(ctx, tx, a.opts, "d", l.Term); err != nil {
			t.Fatalf("Fence: %v", err)
		}
		start := time.Now()
		if err := p.Stage(callCtx(t), leader.GrantTransfer, ttl); err != nil {
			t.Fatalf("Stage under a fenced transaction: %v; want it declined without an error", err)
		}
		if p.staged {
			t.Fatal("Stage staged the release under an open fenced transaction")
		}
		if took := time.Since(start); took > 5*time.Second {
			t.Fatalf("Stage under a fenced transaction took %v; want it not to wait for the transaction", took)
		}
		if _, err := tx.Exec(ctx, "SELECT 1"); err != nil {
			t.Fatalf("the fenced transaction after the declined Stage: %v", err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatalf("committing the fenced transaction: %v", err)
		}
		if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
			t.Fatalf("Commit: %v", err)
		}
		if r := await(t, done); r.err != nil || !r.granted || r.lease.Term != l.Term+1 || r.lease.HolderID != "bob" {
			t.Fatalf("the successor's Acquire: %+v granted %v err %v; want bob granted term %d", r.lease, r.granted, r.err, l.Term+1)
		}
	})
	t.Run("declined while a transaction holds the staged lock", func(t *testing.T) {
		t.Parallel()
		pool := pgtest.NewPool(t)
		a := setupAdvisory(t, pool, Options{})
		succ := setupAdvisory(t, pool, Options{})
		alice, bob := candidate("alice"), candidate("bob")
		l := mustGrant(t, a, "sl", alice, ttl)
		done := acquireOnNotice(t, succ, "sl", bob, ttl)
		hp, err := a.PrepareHandover(callCtx(t), "sl", alice.Token, l.Term, bob, 10*time.Second)
		if err != nil {
			t.Fatalf("PrepareHandover: %v", err)
		}
		p := hp.(*advisoryPrepared)
		ctx := callCtx(t)
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock_shared($1)", a.opts.stagedKey("sl")); err != nil {
			t.Fatal(err)
		}
		if err := p.Stage(callCtx(t), leader.GrantTransfer, ttl); err != nil || p.staged {
			t.Fatalf("Stage while the staged lock is held: staged %v, %v; want it declined", p.staged, err)
		}
		tx.Rollback(ctx)
		if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
			t.Fatalf("Commit: %v", err)
		}
		if r := await(t, done); r.err != nil || !r.granted || r.lease.Term != l.Term+1 {
			t.Fatalf("the successor's Acquire: %+v granted %v err %v; want term %d", r.lease, r.granted, r.err, l.Term+1)
		}
	})
	t.Run("a fenced write while staged holds up the grant of a late commit", func(t *testing.T) {
		// The late Commit rolls the staged release back and releases
		// afresh; that release's grant waits for the fenced transaction
		// that judged the row while staged (fenceAfterGrant).
		t.Parallel()
		const hold = 400 * time.Millisecond
		a, _, p, l, _, done := stagedWith(t, "lf", hold)
		ctx := callCtx(t)
		tx, err := a.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if err := Fence(ctx, tx, a.opts, "lf", l.Term); err != nil {
			t.Fatalf("Fence while staged: %v", err)
		}
		time.Sleep(hold/2 + 50*time.Millisecond)
		committed := make(chan error, 1)
		go func() { committed <- p.Commit(callCtx(t), leader.GrantTransfer, hold) }()
		select {
		case r := <-done:
			t.Fatalf("the successor was granted while a fenced transaction of the old term was open: %+v", r)
		case <-time.After(300 * time.Millisecond):
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatalf("committing the fenced transaction: %v", err)
		}
		if err := <-committed; err != nil {
			t.Fatalf("Commit: %v", err)
		}
		if r := await(t, done); r.err != nil || !r.granted || r.lease.Term != l.Term+1 {
			t.Fatalf("the successor's Acquire: %+v granted %v err %v; want term %d", r.lease, r.granted, r.err, l.Term+1)
		}
	})
	t.Run("committed late", func(t *testing.T) {
		// A Commit later than half of the hold after Stage rolls the
		// staged release back and releases then: the grant is Commit's.
		t.Parallel()
		const hold = 200 * time.Millisecond
		_, _, p, l, _, done := stagedWith(t, "late", hold)
		time.Sleep(hold/2 + 50*time.Millisecond)
		before := time.Now()
		if err := p.Commit(callCtx(t), leader.GrantTransfer, hold); err != nil {
			t.Fatalf("Commit: %v", err)
		}
		r := await(t, done)
		if r.err != nil || !r.granted || r.lease.Term != l.Term+1 || r.lease.HolderID != "bob" {
			t.Fatalf("the successor's Acquire: %+v granted %v err %v; want bob granted term %d", r.lease, r.granted, r.err, l.Term+1)
		}
		// Stage's release would have granted the lease 150 ms before
		// Commit; the server's clock is this machine's.
		if r.lease.AcquiredAt.Before(before.Add(-20 * time.Millisecond)) {
			t.Fatalf("granted at %v, %v before Commit was called; want the grant made by Commit, not by the stale staged release",
				r.lease.AcquiredAt, before.Sub(r.lease.AcquiredAt))
		}
	})
	t.Run("never left staged", func(t *testing.T) {
		// A Commit that returns before it reaches the session (its
		// context ended) does not leave the session staged for good: the
		// session's next call drops it, which frees the lease.
		t.Parallel()
		a, _, p, l, alicePID, done := staged(t, "n")
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if err := p.Commit(ctx, leader.GrantTransfer, ttl); err == nil {
			t.Fatal("Commit under an ended context succeeded")
		}
		_, err := a.Renew(callCtx(t), "n", p.token, l.Term, ttl)
		if !errors.Is(err, errSessionDropped) && !errors.Is(err, leader.ErrLeaseLost) {
			t.Fatalf("Renew after the ended Commit: %v; want the session dropped (the lease lost)", err)
		}
		// The drop closes the connection; the server frees the lock once
		// it sees that, which a busy machine may take a while to do.
		electortest.Eventually(t, 10*time.Second, "alice's session to let go of the lease's lock after the ended Commit and a call", func() bool {
			lock, _ := locksOf(t, a.pool, a.Key("n"), alicePID)
			return !lock
		})
		if r := await(t, done); r.err != nil || !r.granted || r.lease.HolderID != "bob" {
			t.Fatalf("the successor's Acquire: %+v granted %v err %v; want bob granted", r.lease, r.granted, r.err)
		}
	})
}

// fenceOnce runs Fence for name and term in a transaction of its own on
// s's pool, and returns its error.
func fenceOnce(t *testing.T, s *AdvisoryStore, name string, term uint64) error {
	t.Helper()
	ctx := callCtx(t)
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	return Fence(ctx, tx, s.opts, name, term)
}

// TestStageKeysAgree checks that the stores' staged and fence keys
// (stagedKey, fenceKey, computed in Go) are those that the fence function
// computes in SQL (stageKeySQL), for names of several scripts and for a
// table whose name needs quoting.
func TestStageKeysAgree(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	for _, opts := range []Options{{}, {Schema: `Odd "schema"`, Table: "it's a table"}} {
		opts = opts.withDefaults()
		for _, name := range []string{"", "a", "nightly-report", "naïve ünïcode", "日本語", `quo'te "double" \back`, strings.Repeat("x", 300)} {
			for _, k := range []struct {
				prefix string
				want   int64
			}{{stagedKeyPrefix, opts.stagedKey(name)}, {fenceKeyPrefix, opts.fenceKey(name)}} {
				var got int64
				if err := pool.QueryRow(callCtx(t), "SELECT "+stageKeySQL(k.prefix, opts.qualifiedTable(), "$1::text"), name).Scan(&got); err != nil {
					t.Fatal(err)
				}
				if got != k.want {
					t.Errorf("table %s, name %q, prefix %q: SQL's key %d, Go's %d", opts.qualifiedTable(), name, k.prefix, got, k.want)
				}
			}
		}
	}
	if a, b := (Options{}).withDefaults().stagedKey("x"), (Options{}).withDefaults().fenceKey("x"); a == b {
		t.Errorf("the staged key and the fence key of a name are the same: %d", a)
	}
}
