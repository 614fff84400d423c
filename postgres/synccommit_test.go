package postgres

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/pgtest"
)

// The test clusters run with synchronous_commit off, as some production
// servers do. A commit is then acknowledged before its WAL is written, and
// a crash (an immediate shutdown, a killed postmaster, a lost host) loses
// the last ones. If it lost a grant, the term would go back: the next grant
// would hand the same term to a second leader, and a fenced resource would
// accept both (DESIGN.md invariant 2). If it lost a renewal, the lease
// would expire earlier than the leader's local deadline (invariant 1). So
// the statements that grant and renew commit synchronously whatever the
// server's default; these tests crash the server right after many of them
// and check that none was lost.

// crashCycles is how many grants or renewals are made, and the server
// crashed right after the last, per test. Without synchronous commits, the
// first cycle loses the last commit almost always.
const crashCycles = 3

// crashAndRestart stops the cluster as a crash would, starts it again, and
// waits until pool can query it.
func crashAndRestart(t *testing.T, cluster *pgtest.Cluster, pool *pgxpool.Pool, own ...*pgxpool.Pool) {
	t.Helper()
	cluster.StopImmediate(t)
	cluster.Start(t)
	pool.Reset() // its connections died with the server
	for _, p := range own {
		p.Reset() // a store's own connections, likewise
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := pool.Ping(callCtx(t))
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no answer after restart: %v", err)
		}
		time.Sleep(10 * time.Millisecond) // poll interval
	}
}

// TestGrantsAndRenewalsSurviveACrash grants and renews leases on a server
// with synchronous_commit off, crashes it right after, and checks that the
// terms and expiries the store reported are still there.
func TestGrantsAndRenewalsSurviveACrash(t *testing.T) {
	t.Parallel()
	cluster := pgtest.NewCluster(t)
	pool := cluster.NewPool(t)
	var setting string
	if err := pool.QueryRow(callCtx(t), "SHOW synchronous_commit").Scan(&setting); err != nil {
		t.Fatal(err)
	}
	if setting != "off" {
		t.Fatalf("the test cluster has synchronous_commit %s; this test needs it off", setting)
	}

	t.Run("the lease store", func(t *testing.T) {
		s := setupOn(t, pool, Options{}).store
		alice := candidate("alice")
		for cycle := range crashCycles {
			name := fmt.Sprint("lease-", cycle)
			// Grants: each one to the holder is a new grant, term+1.
			var l leader.Lease
			for range 20 {
				l = mustGrant(t, s, name, alice, time.Hour)
			}
			crashAndRestart(t, cluster, pool, s.pool)
			got, err := s.Observe(callCtx(t), name)
			if err != nil {
				t.Fatal(err)
			}
			if got.Term != l.Term {
				t.Errorf("cycle %d: term %d granted, then after a crash the store has term %d", cycle, l.Term, got.Term)
			}
			// A renewal for an hour, of a grant for a minute made
			// durable by a checkpoint: after the crash the lease must
			// still run for the hour.
			before := mustGrant(t, s, name, alice, time.Minute)
			checkpoint(t, pool)
			r, err := s.Renew(callCtx(t), name, alice.Token, before.Term, time.Hour)
			if err != nil {
				t.Fatal(err)
			}
			crashAndRestart(t, cluster, pool, s.pool)
			got, err = s.Observe(callCtx(t), name)
			if err != nil {
				t.Fatal(err)
			}
			if !got.ExpiresAt.Equal(r.ExpiresAt) || got.Term != before.Term {
				t.Errorf("cycle %d: renewed term %d until %v, then after a crash the store has term %d until %v",
					cycle, before.Term, r.ExpiresAt, got.Term, got.ExpiresAt)
			}
		}
	})

	t.Run("the advisory store", func(t *testing.T) {
		if err := Migrate(callCtx(t), pool, Options{}); err != nil {
			t.Fatal(err)
		}
		s, err := NewAdvisoryStore(callCtx(t), pool, Options{TakeoverGrace: time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Close)
		alice := candidate("alice")
		for cycle := range crashCycles {
			name := fmt.Sprint("advisory-", cycle)
			// The first grant takes the lock; the next ones are
			// re-grants on the holder's session, term+1 each.
			var l leader.Lease
			for range 20 {
				l = mustAdvisoryGrant(t, s, name, alice)
			}
			crashAndRestart(t, cluster, pool, s.pool)
			got, err := s.Observe(callCtx(t), name)
			if err != nil {
				t.Fatal(err)
			}
			if got.Term != l.Term {
				t.Errorf("cycle %d: term %d granted, then after a crash the store has term %d", cycle, l.Term, got.Term)
			}
			// The crash ended the holder's session: the next grant
			// takes the lock on a new one, after a checkpoint, so that
			// only that grant is at stake.
			checkpoint(t, pool)
			l = mustAdvisoryGrant(t, s, name, alice)
			crashAndRestart(t, cluster, pool, s.pool)
			if got, err = s.Observe(callCtx(t), name); err != nil {
				t.Fatal(err)
			}
			if got.Term != l.Term {
				t.Errorf("cycle %d: term %d granted on a new session, then after a crash the store has term %d", cycle, l.Term, got.Term)
			}
		}
	})
}

// checkpoint makes every commit so far durable.
func checkpoint(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	if _, err := pool.Exec(callCtx(t), "CHECKPOINT"); err != nil {
		t.Fatal(err)
	}
}

// mustAdvisoryGrant acquires name for c on s, retrying while the server is
// still ending the sessions of before a crash, and fails t unless granted.
func mustAdvisoryGrant(t *testing.T, s *AdvisoryStore, name string, c leader.Candidate) leader.Lease {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		l, granted, err := s.Acquire(callCtx(t), name, c, time.Hour)
		switch {
		case err == nil && granted:
			return l
		case time.Now().After(deadline):
			t.Fatalf("acquire %q: granted %v, %v", name, granted, err)
		case err != nil && !errors.Is(err, leader.ErrUnavailable) && !errors.Is(err, leader.ErrLeaseLost) && !errors.Is(err, context.DeadlineExceeded):
			t.Fatalf("acquire %q: %v", name, err)
		}
		time.Sleep(10 * time.Millisecond) // poll interval
	}
}

// TestDurableCommitRaisesOnlyOff checks durableCommit on each setting of
// synchronous_commit: off becomes local, stronger settings (which may wait
// for standbys) are kept, and the session's setting is back after the
// transaction.
func TestDurableCommitRaisesOnlyOff(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	conn, err := pool.Acquire(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	for setting, want := range map[string]string{
		"off": "local", "local": "local", "remote_write": "remote_write", "on": "on", "remote_apply": "remote_apply",
	} {
		if _, err := conn.Exec(callCtx(t), "SET synchronous_commit = "+setting); err != nil {
			t.Fatal(err)
		}
		var got, after string
		if err := conn.QueryRow(callCtx(t), "SELECT "+durableCommit).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if err := conn.QueryRow(callCtx(t), "SHOW synchronous_commit").Scan(&after); err != nil {
			t.Fatal(err)
		}
		if got != want || after != setting {
			t.Errorf("synchronous_commit %s: durableCommit set %s for the transaction (want %s), and the session has %s after it (want %s)",
				setting, got, want, after, setting)
		}
	}
}
