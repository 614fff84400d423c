package postgres

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/pgtest"
)

// acquireResult is what an Acquire in the background returned.
type acquireResult struct {
	lease   leader.Lease
	granted bool
	err     error
	at      time.Time
}

// positioned is a successor's store whose candidate is woken by a
// prepared handover's notice and then calls Acquire in the background,
// as an Elector's follower does; done receives that Acquire's outcome.
type positioned struct {
	b    testBundle
	c    leader.Candidate
	done chan acquireResult
}

// position starts a successor on a store of its own on pool's database
// that watches name for c and, once woken, calls Acquire with ttl.
func position(t *testing.T, pool testBundle, name string, c leader.Candidate, ttl time.Duration, tune ...func(*LeaseStore)) *positioned {
	t.Helper()
	b := setupOn(t, pool.pool, Options{})
	for _, f := range tune {
		f(b.store)
	}
	// A connection for waiting, open before the preparation, so that a
	// slow machine's connection set-up does not outlast the test's wait.
	conn, err := b.store.waits.Acquire(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	conn.Release()
	ch, err := b.store.WatchFreeFor(t.Context(), name, c)
	if err != nil {
		t.Fatal(err)
	}
	waitListening(t, b)
	drain(ch) // the wake-up sent once listening
	p := &positioned{b: b, c: c, done: make(chan acquireResult, 1)}
	go func() {
		select {
		case <-ch:
		case <-t.Context().Done():
			p.done <- acquireResult{err: t.Context().Err()}
			return
		}
		l, granted, err := b.store.Acquire(callCtx(t), name, c, ttl)
		p.done <- acquireResult{lease: l, granted: granted, err: err, at: time.Now()}
	}()
	return p
}

// result waits for the successor's Acquire.
func (p *positioned) result(t *testing.T) acquireResult {
	t.Helper()
	select {
	case r := <-p.done:
		if r.err != nil {
			t.Fatalf("the successor's Acquire: %v", r.err)
		}
		return r
	case <-time.After(30 * time.Second):
		t.Fatal("the successor's Acquire did not return within 30s")
		return acquireResult{}
	}
}

// notReturned fails the test if the successor's Acquire has returned.
func (p *positioned) notReturned(t *testing.T, when string) {
	t.Helper()
	select {
	case r := <-p.done:
		t.Fatalf("the successor's Acquire returned %s: %+v granted %v err %v", when, r.lease, r.granted, r.err)
	default:
	}
}

// mustPrepare prepares a handover of name, held by from under term, to
// to, and checks that the successor was waiting when it returned.
func mustPrepare(t *testing.T, s *LeaseStore, name string, from leader.Candidate, term uint64, to leader.Candidate) *preparedHandover {
	t.Helper()
	p, err := s.PrepareHandover(callCtx(t), name, from.Token, term, to, 10*time.Second)
	if err != nil {
		t.Fatalf("PrepareHandover: %v", err)
	}
	ph := p.(*preparedHandover)
	if !ph.waited {
		t.Fatal("PrepareHandover returned before the successor waited for the handover")
	}
	return ph
}

// TestPreparedHandoverGrantsAsTheReleaseCommits checks that a successor
// whose handover was prepared waits in its Acquire, on the server, while
// the lease stays held and renewable, and is granted the lease with the
// next term by the commit alone: its store's listener is closed before
// the commit, so no notification can be what woke it. The Commit removes
// the holder's own entry among the candidates, as a release does, after
// the successor's grant (dropHolder), and leaves the others'.
func TestPreparedHandoverGrantsAsTheReleaseCommits(t *testing.T) {
	t.Parallel()
	a := setup(t)
	alice, bob, carol := candidate("alice"), candidate("bob"), candidate("carol")
	const ttl = 20 * time.Second
	l := mustGrant(t, a.store, "prep", alice, ttl)
	for _, c := range []leader.Candidate{alice, carol} {
		if err := a.store.Enlist(callCtx(t), "prep", c, ttl); err != nil {
			t.Fatal(err)
		}
	}
	// Run while alice still holds the lease (as after a release that
	// released nothing), the removal leaves her entry.
	if !dropLeaves(t, a.pool, a.store, a.store.sql.dropHolder, "prep", alice) {
		t.Fatal("the removal of the holder's entry, run while the holder holds the lease, removed it")
	}
	// The release on the successor's path leaves it (run here in a
	// transaction rolled back).
	if entries := entriesAfter(t, a.pool, a.store.opts, "prep", alice, a.store.sql.releaseQuiet,
		"prep", alice.Token, int64(l.Term), a.store.opts.Channel, bob.Token, bob.ID, string(leader.GrantTransfer), ttl); entries != 1 {
		t.Fatalf("after the quiet release, in its transaction, the holder has %d entries among the candidates; want 1", entries)
	}
	succ := position(t, a, "prep", bob, ttl)

	p := mustPrepare(t, a.store, "prep", alice, l.Term, bob)
	succ.notReturned(t, "before the handover was committed")
	if o := mustObserve(t, a.store, "prep"); o.HolderID != "alice" || o.Term != l.Term {
		t.Fatalf("while prepared the lease is %+v; want held by alice with term %d", o, l.Term)
	}
	if _, err := a.store.Renew(callCtx(t), "prep", alice.Token, l.Term, ttl); err != nil {
		t.Fatalf("Renew while the handover is prepared: %v", err)
	}
	succ.b.store.wakeups.Close() // from now on the successor hears nothing

	committed := time.Now()
	if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
		t.Fatalf("Commit: %v", err)
	}
	r := succ.result(t)
	if !r.granted || r.lease.Term != l.Term+1 || r.lease.Reason != leader.GrantTransfer || r.lease.HolderID != "bob" {
		t.Fatalf("the successor's Acquire returned %+v granted %v; want granted to bob with term %d for a transfer", r.lease, r.granted, l.Term+1)
	}
	if d := r.at.Sub(committed); d > ttl/4 {
		t.Fatalf("the successor was granted %v after the commit, past its wait of TTL/4", d)
	}
	if enlisted(t, a.store, "prep", alice) {
		t.Error("the holder's entry is still among the candidates after the Commit")
	}
	if !enlisted(t, a.store, "prep", carol) {
		t.Error("the Commit removed another candidate's entry")
	}
	// An entry enlisted again after the release stays.
	if err := a.store.Enlist(callCtx(t), "prep", alice, ttl); err != nil {
		t.Fatal(err)
	}
	if !dropLeaves(t, a.pool, a.store, a.store.sql.dropHolder, "prep", alice) {
		t.Error("the removal of the holder's entry removed one enlisted after the release")
	}
	if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err == nil {
		t.Fatal("a second Commit of the same prepared handover succeeded")
	}
	p.Abort() // does nothing once committed
}

// dropLeaves runs drop, a store's removal of the holder's own entry among
// the candidates (dropHolder), for c's token on pool, and reports whether
// c is still enlisted in s.
func dropLeaves(t *testing.T, pool *pgxpool.Pool, s leader.Transferer, drop, name string, c leader.Candidate) bool {
	t.Helper()
	if _, err := pool.Exec(callCtx(t), drop, name, c.Token); err != nil {
		t.Fatal(err)
	}
	return enlisted(t, s, name, c)
}

// entriesAfter runs sql with args in a transaction on q, rolled back, and
// returns how many entries c has among the candidates of name in it.
func entriesAfter(t *testing.T, q interface {
	Begin(context.Context) (pgx.Tx, error)
}, opts Options, name string, c leader.Candidate, sql string, args ...any) int {
	t.Helper()
	tx, err := q.Begin(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background()) //nolint:errcheck // rolled back on purpose
	if _, err := tx.Exec(callCtx(t), sql, args...); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := tx.QueryRow(callCtx(t), `SELECT count(*) FROM `+opts.qualifiedCandidateTable()+` WHERE name = $1 AND token = $2`,
		name, c.Token).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestPreparedHandoverAborted checks that an aborted preparation, and one
// whose session was ended (its process killed), let the waiting successor
// go without granting it anything: the lease stays the leader's.
func TestPreparedHandoverAborted(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"aborted", "session killed"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			a := setup(t)
			alice, bob := candidate("alice"), candidate("bob")
			const ttl = 20 * time.Second
			l := mustGrant(t, a.store, "prep", alice, ttl)
			succ := position(t, a, "prep", bob, ttl)
			p := mustPrepare(t, a.store, "prep", alice, l.Term, bob)
			succ.notReturned(t, "before the handover was aborted")
			if how == "aborted" {
				p.Abort()
			} else {
				pid := p.conn.Conn().PgConn().PID()
				if _, err := a.pool.Exec(callCtx(t), "SELECT pg_terminate_backend($1)", int64(pid)); err != nil {
					t.Fatal(err)
				}
			}
			r := succ.result(t)
			if r.granted || r.lease.HolderID != "alice" || r.lease.Term != l.Term {
				t.Fatalf("after the preparation was %s the successor's Acquire returned %+v granted %v; want refused, alice holding term %d",
					how, r.lease, r.granted, l.Term)
			}
			if how == "session killed" {
				if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err == nil {
					t.Fatal("Commit on a killed session succeeded")
				}
				if o := mustObserve(t, a.store, "prep"); o.HolderID != "alice" || o.Term != l.Term {
					t.Fatalf("after a failed Commit the lease is %+v; want alice's with term %d", o, l.Term)
				}
			}
		})
	}
}

// TestPreparedHandoverWaitIsBounded checks that a successor waits for a
// prepared handover that does not come for a quarter of its TTL, then
// tries as usual and is refused, not failed.
func TestPreparedHandoverWaitIsBounded(t *testing.T) {
	t.Parallel()
	a := setup(t)
	alice, bob := candidate("alice"), candidate("bob")
	const ttl = 2 * time.Second
	l := mustGrant(t, a.store, "prep", alice, 30*time.Second)
	succ := position(t, a, "prep", bob, ttl)
	p := mustPrepare(t, a.store, "prep", alice, l.Term, bob)
	defer p.Abort()
	prepared := time.Now()
	r := succ.result(t)
	if r.granted || r.lease.HolderID != "alice" {
		t.Fatalf("the successor's Acquire returned %+v granted %v; want refused, alice holding", r.lease, r.granted)
	}
	// It waited TTL/4 (500 ms) from before the preparation returned (by
	// as much as a slow machine takes to see it waiting); the bounds are
	// far from both an Acquire that did not wait (0) and one without a
	// lock_timeout (the lease's 30 s).
	if d := r.at.Sub(prepared); d < ttl/8 || d > 10*time.Second {
		t.Fatalf("the successor's Acquire returned %v after the preparation; want about TTL/4 (%v)", d, ttl/4)
	}
}

// TestPreparedHandoverWithoutSuccessor checks that a preparation that no
// successor answers returns once its wait has passed, and that its Commit
// is then an ordinary handover, which the successor takes as usual.
func TestPreparedHandoverWithoutSuccessor(t *testing.T) {
	t.Parallel()
	a := setup(t)
	alice, bob := candidate("alice"), candidate("bob")
	const ttl = 20 * time.Second
	l := mustGrant(t, a.store, "prep", alice, ttl)
	const wait = 50 * time.Millisecond
	start := time.Now()
	p, err := a.store.PrepareHandover(callCtx(t), "prep", alice.Token, l.Term, bob, wait)
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < wait || p.(*preparedHandover).waited {
		t.Fatalf("PrepareHandover with nobody listening returned after %v, waited %v; want after %v, false", d, p.(*preparedHandover).waited, wait)
	}
	if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
		t.Fatal(err)
	}
	if o := mustObserve(t, a.store, "prep"); o.Held() || o.Successor != "bob" {
		t.Fatalf("after the commit the lease is %+v; want released and reserved for bob", o)
	}
	if l2 := mustGrant(t, setupOn(t, a.pool, Options{}).store, "prep", bob, ttl); l2.Term != l.Term+1 {
		t.Fatalf("bob was granted term %d; want %d", l2.Term, l.Term+1)
	}
}

// TestPrepareHandoverRefusals checks what PrepareHandover refuses,
// having prepared nothing: a second preparation of a name, a connection
// through a transaction-pooling proxy, and a successor without a token;
// and that a Commit of a lease no longer held fails with ErrLeaseLost.
func TestPrepareHandoverRefusals(t *testing.T) {
	t.Parallel()
	a := setup(t)
	alice, bob := candidate("alice"), candidate("bob")
	const ttl = 20 * time.Second
	l := mustGrant(t, a.store, "prep", alice, ttl)

	p, err := a.store.PrepareHandover(callCtx(t), "prep", alice.Token, l.Term, bob, time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.store.PrepareHandover(callCtx(t), "prep", alice.Token, l.Term, bob, time.Millisecond); err == nil || !strings.Contains(err.Error(), "another handover") {
		t.Fatalf("a second preparation of the same name: %v; want an error saying another is being prepared", err)
	}
	p.Abort()
	p2, err := a.store.PrepareHandover(callCtx(t), "prep", alice.Token, l.Term, bob, time.Millisecond)
	if err != nil {
		t.Fatalf("a preparation after the first was aborted: %v", err)
	}
	if _, err := a.store.PrepareHandover(callCtx(t), "prep", alice.Token, l.Term, leader.Candidate{ID: "x"}, time.Millisecond); err == nil {
		t.Fatal("a preparation for a successor without a token succeeded")
	}
	mustRelease(t, a.store, "prep", alice, l.Term)
	if err := p2.Commit(callCtx(t), leader.GrantTransfer, ttl); !errors.Is(err, leader.ErrLeaseLost) {
		t.Fatalf("Commit of a released lease: %v; want ErrLeaseLost", err)
	}

	url := pgtest.NewDatabase(t)
	if err := Migrate(callCtx(t), pgtest.OpenPool(t, url), Options{}); err != nil {
		t.Fatal(err)
	}
	pooled, err := NewLeaseStore(pgtest.OpenPool(t, pgtest.PgBouncer(t, url, "transaction")), Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pooled.Close)
	l = mustGrant(t, pooled, "prep", alice, ttl)
	if _, err := pooled.PrepareHandover(callCtx(t), "prep", alice.Token, l.Term, bob, time.Millisecond); !errors.Is(err, ErrPooledSession) {
		t.Fatalf("PrepareHandover behind a transaction-pooling proxy: %v; want ErrPooledSession", err)
	}
}

// TestPrepareNoticeWakesOnlyTheSuccessor checks the wake-ups of a
// preparation's notice: the successor's free-watcher alone, and it is
// remembered for the successor's Acquire, once.
func TestPrepareNoticeWakesOnlyTheSuccessor(t *testing.T) {
	t.Parallel()
	w := wakeups{watchers: map[string]map[chan struct{}]watcher{}, covered: map[string]*coverage{}, deferred: map[string]*time.Timer{}}
	t.Cleanup(w.Close)
	bob, carol, free, all := make(chan struct{}, 1), make(chan struct{}, 1), make(chan struct{}, 1), make(chan struct{}, 1)
	w.addLocked("n", bob, watcher{kind: watchFree, token: "bob"})
	w.addLocked("n", carol, watcher{kind: watchFree, token: "carol"})
	w.addLocked("n", free, watcher{kind: watchFree})
	w.addLocked("n", all, watcher{kind: watchAll})
	w.notified(payloadPrepare+"3:bobn", 0, false)
	if len(bob) != 1 || len(carol) != 0 || len(free) != 0 || len(all) != 0 {
		t.Fatalf("a preparation for bob woke bob %v, carol %v, a free-watcher of no candidate %v, a plain watcher %v; want only bob",
			len(bob) == 1, len(carol) == 1, len(free) == 1, len(all) == 1)
	}
	if w.takePrepared("n", "carol") {
		t.Fatal("carol was told of a handover prepared for bob")
	}
	if !w.takePrepared("n", "bob") || w.takePrepared("n", "bob") {
		t.Fatal("bob was not told of the handover prepared for him exactly once")
	}
}

// mustObserve returns name's lease on s, failing the test on an error.
func mustObserve(t *testing.T, s leader.Store, name string) leader.Lease {
	t.Helper()
	l, err := s.Observe(callCtx(t), name)
	if err != nil {
		t.Fatalf("Observe(%q): %v", name, err)
	}
	return l
}

// callCounter is a leader.Metrics that counts an Elector's store calls
// that succeeded, by op.
type callCounter struct {
	leader.NopMetrics
	mu sync.Mutex
	ok map[string]int
}

func (m *callCounter) StoreCall(_, op string, _ time.Duration, err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err == nil {
		m.ok[op]++
	}
}

func (m *callCounter) count(op string) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.ok[op]
}

// TestElectorPreparesTransfers checks that an Elector on the lease store
// prepares each handover: the leader's preparation succeeds, and the
// successor is granted the lease by the statement that waited for it,
// at every transfer of a round among three Electors.
func TestElectorPreparesTransfers(t *testing.T) {
	t.Parallel()
	a := setup(t)
	const ttl = 10 * time.Second
	h := electortest.NewHistory()
	es, stores, calls := map[string]*leader.Elector{}, map[string]*LeaseStore{}, map[string]*callCounter{}
	bundles, listening := map[string]testBundle{}, map[string]bool{}
	for _, id := range []string{"a", "b", "c"} {
		bundles[id] = setupOn(t, a.pool, Options{})
		stores[id] = bundles[id].store
		// A connection for prepared handovers, open before the first:
		// opening one may take longer than a preparation waits.
		c, err := stores[id].waits.Acquire(callCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		c.Release()
		calls[id] = &callCounter{ok: map[string]int{}}
		cfg := leader.Config{Name: "prepared", ID: id, TTL: ttl, RetryInterval: 100 * time.Millisecond,
			Metrics: calls[id], Logger: slog.New(slog.DiscardHandler)}
		cfg.OnElected, cfg.OnDemoted = h.Hooks(t, id)
		e, err := leader.New(stores[id], cfg)
		if err != nil {
			t.Fatal(err)
		}
		es[id] = e
		electortest.Run(t, e)
	}
	leaderNow := func() (string, uint64) {
		var id string
		var term uint64
		electortest.Eventually(t, 15*time.Second, "a leader", func() bool {
			for i, e := range es {
				if st := e.Status(); st.IsLeader {
					id, term = i, st.Term
					return true
				}
			}
			return false
		})
		return id, term
	}
	for range 3 {
		from, term := leaderNow()
		to := map[string]string{"a": "b", "b": "c", "c": "a"}[from]
		electortest.Eventually(t, 2*ttl, to+" enlisted", func() bool {
			cands, err := stores[from].Candidates(t.Context(), "prepared")
			return err == nil && slices.ContainsFunc(cands, func(c leader.Candidate) bool { return c.ID == to })
		})
		// The successor hears the preparation's notice only once its
		// store's listener has started LISTENing.
		if !listening[to] {
			waitListening(t, bundles[to])
			listening[to] = true
		}
		prepared, waited := calls[from].count("prepare_handover"), stores[to].waitedGrants.Load()
		l, err := es[from].Transfer(t.Context(), to)
		if err != nil {
			t.Fatalf("Transfer from %s to %s: %v", from, to, err)
		}
		if l.HolderID != to || l.Term != term+1 {
			t.Fatalf("Transfer from %s to %s returned %+v; want %s leading with term %d", from, to, l, to, term+1)
		}
		if n := calls[from].count("prepare_handover") - prepared; n != 1 {
			t.Fatalf("%s prepared %d handovers to transfer to %s; want 1", from, n, to)
		}
		if n := stores[to].waitedGrants.Load() - waited; n != 1 {
			t.Fatalf("%s was granted the lease by %d statements that waited for the prepared handover; want 1", to, n)
		}
	}
}

// heardOn LISTENs on channel on a connection of pool's and returns a
// function that returns the payloads received for d from then on.
func heardOn(t *testing.T, b testBundle, channel string) func(d time.Duration) []string {
	t.Helper()
	conn, err := b.pool.Acquire(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Hijack().Close(context.Background()) })
	if _, err := conn.Exec(callCtx(t), "LISTEN "+pgx.Identifier{channel}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	return func(d time.Duration) []string {
		ctx, cancel := context.WithTimeout(t.Context(), d)
		defer cancel()
		var got []string
		for {
			n, err := conn.Conn().WaitForNotification(ctx)
			if err != nil {
				return got
			}
			got = append(got, n.Payload)
		}
	}
}

// awaitNotice waits, with heard (see heardOn), until the listener has
// heard a notice whose payload begins with want, which the test that
// follows leaves out of what it hears next, and fails if it hears another
// first or none within 10 s. (A fixed window, its first form, was at
// times too short for a busy machine to deliver the notice in.)
func awaitNotice(t *testing.T, heard func(time.Duration) []string, want string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		for _, p := range heard(50 * time.Millisecond) {
			if !strings.HasPrefix(p, want) {
				t.Fatalf("waiting for a notice %q…, the listener heard %q first", want, p)
			}
			return
		}
	}
	t.Fatalf("the listener did not hear a notice %q… within 10 s", want)
}

// TestPreparedHandoverNoticeOnlyIfUntaken checks the release's NOTIFY of
// a handover whose successor waited: left out when the successor took the
// lease (the listeners hear its grant alone), and sent after
// handoverNoticeDelay when nobody took it (here the successor's waiting
// session was ended before the commit), so that the other candidates
// still learn of the handover and wake at the end of its reservation.
func TestPreparedHandoverNoticeOnlyIfUntaken(t *testing.T) {
	t.Parallel()
	for _, taken := range []bool{true, false} {
		t.Run(map[bool]string{true: "taken", false: "untaken"}[taken], func(t *testing.T) {
			t.Parallel()
			a := setup(t)
			alice, bob := candidate("alice"), candidate("bob")
			const ttl = 20 * time.Second
			// The deferred notice comes long after the successor's grant,
			// however busy the machine: heard at all, it was not left out.
			a.store.noticeDelay = 2 * time.Second
			l := mustGrant(t, a.store, "prep", alice, ttl)
			heard := heardOn(t, a, a.store.opts.Channel)
			succ := position(t, a, "prep", bob, ttl)
			p := mustPrepare(t, a.store, "prep", alice, l.Term, bob)
			awaitNotice(t, heard, payloadPrepare) // the preparation's own notice
			if !taken {
				var pid int64
				err := a.pool.QueryRow(callCtx(t), `SELECT pid FROM pg_locks
	WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
		AND classid::bigint = $1 AND objid::bigint = $2 AND objsubid = 2 AND NOT granted`,
					int64(handoverClass), int64(uint32(a.store.handoverKey("prep")))).Scan(&pid)
				if err != nil {
					t.Fatalf("finding the successor's waiting backend: %v", err)
				}
				if _, err := a.pool.Exec(callCtx(t), "SELECT pg_terminate_backend($1)", pid); err != nil {
					t.Fatal(err)
				}
				if r := <-succ.done; r.err == nil {
					t.Fatalf("the successor's Acquire on a terminated session returned %+v granted %v, no error", r.lease, r.granted)
				}
			}
			if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
				t.Fatal(err)
			}
			if taken {
				if r := succ.result(t); !r.granted {
					t.Fatalf("the successor was not granted the lease: %+v", r.lease)
				}
			}
			got := heard(a.store.noticeDelay + time.Second)
			want := []string{payloadGrant + "prep"}
			if !taken {
				if len(got) == 1 && strings.HasPrefix(got[0], payloadHandover) && parsePayload(got[0]).token == bob.Token {
					return
				}
				t.Fatalf("after a handover that nobody took the listeners heard %q; want its notice, to %s", got, bob.ID)
			}
			if !slices.Equal(got, want) {
				t.Fatalf("after a handover that the waiting successor took the listeners heard %q; want %q", got, want)
			}
		})
	}
}

// TestWaitedGrantNoticeDeferred checks the NOTIFY of a grant that waited
// for a prepared handover: left out of the grant, so that the listeners'
// wake-ups do not compete with the successor's first moments as leader,
// and sent noticeDelay later if the grant still holds then, never if it
// was released meanwhile (whose own notice must stay the last word).
func TestWaitedGrantNoticeDeferred(t *testing.T) {
	t.Parallel()
	for _, keep := range []bool{true, false} {
		t.Run(map[bool]string{true: "held", false: "released"}[keep], func(t *testing.T) {
			t.Parallel()
			a := setup(t)
			alice, bob := candidate("alice"), candidate("bob")
			const ttl = 20 * time.Second
			// The successor's delay: long enough that a grant notice
			// heard in the second after the commit returned was not
			// deferred, however busy the machine. The preparer's own
			// (Commit returns after it) is long too, so that its notice of
			// the release, if the successor's grant had not locked the
			// row by then, is not sent before the grant on a slow machine.
			const delay = 6 * time.Second
			a.store.noticeDelay = 2 * time.Second
			l := mustGrant(t, a.store, "wg", alice, ttl)
			heard := heardOn(t, a, a.store.opts.Channel)
			succ := position(t, a, "wg", bob, ttl, func(s *LeaseStore) { s.noticeDelay = delay })
			p := mustPrepare(t, a.store, "wg", alice, l.Term, bob)
			awaitNotice(t, heard, payloadPrepare) // the preparation's own notice
			if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
				t.Fatal(err)
			}
			r := succ.result(t)
			if !r.granted {
				t.Fatalf("the successor was not granted the lease: %+v", r.lease)
			}
			if keep {
				if got := heard(time.Second); len(got) > 0 {
					t.Fatalf("in the second after the commit returned (2 s after the waited grant) the listeners heard %q; want nothing until %v after the grant", got, delay)
				}
				if got, want := heard(delay+time.Second), []string{payloadGrant + "wg"}; !slices.Equal(got, want) {
					t.Fatalf("after the delay the listeners heard %q; want the grant's notice %q", got, want)
				}
				return
			}
			if err := succ.b.store.Release(callCtx(t), "wg", bob.Token, r.lease.Term); err != nil {
				t.Fatal(err)
			}
			if got, want := heard(delay+time.Second), []string{"wg"}; !slices.Equal(got, want) {
				t.Fatalf("the successor released its waited grant before the delay; the listeners heard %q, want the release's notice %q alone", got, want)
			}
		})
	}
}

// TestPreparedHandoverUnderSimpleProtocol checks a prepared handover to a
// successor whose pool runs the simple protocol (a setting the store
// supports), under which pgx runs no prepared statement in a batch: the
// successor waits, and is granted, with the statement's text.
func TestPreparedHandoverUnderSimpleProtocol(t *testing.T) {
	t.Parallel()
	a := setup(t)
	cfg := a.pool.Config()
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	simple, err := pgxpool.NewWithConfig(callCtx(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(simple.Close)
	alice, bob := candidate("alice"), candidate("bob")
	const ttl = 20 * time.Second
	l := mustGrant(t, a.store, "sp", alice, ttl)
	succ := position(t, testBundle{pool: simple}, "sp", bob, ttl)
	p := mustPrepare(t, a.store, "sp", alice, l.Term, bob)
	if err := p.Commit(callCtx(t), leader.GrantTransfer, ttl); err != nil {
		t.Fatal(err)
	}
	r := succ.result(t)
	if !r.granted || r.lease.Term != l.Term+1 {
		t.Fatalf("the successor on the simple protocol got %+v granted %v; want term %d granted", r.lease, r.granted, l.Term+1)
	}
	if n := succ.b.store.waitedGrants.Load(); n != 1 {
		t.Fatalf("the successor's grants that waited for the handover: %d; want 1", n)
	}
}

// TestGrantNoticeDeferred checks the NOTIFY of an ordinary grant: sent
// noticeDelay after the grant by the holder's store, if the grant still
// holds then, and never after a release of it.
func TestGrantNoticeDeferred(t *testing.T) {
	t.Parallel()
	for _, keep := range []bool{true, false} {
		t.Run(map[bool]string{true: "held", false: "released"}[keep], func(t *testing.T) {
			t.Parallel()
			a := setup(t)
			// Long enough that a grant notice heard within the first
			// second was not deferred, however busy the machine.
			const delay = 3 * time.Second
			a.store.noticeDelay = delay
			heard := heardOn(t, a, a.store.opts.Channel)
			alice := candidate("alice")
			l := mustGrant(t, a.store, "gn", alice, time.Minute)
			if keep {
				own, waits := a.store.pool.Stat().AcquireCount(), a.store.waits.Stat().AcquireCount()
				if got := heard(time.Second); len(got) > 0 {
					t.Fatalf("within a second of the grant the listeners heard %q; want nothing until %v after it", got, delay)
				}
				if got, want := heard(delay+time.Second), []string{payloadGrant + "gn"}; !slices.Equal(got, want) {
					t.Fatalf("after the delay the listeners heard %q; want the grant's notice %q", got, want)
				}
				// Sent on the waits' connections: on the lease's, a
				// release as it ran would open a connection of its own.
				if got := a.store.pool.Stat().AcquireCount() - own; got != 0 {
					t.Errorf("the deferred notice took %d of the lease's connections; want it on the waits'", got)
				}
				if got := a.store.waits.Stat().AcquireCount() - waits; got < 1 {
					t.Errorf("the waits' connections were taken %d times for the deferred notice; want at least once", got)
				}
				return
			}
			mustRelease(t, a.store, "gn", alice, l.Term)
			if got, want := heard(delay+time.Second), []string{"gn"}; !slices.Equal(got, want) {
				t.Fatalf("the lease was released before its grant's notice was due; the listeners heard %q, want the release's notice %q alone", got, want)
			}
		})
	}
}

// acquireTimes records how long each successful Acquire of an Elector
// took.
type acquireTimes struct {
	leader.NopMetrics
	mu    sync.Mutex
	times []time.Duration
}

func (m *acquireTimes) StoreCall(_, op string, d time.Duration, err error) {
	if op != "acquire" || err != nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.times = append(m.times, d)
}

// longestSince returns the longest of the Acquire calls after the first n.
func (m *acquireTimes) longestSince(n int) (time.Duration, int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	var longest time.Duration
	for _, d := range m.times[min(n, len(m.times)):] {
		longest = max(longest, d)
	}
	return longest, len(m.times)
}

// TestSittingOutSuccessorWaitsForPreparedHandover checks that a candidate
// that sits out after its own tenure (Config.RetryInterval) still waits
// for a handover prepared for it (leader.PreparedForChecker): handed the
// lease back a moment after it handed it over, its Acquire starts before
// the old leader's OnDemoted has returned, so that the grant runs as the
// release commits. A follower that ignored the preparation's wake-up
// would try only once the release had woken it, after OnDemoted.
func TestSittingOutSuccessorWaitsForPreparedHandover(t *testing.T) {
	t.Parallel()
	a := setup(t)
	const (
		ttl       = 10 * time.Second
		demotedIn = time.Second // the slow OnDemoted of the second handover
	)
	h := electortest.NewHistory()
	es, times := map[string]*leader.Elector{}, map[string]*acquireTimes{}
	store := map[string]*LeaseStore{}
	var slow atomic.Bool
	for _, id := range []string{"a", "b"} {
		b := setupOn(t, a.pool, Options{})
		store[id] = b.store
		c, err := b.store.waits.Acquire(callCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		c.Release()
		times[id] = &acquireTimes{}
		cfg := leader.Config{Name: "sitting", ID: id, TTL: ttl, RetryInterval: 8 * time.Second,
			Metrics: times[id], Logger: slog.New(slog.DiscardHandler)}
		elected, demoted := h.Hooks(t, id)
		cfg.OnElected = elected
		cfg.OnDemoted = func() {
			demoted()
			if slow.Load() {
				time.Sleep(demotedIn)
			}
		}
		e, err := leader.New(b.store, cfg)
		if err != nil {
			t.Fatal(err)
		}
		es[id] = e
		electortest.Run(t, e)
		waitListening(t, b)
	}
	var from string
	electortest.Eventually(t, 15*time.Second, "a leader", func() bool {
		for id, e := range es {
			if e.Status().IsLeader {
				from = id
				return true
			}
		}
		return false
	})
	to := map[string]string{"a": "b", "b": "a"}[from]
	enlisted := func(id string) {
		electortest.Eventually(t, 2*ttl, id+" enlisted", func() bool {
			cands, err := store[from].Candidates(t.Context(), "sitting")
			return err == nil && slices.ContainsFunc(cands, func(c leader.Candidate) bool { return c.ID == id })
		})
	}
	enlisted(to)
	if _, err := es[from].Transfer(t.Context(), to); err != nil {
		t.Fatalf("Transfer from %s to %s: %v", from, to, err)
	}
	// from now sits out for its RetryInterval; it enlists again half of
	// it in. Hand the lease back to it meanwhile.
	enlisted(from)
	slow.Store(true)
	_, before := times[from].longestSince(1 << 30)
	l, err := es[to].Transfer(t.Context(), from)
	if err != nil {
		t.Fatalf("Transfer back from %s to %s: %v", to, from, err)
	}
	if l.HolderID != from {
		t.Fatalf("Transfer back returned %+v; want %s leading", l, from)
	}
	if longest, _ := times[from].longestSince(before); longest < demotedIn {
		t.Fatalf("%s, sitting out, took the handover back with Acquire calls of at most %v; want one that waited through the old leader's OnDemoted (%v)",
			from, longest, demotedIn)
	}
}

// TestPrepareHandoverWaitsForAConnectionOnlyWhileOneCanBeOpened checks how
// long PrepareHandover waits for a connection of the store's prepared
// handovers. While one can be opened it waits for the opening, up to
// prepareConnWait (here 300 ms a connection, beyond the 100 ms that failed
// preparations on a loaded machine): the lease is held meanwhile, and an
// unprepared handover's gap is the longer one.
// When every one is in use it gives up after its wait or waitsConnWait,
// whichever is longer, and the Elector hands over unprepared.
func TestPrepareHandoverWaitsForAConnectionOnlyWhileOneCanBeOpened(t *testing.T) {
	t.Parallel()
	cfg, err := pgxpool.ParseConfig(pgtest.NewDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	const dialDelay = 300 * time.Millisecond
	var dialer net.Dialer
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if err := sleepCtx(ctx, dialDelay); err != nil {
			return nil, err
		}
		return dialer.DialContext(ctx, network, addr)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	a := setupOn(t, pool, Options{})
	alice, bob := candidate("alice"), candidate("bob")
	l := mustGrant(t, a.store, "prep", alice, time.Minute)

	start := time.Now()
	p, err := a.store.PrepareHandover(callCtx(t), "prep", alice.Token, l.Term, bob, time.Millisecond)
	if err != nil {
		t.Fatalf("PrepareHandover, its connection opened in %v: %v; want prepared", dialDelay, err)
	}
	if took := time.Since(start); took < dialDelay {
		t.Fatalf("PrepareHandover took %v; want at least the opening of a connection (%v): it opened none", took, dialDelay)
	}
	p.Abort()

	// Every connection in use: it gives up within waitsConnWait or so,
	// not the call's 30 s.
	var held []*pgxpool.Conn
	for range a.store.waits.Stat().MaxConns() {
		c, err := a.store.waits.Acquire(callCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	defer func() {
		for _, c := range held {
			c.Release()
		}
	}()
	start = time.Now()
	p, err = a.store.PrepareHandover(callCtx(t), "prep", alice.Token, l.Term, bob, time.Millisecond)
	took := time.Since(start)
	if err == nil {
		p.Abort()
		t.Fatalf("PrepareHandover with every connection in use prepared; want an error")
	}
	if took < waitsConnWait || took > 5*time.Second {
		t.Fatalf("PrepareHandover with every connection in use failed after %v (%v); want after about waitsConnWait (%v)", took, err, waitsConnWait)
	}
	if l2 := mustRenew(t, a.store, "prep", alice, l.Term, time.Minute); l2.Term != l.Term {
		t.Fatalf("renewed with term %d after the failed preparation; want %d", l2.Term, l.Term)
	}
}
