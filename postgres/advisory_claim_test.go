package postgres

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/pgtest"
)

// acquired is the outcome of an Acquire run in the background.
type acquired struct {
	lease   leader.Lease
	granted bool
	err     error
}

// acquireOnNotice has c, on s, watch name and Acquire it for ttl once woken
// (by a preparation's notice), in the background.
func acquireOnNotice(t *testing.T, s *AdvisoryStore, name string, c leader.Candidate, ttl time.Duration) <-chan acquired {
	t.Helper()
	woken := watchFor(t, s, name, c)
	quieten(t, woken) // the wake-ups sent once listening
	done := make(chan acquired, 1)
	go func() {
		<-woken
		l, granted, err := s.Acquire(callCtx(t), name, c, ttl)
		done <- acquired{l, granted, err}
	}()
	return done
}

// await returns what done delivers, failing after 30 s.
func await(t *testing.T, done <-chan acquired) acquired {
	t.Helper()
	select {
	case r := <-done:
		return r
	case <-time.After(30 * time.Second):
		t.Fatal("the Acquire did not return")
		return acquired{}
	}
}

// advisoryRow is the advisory table's row of a name, as a prepared
// handover's release leaves it.
type advisoryRow struct {
	term                   int64
	holderToken, holderID  *string
	holderPID              *int32
	ttl                    *time.Duration
	priority               int32
	reason                 string
	acquiredAt, releasedAt *time.Time
	successorToken         *string
	reservedUntil          *time.Time
}

func readAdvisoryRow(t *testing.T, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, opts Options, name string) advisoryRow {
	t.Helper()
	var r advisoryRow
	err := q.QueryRow(callCtx(t), `SELECT term, holder_token, holder_id, holder_pid, ttl, priority, reason, acquired_at, released_at,
		successor_token, reserved_until FROM `+opts.qualifiedAdvisoryTable()+` WHERE name = $1`, name).
		Scan(&r.term, &r.holderToken, &r.holderID, &r.holderPID, &r.ttl, &r.priority, &r.reason, &r.acquiredAt, &r.releasedAt,
			&r.successorToken, &r.reservedUntil)
	if err != nil {
		t.Fatalf("reading the row of %q: %v", name, err)
	}
	return r
}

// locksOf returns, of the lock of key and of pid's mark, which pid holds.
func locksOf(t *testing.T, pool *pgxpool.Pool, key int64, pid int32) (lock, mark bool) {
	t.Helper()
	hi, lo := keyHalves(key)
	err := pool.QueryRow(callCtx(t), `SELECT EXISTS (`+heldBy("$1::bigint", "$2::bigint")+` AND l.pid = $3),
		EXISTS (`+markedBy("$3::int4")+`)`, hi, lo, pid).Scan(&lock, &mark)
	if err != nil {
		t.Fatal(err)
	}
	return lock, mark
}

// sessionPID returns the backend PID of c's session of name on s.
func sessionPID(t *testing.T, s *AdvisoryStore, name string, c leader.Candidate) int32 {
	t.Helper()
	s.smu.Lock()
	ss := s.sessions[sessionKey{name, c.Token}]
	s.smu.Unlock()
	var pid int32
	err := ss.do(callCtx(t), s, false, func(conn *pgx.Conn) error {
		pid = int32(conn.PgConn().PID())
		return nil
	})
	if err != nil {
		t.Fatalf("the session of %s: %v", c.ID, err)
	}
	return pid
}

// TestAdvisoryReleaseGrantsTheWaitingSuccessor checks that a prepared
// handover of the advisory strategy whose successor's session alone waits
// grants the lease to that session in its release (releaseGranting): the
// row names the successor, its backend, its priority and the handover's
// reason under the next term, acquired as it was released; the
// successor's waiting statements take the lock and the mark, and correct
// the row's TTL to the successor's own; the grant's announce clears the
// reservation. When the waiting
// session is not known (more than one waited), the release reserves the
// lease, and the successor, finding no grant to claim, is granted by its
// grant statement, acquired after the release.
func TestAdvisoryReleaseGrantsTheWaitingSuccessor(t *testing.T) {
	t.Parallel()
	for _, known := range []bool{true, false} {
		t.Run("waiter known "+strconv.FormatBool(known), func(t *testing.T) {
			t.Parallel()
			pool := pgtest.NewPool(t)
			a := setupAdvisory(t, pool, Options{})
			succ := setupAdvisory(t, pool, Options{})
			alice, bob := candidate("alice"), candidate("bob")
			bob.Priority = 3
			const ttl, bobTTL = time.Minute, 40 * time.Second
			l := mustGrant(t, a, "g", alice, ttl)
			done := acquireOnNotice(t, succ, "g", bob, bobTTL)
			p, err := a.PrepareHandover(callCtx(t), "g", alice.Token, l.Term, bob, 10*time.Second)
			if err != nil {
				t.Fatalf("PrepareHandover: %v", err)
			}
			ap := p.(*advisoryPrepared)
			if !ap.waited || ap.waiter == 0 {
				t.Fatalf("PrepareHandover returned with waited %v, waiter %d; want the successor's session found waiting", ap.waited, ap.waiter)
			}
			if !known {
				ap.waiter = 0 // as when two sessions waited
			}
			if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
				t.Fatalf("Commit: %v", err)
			}
			r := await(t, done)
			if r.err != nil || !r.granted || r.lease.Term != l.Term+1 || r.lease.Reason != leader.GrantTransfer || r.lease.Priority != 3 {
				t.Fatalf("the successor's Acquire: %+v granted %v err %v; want granted term %d for a transfer, priority 3", r.lease, r.granted, r.err, l.Term+1)
			}
			pid := sessionPID(t, succ, "g", bob)
			waitAnnounced(t, pool, succ, "g") // which clears the reservation
			row := readAdvisoryRow(t, pool, a.opts, "g")
			switch {
			case row.term != int64(l.Term)+1 || deref(row.holderToken) != bob.Token || deref(row.holderID) != "bob" ||
				row.holderPID == nil || *row.holderPID != pid || row.priority != 3 || row.reason != string(leader.GrantTransfer):
				t.Fatalf("the row after the handover: %+v; want term %d, bob's token, ID and backend %d, priority 3, reason transfer", row, l.Term+1, pid)
			case row.ttl == nil || *row.ttl != bobTTL:
				t.Errorf("the row's TTL is %v; want the successor's, %v", row.ttl, bobTTL)
			case row.successorToken != nil || row.reservedUntil != nil:
				t.Errorf("the row after the handover still has a reservation: %+v", row)
			case row.acquiredAt == nil || row.releasedAt == nil:
				t.Fatalf("the row after the handover: %+v; want acquired_at and released_at", row)
			case known && !row.acquiredAt.Equal(*row.releasedAt):
				t.Errorf("acquired at %v, released at %v; want the grant made by the release, at its time", row.acquiredAt, row.releasedAt)
			case !known && !row.acquiredAt.After(*row.releasedAt):
				t.Errorf("acquired at %v, released at %v; want the grant made by the successor's statement, after the release", row.acquiredAt, row.releasedAt)
			}
			if lock, mark := locksOf(t, pool, a.Key("g"), pid); !lock || !mark {
				t.Fatalf("the successor's session holds the lock %v, its mark %v; want both", lock, mark)
			}
			if o := mustObserve(t, a, "g"); o.HolderID != "bob" || o.Term != l.Term+1 {
				t.Fatalf("Observe after the handover: %+v; want bob's, term %d", o, l.Term+1)
			}
			// bob holds it as any holder does: renewed, and released.
			if _, err := succ.Renew(callCtx(t), "g", bob.Token, l.Term+1, bobTTL); err != nil {
				t.Fatalf("the successor's Renew: %v", err)
			}
			if err := succ.Release(callCtx(t), "g", bob.Token, l.Term+1); err != nil {
				t.Fatalf("the successor's Release: %v", err)
			}
		})
	}
}

// TestAwaitHandoverWaiterNamesTheOneWaiter checks that a preparation
// learns the backend of the session that waits for its lock, and none
// when two do.
func TestAwaitHandoverWaiterNamesTheOneWaiter(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	const key = int32(12345)
	holder, err := pool.Acquire(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Release()
	if _, err := holder.Exec(callCtx(t), `SELECT pg_advisory_lock($1::int4, $2::int4)`, int32(handoverClass), key); err != nil {
		t.Fatal(err)
	}
	ctx := callCtx(t)
	var (
		pids    []int32
		waiters []chan error
	)
	for i := range 2 {
		conn, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		pids = append(pids, int32(conn.Conn().PgConn().PID()))
		waited := make(chan error, 1)
		waiters = append(waiters, waited)
		go func() {
			defer conn.Release()
			_, err := conn.Exec(ctx, `SELECT pg_advisory_lock_shared($1::int4, $2::int4), pg_advisory_unlock_shared($1::int4, $2::int4)`,
				int32(handoverClass), key)
			waited <- err
		}()
		waiting, pid, err := awaitHandoverWaiter(ctx, pool, key, 10*time.Second)
		want := pids[0]
		if i == 1 {
			// The second waiter may not be seen at once: look until both are.
			for deadline := time.Now().Add(10 * time.Second); err == nil && pid != 0 && time.Now().Before(deadline); {
				time.Sleep(time.Millisecond)
				waiting, pid, err = awaitHandoverWaiter(ctx, pool, key, 0)
			}
			want = 0
		}
		if err != nil || !waiting || pid != want {
			t.Errorf("with %d waiting: waiting %v, pid %d, err %v; want waiting, pid %d", i+1, waiting, pid, err, want)
		}
	}
	if _, err := holder.Exec(ctx, `SELECT pg_advisory_unlock($1::int4, $2::int4)`, int32(handoverClass), key); err != nil {
		t.Fatal(err)
	}
	for _, w := range waiters {
		if err := <-w; err != nil {
			t.Error(err)
		}
	}
}

// TestAdvisoryReleaseGrantingRefusals checks the release that grants a
// prepared handover's successor (releaseGranting) on a row held by the
// backend that runs it, in transactions rolled back: it grants under the
// next term, above the strategy row's floor, the lease reserved for the
// successor as well, and otherwise (the name not
// the advisory strategy's, a failover's hold, no successor's backend)
// releases the lease reserved for the successor, as releaseHandedOver
// does; a session that does not hold the row releases nothing.
func TestAdvisoryReleaseGrantingRefusals(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	s := setupAdvisory(t, pool, Options{})
	alice, bob := candidate("alice"), candidate("bob")
	const ttl = time.Minute
	l := mustGrant(t, s, "r", alice, ttl)
	if err := s.Release(callCtx(t), "r", alice.Token, l.Term); err != nil {
		t.Fatal(err)
	}
	l = mustGrant(t, s, "r", alice, ttl)
	run := func(t *testing.T, setup string, term uint64, pid *int32) (released int64, granted bool, row advisoryRow) {
		t.Helper()
		tx, err := pool.Begin(callCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(context.Background()) //nolint:errcheck // rolled back on purpose
		// The row names this backend as its holder, as on alice's session.
		if _, err := tx.Exec(callCtx(t), `UPDATE `+s.opts.qualifiedAdvisoryTable()+` SET holder_pid = pg_backend_pid() WHERE name = 'r'`); err != nil {
			t.Fatal(err)
		}
		if setup != "" {
			if _, err := tx.Exec(callCtx(t), setup); err != nil {
				t.Fatal(err)
			}
		}
		if err := tx.QueryRow(callCtx(t), s.sql.releaseGranting, "r", alice.Token, int64(term), bob.Token, bob.ID, string(leader.GrantTransfer),
			int64(ttl/time.Microsecond), pid, int32(5)).Scan(&released, &granted); err != nil {
			t.Fatal(err)
		}
		return released, granted, readAdvisoryRow(t, tx, s.opts, "r")
	}
	succPID := int32(4242)
	t.Run("granted", func(t *testing.T) {
		released, granted, row := run(t, "", l.Term, &succPID)
		if released != 1 || !granted || row.term != int64(l.Term)+1 || deref(row.holderToken) != bob.Token || deref(row.holderID) != "bob" ||
			row.holderPID == nil || *row.holderPID != succPID || row.priority != 5 || row.reason != string(leader.GrantTransfer) ||
			row.ttl == nil || *row.ttl != ttl || deref(row.successorToken) != bob.Token || row.reservedUntil == nil ||
			row.acquiredAt == nil || row.releasedAt == nil || !row.acquiredAt.Equal(*row.releasedAt) {
			t.Fatalf("released %d granted %v, row %+v; want bob granted term %d on backend %d, priority 5, for a transfer, alice's TTL, reserved for bob",
				released, granted, row, l.Term+1, succPID)
		}
	})
	t.Run("above the strategy row's floor", func(t *testing.T) {
		floor := l.Term + 100
		_, granted, row := run(t, `UPDATE `+s.opts.qualifiedStrategyTable()+` SET term_floor = `+strconv.FormatUint(floor, 10)+` WHERE name = 'r'`, l.Term, &succPID)
		if !granted || row.term != int64(floor)+1 {
			t.Fatalf("granted %v, term %d; want term %d, above the floor %d", granted, row.term, floor+1, floor)
		}
	})
	for _, c := range []struct {
		what  string
		setup string
		pid   *int32
	}{
		{what: "the name is the lease strategy's", setup: `UPDATE ` + s.opts.qualifiedStrategyTable() + ` SET strategy = 'lease' WHERE name = 'r'`, pid: &succPID},
		{what: "a failover's hold", pid: &succPID,
			// An earlier timeline is recorded, and this one was first
			// seen just now: no grant for a TTL (see epochCTEs).
			setup: `INSERT INTO ` + s.opts.qualifiedEpochTable() + ` (timeline, seen_at) VALUES (0, clock_timestamp() - interval '1 hour');
INSERT INTO ` + s.opts.qualifiedEpochTable() + ` (timeline, seen_at)
SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint, clock_timestamp()
ON CONFLICT (timeline) DO UPDATE SET seen_at = excluded.seen_at`},
		{what: "no successor's backend"},
	} {
		t.Run(c.what, func(t *testing.T) {
			released, granted, row := run(t, c.setup, l.Term, c.pid)
			if released != 1 || granted || row.term != int64(l.Term) || row.holderToken != nil || row.holderPID != nil ||
				deref(row.successorToken) != bob.Token || row.reservedUntil == nil {
				t.Fatalf("released %d granted %v, row %+v; want released under term %d, reserved for bob, granted to nobody", released, granted, row, l.Term)
			}
		})
	}
	t.Run("not the holder's term", func(t *testing.T) {
		released, granted, row := run(t, "", l.Term-1, &succPID)
		if released != 0 || granted || row.term != int64(l.Term) || deref(row.holderToken) != alice.Token {
			t.Fatalf("released %d granted %v, row %+v; want nothing changed", released, granted, row)
		}
	})
}

// TestAdvisoryClaimTakesOnlyAGrantToItsSession checks the statements with
// which a prepared handover's successor claims the lease that the release
// granted it (claimLock, claimRow): it takes the lock and its mark and
// arms the holder's settings only if the row names its token and its
// backend and it gets the lock; a row naming another backend, or a lock
// someone else holds past lock_timeout (which claimLock waits for), leaves
// it holding nothing; and a lock taken while
// the row, read after it, names someone else, is let go.
func TestAdvisoryClaimTakesOnlyAGrantToItsSession(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	s := setupAdvisory(t, pool, Options{})
	alice, bob := candidate("alice"), candidate("bob")
	const ttl, bobTTL = time.Minute, 30 * time.Second
	l := mustGrant(t, s, "c", alice, ttl)
	if err := s.Release(callCtx(t), "c", alice.Token, l.Term); err != nil {
		t.Fatal(err)
	}
	key := s.Key("c")
	table := s.opts.qualifiedAdvisoryTable()
	iv, ms, idle, every := ttlSettings(bobTTL)
	// claim runs the two statements in a transaction on conn, as the
	// successor's waiting batch does, and returns the term claimed (nil
	// if none) and whether the mark was taken.
	claim := func(t *testing.T, conn *pgxpool.Conn, setting bool) (*int64, bool) {
		t.Helper()
		tx, err := conn.Begin(callCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(context.Background()) //nolint:errcheck // a no-op after Commit
		// As the successor's batch sets it for claimLock (waitThenRun).
		if _, err := tx.Exec(callCtx(t), `SELECT set_config('lock_timeout', $1, true)`, strconv.FormatInt(beforeLockWait.Milliseconds(), 10)+"ms"); err != nil {
			t.Fatal(err)
		}
		if setting {
			// claimLock's record, as if it had taken the lock.
			if _, err := tx.Exec(callCtx(t), `SELECT set_config('`+claimedSetting+`', 'true', true)`); err != nil {
				t.Fatal(err)
			}
		} else if _, err := tx.Exec(callCtx(t), s.sql.claimLock, "c", bob.Token, key); err != nil {
			t.Fatal(err)
		}
		var (
			term       *int64
			acquiredAt *time.Time
			marked     bool
			priority   *int32
			reason     *string
			n          int64
		)
		if err := tx.QueryRow(callCtx(t), s.sql.claimRow, "c", bob.Token, key, iv, ms, idle, every).
			Scan(&term, &acquiredAt, &marked, &priority, &reason, &n); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(callCtx(t)); err != nil {
			t.Fatal(err)
		}
		return term, marked
	}
	// grantTo makes the row name bob's token and pid's backend under the
	// next term, as releaseGranting does.
	grantTo := func(t *testing.T, pid int32) int64 {
		t.Helper()
		var term int64
		if err := pool.QueryRow(callCtx(t), `UPDATE `+table+` SET (term, holder_token, holder_id, holder_pid, ttl, acquired_at) =
			(term + 1, $2, 'bob', $3, $4::interval, clock_timestamp()) WHERE name = $1 RETURNING term`, "c", bob.Token, pid, ttl).Scan(&term); err != nil {
			t.Fatal(err)
		}
		return term
	}
	conn := func(t *testing.T) (*pgxpool.Conn, int32) {
		t.Helper()
		c, err := pool.Acquire(callCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			c.Conn().Close(context.Background()) // frees whatever it holds
			c.Release()
		})
		return c, int32(c.Conn().PgConn().PID())
	}

	t.Run("granted to this session", func(t *testing.T) {
		x, pid := conn(t)
		want := grantTo(t, pid)
		term, marked := claim(t, x, false)
		if term == nil || *term != want || !marked {
			t.Fatalf("claimed term %v, marked %v; want term %d and the mark", term, marked, want)
		}
		if lock, mark := locksOf(t, pool, key, pid); !lock || !mark {
			t.Fatalf("the session holds the lock %v, its mark %v; want both", lock, mark)
		}
		var timeout string
		if err := x.QueryRow(callCtx(t), `SELECT current_setting('idle_session_timeout')`).Scan(&timeout); err != nil {
			t.Fatal(err)
		}
		if timeout != "30s" {
			t.Errorf("idle_session_timeout is %q; want the TTL, 30s", timeout)
		}
		if row := readAdvisoryRow(t, pool, s.opts, "c"); row.ttl == nil || *row.ttl != bobTTL || row.term != want {
			t.Errorf("the row after the claim: %+v; want the claimant's TTL %v, term %d", row, bobTTL, want)
		}
	})
	t.Run("granted to another backend", func(t *testing.T) {
		x, pid := conn(t)
		grantTo(t, pid+1_000_000)
		if term, _ := claim(t, x, false); term != nil {
			t.Fatalf("claimed term %d of a grant to another backend", *term)
		}
		if lock, mark := locksOf(t, pool, key, pid); lock || mark {
			t.Fatalf("the session holds the lock %v, its mark %v; want neither", lock, mark)
		}
	})
	t.Run("the lock held by another", func(t *testing.T) {
		x, pid := conn(t)
		y, _ := conn(t)
		if _, err := y.Exec(callCtx(t), `SELECT pg_advisory_lock($1::bigint)`, key); err != nil {
			t.Fatal(err)
		}
		grantTo(t, pid)
		// claimLock waits for the lock, for lock_timeout at most.
		tx, err := x.Begin(callCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(callCtx(t), `SELECT set_config('lock_timeout', '50ms', true)`); err != nil {
			t.Fatal(err)
		}
		_, err = tx.Exec(callCtx(t), s.sql.claimLock, "c", bob.Token, key)
		if err := tx.Rollback(callCtx(t)); err != nil {
			t.Fatal(err)
		}
		if pgErr := (*pgconn.PgError)(nil); !errors.As(err, &pgErr) || pgErr.Code != "55P03" {
			t.Fatalf("claimLock while another session holds the lock: %v; want it to wait and run out of lock_timeout (55P03)", err)
		}
		if lock, mark := locksOf(t, pool, key, pid); lock || mark {
			t.Fatalf("the session holds the lock %v, its mark %v; want neither", lock, mark)
		}
	})
	t.Run("the lock taken, the row another's", func(t *testing.T) {
		x, pid := conn(t)
		grantTo(t, pid+1_000_000)
		if _, err := x.Exec(callCtx(t), `SELECT pg_advisory_lock($1::bigint)`, key); err != nil {
			t.Fatal(err)
		}
		if term, _ := claim(t, x, true); term != nil {
			t.Fatalf("claimed term %d of a grant to another backend", *term)
		}
		if lock, mark := locksOf(t, pool, key, pid); lock || mark {
			t.Fatalf("after the claim the session holds the lock %v, its mark %v; want neither", lock, mark)
		}
	})
}

// TestAdvisoryGrantToAGoneSuccessor checks that a release that granted the
// lease to a successor's session that ended before it could claim it (its
// backend terminated as it waited) leaves a lease that another candidate
// is refused while it stays reserved for the successor, and then takes,
// with the term after the grant's, for an expiry, after TakeoverGrace, as
// from a holder gone without a release: nobody held the lock under the
// grant's term.
func TestAdvisoryGrantToAGoneSuccessor(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	const grace, hold = 300 * time.Millisecond, time.Second
	a := setupAdvisory(t, pool, Options{})
	succ := setupAdvisory(t, pool, Options{})
	other := setupAdvisory(t, pool, Options{TakeoverGrace: grace})
	alice, bob, carol := candidate("alice"), candidate("bob"), candidate("carol")
	const ttl = time.Minute
	l := mustGrant(t, a, "gone", alice, ttl)
	done := acquireOnNotice(t, succ, "gone", bob, ttl)
	p, err := a.PrepareHandover(callCtx(t), "gone", alice.Token, l.Term, bob, 10*time.Second)
	if err != nil {
		t.Fatalf("PrepareHandover: %v", err)
	}
	pid := p.(*advisoryPrepared).waiter
	if pid == 0 {
		t.Fatal("PrepareHandover did not find the successor's session waiting")
	}
	var ended bool
	if err := pool.QueryRow(callCtx(t), `SELECT pg_terminate_backend($1, 10000)`, pid).Scan(&ended); err != nil || !ended {
		t.Fatalf("terminating the successor's backend: %v, %v", ended, err)
	}
	if r := await(t, done); r.granted {
		t.Fatalf("the successor, its session ended, was granted %+v", r.lease)
	}
	if err := p.Commit(callCtx(t), leader.GrantTransfer, hold); err != nil {
		t.Fatalf("Commit: %v", err)
	}
	committed := time.Now()
	row := readAdvisoryRow(t, pool, a.opts, "gone")
	if row.term != int64(l.Term)+1 || deref(row.holderToken) != bob.Token || row.holderPID == nil || *row.holderPID != pid {
		t.Fatalf("the row after the Commit: %+v; want granted to bob's ended backend %d under term %d", row, pid, l.Term+1)
	}
	if o := mustObserve(t, a, "gone"); o.Held() || o.Successor != "bob" {
		t.Fatalf("Observe after a grant to an ended session: %+v; want nobody holding it, reserved for bob", o)
	}
	g, granted, err := other.Acquire(callCtx(t), "gone", carol, ttl)
	if err != nil || granted || g.Successor != "bob" {
		t.Fatalf("carol's Acquire during the reservation: %+v granted %v err %v; want refused, told of bob's reservation", g, granted, err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for !granted && err == nil && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
		g, granted, err = other.Acquire(callCtx(t), "gone", carol, ttl)
	}
	if err != nil || !granted {
		t.Fatalf("carol's Acquire after the reservation: %+v granted %v err %v", g, granted, err)
	}
	if took := time.Since(committed); took < hold+grace-grace/5 {
		t.Errorf("carol was granted %v after the Commit; want the reservation, %v, and TakeoverGrace, %v, as after a holder gone without a release", took, hold, grace)
	}
	if g.Term != l.Term+2 || g.Reason != leader.GrantExpiry {
		t.Fatalf("carol was granted %+v; want term %d, for an expiry", g, l.Term+2)
	}
}

// TestAdvisoryGrantedReleaseStaysReserved checks that a lease that a
// handover's release granted to its successor's session (the row names the
// successor, reserved for it), before the successor holds the lock,
// refuses another candidate without its trying the lock, and that the
// successor, on a session that is not the one named (its claim found
// nothing), is granted it in its own statement with the term after it, for
// the handover's reason, without TakeoverGrace.
func TestAdvisoryGrantedReleaseStaysReserved(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	// Long beside what bob's Acquire takes however busy the machine: its
	// first opens bob's session (a second, at times, under load).
	const grace = 10 * time.Second
	s := setupAdvisory(t, pool, Options{TakeoverGrace: grace})
	alice, bob, carol := candidate("alice"), candidate("bob"), candidate("carol")
	const ttl = time.Minute
	l := mustGrant(t, s, "kept", alice, ttl)
	if err := s.Release(callCtx(t), "kept", alice.Token, l.Term); err != nil {
		t.Fatal(err)
	}
	// As releaseGranting leaves it, granted to a backend that is not
	// bob's session's.
	if _, err := pool.Exec(callCtx(t), `UPDATE `+s.opts.qualifiedAdvisoryTable()+` SET (term, holder_token, holder_id, holder_pid, ttl, acquired_at,
		successor_token, successor_id, successor_reason, reserved_until) = (term + 1, $2, 'bob', 1000000000, $3::interval, clock_timestamp(),
		$2, 'bob', 'transfer', clock_timestamp() + interval '1 minute') WHERE name = $1`, "kept", bob.Token, ttl); err != nil {
		t.Fatal(err)
	}
	g, granted, err := s.Acquire(callCtx(t), "kept", carol, ttl)
	if err != nil || granted || g.Successor != "bob" {
		t.Fatalf("carol's Acquire: %+v granted %v err %v; want refused, told of bob's reservation", g, granted, err)
	}
	if lock, _ := locksOf(t, pool, s.Key("kept"), sessionPID(t, s, "kept", carol)); lock {
		t.Fatal("carol's session holds the lock of a lease reserved for bob")
	}
	start := time.Now()
	g, granted, err = s.Acquire(callCtx(t), "kept", bob, ttl)
	if err != nil || !granted || g.Term != l.Term+2 || g.Reason != leader.GrantTransfer {
		t.Fatalf("bob's Acquire: %+v granted %v err %v; want granted term %d for a transfer", g, granted, err, l.Term+2)
	}
	if took := time.Since(start); took >= grace {
		t.Errorf("bob's grant took %v: it waited TakeoverGrace (%v) for itself", took, grace)
	}
}

// TestAdvisoryLockWaiterTakesAnUnclaimedGrantForAGrantInFlight checks that
// a lock waiter that finds the lease's lock held without its mark by the
// backend that a handover's release granted the lease to (the row names
// it, still reserved for it: its claim has taken the lock, not yet the
// mark) takes it for a grant in flight, and looks again, rather than for a
// holder without its mark, whose lock it would wait on itself: that wait,
// granted the shared lock at the holder's next unlock, made the next
// successor's claim fail.
func TestAdvisoryLockWaiterTakesAnUnclaimedGrantForAGrantInFlight(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	s := setupAdvisory(t, pool, Options{})
	watchers := setupAdvisory(t, pool, Options{})
	watchers.waiterPoll = 20 * time.Millisecond // looks often at a free lock
	const name = "claiming"
	alice, bob := candidate("alice"), candidate("bob")
	l := mustGrant(t, s, name, alice, time.Minute)
	mustRelease(t, s, name, alice, l.Term)
	ch := watchers.watchFreeSettled(t, name)
	drain(ch)
	key := s.Key(name)
	x, err := pool.Acquire(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		x.Conn().Close(context.Background()) // frees its locks
		x.Release()
	}()
	pid := int32(x.Conn().PgConn().PID())
	// As releaseGranting leaves the row, granted to x's backend, which
	// then takes the lock without its mark yet.
	if _, err := pool.Exec(callCtx(t), `UPDATE `+s.opts.qualifiedAdvisoryTable()+` SET (term, holder_token, holder_id, holder_pid, ttl, acquired_at,
		successor_token, successor_id, successor_reason, reserved_until) = (term + 1, $2, 'bob', $3, interval '1 minute', clock_timestamp(),
		$2, 'bob', 'transfer', clock_timestamp() + interval '1 minute') WHERE name = $1`, name, bob.Token, pid); err != nil {
		t.Fatal(err)
	}
	if _, err := x.Exec(callCtx(t), `SELECT pg_advisory_lock($1::bigint)`, key); err != nil {
		t.Fatal(err)
	}
	// Several of the lock waiter's looks (every 20 ms at a free lock, and
	// at markLook and after for a grant in flight) come meanwhile.
	for range 10 {
		time.Sleep(30 * time.Millisecond)
		if r := requests(t, pool, key, pid); r.lockSharedWaiting != 0 {
			t.Fatalf("the lock waiter waits on the lease's lock itself (%+v): it took the claiming successor for a holder without its mark", r)
		}
	}
	// The claim takes the mark: the lock waiter waits on it.
	if _, err := x.Exec(callCtx(t), `SELECT pg_advisory_lock(`+markClass+`, pg_backend_pid())`); err != nil {
		t.Fatal(err)
	}
	electortest.Eventually(t, 10*time.Second, "the lock waiter on the successor's mark", func() bool {
		return requests(t, pool, key, pid).markSharedWaiting == 1
	})
}

// TestAdvisoryUnlockIfHeld checks the clean-up after a claim whose wait
// ran out: a session that holds the lease's lock (granted as the wait ran
// out) lets go of it, and one that does not is left as it is.
func TestAdvisoryUnlockIfHeld(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	s := setupAdvisory(t, pool, Options{})
	key := s.Key("held")
	c, err := pool.Acquire(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release()
	pid := int32(c.Conn().PgConn().PID())
	if err := s.unlockIfHeld(callCtx(t), c.Conn(), key); err != nil {
		t.Fatalf("unlockIfHeld on a session holding nothing: %v", err)
	}
	if _, err := c.Exec(callCtx(t), `SELECT pg_advisory_lock($1::bigint)`, key); err != nil {
		t.Fatal(err)
	}
	if lock, _ := locksOf(t, pool, key, pid); !lock {
		t.Fatal("the session does not hold the lock it took")
	}
	if err := s.unlockIfHeld(callCtx(t), c.Conn(), key); err != nil {
		t.Fatalf("unlockIfHeld: %v", err)
	}
	if lock, _ := locksOf(t, pool, key, pid); lock {
		t.Fatal("the session still holds the lock after unlockIfHeld")
	}
}

// TestAdvisoryClaimWaitsForALockHeldForAMoment checks that a prepared
// handover's successor whose claim finds the lease's lock held by another
// session (a follower whose grant's snapshot came before the release
// takes it as the release frees it, and lets go once it finds the row
// reserved) waits for it, and is granted the term that the release wrote;
// and that one held past beforeLockWait ends the claim's transaction
// without an error: the successor's Acquire is refused while the other
// session holds the lock, and granted, still for the transfer, under the
// term after, once it lets go. The other session waits for the lease's
// lock before the Commit, so it is granted the lock as the release frees
// it, before the successor's claim: with a claim that only tried the lock,
// the first case was granted under the term after (1 bench transfer in
// 100).
func TestAdvisoryClaimWaitsForALockHeldForAMoment(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		hold time.Duration
	}{{"a moment", 5 * time.Millisecond}, {"past the claim's wait", 40 * beforeLockWait}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			pool := pgtest.NewPool(t)
			a := setupAdvisory(t, pool, Options{})
			succ := setupAdvisory(t, pool, Options{})
			alice, bob := candidate("alice"), candidate("bob")
			const ttl = time.Minute
			name := "moment"
			l := mustGrant(t, a, name, alice, ttl)
			key := a.Key(name)
			// y queues for the lease's lock, and holds it for c.hold once
			// it has it.
			y, err := pool.Acquire(callCtx(t))
			if err != nil {
				t.Fatal(err)
			}
			yPID := int32(y.Conn().PgConn().PID())
			letGo := make(chan error, 1)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			t.Cleanup(func() {
				cancel()
				<-letGo // y is no longer in use
				y.Conn().Close(context.Background())
				y.Release()
			})
			go func() {
				if _, err := y.Exec(ctx, `SELECT pg_advisory_lock($1::bigint)`, key); err != nil {
					letGo <- err
					return
				}
				time.Sleep(c.hold)
				_, err := y.Exec(ctx, `SELECT pg_advisory_unlock($1::bigint)`, key)
				letGo <- err
			}()
			hi, lo := keyHalves(key)
			electortest.Eventually(t, 10*time.Second, "the other session waiting for the lease's lock", func() bool {
				var waiting bool
				err := pool.QueryRow(callCtx(t), `SELECT EXISTS (SELECT FROM pg_locks AS l WHERE l.locktype = 'advisory'
					AND l.classid = $1::bigint::oid AND l.objid = $2::bigint::oid AND l.objsubid = 1 AND l.pid = $3 AND NOT l.granted)`,
					hi, lo, yPID).Scan(&waiting)
				return err == nil && waiting
			})
			done := acquireOnNotice(t, succ, name, bob, ttl)
			p, err := a.PrepareHandover(callCtx(t), name, alice.Token, l.Term, bob, 10*time.Second)
			if err != nil {
				t.Fatalf("PrepareHandover: %v", err)
			}
			if p.(*advisoryPrepared).waiter == 0 {
				t.Fatal("PrepareHandover did not find the successor's session waiting")
			}
			if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
				t.Fatalf("Commit: %v", err)
			}
			r := await(t, done)
			if c.hold < beforeLockWait {
				if r.err != nil || !r.granted || r.lease.Term != l.Term+1 || r.lease.Reason != leader.GrantTransfer {
					t.Fatalf("the successor's Acquire: %+v granted %v err %v; want granted the release's term %d, for a transfer", r.lease, r.granted, r.err, l.Term+1)
				}
				return
			}
			if r.err != nil || r.granted {
				t.Fatalf("the successor's Acquire while the other session holds the lock: %+v granted %v err %v; want refused, without an error", r.lease, r.granted, r.err)
			}
			electortest.Eventually(t, 10*time.Second, "the other session letting go of the lease's lock", func() bool {
				lock, _ := locksOf(t, pool, key, yPID)
				return !lock
			})
			g, granted, err := succ.Acquire(callCtx(t), name, bob, ttl)
			if err != nil || !granted || g.Term != l.Term+2 || g.Reason != leader.GrantTransfer {
				t.Fatalf("the successor's next Acquire: %+v granted %v err %v; want granted term %d, for a transfer", g, granted, err, l.Term+2)
			}
		})
	}
}
