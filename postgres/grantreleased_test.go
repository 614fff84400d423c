package postgres

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leaderelect/leader"
)

// TestGrantReleasedOnlyTakesAFreeLease checks the statement that a
// candidate woken by name runs first, and the successor of a prepared
// handover once its lock is free (statements.grantReleased): it grants a
// lease released and not reserved for another candidate as the acquire
// statement would (the next term, above the strategy row's floor; the
// reservation's reason, or 'release'; the candidate's priority), and
// grants nothing, returning no row, in every other case, the failover's
// hold and a name the other strategy took among them. A grant's commit is
// durable. Each case runs in a transaction that is rolled back, on the
// same reserved lease.
func TestGrantReleasedOnlyTakesAFreeLease(t *testing.T) {
	t.Parallel()
	b := setup(t)
	s, opts := b.store, b.store.opts
	alice, bob, carol := candidate("alice"), candidate("bob"), candidate("carol")
	bob.Priority = 3
	const ttl = 20 * time.Second
	l := mustGrant(t, s, "w", alice, ttl)
	if err := s.ReleaseTo(callCtx(t), "w", alice.Token, l.Term, bob, leader.GrantTransfer, 10*time.Second); err != nil {
		t.Fatalf("ReleaseTo: %v", err)
	}
	held := mustGrant(t, s, "held", alice, ttl)

	// granted runs the statement for c on name after setup, in a
	// transaction that it rolls back, and returns the lease it granted,
	// or nil if it returned no row.
	granted := func(t *testing.T, name string, c leader.Candidate, setup ...string) *leader.Lease {
		t.Helper()
		ctx := callCtx(t)
		tx, err := b.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		for _, sql := range append([]string{"SET LOCAL synchronous_commit = off"}, setup...) {
			if _, err := tx.Exec(ctx, sql); err != nil {
				t.Fatalf("%s: %v", sql, err)
			}
		}
		var (
			r             leaseRow
			granted, mine bool
			notified      int64
		)
		dest := append([]any{&granted, &r.term, &r.held, &r.holderID, &r.acquiredAt, &r.expiresAt, &r.remaining, &notified, &mine},
			r.transfer.dest()...)
		err = tx.QueryRow(ctx, s.sql.grantReleased, name, c.Token, c.ID, interval(ttl), opts.Channel, int32(c.Priority)).Scan(dest...)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		if err != nil {
			t.Fatalf("the grant statement: %v", err)
		}
		if !granted || !mine || notified != 2 {
			t.Fatalf("the grant statement returned granted %v, mine %v, notified %d: want true, true, 2", granted, mine, notified)
		}
		// A grant's commit is durable (durableCommit): the cases run
		// with synchronous_commit off, which it raises to local.
		var sync string
		if err := tx.QueryRow(ctx, "SHOW synchronous_commit").Scan(&sync); err != nil {
			t.Fatal(err)
		}
		if sync != "local" {
			t.Fatalf("the grant's transaction commits with synchronous_commit %s; want local", sync)
		}
		lease := r.lease(name)
		return &lease
	}

	t.Run("reserved for it", func(t *testing.T) {
		g := granted(t, "w", bob)
		if g == nil || g.Term != l.Term+1 || g.HolderID != "bob" || g.Reason != leader.GrantTransfer || g.Priority != 3 ||
			g.Remaining <= 0 || g.Remaining > ttl {
			t.Fatalf("granted %+v; want bob's, term %d, for a transfer, priority 3, for at most %v", g, l.Term+1, ttl)
		}
	})
	for _, c := range []struct {
		what  string
		name  string
		c     leader.Candidate
		setup []string
	}{
		{what: "the reservation ran out", name: "w", c: carol,
			setup: []string{fmt.Sprintf(`UPDATE %s SET reserved_until = clock_timestamp() - interval '1 second' WHERE name = 'w'`, opts.qualifiedTable())}},
		{what: "released to nobody", name: "w", c: carol,
			setup: []string{fmt.Sprintf(`UPDATE %s SET (successor_token, successor_id, successor_reason, reserved_until) = (NULL, NULL, NULL, NULL) WHERE name = 'w'`, opts.qualifiedTable())}},
	} {
		t.Run(c.what, func(t *testing.T) {
			g := granted(t, c.name, c.c, c.setup...)
			if g == nil || g.Term != l.Term+1 || g.HolderID != "carol" || g.Reason != leader.GrantRelease {
				t.Fatalf("granted %+v; want carol's, term %d, after a release", g, l.Term+1)
			}
		})
	}
	t.Run("above the strategy row's floor", func(t *testing.T) {
		floor := l.Term + 100
		g := granted(t, "w", bob, fmt.Sprintf(`UPDATE %s SET term_floor = %d WHERE name = 'w'`, opts.qualifiedStrategyTable(), floor))
		if g == nil || g.Term != floor+1 {
			t.Fatalf("granted %+v; want term %d, above the floor %d", g, floor+1, floor)
		}
	})
	for _, c := range []struct {
		what  string
		name  string
		c     leader.Candidate
		setup []string
	}{
		{what: "reserved for another", name: "w", c: carol},
		{what: "held", name: "held", c: bob},
		{what: "held, with the reservation's columns left", name: "w", c: bob,
			setup: []string{fmt.Sprintf(`UPDATE %s SET (holder_token, holder_id, expires_at) = ('%s', 'alice', clock_timestamp() + interval '1 minute') WHERE name = 'w'`,
				opts.qualifiedTable(), alice.Token)}},
		{what: "never held", name: "none", c: bob},
		{what: "the name is the advisory strategy's", name: "w", c: bob,
			setup: []string{fmt.Sprintf(`UPDATE %s SET strategy = 'advisory' WHERE name = 'w'`, opts.qualifiedStrategyTable())}},
		{what: "a failover's hold", name: "w", c: bob,
			// An earlier timeline is recorded, and this one was first
			// seen just now: no grant for a TTL (see epochCTEs).
			setup: []string{fmt.Sprintf(`INSERT INTO %[1]s (timeline, seen_at) VALUES (0, clock_timestamp() - interval '1 hour');
INSERT INTO %[1]s (timeline, seen_at)
SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint, clock_timestamp()
ON CONFLICT (timeline) DO UPDATE SET seen_at = excluded.seen_at`, opts.qualifiedEpochTable())}},
	} {
		t.Run(c.what, func(t *testing.T) {
			if g := granted(t, c.name, c.c, c.setup...); g != nil {
				t.Fatalf("granted %+v; want no grant", g)
			}
		})
	}
	// The cases rolled back: the lease is still reserved for bob, and
	// "held" still alice's.
	if o := mustObserve(t, s, "w"); o.Held() || o.Successor != "bob" {
		t.Fatalf("after the cases the lease is %+v; want free and reserved for bob", o)
	}
	if o := mustObserve(t, s, "held"); o.HolderID != "alice" || o.Term != held.Term {
		t.Fatalf("after the cases %q is %+v; want alice's with term %d", "held", o, held.Term)
	}
}
