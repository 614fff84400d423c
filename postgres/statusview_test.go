package postgres

import (
	"testing"
	"time"
)

// statusRow is a row of the status view.
type statusRow struct {
	strategy  string
	held      bool
	holderID  *string
	term      int64
	expiresAt *time.Time
	left      *time.Duration // expires_at - now, on the server's clock
}

// readStatus reads name's row of strategy in the status view.
func readStatus(t *testing.T, b testBundle, name, strategy string) statusRow {
	t.Helper()
	var r statusRow
	err := b.pool.QueryRow(callCtx(t), `SELECT strategy, held, holder_id, term, expires_at, expires_at - clock_timestamp()
		FROM `+b.store.opts.qualifiedStatusView()+` WHERE name = $1 AND strategy = $2`, name, strategy).
		Scan(&r.strategy, &r.held, &r.holderID, &r.term, &r.expiresAt, &r.left)
	if err != nil {
		t.Fatalf("reading %s's %s row of the status view: %v", name, strategy, err)
	}
	return r
}

// TestStatusViewShowsWhoHoldsEachName checks the view a person reads with
// psql: who holds each name and until when, on the server's clock, for a
// lease under its own expiry, one under a heartbeat (whose row says
// 'infinity'), an advisory lease, and released ones.
func TestStatusViewShowsWhoHoldsEachName(t *testing.T) {
	t.Parallel()
	b := setup(t)
	advisory := setupAdvisory(t, b.pool, Options{})
	const ttl = time.Minute
	check := func(what string, r statusRow, held bool, holder string, term int64) {
		t.Helper()
		switch {
		case r.held != held || r.term != term:
			t.Errorf("%s: held %v, term %d; want held %v, term %d", what, r.held, r.term, held, term)
		case held && (r.holderID == nil || *r.holderID != holder || r.left == nil || *r.left <= 0 || *r.left > ttl):
			t.Errorf("%s: holder %v, left %v; want %s and a time left within the TTL", what, r.holderID, r.left, holder)
		case !held && (r.holderID != nil || r.expiresAt != nil):
			t.Errorf("%s: holder %v, expires %v; want none while not held", what, r.holderID, r.expiresAt)
		}
	}

	alice, bob := candidate("alice"), candidate("bob")
	l := mustGrant(t, b.store, "own-expiry", alice, ttl)
	check("a granted lease", readStatus(t, b, "own-expiry", "lease"), true, "alice", int64(l.Term))

	h := mustGrant(t, b.store, "heartbeat", alice, ttl)
	mustRenewBatch(t, b.store, renewals(alice, ttl, h))
	if r := readBeatRows(t, b.pool, "heartbeat")["heartbeat"]; !r.infinite {
		t.Fatal("the lease is not under a heartbeat after RenewBatch")
	}
	check("a lease under a heartbeat", readStatus(t, b, "heartbeat", "lease"), true, "alice", int64(h.Term))

	a := mustGrant(t, advisory, "advisory", bob, ttl)
	check("an advisory lease", readStatus(t, b, "advisory", "advisory"), true, "bob", int64(a.Term))

	mustRelease(t, b.store, "own-expiry", alice, l.Term)
	check("a released lease", readStatus(t, b, "own-expiry", "lease"), false, "", int64(l.Term))
	mustRelease(t, advisory, "advisory", bob, a.Term)
	check("a released advisory lease", readStatus(t, b, "advisory", "advisory"), false, "", int64(a.Term))
}
