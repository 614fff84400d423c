package postgres

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
)

// renewals returns a batch renewing each of leases (granted to c) for ttl.
func renewals(c leader.Candidate, ttl time.Duration, leases ...leader.Lease) []leader.Renewal {
	batch := make([]leader.Renewal, len(leases))
	for i, l := range leases {
		batch[i] = leader.Renewal{Name: l.Name, Token: c.Token, Term: l.Term, TTL: ttl}
	}
	return batch
}

// mustRenewBatch renews batch and fails the test unless every lease was
// renewed.
func mustRenewBatch(t *testing.T, s *LeaseStore, batch []leader.Renewal) {
	t.Helper()
	s.RenewBatch(callCtx(t), batch)
	for _, r := range batch {
		if r.Err != nil {
			t.Fatalf("RenewBatch of %s: %v", r.Name, r.Err)
		}
	}
}

// beatRow is a lease row's heartbeat and its row version (xmin changes
// whenever the row is written).
type beatRow struct {
	heartbeat *string
	xmin      uint32
	infinite  bool // expires_at is 'infinity'
}

func readBeatRows(t *testing.T, pool *pgxpool.Pool, names ...string) map[string]beatRow {
	t.Helper()
	rows, err := pool.Query(callCtx(t), `SELECT name, heartbeat, xmin::text::bigint, expires_at = 'infinity'
		FROM leader_leases WHERE name = ANY($1)`, names)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]beatRow{}
	var (
		name string
		r    beatRow
		xmin int64
	)
	_, err = pgx.ForEachRow(rows, []any{&name, &r.heartbeat, &xmin, &r.infinite}, func() error {
		r.xmin = uint32(xmin)
		out[name] = r
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// heartbeatOf returns the heartbeat name's lease is under, failing the test
// if it is under none.
func heartbeatOf(t *testing.T, pool *pgxpool.Pool, name string) string {
	t.Helper()
	r := readBeatRows(t, pool, name)[name]
	if r.heartbeat == nil {
		t.Fatalf("lease %s is under no heartbeat", name)
	}
	return *r.heartbeat
}

// heartbeatTTL is the TTL of the heartbeat tests: long, so that nothing
// expires unless a test makes it.
const heartbeatTTL = 30 * time.Second

// underHeartbeat grants name to alice on a fresh store and renews it once
// with RenewBatch, which puts it under the store's heartbeat; it returns
// the store's bundle, the lease and the heartbeat.
func underHeartbeat(t *testing.T, name string, alice leader.Candidate) (testBundle, leader.Lease, string) {
	t.Helper()
	b := setup(t)
	l := mustGrant(t, b.store, name, alice, heartbeatTTL)
	mustRenewBatch(t, b.store, renewals(alice, heartbeatTTL, l))
	return b, l, heartbeatOf(t, b.pool, name)
}

// renewalUnderWay begins a transaction that renews heartbeat hb, as a round
// does, and leaves it uncommitted, holding the heartbeat's row lock; it is
// rolled back when the test ends unless committed.
func renewalUnderWay(t *testing.T, pool *pgxpool.Pool, hb string) pgx.Tx {
	t.Helper()
	tx, err := pool.Begin(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback(context.Background()) })
	if _, err := tx.Exec(callCtx(t), `UPDATE leader_heartbeats SET expires_at = clock_timestamp() + interval '1 minute' WHERE id = $1`, hb); err != nil {
		t.Fatal(err)
	}
	return tx
}

// setHeartbeat changes heartbeat hb's row with set, an SQL SET list.
func setHeartbeat(t *testing.T, pool *pgxpool.Pool, hb, set string) {
	t.Helper()
	if _, err := pool.Exec(callCtx(t), `UPDATE leader_heartbeats SET `+set+` WHERE id = $1`, hb); err != nil {
		t.Fatal(err)
	}
}

func TestRenewBatchRenewsOneHeartbeatRow(t *testing.T) {
	t.Parallel()
	b := setup(t)
	s, pool := b.store, b.pool
	alice := candidate("alice")
	const ttl = 30 * time.Second
	var leases []leader.Lease
	var names []string
	for i := range 20 {
		l := mustGrant(t, s, fmt.Sprintf("beat-%02d", i), alice, ttl)
		leases = append(leases, l)
		names = append(names, l.Name)
	}
	mustRenewBatch(t, s, renewals(alice, ttl, leases...))
	moved := readBeatRows(t, pool, names...)
	hb := heartbeatOf(t, pool, names[0])
	for name, r := range moved {
		if r.heartbeat == nil || *r.heartbeat != hb || !r.infinite {
			t.Fatalf("after the first round %s has heartbeat %v, expires_at infinity %v; want %s and infinity (so that an earlier version never takes it over)",
				name, r.heartbeat, r.infinite, hb)
		}
	}
	var beatXmin int64
	readBeat := func() (expires time.Time) {
		t.Helper()
		if err := pool.QueryRow(callCtx(t), `SELECT expires_at, xmin::text::bigint FROM leader_heartbeats WHERE id = $1`, hb).
			Scan(&expires, &beatXmin); err != nil {
			t.Fatal(err)
		}
		return expires
	}
	before, beatBefore := readBeat(), beatXmin

	for range 3 {
		batch := renewals(alice, ttl, leases...)
		mustRenewBatch(t, s, batch)
		for _, r := range batch {
			if r.Lease.HolderID != alice.ID || r.Lease.Term != r.Term || !r.Lease.AcquiredAt.Equal(leases[0].AcquiredAt.Truncate(0)) && r.Lease.AcquiredAt.IsZero() ||
				r.Lease.Remaining <= 0 || r.Lease.Remaining > ttl {
				t.Fatalf("RenewBatch reported %+v for %s", r.Lease, r.Name)
			}
		}
	}
	after := readBeat()
	if !after.After(before) || beatXmin == beatBefore {
		t.Errorf("the heartbeat's expiry went from %v to %v (row version %d to %d); want it renewed", before, after, beatBefore, beatXmin)
	}
	for name, r := range readBeatRows(t, pool, names...) {
		if r.xmin != moved[name].xmin {
			t.Errorf("lease row %s was written by rounds after its first (xmin %d, then %d); want only the heartbeat written", name, moved[name].xmin, r.xmin)
		}
	}
	// Readers see the heartbeat's expiry as the lease's.
	l, err := s.Observe(callCtx(t), names[3])
	if err != nil {
		t.Fatal(err)
	}
	if !l.Held() || l.HolderID != alice.ID || !l.ExpiresAt.Equal(after) {
		t.Errorf("Observe of a lease under the heartbeat: %+v; want held by alice until %v", l, after)
	}
	bob := candidate("bob")
	if l, granted := mustAcquire(t, s, names[4], bob, ttl); granted || !l.Held() || l.HolderID != alice.ID || !l.ExpiresAt.Equal(after) {
		t.Errorf("Acquire by bob of a lease under a live heartbeat: granted %v, %+v; want refused, held by alice until %v", granted, l, after)
	}
}

func TestALeaseUnderAnExpiredHeartbeatCanBeTakenOver(t *testing.T) {
	t.Parallel()
	b := setup(t)
	s, pool := b.store, b.pool
	alice, bob := candidate("alice"), candidate("bob")
	const ttl = 30 * time.Second
	la, lb := mustGrant(t, s, "expired-a", alice, ttl), mustGrant(t, s, "expired-b", alice, ttl)
	mustRenewBatch(t, s, renewals(alice, ttl, la, lb))
	hb := heartbeatOf(t, pool, "expired-a")
	setHeartbeat(t, pool, hb, "expires_at = clock_timestamp()")
	if l, err := s.Observe(callCtx(t), "expired-b"); err != nil || l.Held() {
		t.Errorf("Observe of a lease under an expired heartbeat: %+v, %v; want free", l, err)
	}
	got := mustGrant(t, s, "expired-a", bob, ttl)
	if got.Term != la.Term+1 {
		t.Errorf("bob's term %d, want %d", got.Term, la.Term+1)
	}
	var dead bool
	if err := pool.QueryRow(callCtx(t), `SELECT dead FROM leader_heartbeats WHERE id = $1`, hb).Scan(&dead); err != nil || !dead {
		t.Errorf("the heartbeat after a takeover from it: dead %v, %v; want marked dead", dead, err)
	}
	if r := readBeatRows(t, pool, "expired-a")["expired-a"]; r.heartbeat != nil || r.infinite {
		t.Errorf("bob's grant is under heartbeat %v (expires_at infinity %v); want under none", r.heartbeat, r.infinite)
	}

	// Alice's store learns at its next round that both leases are lost,
	// the one nobody took too, and goes on with a new heartbeat.
	batch := renewals(alice, ttl, la, lb)
	s.RenewBatch(callCtx(t), batch)
	for _, r := range batch {
		wantErrorIs(t, r.Err, leader.ErrLeaseLost, "RenewBatch of "+r.Name+" after its heartbeat expired")
	}
	lc := mustGrant(t, s, "expired-c", alice, ttl)
	mustRenewBatch(t, s, renewals(alice, ttl, lc))
	if next := heartbeatOf(t, pool, "expired-c"); next == hb {
		t.Errorf("a new lease was put under the dead heartbeat %s", hb)
	}
}

// A heartbeat marked dead is never renewed again, even if the server's
// clock stepped back so that it looks unexpired.
func TestADeadHeartbeatIsNeverRenewed(t *testing.T) {
	t.Parallel()
	alice := candidate("alice")
	b, l, hb := underHeartbeat(t, "dead", alice)
	s := b.store
	setHeartbeat(t, b.pool, hb, "dead = true")
	batch := renewals(alice, heartbeatTTL, l)
	s.RenewBatch(callCtx(t), batch)
	wantErrorIs(t, batch[0].Err, leader.ErrLeaseLost, "RenewBatch under a dead heartbeat")
	if o, err := s.Observe(callCtx(t), "dead"); err != nil || o.Held() {
		t.Errorf("Observe of a lease under a dead heartbeat: %+v, %v; want free", o, err)
	}
}

// The statement that takes a lease over from an expired heartbeat and the
// one that renews that heartbeat are ordered by the heartbeat's row: a
// renewal already under way when the taker looks wins, and the lease is
// not taken.
func TestATakeoverWaitsForAHeartbeatRenewalUnderWay(t *testing.T) {
	t.Parallel()
	alice, bob := candidate("alice"), candidate("bob")
	const ttl = heartbeatTTL
	b, l, hb := underHeartbeat(t, "race", alice)
	s, pool := b.store, b.pool

	// As committed, the heartbeat has expired; a renewal of it, begun
	// before it expired, has not committed yet.
	setHeartbeat(t, pool, hb, "expires_at = clock_timestamp()")
	tx := renewalUnderWay(t, pool, hb)
	type result struct {
		l       leader.Lease
		granted bool
		err     error
	}
	done := make(chan result, 1)
	go func() {
		l, granted, err := s.Acquire(callCtx(t), "race", bob, ttl)
		done <- result{l, granted, err}
	}()
	waitForLockWait(t, pool)
	if err := tx.Commit(callCtx(t)); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil || r.granted {
		t.Fatalf("bob's Acquire while alice's heartbeat renewal was under way: %+v, granted %v, %v; want refused", r.l, r.granted, r.err)
	}
	if o, err := s.Observe(callCtx(t), "race"); err != nil || !o.Held() || o.HolderID != alice.ID || o.Term != l.Term {
		t.Fatalf("Observe after bob was refused: %+v, %v; want alice holding term %d", o, err, l.Term)
	}
	mustRenewBatch(t, s, renewals(alice, ttl, l))
}

// A lease that left the store's heartbeat behind its back (here, released by
// another store with the same token) is reported lost while the others are
// renewed; a lease under it that the store let go is taken out from under
// it, keeping the heartbeat's expiry as its own.
func TestRenewBatchReconcilesItsHeartbeat(t *testing.T) {
	t.Parallel()
	b := setup(t)
	s, pool := b.store, b.pool
	other, err := NewLeaseStore(pool, Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(other.Close)
	alice := candidate("alice")
	const ttl = 30 * time.Second
	la, lb, lc := mustGrant(t, s, "rec-a", alice, ttl), mustGrant(t, s, "rec-b", alice, ttl), mustGrant(t, s, "rec-c", alice, ttl)
	mustRenewBatch(t, s, renewals(alice, ttl, la, lb, lc))
	hb := heartbeatOf(t, pool, "rec-a")

	mustRelease(t, other, "rec-b", alice, lb.Term)
	batch := renewals(alice, ttl, la, lb, lc)
	s.RenewBatch(callCtx(t), batch)
	if batch[0].Err != nil || batch[2].Err != nil {
		t.Fatalf("RenewBatch of the leases still held: %v, %v", batch[0].Err, batch[2].Err)
	}
	wantErrorIs(t, batch[1].Err, leader.ErrLeaseLost, "RenewBatch of a lease released by another store")

	// The store lets go of rec-c as it does of a lease no Elector renews
	// any more.
	s.beats.forget("rec-c", alice.Token)
	mustRenewBatch(t, s, renewals(alice, ttl, la))
	rows := readBeatRows(t, pool, "rec-a", "rec-c")
	if r := rows["rec-c"]; r.heartbeat != nil || r.infinite {
		t.Errorf("rec-c, let go by the store, is under heartbeat %v (expires_at infinity %v); want under none, with an expiry of its own", r.heartbeat, r.infinite)
	}
	if r := rows["rec-a"]; r.heartbeat == nil || *r.heartbeat != hb {
		t.Errorf("rec-a is under heartbeat %v; want %s", r.heartbeat, hb)
	}
	o, err := s.Observe(callCtx(t), "rec-c")
	if err != nil || !o.Held() || o.Remaining > ttl {
		t.Errorf("Observe of rec-c after it was let go: %+v, %v; want held, for at most the TTL", o, err)
	}
	names := []string{}
	n, err := pool.Query(callCtx(t), `SELECT name FROM leader_leases WHERE heartbeat = $1 ORDER BY name`, hb)
	if err == nil {
		names, err = pgx.CollectRows(n, pgx.RowTo[string])
	}
	if err != nil || !slices.Equal(names, []string{"rec-a"}) {
		t.Errorf("leases under the heartbeat: %v, %v; want [rec-a]", names, err)
	}
}

// Statements lock a heartbeat before a lease row, never after: a refused
// Acquire (which holds the lease row) does not wait for a renewal of the
// heartbeat that is about to move that lease, which would deadlock.
func TestARefusedAcquireDoesNotWaitForTheHeartbeat(t *testing.T) {
	t.Parallel()
	alice, bob := candidate("alice"), candidate("bob")
	const ttl = heartbeatTTL
	b, _, hb := underHeartbeat(t, "order", alice)
	s, pool := b.store, b.pool

	// A round under way: it has renewed the heartbeat and is about to
	// write the lease row.
	tx := renewalUnderWay(t, pool, hb)
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		_, granted, err := s.Acquire(ctx, "order", bob, ttl)
		if err == nil && granted {
			err = fmt.Errorf("bob was granted a lease under a live heartbeat")
		}
		done <- err
	}()
	if err := <-done; err != nil {
		t.Fatalf("bob's Acquire while a renewal of the heartbeat was under way: %v", err)
	}
	if _, err := tx.Exec(callCtx(t), `UPDATE leader_leases SET renewed_at = clock_timestamp() WHERE name = 'order'`); err != nil {
		t.Fatalf("the round's write of the lease row: %v", err)
	}
	if err := tx.Commit(callCtx(t)); err != nil {
		t.Fatal(err)
	}
}

// TestNewHeartbeatSweepsThoseOfGoneProcesses checks that a store's new
// heartbeat deletes the heartbeat rows of processes long gone (expired for
// a minute, named by no lease row), and keeps those a lease row names and
// those that are live or only just expired.
func TestNewHeartbeatSweepsThoseOfGoneProcesses(t *testing.T) {
	t.Parallel()
	b := setup(t)
	s, pool := b.store, b.pool
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := pool.Exec(callCtx(t), sql, args...); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 50 {
		exec(`INSERT INTO leader_heartbeats (id, expires_at) VALUES ($1, clock_timestamp() - interval '2 hours')`, fmt.Sprintf("gone-%02d", i))
	}
	exec(`INSERT INTO leader_heartbeats (id, expires_at) VALUES ('named', clock_timestamp() - interval '2 hours')`)
	exec(`INSERT INTO leader_leases (name, term, heartbeat) VALUES ('old', 7, 'named')`)
	exec(`INSERT INTO leader_heartbeats (id, expires_at) VALUES ('recent', clock_timestamp() - interval '10 seconds')`)
	exec(`INSERT INTO leader_heartbeats (id, expires_at) VALUES ('live', clock_timestamp() + interval '1 hour')`)

	alice := candidate("alice")
	l := mustGrant(t, s, "sweep", alice, 30*time.Second)
	mustRenewBatch(t, s, renewals(alice, 30*time.Second, l)) // makes this store's heartbeat
	mine := heartbeatOf(t, pool, "sweep")

	rows, err := pool.Query(callCtx(t), `SELECT id FROM leader_heartbeats ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	left, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"live", mine, "named", "recent"}
	slices.Sort(want)
	if !slices.Equal(left, want) {
		t.Errorf("heartbeats left: %q; want %q", left, want)
	}
}
