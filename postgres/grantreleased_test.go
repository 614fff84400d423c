package postgres

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/leaderelect/leader"
)

// TestGrantReleasedOnlyTakesAFreeLease checks the statement that a
// candidate woken by name runs first, and the successor of a prepared
// handover once its lock is free (statements.grantReleased): it grants a
// lease released and not reserved for another candidate as the acquire
// statement would (the same row after it: the next term, above the
// strategy row's floor; the reservation's reason, or 'release'; the
// candidate's priority; no heartbeat, request or reservation left; a TTL
// from the grant; the strategy row locked), and grants nothing, returning
// no row and leaving the row as it was, in every other case, the
// failover's hold and a name the other strategy took among them, where
// the acquire statement grants nothing either. A grant's commit is
// durable; a refusal of a held or reserved lease writes nothing, so its
// commit waits for no WAL flush. Each statement runs with custom plans
// and with the generic plan (the store's connections use it), in a
// transaction that is rolled back, on the same reserved lease.
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

	// rowSQL renders the lease row of $1 as a statement left it, for
	// the candidate of token $2 and a grant for $3 (a TTL).
	rowSQL := fmt.Sprintf(`SELECT coalesce((SELECT concat_ws(' ',
	'holder=' || coalesce(l.holder_id, '-'), 'holder_token_is_candidates=' || (l.holder_token IS NOT DISTINCT FROM $2),
	'term=' || l.term, 'heartbeat=' || (l.heartbeat IS NOT NULL), 'for_ttl=' || (l.expires_at - l.acquired_at = $3::interval),
	'renewed_at_grant=' || (l.renewed_at = l.acquired_at), 'transfer_columns_set=' || num_nonnulls(%s),
	'priority=' || l.priority, 'reason=' || l.reason) FROM %s AS l WHERE l.name = $1), 'no row')`, clearedTransfer, opts.qualifiedTable())

	// outcome is what a statement did: the lease it granted (nil if
	// none), the row before and after it, and whether its transaction
	// was given an ID (wrote anything) and commits with synchronous_commit
	// raised to local.
	type outcome struct {
		lease         *leader.Lease
		before, after string
		wrote         bool
		sync          string
	}
	// run runs stmt (grantReleased, or acquire to compare) for c on name
	// after setup, in a transaction that it rolls back, with
	// synchronous_commit off and plan_cache_mode set to mode (the store's
	// own connections use force_generic_plan; see planAhead).
	run := func(t *testing.T, mode, stmt, name string, c leader.Candidate, setup ...string) outcome {
		t.Helper()
		ctx := callCtx(t)
		tx, err := b.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		for _, sql := range append([]string{"SET LOCAL synchronous_commit = off", "SET LOCAL plan_cache_mode = " + mode}, setup...) {
			if _, err := tx.Exec(ctx, sql); err != nil {
				t.Fatalf("%s: %v", sql, err)
			}
		}
		var o outcome
		if err := tx.QueryRow(ctx, rowSQL, name, c.Token, interval(ttl)).Scan(&o.before); err != nil {
			t.Fatal(err)
		}
		wroteBefore := len(setup) > 0
		var (
			r             leaseRow
			granted, mine bool
			notified      int64
		)
		dest := append([]any{&granted, &r.term, &r.held, &r.holderID, &r.acquiredAt, &r.expiresAt, &r.remaining, &notified, &mine},
			r.transfer.dest()...)
		err = tx.QueryRow(ctx, stmt, name, c.Token, c.ID, interval(ttl), opts.Channel, int32(c.Priority)).Scan(dest...)
		switch {
		case errors.Is(err, pgx.ErrNoRows) && stmt == s.sql.grantReleased:
		case err != nil:
			t.Fatalf("the statement: %v", err)
		case granted:
			// notified counts the CTEs "notified", "durable" and
			// "fenced" (fenceAfterGrant), each of one row for a grant.
			if !mine || notified != 3 {
				t.Fatalf("the statement granted, with mine %v, notified %d: want true, 3", mine, notified)
			}
			lease := r.lease(name)
			o.lease = &lease
		case stmt == s.sql.grantReleased:
			t.Fatalf("the grant statement returned a row that grants nothing: %+v", r)
		}
		if err := tx.QueryRow(ctx, rowSQL+`, txid_current_if_assigned() IS NOT NULL, current_setting('synchronous_commit')`,
			name, c.Token, interval(ttl)).Scan(&o.after, &o.wrote, &o.sync); err != nil {
			t.Fatal(err)
		}
		o.wrote = o.wrote && !wroteBefore
		if o.lease != nil {
			// The grant holds the strategy row (FOR KEY SHARE) until its
			// commit, so that no claim moves the name meanwhile.
			_, err := b.pool.Exec(ctx, fmt.Sprintf(`SELECT FROM %s WHERE name = $1 FOR UPDATE NOWAIT`, opts.qualifiedStrategyTable()), name)
			if pgErr := (*pgconn.PgError)(nil); !errors.As(err, &pgErr) || pgErr.Code != "55P03" {
				t.Fatalf("locking the strategy row under the grant: %v; want lock_not_available (55P03)", err)
			}
		}
		return o
	}
	// granted runs the grant statement and the acquire statement on the
	// same case, each with custom plans and with the generic one, checks
	// that they all agree, and returns the grant statement's outcome
	// with the generic plan.
	granted := func(t *testing.T, name string, c leader.Candidate, setup ...string) outcome {
		t.Helper()
		var g outcome
		for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
			g = run(t, mode, s.sql.grantReleased, name, c, setup...)
			a := run(t, mode, s.sql.acquire, name, c, setup...)
			if (g.lease != nil) != (a.lease != nil) || g.after != a.after {
				t.Fatalf("%s: the grant statement granted %v and left %q; the acquire statement granted %v and left %q",
					mode, g.lease != nil, g.after, a.lease != nil, a.after)
			}
			// Refused, it wrote nothing (no row lock either): its
			// transaction has no ID, and its commit waits for no WAL
			// flush, whatever synchronous_commit is. (A case whose setup
			// wrote cannot tell.)
			if g.lease == nil && g.wrote {
				t.Fatalf("%s: the grant statement granted nothing, but its transaction was given an ID: it wrote", mode)
			}
		}
		if g.lease == nil {
			if g.after != g.before {
				t.Fatalf("the grant statement granted nothing but changed the row from %q to %q", g.before, g.after)
			}
			return g
		}
		// A grant's commit is durable (durableCommit): the cases run
		// with synchronous_commit off, which it raises to local.
		if g.sync != "local" {
			t.Fatalf("the grant's transaction commits with synchronous_commit %s; want local", g.sync)
		}
		want := fmt.Sprintf("holder=%s holder_token_is_candidates=true term=%d heartbeat=false for_ttl=true renewed_at_grant=true transfer_columns_set=0 priority=%d reason=%s",
			c.ID, g.lease.Term, c.Priority, g.lease.Reason)
		if g.after != want {
			t.Fatalf("the grant left the row %q; want %q", g.after, want)
		}
		return g
	}

	t.Run("reserved for it", func(t *testing.T) {
		g := granted(t, "w", bob).lease
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
		{what: "a request left on the released row", name: "w", c: bob,
			setup: []string{fmt.Sprintf(`UPDATE %s SET (request_to, request_reason, request_until) = ('carol', 'transfer', clock_timestamp() + interval '1 minute') WHERE name = 'w'`, opts.qualifiedTable())}},
	} {
		t.Run(c.what, func(t *testing.T) {
			g := granted(t, c.name, c.c, c.setup...).lease
			if g == nil || g.Term != l.Term+1 || g.HolderID != c.c.ID {
				t.Fatalf("granted %+v; want %s's, term %d", g, c.c.ID, l.Term+1)
			}
			if c.c.ID == "carol" && g.Reason != leader.GrantRelease {
				t.Fatalf("granted %+v; want it granted after a release", g)
			}
		})
	}
	t.Run("above the strategy row's floor", func(t *testing.T) {
		floor := l.Term + 100
		g := granted(t, "w", bob, fmt.Sprintf(`UPDATE %s SET term_floor = %d WHERE name = 'w'`, opts.qualifiedStrategyTable(), floor)).lease
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
			g := granted(t, c.name, c.c, c.setup...)
			if g.lease != nil {
				t.Fatalf("granted %+v; want no grant", g.lease)
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
