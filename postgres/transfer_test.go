package postgres

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/pgtest"
)

// mustRequest records req on name's lease for ttl, failing the test if it
// is not recorded.
func mustRequest(t *testing.T, s leader.Transferer, name string, req leader.TransferRequest, ttl time.Duration) {
	t.Helper()
	if _, err := s.RequestTransfer(callCtx(t), name, req, ttl); err != nil {
		t.Fatalf("RequestTransfer(%q, %+v, %v): %v", name, req, ttl, err)
	}
}

// TestRenewBatchReportsTransferRequests checks that a heartbeat round
// reports each lease's priority, the reason of its grant and its pending
// request, as the Elector reads them there: for a lease the round moves
// under the heartbeat, and for leases already under it (whose rows the
// round does not write), in one statement per round.
func TestRenewBatchReportsTransferRequests(t *testing.T) {
	t.Parallel()
	b := setup(t)
	s := b.store
	alice := candidate("alice")
	alice.Priority = 7
	const ttl = time.Minute
	la, lb := mustGrant(t, s, "req-a", alice, ttl), mustGrant(t, s, "req-b", alice, ttl)
	toBob := leader.TransferRequest{To: "bob", Reason: leader.GrantTransfer}
	mustRequest(t, s, "req-a", toBob, ttl)

	check := func(what string, batch []leader.Renewal, want map[string]leader.TransferRequest) {
		t.Helper()
		for _, r := range batch {
			if r.Err != nil {
				t.Fatalf("%s: RenewBatch of %s: %v", what, r.Name, r.Err)
			}
			l, w := r.Lease, want[r.Name]
			if l.Priority != 7 || l.Reason != leader.GrantFirst {
				t.Errorf("%s: %s renewed with priority %d, reason %q; want 7 and %q", what, r.Name, l.Priority, l.Reason, leader.GrantFirst)
			}
			if got := l.Transfer; got.To != w.To || got.Reason != w.Reason || got.Pending() != w.Pending() || got.Remaining > ttl {
				t.Errorf("%s: %s renewed with request %+v; want %+v (pending %v)", what, r.Name, got, w, w.Pending())
			}
		}
	}
	pending := toBob
	pending.Remaining = ttl
	batch := renewals(alice, ttl, la, lb)
	s.RenewBatch(callCtx(t), batch)
	check("the round that moves the leases under the heartbeat", batch, map[string]leader.TransferRequest{"req-a": pending})
	if r := readBeatRows(t, b.pool, "req-a", "req-b"); r["req-a"].heartbeat == nil || r["req-b"].heartbeat == nil {
		t.Fatal("the leases are not under a heartbeat after a round")
	}

	batch = renewals(alice, ttl, la, lb)
	s.RenewBatch(callCtx(t), batch)
	check("a round of leases under the heartbeat", batch, map[string]leader.TransferRequest{"req-a": pending})

	best := leader.TransferRequest{Reason: leader.GrantPriority, Remaining: ttl}
	mustRequest(t, s, "req-b", best, ttl)
	mustRequest(t, s, "req-a", leader.TransferRequest{}, 0) // cleared
	batch = renewals(alice, ttl, la, lb)
	s.RenewBatch(callCtx(t), batch)
	check("a round after one request was cleared and another made", batch, map[string]leader.TransferRequest{"req-b": best})

	mustRequest(t, s, "req-b", best, 50*time.Millisecond)
	time.Sleep(100 * time.Millisecond)
	batch = renewals(alice, ttl, la, lb)
	s.RenewBatch(callCtx(t), batch)
	check("a round after the request lapsed", batch, nil)
}

// TestRequestTransferNeedsAHolder checks, on both strategies, that a
// request for a lease released or handed over is refused with
// leader.ErrNoLeader and reports the lease as it stands, a handover's
// reservation included.
func TestRequestTransferNeedsAHolder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, s := range []interface {
		leader.Store
		leader.Transferer
	}{b.store, setupAdvisory(t, b.pool, Options{})} {
		name := "no-holder-" + string(strategyOf(s))
		alice, bob := candidate("alice"), candidate("bob")
		l := mustGrant(t, s, name, alice, time.Minute)
		if err := s.ReleaseTo(callCtx(t), name, alice.Token, l.Term, bob, leader.GrantTransfer, time.Minute); err != nil {
			t.Fatalf("%s: ReleaseTo: %v", name, err)
		}
		got, err := s.RequestTransfer(callCtx(t), name, leader.TransferRequest{Reason: leader.GrantTransfer}, time.Minute)
		if !errors.Is(err, leader.ErrNoLeader) || got.Held() || got.Successor != "bob" || got.Term != l.Term {
			t.Errorf("%s: RequestTransfer of a lease handed to bob = %+v, %v; want it free, reserved for bob, and ErrNoLeader", name, got, err)
		}
		if g := mustGrant(t, s, name, bob, time.Minute); g.Term != l.Term+1 || g.Reason != leader.GrantTransfer || g.Transfer.Pending() {
			t.Errorf("%s: bob's grant = %+v; want term %d, reason transfer, no request", name, g, l.Term+1)
		}
	}
}

// strategyOf returns the strategy of a store of this package.
func strategyOf(s leader.Store) Strategy {
	if _, ok := s.(*AdvisoryStore); ok {
		return StrategyAdvisory
	}
	return StrategyLease
}

// TestAdvisoryHandoverLeavesTheLockAlone checks that a candidate woken by
// a handover to another one is refused without taking the lock, so that
// the successor, coming at the same moment, finds it free: the lock stays
// free, and no lock waiter mistakes the refused candidate for a holder.
func TestAdvisoryHandoverLeavesTheLockAlone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	holder, other := setupAdvisory(t, b.pool, Options{}), setupAdvisory(t, b.pool, Options{})
	const name = "lock-alone"
	alice, bob, carol := candidate("alice"), candidate("bob"), candidate("carol")
	l := mustGrant(t, holder, name, alice, time.Minute)
	if err := holder.ReleaseTo(callCtx(t), name, alice.Token, l.Term, bob, leader.GrantTransfer, time.Minute); err != nil {
		t.Fatal(err)
	}
	tries := 0
	for range 20 {
		refused, granted := mustAcquire(t, other, name, carol, time.Minute)
		if granted || refused.Successor != "bob" || refused.Reserved <= 0 {
			t.Fatalf("carol's Acquire of a lease handed to bob = %+v (granted %v); want refused, reserved for bob", refused, granted)
		}
		tries++
	}
	hi, lo := keyHalves(other.Key(name))
	var lockers int
	err := b.pool.QueryRow(callCtx(t), `SELECT count(*) FROM pg_locks AS l
		WHERE l.locktype = 'advisory' AND l.classid::bigint = $1 AND l.objid::bigint = $2 AND l.objsubid = 1`, hi, lo).Scan(&lockers)
	if err != nil {
		t.Fatal(err)
	}
	if lockers != 0 {
		t.Errorf("after %d refused attempts the lock has %d holders or waiters; want none", tries, lockers)
	}
	if g := mustGrant(t, other, name, bob, time.Minute); g.Term != l.Term+1 || g.Reason != leader.GrantTransfer {
		t.Errorf("bob's grant = %+v; want term %d, reason transfer", g, l.Term+1)
	}
}

// TestEnlistKeepsToTheNamesStrategy checks that a candidate of one strategy
// cannot enlist for a name that the other strategy elects (whose leader
// could pick it as a successor that can never take the lease), and so
// that its Elector's first successful call is not an Enlist (Run returns
// the conflict of its Acquire at once), while the name's own candidates
// enlist as ever.
func TestEnlistKeepsToTheNamesStrategy(t *testing.T) {
	t.Parallel()
	b := setup(t)
	advisory := setupAdvisory(t, b.pool, Options{})
	mustGrant(t, b.store, "lease-name", candidate("holder"), time.Minute)
	ttl := time.Minute
	err := advisory.Enlist(callCtx(t), "lease-name", candidate("advisory"), ttl)
	if err == nil || !strings.Contains(err.Error(), "lease strategy") {
		t.Errorf("Enlist of an advisory candidate for a lease-strategy name: %v; want an error naming the lease strategy", err)
	}
	if err := b.store.Enlist(callCtx(t), "lease-name", candidate("lease"), ttl); err != nil {
		t.Errorf("Enlist of a lease candidate: %v", err)
	}
	if err := advisory.Enlist(callCtx(t), "never-granted", candidate("advisory"), ttl); err != nil {
		t.Errorf("Enlist of an advisory candidate for a name never granted: %v", err)
	}
	cands, err := advisory.Candidates(callCtx(t), "lease-name")
	if err != nil || len(cands) != 1 || cands[0].ID != "lease" {
		t.Errorf("Candidates = %+v, %v; want the lease candidate alone", cands, err)
	}
}

// transferer is a store of this package.
type transferer interface {
	leader.Store
	leader.Transferer
}

// statementLog is a pgx tracer that records the SQL of the statements sent
// during record.
type statementLog struct {
	mu  sync.Mutex
	on  bool
	sql []string
}

func (l *statementLog) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.on {
		l.sql = append(l.sql, d.SQL)
	}
	return ctx
}

func (l *statementLog) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// record runs f and returns the statements sent meanwhile.
func (l *statementLog) record(f func()) []string {
	l.mu.Lock()
	l.on, l.sql = true, nil
	l.mu.Unlock()
	f()
	l.mu.Lock()
	defer l.mu.Unlock()
	l.on = false
	return l.sql
}

// candidateList returns name's candidates on s as "id/priority", sorted.
func candidateList(t *testing.T, s leader.Transferer, name string) []string {
	t.Helper()
	cands, err := s.Candidates(callCtx(t), name)
	if err != nil {
		t.Fatalf("Candidates(%q): %v", name, err)
	}
	var out []string
	for _, c := range cands {
		out = append(out, fmt.Sprintf("%s/%d", c.ID, c.Priority))
	}
	slices.Sort(out)
	return out
}

// TestRefusedAcquireEnlistsInItsStatement checks, on both strategies, that
// an Acquire that does not grant enlists its candidate, with its priority,
// for EnlistFactor times its TTL on the server's clock, in the one
// statement that refuses it; and that a grant enlists nobody. The holder
// is on a store of its own, whose statements (an advisory grant's
// announcement) are not counted.
func TestRefusedAcquireEnlistsInItsStatement(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	log := &statementLog{}
	traced := poolWith(t, pool, func(c *pgx.ConnConfig) { c.Tracer = log })
	lease, advisory := setupOn(t, traced, Options{}).store, setupAdvisory(t, traced, Options{})
	for _, st := range []struct {
		holder, s transferer
		want      string // the refusing statement
	}{
		{setupOn(t, pool, Options{}).store, lease, lease.sql.acquire},
		{setupAdvisory(t, pool, Options{}), advisory, advisory.sql.grantQuick},
	} {
		const ttl = time.Minute
		name := "enlists-" + string(strategyOf(st.s))
		alice, bob := candidate("alice"), candidate("bob")
		mustGrant(t, st.holder, name, alice, ttl)
		bob.Priority = 3
		if _, granted := mustAcquire(t, st.s, name, bob, ttl); granted { // the advisory store opens bob's session
			t.Fatalf("%s: bob was granted alice's lease", name)
		}
		bob.Priority = 9
		var granted bool
		sent := log.record(func() { _, granted = mustAcquire(t, st.s, name, bob, ttl) })
		if granted {
			t.Fatalf("%s: bob was granted alice's lease", name)
		}
		if len(sent) != 1 || sent[0] != st.want {
			t.Errorf("%s: bob's refused Acquire sent %d statements; want one, the grant statement:\n%s", name, len(sent), strings.Join(sent, "\n----\n"))
		}
		if got := candidateList(t, st.s, name); !slices.Equal(got, []string{"bob/9"}) {
			t.Errorf("%s: Candidates after bob's refusals = %v; want bob/9 alone (a grant enlists nobody)", name, got)
		}
		var left time.Duration
		err := pool.QueryRow(callCtx(t), `SELECT expires_at - clock_timestamp() FROM `+Options{}.withDefaults().qualifiedCandidateTable()+
			` WHERE name = $1 AND token = $2`, name, bob.Token).Scan(&left)
		if want := leader.EnlistFactor * ttl; err != nil || left > want || left < want-10*time.Second {
			t.Errorf("%s: bob's entry has %v left, %v; want about %v", name, left, err, want)
		}
	}
}

// TestAcquireOfTheOtherStrategyDoesNotEnlist checks that an Acquire
// refused because the other strategy elects the name does not enlist its
// candidate, any more than Enlist would (see
// TestEnlistKeepsToTheNamesStrategy).
func TestAcquireOfTheOtherStrategyDoesNotEnlist(t *testing.T) {
	t.Parallel()
	b := setup(t)
	advisory := setupAdvisory(t, b.pool, Options{})
	for _, st := range []struct {
		name          string
		holder, other transferer
	}{{"lease-held", b.store, advisory}, {"advisory-held", advisory, b.store}} {
		mustGrant(t, st.holder, st.name, candidate("alice"), time.Minute)
		_, granted, err := st.other.Acquire(callCtx(t), st.name, candidate("bob"), time.Minute)
		var conflict *StrategyConflictError
		if granted || !errors.As(err, &conflict) {
			t.Errorf("%s: the other strategy's Acquire: granted %v, %v; want a *StrategyConflictError", st.name, granted, err)
		}
		if got := candidateList(t, st.holder, st.name); len(got) != 0 {
			t.Errorf("%s: Candidates after the other strategy's Acquire = %v; want none", st.name, got)
		}
	}
}

// TestRefusalCommitsLazily checks that the statement of an Acquire that
// does not grant commits with synchronous_commit off, on both strategies
// (the candidate's entry need not survive a crash, and a refusal need not
// wait for a WAL flush), and that a grant's keeps the setting it had (see
// durableCommit).
func TestRefusalCommitsLazily(t *testing.T) {
	t.Parallel()
	b := setup(t)
	advisory := setupAdvisory(t, b.pool, Options{})
	const ttl = time.Minute
	alice, bob := candidate("alice"), candidate("bob")
	mustRelease(t, b.store, "lazy-lease", alice, mustGrant(t, b.store, "lazy-lease", alice, ttl).Term)
	iv, ms, idle, every := ttlSettings(ttl)
	hi, lo := keyHalves(advisory.Key("lazy-advisory"))
	leaseArgs := []any{"lazy-lease", bob.Token, bob.ID, iv, b.store.opts.Channel, int32(0)}
	for _, st := range []struct {
		what string
		hold func() // before the statement runs
		sql  string
		args []any
		want string
	}{
		{"a lease grant", func() {}, b.store.sql.acquire, leaseArgs, "on"},
		{"a lease refusal", func() { mustGrant(t, b.store, "lazy-lease", alice, ttl) }, b.store.sql.acquire, leaseArgs, "off"},
		{"an advisory refusal", func() { mustGrant(t, advisory, "lazy-advisory", alice, ttl) }, advisory.sql.grantQuick,
			[]any{"lazy-advisory", advisory.Key("lazy-advisory"), bob.Token, bob.ID, iv, ms, idle, every, hi, lo, int32(0)}, "off"},
	} {
		st.hold()
		if got := commitSetting(t, b.pool, st.sql, st.args...); got != st.want {
			t.Errorf("%s: the statement's transaction commits with synchronous_commit %s; want %s", st.what, got, st.want)
		}
	}
}

// commitSetting runs sql in a transaction whose synchronous_commit is on,
// and returns the setting that the transaction would commit with; it
// rolls the transaction back.
func commitSetting(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) string {
	t.Helper()
	tx, err := pool.Begin(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(callCtx(t)) //nolint:errcheck // the test's outcome is the setting
	if _, err := tx.Exec(callCtx(t), "SET LOCAL synchronous_commit = on"); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(callCtx(t), sql, args...); err != nil {
		t.Fatal(err)
	}
	var got string
	if err := tx.QueryRow(callCtx(t), "SHOW synchronous_commit").Scan(&got); err != nil {
		t.Fatal(err)
	}
	return got
}
