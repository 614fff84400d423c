package postgres

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/pgtest"
)

// lockRequests counts the advisory lock requests in the pool's database
// by mode, granted or waiting, on the lock of key (objsubid 1) and on the
// mark of the backend pid (see markClass).
type lockRequests struct {
	lockExclusive, lockSharedWaiting, lockShared   int
	markExclusive, markSharedWaiting, markSharedOK int
}

func requests(t *testing.T, pool *pgxpool.Pool, key int64, pid int32) lockRequests {
	t.Helper()
	hi, lo := keyHalves(key)
	rows, err := pool.Query(callCtx(t), `SELECT l.objsubid, l.mode, l.granted FROM pg_locks AS l
		WHERE l.locktype = 'advisory'
			AND l.database = (SELECT d.oid FROM pg_database AS d WHERE d.datname = current_database()) AND (
			(l.classid::bigint = $1 AND l.objid::bigint = $2 AND l.objsubid = 1) OR
			(l.classid::bigint = `+markClassOID+` AND l.objid::bigint = $3 AND l.objsubid = 2))`, hi, lo, pid)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var r lockRequests
	for rows.Next() {
		var (
			sub     int16
			mode    string
			granted bool
		)
		if err := rows.Scan(&sub, &mode, &granted); err != nil {
			t.Fatal(err)
		}
		switch {
		case sub == 1 && mode == "ExclusiveLock" && granted:
			r.lockExclusive++
		case sub == 1 && mode == "ShareLock" && !granted:
			r.lockSharedWaiting++
		case sub == 1 && mode == "ShareLock":
			r.lockShared++
		case sub == 2 && mode == "ExclusiveLock" && granted:
			r.markExclusive++
		case sub == 2 && mode == "ShareLock" && !granted:
			r.markSharedWaiting++
		case sub == 2 && mode == "ShareLock":
			r.markSharedOK++
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return r
}

// holderPID returns the backend PID of the session of s that holds name.
func (s *AdvisoryStore) holderPID(t *testing.T, name string) int32 {
	t.Helper()
	ss := s.holderSession(t, name)
	ss.turn <- struct{}{}
	defer func() { <-ss.turn }()
	return int32(ss.conn.PgConn().PID())
}

// waitFirstLook waits until the lock waiter of name has made its first
// look, and woken the watchers if it found the lock free.
func (s *AdvisoryStore) waitFirstLook(t *testing.T, name string) {
	t.Helper()
	s.smu.Lock()
	w := s.waiters[name]
	s.smu.Unlock()
	if w == nil {
		t.Fatalf("no lock waiter for %q", name)
	}
	select {
	case <-w.looked:
	case <-time.After(30 * time.Second):
		t.Fatalf("the lock waiter of %q made no first look within 30s", name)
	}
}

// advisoryOn returns an AdvisoryStore (migrated, closed with the test) on a
// pool of its own to pool's database, whose connection config change has
// changed: a tracer, or a hook at connect.
func advisoryOn(t *testing.T, pool *pgxpool.Pool, change func(*pgx.ConnConfig)) *AdvisoryStore {
	t.Helper()
	return setupAdvisory(t, poolWith(t, pool, change), Options{})
}

// poolWith returns a pool on pool's database whose connections' config is
// changed by change, closed when t ends.
func poolWith(t *testing.T, pool *pgxpool.Pool, change func(*pgx.ConnConfig)) *pgxpool.Pool {
	t.Helper()
	config := pool.Config()
	change(config.ConnConfig)
	own, err := pgxpool.NewWithConfig(callCtx(t), config)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(own.Close)
	return own
}

// listeningSignal returns a channel closed once s's listener has first
// LISTENed (see wakeups.onListen). s must not have listened before.
func (s *AdvisoryStore) listeningSignal() <-chan struct{} {
	listening := make(chan struct{})
	s.onListen = func(uint32) {
		select {
		case <-listening:
		default:
			close(listening)
		}
	}
	return listening
}

// watchFreeSettled returns s.WatchFree(name) once s listens and name's
// lock waiter has made its first look.
func (s *AdvisoryStore) watchFreeSettled(t *testing.T, name string) <-chan struct{} {
	t.Helper()
	listening := s.listeningSignal()
	ch, err := s.WatchFree(t.Context(), name)
	if err != nil {
		t.Fatal(err)
	}
	<-listening
	s.waitFirstLook(t, name)
	return ch
}

// lockRow locks the advisory strategy's row of name (which must exist) in
// a transaction of its own, rolled back when the test ends unless the
// caller does so first.
func lockRow(t *testing.T, pool *pgxpool.Pool, name string) pgx.Tx {
	t.Helper()
	tx, err := pool.Begin(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback(context.Background()) })
	if _, err := tx.Exec(callCtx(t), "SELECT FROM leader_advisory WHERE name = $1 FOR UPDATE", name); err != nil {
		t.Fatal(err)
	}
	return tx
}

// TestAdvisoryLockWaitersWaitOnTheHoldersMark checks that a holder takes
// its mark with the lock and lets it go at its release, and that lock
// waiters wait on the mark, not on the lock, so that they never stand in
// a candidate's way; and that a holder without its mark is waited for on
// the lock itself, and its release still wakes the followers.
func TestAdvisoryLockWaitersWaitOnTheHoldersMark(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	holders := setupAdvisory(t, pool, Options{})
	const name = "marked"
	key := holders.Key(name)
	var watchers []<-chan struct{}
	for range 3 {
		ch, err := setupAdvisory(t, pool, Options{}).WatchFree(t.Context(), name)
		if err != nil {
			t.Fatal(err)
		}
		watchers = append(watchers, ch)
	}
	alice := candidate("alice")

	held := mustGrant(t, holders, name, alice, time.Minute)
	pid := holders.holderPID(t, name)
	electortest.Eventually(t, 10*time.Second, "three lock waiters waiting on the holder's mark", func() bool {
		return requests(t, pool, key, pid).markSharedWaiting == 3
	})
	if r := requests(t, pool, key, pid); r.lockExclusive != 1 || r.markExclusive != 1 || r.lockSharedWaiting+r.lockShared != 0 {
		t.Fatalf("with the lock held and waited for: %+v; want the holder on the lock and its mark, and no one else on the lock", r)
	}
	for _, ch := range watchers {
		drain(ch)
	}
	mustRelease(t, holders, name, alice, held.Term)
	for _, ch := range watchers {
		waitWake(t, ch, "after a release the lock waiter saw")
	}
	electortest.Eventually(t, 10*time.Second, "the released holder's locks and mark gone", func() bool {
		r := requests(t, pool, key, pid)
		return r == lockRequests{}
	})

	// A holder without its mark (as when a stray session holds it): the
	// lock waiters look again, then wait on the lock itself.
	held = mustGrant(t, holders, name, alice, time.Minute)
	pid = holders.holderPID(t, name)
	unmark(t, holders, name)
	electortest.Eventually(t, 10*time.Second, "three lock waiters waiting on the unmarked lock", func() bool {
		return requests(t, pool, key, pid).lockSharedWaiting == 3
	})
	for _, ch := range watchers {
		drain(ch)
	}
	mustRelease(t, holders, name, alice, held.Term)
	for _, ch := range watchers {
		waitWake(t, ch, "after the release of an unmarked lock")
	}
}

// unmark has the session that holds name's lease on s let go of its
// mark, keeping the lease's lock, as when a stray session holds the mark.
func unmark(t *testing.T, s *AdvisoryStore, name string) {
	t.Helper()
	err := s.holderSession(t, name).do(callCtx(t), s, false, func(conn *pgx.Conn) error {
		_, err := conn.Exec(callCtx(t), "SELECT pg_advisory_unlock("+markClass+", pg_backend_pid())")
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

// countingAdvisory counts an AdvisoryStore's Acquire calls, by candidate
// ID: those begun, and those that have returned.
type countingAdvisory struct {
	*AdvisoryStore
	mu       sync.Mutex
	begun    map[string]int
	returned map[string]int
}

func newCountingAdvisory(s *AdvisoryStore) *countingAdvisory {
	return &countingAdvisory{AdvisoryStore: s, begun: make(map[string]int), returned: make(map[string]int)}
}

func (c *countingAdvisory) Acquire(ctx context.Context, name string, cand leader.Candidate, ttl time.Duration) (leader.Lease, bool, error) {
	c.mu.Lock()
	c.begun[cand.ID]++
	c.mu.Unlock()
	defer func() {
		c.mu.Lock()
		c.returned[cand.ID]++
		c.mu.Unlock()
	}()
	return c.AdvisoryStore.Acquire(ctx, name, cand, ttl)
}

// counts returns a copy of the counts of calls begun and returned.
func (c *countingAdvisory) counts() (begun, returned map[string]int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return maps.Clone(c.begun), maps.Clone(c.returned)
}

// TestAdvisoryFollowersWakeOncePerHandover checks that followers whose
// lock waiter waits on the holder's mark are woken once by a release, not
// once by its notification and again by the lock waiter: a follower that
// is woken twice tries twice. It fails too if a release unlocks before it
// commits its row, as the lock waiter then takes the release for a
// session that ended.
func TestAdvisoryFollowersWakeOncePerHandover(t *testing.T) {
	t.Parallel()
	const followers = 5
	pool := pgtest.NewPool(t)
	holders := setupAdvisory(t, pool, Options{})
	others := newCountingAdvisory(setupAdvisory(t, pool, Options{}))
	const name = "once"
	h := newBeliefs()
	newElector := func(s leader.Store, id string) *leader.Elector {
		cfg := leader.Config{Name: name, ID: id, TTL: time.Minute, Logger: slog.New(slog.DiscardHandler)} // no renewal, expiry or retry during the test
		cfg.OnElected, cfg.OnDemoted = h.Hooks(t, id)
		e, err := leader.New(s, cfg)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); _ = e.Run(ctx) }()
		t.Cleanup(func() { cancel(); <-done })
		return e
	}
	first := newElector(holders, "first")
	electortest.Eventually(t, 10*time.Second, "the first elected", first.IsLeader)
	pid := holders.holderPID(t, name)
	// The followers' store listens before they watch: the wake-up of
	// every watcher once listening would otherwise make some of them try
	// twice before the handover, perhaps the second time after it began.
	others.watchFreeSettled(t, name)
	var es []*leader.Elector
	ids := make([]string, followers)
	for i := range followers {
		ids[i] = fmt.Sprint("f", i)
		es = append(es, newElector(others, ids[i]))
	}
	// Each follower has been refused and now waits for a wake-up (or the
	// expiry, a minute away).
	electortest.Eventually(t, 10*time.Second, "every follower refused once, and the lock waiter on the mark", func() bool {
		_, returned := others.counts()
		for _, id := range ids {
			if returned[id] < 1 {
				return false
			}
		}
		// The holder's own store may watch too, so at least one lock waiter.
		return requests(t, pool, holders.Key(name), pid).markSharedWaiting >= 1
	})
	before, _ := others.counts()
	if err := first.Resign(t.Context()); err != nil {
		t.Fatal(err)
	}
	leaderOf(t, es, 10*time.Second)
	time.Sleep(300 * time.Millisecond) // for any attempt a second wake-up would cause
	after, _ := others.counts()
	for _, id := range ids {
		if n := after[id] - before[id]; n > 1 {
			t.Errorf("follower %s made %d acquire attempts at a handover; want at most one", id, n)
		}
	}
}

// TestAdvisoryGraceCountsFromTheFreeing checks that the TakeoverGrace
// after a holder's session ended without a release is counted from when
// the lock waiter saw the lock freed, not from the grant: a candidate that
// comes late is not held back for the whole grace again, and no grant is
// reported before the grace has passed since the holder's session ended.
func TestAdvisoryGraceCountsFromTheFreeing(t *testing.T) {
	t.Parallel()
	// The candidate comes late, 3 s into the grace: a grant that counted the
	// grace from the call would take all of it, and the margin between
	// the two is wide enough for a busy machine.
	const (
		grace = 5 * time.Second
		late  = 3 * time.Second
	)
	pool := pgtest.NewPool(t)
	holders := setupAdvisory(t, pool, Options{TakeoverGrace: grace})
	others := setupAdvisory(t, pool, Options{TakeoverGrace: grace})
	const name = "grace"
	alice, bob := candidate("alice"), candidate("bob")
	held := mustGrant(t, holders, name, alice, time.Minute)
	pid := holders.holderPID(t, name)
	free, err := others.WatchFree(t.Context(), name)
	if err != nil {
		t.Fatal(err)
	}
	electortest.Eventually(t, 10*time.Second, "the lock waiter on the mark", func() bool {
		return requests(t, pool, holders.Key(name), pid).markSharedWaiting == 1
	})
	drain(free)
	cut := time.Now()
	holders.cutConnection(t, name)
	waitWake(t, free, "after the holder's connection was cut")
	time.Sleep(late) // the candidate comes late, not a wait for something
	start := time.Now()
	l, granted := mustAcquire(t, others, name, bob, time.Minute)
	end := time.Now()
	if !granted || l.Term != held.Term+1 {
		t.Fatalf("Acquire: %+v granted %v; want granted with term %d", l, granted, held.Term+1)
	}
	if since := end.Sub(cut); since < grace {
		t.Errorf("granted %v after the holder's connection was cut; want at least the TakeoverGrace (%v)", since, grace)
	}
	if took := end.Sub(start); took > grace*9/10 {
		t.Errorf("Acquire took %v, %v after the lock waiter saw the lock freed; want the rest of the TakeoverGrace (%v) only", took, start.Sub(cut), grace)
	}
}

// TestAdvisoryCandidatesShareAnAttempt checks that candidates of a name
// that call Acquire on one store while another candidate's attempt is in
// progress wait for it, and that one more attempt then serves them all:
// the first is granted, and the others are refused and told who holds the
// lease, with two sessions connected in all. An attempt that began before
// a candidate's call cannot answer it (the lease may have been freed
// since), so they cannot share the first. The others are enlisted, with
// their priorities, by the statement of the attempt they share and by one
// statement more for those refused with its outcome.
func TestAdvisoryCandidatesShareAnAttempt(t *testing.T) {
	t.Parallel()
	const grace = 3 * time.Second // how long the first attempt lasts: long enough for the others to come during it on a busy machine
	pool := pgtest.NewPool(t)
	holders := setupAdvisory(t, pool, Options{})
	enlists := &statementCounter{marker: newCandidateStatements(Options{}.withDefaults()).enlistShared}
	s := setupAdvisory(t, poolWith(t, pool, func(c *pgx.ConnConfig) { c.Tracer = enlists }), Options{TakeoverGrace: grace})
	const name = "shared"
	mustGrant(t, holders, name, candidate("alice"), time.Minute)
	holders.cutConnection(t, name) // a grant now waits the grace
	electortest.Eventually(t, 10*time.Second, "the lock freed", func() bool {
		return !observe(t, s, name).Held()
	})

	type outcome struct {
		l       leader.Lease
		granted bool
		err     error
	}
	first := make(chan outcome, 1)
	go func() {
		l, granted, err := s.Acquire(callCtx(t), name, candidate("first"), time.Minute)
		first <- outcome{l, granted, err}
	}()
	electortest.Eventually(t, 10*time.Second, "the first attempt in progress", func() bool {
		s.smu.Lock()
		defer s.smu.Unlock()
		return s.flights[name] != nil
	})
	const others = 10
	rest := make(chan outcome, others)
	var want []string // their entries among the candidates
	for i := range others {
		c := candidate(fmt.Sprint("c", i))
		c.Priority = i - 5
		want = append(want, fmt.Sprintf("%s/%d", c.ID, c.Priority))
		go func() {
			l, granted, err := s.Acquire(callCtx(t), name, c, time.Minute)
			rest <- outcome{l, granted, err}
		}()
	}
	o := <-first
	if o.err != nil || !o.granted {
		t.Fatalf("the first candidate: %+v granted %v, %v; want granted", o.l, o.granted, o.err)
	}
	for range others {
		r := <-rest
		if r.err != nil || r.granted || r.l.HolderID != "first" || r.l.Term != o.l.Term || r.l.Remaining <= 0 {
			t.Errorf("a candidate that came during the first attempt: %+v granted %v, %v; want refused, told that first holds term %d", r.l, r.granted, r.err, o.l.Term)
		}
	}
	s.smu.Lock()
	connected := 0
	for _, ss := range s.sessions {
		if ss.conn != nil {
			connected++
		}
	}
	s.smu.Unlock()
	if connected != 2 {
		t.Errorf("%d sessions connected for %d candidates; want 2: the first candidate's, and one whose attempt the others share", connected, others+1)
	}
	slices.Sort(want)
	if got := candidateList(t, s, name); !slices.Equal(got, want) {
		t.Errorf("Candidates = %v; want the refused candidates, %v (the first, granted, is not enlisted)", got, want)
	}
	if n := enlists.n.Load(); n != 1 {
		t.Errorf("%d statements enlisted the candidates refused with the shared attempt's outcome; want 1", n)
	}
}

// TestAdvisoryLockWaiterWakesOnceTheLockIsFree checks that the watchers
// are woken after a holder's lock is freed, also when the lock outlasts
// the holder's mark: a session that ends frees its locks one lock
// partition after another, and a wake-up at the mark alone would find the
// lock still held, with none to follow until the lock waiter's poll (5 s).
// And a candidate woken at the mark that finds the lock still held by the
// backend that went looks again, and is granted, instead of being refused
// for the rest of the lease. The holder here lets go of its mark without a
// release, then of its lock 15 ms later.
func TestAdvisoryLockWaiterWakesOnceTheLockIsFree(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	holders := setupAdvisory(t, pool, Options{})
	const name = "lingering"
	key := holders.Key(name)
	watchers := setupAdvisory(t, pool, Options{})
	watchers.waiterPoll = time.Hour // the wake-up must not be the poll's
	ch, err := watchers.WatchFree(t.Context(), name)
	if err != nil {
		t.Fatal(err)
	}
	mustGrant(t, holders, name, candidate("alice"), time.Minute)
	pid := holders.holderPID(t, name)
	electortest.Eventually(t, 10*time.Second, "the lock waiter on the holder's mark", func() bool {
		return requests(t, pool, key, pid).markSharedWaiting == 1
	})
	drain(ch)

	wakes := make(chan time.Time, 16)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-ctx.Done():
				return
			case <-ch:
				wakes <- time.Now()
			}
		}
	}()
	defer func() { cancel(); <-done }()

	var unlocking time.Time
	err = holders.holderSession(t, name).do(callCtx(t), holders, false, func(conn *pgx.Conn) error {
		if _, err := conn.Exec(callCtx(t), "SELECT pg_advisory_unlock("+markClass+", pg_backend_pid())"); err != nil {
			return err
		}
		time.Sleep(15 * time.Millisecond)
		unlocking = time.Now()
		_, err := conn.Exec(callCtx(t), "SELECT pg_advisory_unlock($1)", key)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	timeout := time.After(wakeTimeout)
	for {
		select {
		case at := <-wakes:
			if at.After(unlocking) {
				return
			}
			t.Logf("a wake-up %v before the lock was let go", unlocking.Sub(at))
		case <-timeout:
			t.Fatalf("no wake-up within %v of the lock being let go, 15 ms after the mark", wakeTimeout)
		}
	}
}

// TestAdvisoryCandidateLooksAgainWhileTheLockOutlastsTheMark: see
// TestAdvisoryLockWaiterWakesOnceTheLockIsFree.
func TestAdvisoryCandidateLooksAgainWhileTheLockOutlastsTheMark(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	holders := setupAdvisory(t, pool, Options{})
	others := setupAdvisory(t, pool, Options{TakeoverGrace: time.Millisecond})
	const name = "outlasting"
	key := holders.Key(name)
	free, err := others.WatchFree(t.Context(), name)
	if err != nil {
		t.Fatal(err)
	}
	held := mustGrant(t, holders, name, candidate("alice"), time.Minute)
	pid := holders.holderPID(t, name)
	electortest.Eventually(t, 10*time.Second, "the lock waiter on the holder's mark", func() bool {
		return requests(t, pool, key, pid).markSharedWaiting == 1
	})
	drain(free)

	// The holder lets go of its mark, and of its lock 15 ms later, in a
	// goroutine, while the candidate, woken at the mark, tries.
	unlocked := make(chan error, 1)
	go func() {
		unlocked <- holders.holderSession(t, name).do(callCtx(t), holders, false, func(conn *pgx.Conn) error {
			if _, err := conn.Exec(callCtx(t), "SELECT pg_advisory_unlock("+markClass+", pg_backend_pid())"); err != nil {
				return err
			}
			time.Sleep(15 * time.Millisecond)
			_, err := conn.Exec(callCtx(t), "SELECT pg_advisory_unlock($1)", key)
			return err
		})
	}()
	waitWake(t, free, "after the holder let go of its mark")
	l, granted := mustAcquire(t, others, name, candidate("bob"), time.Minute)
	if err := <-unlocked; err != nil {
		t.Fatal(err)
	}
	if !granted || l.Term != held.Term+1 {
		t.Errorf("a candidate woken while the lock outlasted the mark: %+v granted %v; want granted with term %d", l, granted, held.Term+1)
	}
}

// TestAdvisoryLockWaiterWakesForAHolderGoneBeforeItsFirstLook checks that
// a lock waiter whose first look finds the lock free wakes the watchers:
// a watcher that read the lease before the lock waiter was connected may
// have seen a holder that went before that first look. The lock waiter's
// connection here is held back until the holder's session has ended
// without a release (pg_terminate_backend: no notification), while the
// store's listener already listens (it wakes every watcher when it starts).
func TestAdvisoryLockWaiterWakesForAHolderGoneBeforeItsFirstLook(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	holders := setupAdvisory(t, pool, Options{})
	const name = "gone-first"
	mustGrant(t, holders, name, candidate("alice"), time.Minute)
	pid := holders.holderPID(t, name)

	// The watchers' store connects through a gate, closed once the store
	// is set up, so that its lock waiter and listener connect only after
	// the holder went.
	var gated atomic.Bool
	gate := make(chan struct{})
	watchers := advisoryOn(t, pool, func(c *pgx.ConnConfig) {
		c.AfterConnect = func(ctx context.Context, _ *pgconn.PgConn) error {
			if !gated.Load() {
				return nil
			}
			select {
			case <-gate:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}
	})
	watchers.waiterPoll = time.Hour // the wake-up must not be the poll's
	// The listener connects at the first watch, and wakes every watcher
	// once it listens: start it before the gate.
	other, err := watchers.WatchFree(t.Context(), "another")
	if err != nil {
		t.Fatal(err)
	}
	waitWake(t, other, "once the listener listens")
	// Observe runs on the store's own connections: open one before the
	// gate too.
	if _, err := watchers.Observe(callCtx(t), name); err != nil {
		t.Fatal(err)
	}
	gated.Store(true)
	ch, err := watchers.WatchFree(t.Context(), name)
	if err != nil {
		t.Fatal(err)
	}
	if l, err := watchers.Observe(callCtx(t), name); err != nil || !l.Held() {
		t.Fatalf("Observe before the holder went: %+v, %v; want held", l, err)
	}
	if _, err := pool.Exec(callCtx(t), "SELECT pg_terminate_backend($1)", pid); err != nil {
		t.Fatal(err)
	}
	electortest.Eventually(t, 10*time.Second, "the holder's session to end", func() bool {
		var n int
		if err := pool.QueryRow(callCtx(t), "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 0
	})
	drain(ch)
	close(gate)
	select {
	case <-ch:
	case <-time.After(wakeTimeout):
		t.Fatalf("no wake-up within %v of a lock waiter's first look finding free the lock a watcher saw held", wakeTimeout)
	}
}

// statementTimes records when statements of interest start and end, as a
// pgx tracer.
type statementTimes struct {
	mu     sync.Mutex
	match  map[string]string // SQL → label
	events []statementEvent
}

type statementEvent struct {
	label string
	end   bool
	at    time.Time
}

type statementLabel struct{}

func (s *statementTimes) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	s.mu.Lock()
	defer s.mu.Unlock()
	label, ok := s.match[d.SQL]
	if !ok {
		return ctx
	}
	s.events = append(s.events, statementEvent{label: label, at: time.Now()})
	return context.WithValue(ctx, statementLabel{}, label)
}

func (s *statementTimes) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	label, ok := ctx.Value(statementLabel{}).(string)
	if !ok {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.events = append(s.events, statementEvent{label: label, end: true, at: time.Now()})
}

// TraceBatchStart, TraceBatchQuery and TraceBatchEnd make statementTimes
// a pgx.BatchTracer too: a statement of interest sent in a batch (the
// lock waiter's wait on a mark, with the read of the row after it) is
// recorded as ended when its result is read.
func (s *statementTimes) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (s *statementTimes) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if label, ok := s.match[d.SQL]; ok {
		s.events = append(s.events, statementEvent{label: label, end: true, at: time.Now()})
	}
}

func (s *statementTimes) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// after returns when the first event of label (a start, or an end if end)
// after t happened, if one has.
func (s *statementTimes) after(t time.Time, label string, end bool) (time.Time, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, e := range s.events {
		if e.label == label && e.end == end && e.at.After(t) {
			return e.at, true
		}
	}
	return time.Time{}, false
}

// TestAdvisoryLockWaiterStaysOutOfTheCandidatesWay checks that a lock
// waiter that saw a holder's mark freed does not look at the lock again
// (a read of pg_locks) while the candidates it woke try for it: only at
// the next grant's notification, or markLook later. Here no one is granted.
func TestAdvisoryLockWaiterStaysOutOfTheCandidatesWay(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	holders := setupAdvisory(t, pool, Options{})
	const name = "out-of-the-way"
	key := holders.Key(name)
	mark := "SELECT pg_advisory_lock_shared(" + markClass + ", $1), pg_advisory_unlock_shared(" + markClass + ", $1)"
	times := &statementTimes{}
	watchers := advisoryOn(t, pool, func(c *pgx.ConnConfig) { c.Tracer = times })
	times.mu.Lock()
	times.match = map[string]string{mark: "mark", watchers.sql.waiter: "look"}
	times.mu.Unlock()
	// Listening first: the listener's wake-up of everyone once it listens
	// would make the lock waiter look early.
	watchers.watchFreeSettled(t, name)
	mustGrant(t, holders, name, candidate("alice"), time.Minute)
	pid := holders.holderPID(t, name)
	electortest.Eventually(t, 10*time.Second, "the lock waiter on the holder's mark", func() bool {
		return requests(t, pool, key, pid).markSharedWaiting == 1
	})
	killed := time.Now()
	if _, err := pool.Exec(callCtx(t), "SELECT pg_terminate_backend($1)", pid); err != nil {
		t.Fatal(err)
	}
	var freed, look time.Time
	electortest.Eventually(t, 10*time.Second, "the lock waiter's look after the mark was freed", func() bool {
		var ok bool
		if freed, ok = times.after(killed, "mark", true); !ok {
			return false
		}
		look, ok = times.after(freed, "look", false)
		return ok
	})
	if gap := look.Sub(freed); gap < markLook {
		t.Errorf("the lock waiter looked again %v after the mark was freed, with no grant; want markLook (%v) or more", gap, markLook)
	}
}

// heldLooks is a pgx tracer that, once armed, holds the next statement
// whose SQL is look at its start until released, and says when it does.
type heldLooks struct {
	look     string
	mu       sync.Mutex
	armed    bool
	holding  chan struct{} // closed when a look is held
	released chan struct{}
}

func (h *heldLooks) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	h.mu.Lock()
	hold := h.armed && d.SQL == h.look
	if hold {
		h.armed = false
		close(h.holding)
	}
	h.mu.Unlock()
	if hold {
		<-h.released
	}
	return ctx
}

func (h *heldLooks) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestAdvisoryLockWaiterWakesForAHolderGrantedAndGoneBetweenLooks checks
// that a lock waiter that finds the lock free, with the row naming a
// holder it never woke the watchers for, wakes them: that holder was
// granted and went without a release between two looks (here, while the
// lock waiter waited for the grant after a release), and no mark wait saw
// it go.
func TestAdvisoryLockWaiterWakesForAHolderGrantedAndGoneBetweenLooks(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	holders := setupAdvisory(t, pool, Options{})
	const name = "granted-and-gone"
	key := holders.Key(name)
	looks := &heldLooks{holding: make(chan struct{}), released: make(chan struct{})}
	watchers := advisoryOn(t, pool, func(c *pgx.ConnConfig) { c.Tracer = looks })
	looks.look = watchers.sql.waiter
	watchers.waiterPoll = time.Hour // the wake-up must not be the poll's
	ch, err := watchers.WatchFree(t.Context(), name)
	if err != nil {
		t.Fatal(err)
	}
	alice, bob := candidate("alice"), candidate("bob")
	held := mustGrant(t, holders, name, alice, time.Minute)
	electortest.Eventually(t, 10*time.Second, "the lock waiter on alice's mark", func() bool {
		return requests(t, pool, key, holders.holderPID(t, name)).markSharedWaiting == 1
	})
	looks.mu.Lock()
	looks.armed = true
	looks.mu.Unlock()
	defer func() {
		select {
		case <-looks.released:
		default:
			close(looks.released)
		}
	}()

	// alice releases; the lock waiter wakes the watchers and its next look
	// is held. bob is granted and his session ends, with no release.
	mustRelease(t, holders, name, alice, held.Term)
	select {
	case <-looks.holding:
	case <-time.After(10 * time.Second):
		t.Fatal("the lock waiter made no look within 10s of the release")
	}
	mustGrant(t, holders, name, bob, time.Minute)
	pid := holders.holderPID(t, name)
	if _, err := pool.Exec(callCtx(t), "SELECT pg_terminate_backend($1)", pid); err != nil {
		t.Fatal(err)
	}
	electortest.Eventually(t, 10*time.Second, "bob's session to end", func() bool {
		return requests(t, pool, key, pid).lockExclusive == 0
	})
	drain(ch)
	close(looks.released)
	select {
	case <-ch:
	case <-time.After(wakeTimeout):
		t.Fatalf("no wake-up within %v of a look finding the lock free, with the row naming a holder that went without a release", wakeTimeout)
	}
}

// TestAdvisoryLockWaiterWaitsOutAGrantInFlight checks that a lock waiter
// that finds the lock held without its mark, while the row does not name
// the lock's holder, takes it for a grant in flight (the lock taken, the
// mark and the row not yet): it looks again, at the grant's announcement,
// and then waits on the holder's mark, however long the grant took. It
// takes a holder for one without a mark only when the row names it, or
// when the lock has been held that way for longer than grantInFlight (a
// session that is no store's holds it): then it waits on the lock itself,
// and wakes the watchers when that session lets go.
func TestAdvisoryLockWaiterWaitsOutAGrantInFlight(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	holders := setupAdvisory(t, pool, Options{})
	const name = "grant-in-flight"
	key := holders.Key(name)
	times := &statementTimes{}
	watchers := advisoryOn(t, pool, func(c *pgx.ConnConfig) { c.Tracer = times })
	times.mu.Lock()
	times.match = map[string]string{watchers.sql.waiter: "look"}
	times.mu.Unlock()
	alice := candidate("alice")

	// The row exists (a grant and a release), so that a transaction can
	// lock it.
	l := mustGrant(t, holders, name, alice, time.Minute)
	mustRelease(t, holders, name, alice, l.Term)
	ch := watchers.watchFreeSettled(t, name)

	// alice's grant takes the lock and waits for the row, which a
	// transaction holds; a notification of a grant of name (as a grant
	// of another store would send) makes the lock waiter look meanwhile.
	tx := lockRow(t, pool, name)
	granted := make(chan error, 1)
	go func() {
		_, ok, err := holders.Acquire(callCtx(t), name, alice, time.Minute)
		if err == nil && !ok {
			err = fmt.Errorf("alice was refused")
		}
		granted <- err
	}()
	electortest.Eventually(t, 10*time.Second, "alice's grant to take the lock", func() bool {
		return requests(t, pool, key, 0).lockExclusive == 1
	})
	notified := time.Now()
	if _, err := pool.Exec(callCtx(t), "SELECT pg_notify($1, $2)", watchers.wakeups.channel, payloadGrant+name); err != nil {
		t.Fatal(err)
	}
	electortest.Eventually(t, 10*time.Second, "the lock waiter's look at the grant in flight", func() bool {
		start, ok := times.after(notified, "look", false)
		if !ok {
			return false
		}
		_, ok = times.after(start, "look", true)
		return ok
	})
	time.Sleep(10 * markLook) // long enough for a lock waiter that counts time to give up on the mark
	if err := tx.Rollback(callCtx(t)); err != nil {
		t.Fatal(err)
	}
	if err := <-granted; err != nil {
		t.Fatal(err)
	}
	pid := holders.holderPID(t, name)
	electortest.Eventually(t, 10*time.Second, "the lock waiter on alice's mark", func() bool {
		r := requests(t, pool, key, pid)
		return r.markSharedWaiting == 1 && r.lockSharedWaiting+r.lockShared == 0
	})
	held, err := holders.Observe(callCtx(t), name)
	if err != nil {
		t.Fatal(err)
	}
	mustRelease(t, holders, name, alice, held.Term)

	// A session that is no store's takes the lock: there is no grant to
	// wait for, and the lock waiter waits on the lock itself once the
	// lock has been held for grantInFlight without a holder in the row.
	stray, err := pool.Acquire(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer stray.Release()
	if _, err := stray.Exec(callCtx(t), "SELECT pg_advisory_lock($1)", key); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(callCtx(t), "SELECT pg_notify($1, $2)", watchers.wakeups.channel, payloadGrant+name); err != nil {
		t.Fatal(err)
	}
	electortest.Eventually(t, 10*time.Second, "the lock waiter on the stray session's lock", func() bool {
		return requests(t, pool, key, 0).lockSharedWaiting == 1
	})
	drain(ch)
	if _, err := stray.Exec(callCtx(t), "SELECT pg_advisory_unlock($1)", key); err != nil {
		t.Fatal(err)
	}
	waitWake(t, ch, "after the stray session let go of the lock")
}

// TestAdvisoryUnmarkedHolderHandsOver checks the lock waiter that waits
// on the lease's lock itself (its holder's mark gone, as when a stray
// session holds it): a handover's release wakes the successor's watcher,
// and the other candidates' only once the reservation has run out, as
// after a mark.
func TestAdvisoryUnmarkedHolderHandsOver(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	holders := setupAdvisory(t, pool, Options{})
	followers := setupAdvisory(t, pool, Options{})
	const name = "unmarked-handover"
	key := holders.Key(name)
	alice, bob, carol := candidate("alice"), candidate("bob"), candidate("carol")
	chs := watchFreeForListening(t, followers, name, bob, carol)
	forBob, forCarol := chs[0], chs[1]
	for _, c := range []leader.Candidate{bob, carol} {
		if err := holders.Enlist(callCtx(t), name, c, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	held := mustGrant(t, holders, name, alice, time.Minute)
	pid := holders.holderPID(t, name)
	unmark(t, holders, name)
	electortest.Eventually(t, 10*time.Second, "the lock waiter waiting on the unmarked lock", func() bool {
		return requests(t, pool, key, pid).lockSharedWaiting == 1
	})
	wantHandoverWakesTheSuccessor(t, holders, name, alice, held.Term, bob, forBob, forCarol, "for the successor, after a handover of an unmarked lock")
}

// TestAdvisoryLockWaiterKeepsNoOldSnapshot checks that a lock waiter
// waiting on a holder that leads on does not keep one statement, and with
// it one snapshot, for the whole tenure (see waitSlice): while the holder
// leads on, the waiting statement is sent again (one that began later
// than the first is seen waiting on the holder's mark). Its slices wake
// no watcher, and it still wakes them at the release.
func TestAdvisoryLockWaiterKeepsNoOldSnapshot(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	holders := setupAdvisory(t, pool, Options{})
	const name = "sliced"
	key := holders.Key(name)
	watchers := setupAdvisory(t, pool, Options{})
	watchers.waiterPoll = time.Hour // the wake-up must not be the poll's
	watchers.waitSlice = 50 * time.Millisecond
	ch, err := watchers.WatchFree(t.Context(), name)
	if err != nil {
		t.Fatal(err)
	}
	alice := candidate("alice")
	l := mustGrant(t, holders, name, alice, time.Minute)
	pid := holders.holderPID(t, name)
	waiting := func() bool { return requests(t, pool, key, pid).markSharedWaiting == 1 }
	electortest.Eventually(t, 10*time.Second, "the lock waiter on the holder's mark", waiting)
	drain(ch)

	// The waiting statement's start, on the server's clock (each test has
	// a database of its own, and the store's lock waiter is its only
	// backend waiting on a lock).
	waitingSince := func() (since time.Time, ok bool) {
		var at *time.Time
		err := pool.QueryRow(callCtx(t), `SELECT max(query_start) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%pg_advisory_lock_shared%'`).Scan(&at)
		if err != nil {
			t.Fatal(err)
		}
		if at == nil {
			return time.Time{}, false
		}
		return *at, true
	}
	var first time.Time
	electortest.Eventually(t, 10*time.Second, "the waiting statement in pg_stat_activity", func() bool {
		var ok bool
		first, ok = waitingSince()
		return ok
	})
	electortest.Eventually(t, 10*time.Second, "a waiting statement begun after the first", func() bool {
		since, ok := waitingSince()
		return ok && since.After(first)
	})
	select {
	case <-ch:
		t.Fatal("a watcher was woken while the holder led on")
	case <-time.After(10 * watchers.waitSlice):
	}
	electortest.Eventually(t, 10*time.Second, "the lock waiter still on the holder's mark", waiting)
	mustRelease(t, holders, name, alice, l.Term)
	waitWake(t, ch, "of the release")
}

// TestAdvisoryLockWaiterReadsCommitted checks that a lock waiter reads a
// handover's reservation, in the round trip of its wait, also where the
// server's default isolation level is repeatable read: there the round
// trip's one transaction would read the row as it stood before the wait,
// and the lock waiter would wake every watcher instead of the successor's
// alone.
func TestAdvisoryLockWaiterReadsCommitted(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	if _, err := pool.Exec(callCtx(t), `DO $$ BEGIN
	EXECUTE format('ALTER DATABASE %I SET default_transaction_isolation = %L', current_database(), 'repeatable read');
END $$`); err != nil {
		t.Fatal(err)
	}
	holders := setupAdvisory(t, pool, Options{})
	followers := setupAdvisory(t, pool, Options{})
	const name = "read-committed"
	key := holders.Key(name)
	alice, bob, carol := candidate("alice"), candidate("bob"), candidate("carol")
	chs := watchFreeForListening(t, followers, name, bob, carol)
	forBob, forCarol := chs[0], chs[1]
	held := mustGrant(t, holders, name, alice, time.Minute)
	pid := holders.holderPID(t, name)
	electortest.Eventually(t, 10*time.Second, "the lock waiter on the holder's mark", func() bool {
		return requests(t, pool, key, pid).markSharedWaiting == 1
	})
	var level string
	if err := holders.holderSession(t, name).do(callCtx(t), holders, false, func(conn *pgx.Conn) error {
		return conn.QueryRow(callCtx(t), "SHOW transaction_isolation").Scan(&level)
	}); err != nil {
		t.Fatal(err)
	}
	if level != "repeatable read" {
		t.Fatalf("the holder's session runs %q; the test needs the database's default, repeatable read", level)
	}
	wantHandoverWakesTheSuccessor(t, holders, name, alice, held.Term, bob, forBob, forCarol, "for the successor, after a handover")
}

// watchFreeFor returns s.WatchFreeFor(name, c).
func watchFreeFor(t *testing.T, s *AdvisoryStore, name string, c leader.Candidate) <-chan struct{} {
	t.Helper()
	ch, err := s.WatchFreeFor(t.Context(), name, c)
	if err != nil {
		t.Fatal(err)
	}
	return ch
}

// watchFreeForListening returns s.WatchFreeFor(name, c) for each of cs,
// once s listens. s must not have listened before.
func watchFreeForListening(t *testing.T, s *AdvisoryStore, name string, cs ...leader.Candidate) []<-chan struct{} {
	t.Helper()
	listening := s.listeningSignal()
	var chs []<-chan struct{}
	for _, c := range cs {
		chs = append(chs, watchFreeFor(t, s, name, c))
	}
	select {
	case <-listening:
	case <-time.After(30 * time.Second):
		t.Fatal("the listener did not LISTEN within 30s")
	}
	return chs
}

// wantHandoverWakesTheSuccessor hands name, held by from under term, over
// to for 3s, and checks that forTo, the successor's watcher, is woken
// (what says after what), and forOther, another candidate's, not before
// half the reservation has passed. Both are quietened first (see
// quieten): the wake-ups sent once listening (on the store's channel, and
// on each candidate channel added) must not count.
func wantHandoverWakesTheSuccessor(t *testing.T, holders *AdvisoryStore, name string, from leader.Candidate, term uint64, to leader.Candidate, forTo, forOther <-chan struct{}, what string) {
	t.Helper()
	quieten(t, forTo, forOther)
	const hold = 3 * time.Second
	if err := holders.ReleaseTo(callCtx(t), name, from.Token, term, to, leader.GrantTransfer, hold); err != nil {
		t.Fatal(err)
	}
	released := time.Now()
	waitWake(t, forTo, what)
	select {
	case <-forOther:
		if d := time.Since(released); d < hold/2 {
			t.Fatalf("a handover to %s for %v woke another candidate's watcher after %v, while it was reserved for the successor", to.ID, hold, d)
		}
	case <-time.After(hold / 2):
	}
}

// handOverKeepingTheMark releases name, held by from under term on
// holders, reserved for to, as a prepared handover's commit does when its
// successor waits: the lease's lock is freed at once and the holder's
// mark keepMark later. The returned channel receives the release's
// outcome once the mark is freed.
func handOverKeepingTheMark(t *testing.T, holders *AdvisoryStore, name string, from leader.Candidate, term uint64, to leader.Candidate, keepMark time.Duration) <-chan error {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), keepMark+30*time.Second)
		defer cancel()
		done <- holders.release(ctx, name, from.Token, term, &reservation{to: to, reason: leader.GrantTransfer, hold: time.Minute, markAfter: keepMark}, 0)
	}()
	return done
}

// successorGranted hands name, held by alice on holders, over to bob on
// successors with handOverKeepingTheMark, has bob granted while alice
// still holds her mark, runs meanwhile (if not nil) before alice's mark
// is freed, and returns bob's lease and backend PID once it is.
func successorGranted(t *testing.T, holders, successors *AdvisoryStore, name string, alice leader.Candidate, term uint64, bob leader.Candidate, meanwhile func()) (leader.Lease, int32) {
	t.Helper()
	done := handOverKeepingTheMark(t, holders, name, alice, term, bob, 2*time.Second)
	// Alice's lock is freed after her row is: once it is, bob's grant
	// finds the row reserved for him.
	key := holders.Key(name)
	electortest.Eventually(t, 10*time.Second, "the lease's lock freed", func() bool {
		return requests(t, holders.pool, key, 0).lockExclusive == 0
	})
	held := mustGrant(t, successors, name, bob, time.Minute)
	pid := successors.holderPID(t, name)
	if meanwhile != nil {
		meanwhile()
	}
	if err := <-done; err != nil {
		t.Fatalf("handing over to %s: %v", bob.ID, err)
	}
	return held, pid
}

// TestAdvisoryLockWaiterFollowsTheSuccessor checks that a lock waiter
// that finds, as a holder lets go of its mark, the lease granted already
// (to a prepared handover's successor, or to the candidate a release
// named) waits on the new holder's mark at once, without a look (a read
// of pg_locks, in every follower process, at every handover), wakes no
// watcher for that handover, and wakes them at the new holder's release.
func TestAdvisoryLockWaiterFollowsTheSuccessor(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	holders := setupAdvisory(t, pool, Options{})
	successors := setupAdvisory(t, pool, Options{})
	const name = "follows-the-successor"
	key := holders.Key(name)
	times := &statementTimes{}
	watchers := advisoryOn(t, pool, func(c *pgx.ConnConfig) { c.Tracer = times })
	times.mu.Lock()
	times.match = map[string]string{watchers.sql.waiter: "look"}
	times.mu.Unlock()
	ch := watchers.watchFreeSettled(t, name)
	alice, bob := candidate("alice"), candidate("bob")
	held := mustGrant(t, holders, name, alice, time.Minute)
	pid := holders.holderPID(t, name)
	electortest.Eventually(t, 10*time.Second, "the lock waiter on the holder's mark", func() bool {
		return requests(t, pool, key, pid).markSharedWaiting == 1
	})
	drain(ch)
	handed := time.Now()
	next, nextPID := successorGranted(t, holders, successors, name, alice, held.Term, bob, nil)
	electortest.Eventually(t, 10*time.Second, "the lock waiter on the successor's mark", func() bool {
		return requests(t, pool, key, nextPID).markSharedWaiting == 1
	})
	time.Sleep(2 * markLook) // a look, had there been one, has begun
	if at, ok := times.after(handed, "look", false); ok {
		t.Errorf("the lock waiter looked %v after the handover; want it to wait on the successor's mark without a look", at.Sub(handed))
	}
	select {
	case <-ch:
		t.Errorf("a handover whose successor held the lease as the holder's mark was freed woke a watcher")
	default:
	}
	mustRelease(t, successors, name, bob, next.Term)
	waitWake(t, ch, "at the successor's release")
}

// TestAdvisoryLockWaiterLooksAtAnUnmarkedSuccessor checks that a lock
// waiter that waits on a successor's mark without a look (see
// TestAdvisoryLockWaiterFollowsTheSuccessor), and finds that the
// successor holds the lease's lock without its mark (a store of an older
// version), wakes no watcher, looks, and waits on the lease's lock
// itself, whose release wakes them.
func TestAdvisoryLockWaiterLooksAtAnUnmarkedSuccessor(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	holders := setupAdvisory(t, pool, Options{})
	successors := setupAdvisory(t, pool, Options{})
	watchers := setupAdvisory(t, pool, Options{})
	const name = "unmarked-successor"
	key := holders.Key(name)
	ch := watchers.watchFreeSettled(t, name)
	alice, bob := candidate("alice"), candidate("bob")
	held := mustGrant(t, holders, name, alice, time.Minute)
	pid := holders.holderPID(t, name)
	electortest.Eventually(t, 10*time.Second, "the lock waiter on the holder's mark", func() bool {
		return requests(t, pool, key, pid).markSharedWaiting == 1
	})
	drain(ch)
	next, nextPID := successorGranted(t, holders, successors, name, alice, held.Term, bob, func() { unmark(t, successors, name) })
	electortest.Eventually(t, 10*time.Second, "the lock waiter on the successor's unmarked lock", func() bool {
		return requests(t, pool, key, nextPID).lockSharedWaiting == 1
	})
	select {
	case <-ch:
		t.Errorf("finding the successor without its mark woke a watcher, while it held the lease")
	default:
	}
	mustRelease(t, successors, name, bob, next.Term)
	waitWake(t, ch, "at the unmarked successor's release")
}

// TestAdvisoryLockWaiterWakesWhenAFollowedSuccessorGoes checks that a
// lock waiter that waits on a successor's mark without a look (see
// TestAdvisoryLockWaiterFollowsTheSuccessor) wakes the watchers when the
// successor's session ends without a release: its mark is freed, the row
// still names it, and the look that follows finds the lock free.
func TestAdvisoryLockWaiterWakesWhenAFollowedSuccessorGoes(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	holders := setupAdvisory(t, pool, Options{})
	successors := setupAdvisory(t, pool, Options{})
	watchers := setupAdvisory(t, pool, Options{})
	watchers.waiterPoll = time.Hour // the wake-up must not be the poll's
	const name = "followed-successor-goes"
	key := holders.Key(name)
	ch := watchers.watchFreeSettled(t, name)
	alice, bob := candidate("alice"), candidate("bob")
	held := mustGrant(t, holders, name, alice, time.Minute)
	pid := holders.holderPID(t, name)
	electortest.Eventually(t, 10*time.Second, "the lock waiter on the holder's mark", func() bool {
		return requests(t, pool, key, pid).markSharedWaiting == 1
	})
	_, nextPID := successorGranted(t, holders, successors, name, alice, held.Term, bob, nil)
	electortest.Eventually(t, 10*time.Second, "the lock waiter on the successor's mark", func() bool {
		return requests(t, pool, key, nextPID).markSharedWaiting == 1
	})
	drain(ch)
	if _, err := pool.Exec(callCtx(t), "SELECT pg_terminate_backend($1)", nextPID); err != nil {
		t.Fatal(err)
	}
	waitWake(t, ch, "after the followed successor's session ended")
}
