package postgres

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/pgtest"
)

// TestAdvisoryPreparedHandoverWakesNoOtherFollower checks that a prepared
// handover of the advisory strategy whose successor waited is taken by the
// successor's waiting statement, and that the lock waiter of another
// process, which wakes once the holder lets go of its mark (freed after
// the successor's grant), finds the lease taken and wakes none of its
// followers: woken, each would try beside the new leader's start. The
// Commit runs its statements prepared, and removes the holder's own entry
// among the candidates, as a release does, after the successor's grant
// (dropHolder), leaving the others'.
func TestAdvisoryPreparedHandoverWakesNoOtherFollower(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	a := setupAdvisory(t, pool, Options{})    // the holder's process
	succ := setupAdvisory(t, pool, Options{}) // the successor's
	other := setupAdvisory(t, pool, Options{})
	alice, bob, carol := candidate("alice"), candidate("bob"), candidate("carol")
	const ttl = time.Minute
	l := mustGrant(t, a, "prep", alice, ttl)
	for _, c := range []leader.Candidate{alice, carol} {
		if err := a.Enlist(callCtx(t), "prep", c, ttl); err != nil {
			t.Fatal(err)
		}
	}

	settled := other.watchFreeSettled(t, "prep") // its lock waiter waits on alice's mark
	forCarol := watchFor(t, other, "prep", carol)
	forBob := watchFor(t, succ, "prep", bob)
	quieten(t, settled, forCarol, forBob) // the wake-ups sent once listening

	type result struct {
		lease   leader.Lease
		granted bool
		err     error
	}
	done := make(chan result, 1)
	go func() {
		<-forBob // the preparation's notice
		l, granted, err := succ.Acquire(callCtx(t), "prep", bob, ttl)
		done <- result{l, granted, err}
	}()
	a.smu.Lock()
	ss := a.sessions[sessionKey{"prep", alice.Token}]
	a.smu.Unlock()
	// runs is how many times alice's session ran each of the statements
	// of a handed-over lease's release as its prepared statement (its
	// generic plan: a run by the statement's text would plan it anew, as
	// a custom plan of an unnamed statement, and count nothing here).
	stmts := map[string]string{"releaseGranting": a.sql.releaseGranting, "unlockHandedOver": a.sql.unlockHandedOver,
		"dropHolder": a.sql.dropHolder}
	runs := func() map[string]int64 {
		t.Helper()
		ns := map[string]int64{}
		for what, sql := range stmts {
			var n int64
			err := ss.do(callCtx(t), a, false, func(conn *pgx.Conn) error {
				return conn.QueryRow(callCtx(t), `SELECT generic_plans FROM pg_prepared_statements WHERE statement = $1`,
					pgx.QueryExecModeSimpleProtocol, sql).Scan(&n)
			})
			if err != nil {
				t.Fatalf("alice's session's prepared %s: %v", what, err)
			}
			ns[what] = n
		}
		return ns
	}
	// Run while alice still holds the lease (as after a release that
	// released nothing), the removal leaves her entry.
	if !dropLeaves(t, pool, a, a.sql.dropHolder, "prep", alice) {
		t.Fatal("the removal of the holder's entry, run while the holder holds the lease, removed it")
	}
	// The release on the successor's path leaves it (run here on alice's
	// session, in a transaction rolled back).
	err := ss.do(callCtx(t), a, false, func(conn *pgx.Conn) error {
		if n := entriesAfter(t, conn, a.opts, "prep", alice, a.sql.releaseGranting,
			"prep", alice.Token, int64(l.Term), bob.Token, bob.ID, string(leader.GrantTransfer), int64(ttl/time.Microsecond), int32(12345), int32(0)); n != 1 {
			t.Errorf("after the handed-over release, in its transaction, the holder has %d entries among the candidates; want 1", n)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	before := runs()
	p, err := a.PrepareHandover(callCtx(t), "prep", alice.Token, l.Term, bob, 10*time.Second)
	if err != nil {
		t.Fatalf("PrepareHandover: %v", err)
	}
	if !p.(*advisoryPrepared).waited {
		t.Fatal("the successor did not wait for the prepared handover")
	}
	if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
		t.Fatalf("Commit: %v", err)
	}
	var r result
	select {
	case r = <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the successor's Acquire did not return")
	}
	if r.err != nil || !r.granted || r.lease.Term != l.Term+1 {
		t.Fatalf("the successor's Acquire: %+v granted %v err %v; want granted term %d", r.lease, r.granted, r.err, l.Term+1)
	}
	// The release and the unlock on the handover's path ran prepared,
	// neither parsed nor planned between the release and the successor's
	// grant, and so did the removal of alice's entry after it.
	for what, n := range runs() {
		if n != before[what]+1 {
			t.Errorf("alice's session ran the prepared %s %d times in the Commit; want 1", what, n-before[what])
		}
	}
	if enlisted(t, a, "prep", alice) {
		t.Error("the holder's entry is still among the candidates after the Commit")
	}
	if !enlisted(t, a, "prep", carol) {
		t.Error("the Commit removed another candidate's entry")
	}
	// An entry enlisted again after the release stays.
	if err := a.Enlist(callCtx(t), "prep", alice, ttl); err != nil {
		t.Fatal(err)
	}
	if !dropLeaves(t, pool, a, a.sql.dropHolder, "prep", alice) {
		t.Error("the removal of the holder's entry removed one enlisted after the release")
	}
	select {
	case <-forCarol:
		t.Fatal("a follower of another process was woken after the successor took the lease")
	case <-time.After(500 * time.Millisecond):
	}
}
