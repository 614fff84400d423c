package postgres

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/pgtest"
)

// listenTo opens a connection of its own that LISTENs on s's channel.
func listenTo(t *testing.T, pool *pgxpool.Pool, s *AdvisoryStore) *pgx.Conn {
	t.Helper()
	conn, err := pgx.ConnectConfig(callCtx(t), pool.Config().ConnConfig.Copy())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeConn(conn) })
	if _, err := conn.Exec(callCtx(t), "LISTEN "+pgx.Identifier{s.Options().Channel}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	return conn
}

// nextNotification returns the next notification conn receives within d,
// or nil if none comes.
func nextNotification(t *testing.T, conn *pgx.Conn, d time.Duration) *pgconnNotification {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), d)
	defer cancel()
	n, err := conn.WaitForNotification(ctx)
	switch {
	case err == nil:
		return &pgconnNotification{PID: n.PID, Payload: n.Payload}
	case errors.Is(err, context.DeadlineExceeded) || ctx.Err() != nil:
		return nil
	default:
		t.Fatalf("waiting for a notification: %v", err)
		return nil
	}
}

type pgconnNotification struct {
	PID     uint32
	Payload string
}

// TestAdvisoryGrantIsAnnouncedAfterItsReply checks that a grant's
// notification is sent once, by the holder's backend, in a statement of
// its own that starts after the grant's reply is in: sent in the grant's
// transaction, the crowd of listeners it wakes would run while the winner
// waits for its reply.
func TestAdvisoryGrantIsAnnouncedAfterItsReply(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	times := &statementTimes{}
	s := advisoryOn(t, pool, func(c *pgx.ConnConfig) { c.Tracer = times })
	times.mu.Lock()
	times.match = map[string]string{s.sql.grantQuick: "grant", s.sql.grant: "grant", s.sql.announce: "announce"}
	times.mu.Unlock()
	listener := listenTo(t, pool, s)
	const name = "announced"
	mustGrant(t, s, name, candidate("alice"), time.Minute)
	pid := s.holderPID(t, name)

	n := nextNotification(t, listener, 10*time.Second)
	if n == nil {
		t.Fatal("no notification within 10s of the grant")
	}
	if want := payloadGrant + name; n.Payload != want || n.PID != uint32(pid) {
		t.Errorf("notification %q from backend %d; want %q from the holder's backend %d", n.Payload, n.PID, want, pid)
	}
	replied, ok := times.after(time.Time{}, "grant", true)
	if !ok {
		t.Fatal("no grant statement traced")
	}
	if _, ok := times.after(replied, "announce", false); !ok {
		t.Error("the announce statement did not start after the grant's reply")
	}
	if n := nextNotification(t, listener, 300*time.Millisecond); n != nil {
		t.Errorf("a second notification %q from backend %d: the grant was announced twice", n.Payload, n.PID)
	}
}

// TestAdvisoryAnnounceNeedsTheLease checks that an announcement is sent
// only while its session holds the lease under the grant's term: a lease
// released (or lost) before its announcement ran is not announced.
func TestAdvisoryAnnounceNeedsTheLease(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	s := setupAdvisory(t, pool, Options{})
	listener := listenTo(t, pool, s)
	const name = "announce-held"
	alice := candidate("alice")
	l := mustGrant(t, s, name, alice, time.Minute)
	if n := nextNotification(t, listener, 10*time.Second); n == nil {
		t.Fatal("the grant was not announced")
	}
	ss := s.holderSession(t, name)
	announce := func(term uint64) {
		t.Helper()
		err := ss.do(callCtx(t), s, false, func(conn *pgx.Conn) error {
			_, err := conn.Exec(callCtx(t), s.sql.announce, name, alice.Token, int64(term), s.opts.Channel)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}

	announce(l.Term + 1) // the statement itself checks the term
	if n := nextNotification(t, listener, 300*time.Millisecond); n != nil {
		t.Errorf("announced under a term the session does not hold: %q", n.Payload)
	}
	announce(l.Term) // the control: under its own term, it is sent
	if n := nextNotification(t, listener, 10*time.Second); n == nil || n.Payload != payloadGrant+name {
		t.Fatalf("not announced under the session's own term: %+v", n)
	}

	if err := s.Release(callCtx(t), name, alice.Token, l.Term); err != nil {
		t.Fatal(err)
	}
	if n := nextNotification(t, listener, 10*time.Second); n == nil || n.Payload != name {
		t.Fatalf("want the release's notification, got %+v", n)
	}
	s.notifyLater(ss, l.Term, false, 0) // as if it ran only after the release
	if n := nextNotification(t, listener, 300*time.Millisecond); n != nil {
		t.Errorf("a released lease was announced: %q", n.Payload)
	}
}

// TestAdvisoryCandidateWaitsForAGrantInFlight checks that a candidate
// refused while another one's grant has taken the lock but not committed
// its row does not poll the server: it waits for the grant's notification,
// then reports the new holder. Here the winner's grant is held up for a
// while by a transaction that locks the name's row.
func TestAdvisoryCandidateWaitsForAGrantInFlight(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	winners := setupAdvisory(t, pool, Options{})
	times := &statementTimes{}
	losers := advisoryOn(t, pool, func(c *pgx.ConnConfig) { c.Tracer = times })
	losers.settleWait = time.Hour // only an event may end a wait
	times.mu.Lock()
	times.match = map[string]string{losers.sql.grantQuick: "grant", losers.sql.grant: "grant"}
	times.mu.Unlock()
	const name = "in-flight"
	hi, lo := keyHalves(winners.Key(name))
	alice, bob := candidate("alice"), candidate("bob")

	// The row exists (a grant and a release), so that a transaction can
	// lock it.
	l := mustGrant(t, winners, name, alice, time.Minute)
	if err := winners.Release(callCtx(t), name, alice.Token, l.Term); err != nil {
		t.Fatal(err)
	}
	losers.watchFreeSettled(t, name)
	tx := lockRow(t, pool, name)
	type outcome struct {
		l       leader.Lease
		granted bool
		err     error
	}
	won, lost := make(chan outcome, 1), make(chan outcome, 1)
	go func() {
		l, granted, err := winners.Acquire(callCtx(t), name, alice, time.Minute)
		won <- outcome{l, granted, err}
	}()
	electortest.Eventually(t, 10*time.Second, "alice's grant to hold the lock and wait for the row", func() bool {
		var waiting bool
		err := pool.QueryRow(callCtx(t), `SELECT EXISTS (
			SELECT FROM pg_stat_activity AS act JOIN (`+heldBy("$1", "$2")+`) AS l ON l.pid = act.pid
			WHERE act.wait_event_type = 'Lock')`, hi, lo).Scan(&waiting)
		if err != nil {
			t.Fatal(err)
		}
		return waiting
	})
	started := time.Now()
	go func() {
		l, granted, err := losers.Acquire(callCtx(t), name, bob, time.Minute)
		lost <- outcome{l, granted, err}
	}()
	electortest.Eventually(t, 10*time.Second, "bob's first attempt", func() bool {
		_, ok := times.after(started, "grant", true)
		return ok
	})
	time.Sleep(200 * time.Millisecond) // time enough for a candidate that polls to do so
	if err := tx.Rollback(callCtx(t)); err != nil {
		t.Fatal(err)
	}

	a := <-won
	if a.err != nil || !a.granted {
		t.Fatalf("alice: granted %v, %v; want granted", a.granted, a.err)
	}
	var b outcome
	select {
	case b = <-lost:
	case <-time.After(10 * time.Second):
		t.Fatal("bob's Acquire has not returned 10s after alice's grant: no event ended its wait")
	}
	if b.err != nil || b.granted {
		t.Fatalf("bob: granted %v, %v; want refused", b.granted, b.err)
	}
	if b.l.HolderID != alice.ID || b.l.Term != a.l.Term {
		t.Errorf("bob was refused with holder %q term %d; want alice's grant, term %d", b.l.HolderID, b.l.Term, a.l.Term)
	}
	times.mu.Lock()
	attempts := 0
	for _, e := range times.events {
		if e.label == "grant" && !e.end && e.at.After(started) {
			attempts++
		}
	}
	times.mu.Unlock()
	if attempts > 3 {
		t.Errorf("bob sent %d grant statements; want 2 (the refusal, and one after alice's grant), 3 at most", attempts)
	}
}

// TestAdvisoryReleaseIsNotifiedAfterItsUnlock checks that a release's
// notification is sent once, by the released backend, in a statement of
// its own after the release and the unlock (which are not traced: they
// go in one pipeline), and only while the row is still free under the
// released term.
func TestAdvisoryReleaseIsNotifiedAfterItsUnlock(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	times := &statementTimes{}
	s := advisoryOn(t, pool, func(c *pgx.ConnConfig) { c.Tracer = times })
	times.mu.Lock()
	times.match = map[string]string{s.sql.releaseNotice: "notice"}
	times.mu.Unlock()
	listener := listenTo(t, pool, s)
	const name = "release-notified"
	alice, bob := candidate("alice"), candidate("bob")
	l := mustGrant(t, s, name, alice, time.Minute)
	if n := nextNotification(t, listener, 10*time.Second); n == nil || n.Payload != payloadGrant+name {
		t.Fatalf("want the grant's notification, got %+v", n)
	}
	ss := s.holderSession(t, name)
	pid := s.holderPID(t, name)
	released := time.Now()
	if err := s.Release(callCtx(t), name, alice.Token, l.Term); err != nil {
		t.Fatal(err)
	}
	n := nextNotification(t, listener, 10*time.Second)
	if n == nil || n.Payload != name || n.PID != uint32(pid) {
		t.Fatalf("notification %+v; want the release of %q from the released backend %d", n, name, pid)
	}
	if _, ok := times.after(released, "notice", false); !ok {
		t.Error("the release was not notified by a statement of its own")
	}
	if n := nextNotification(t, listener, 300*time.Millisecond); n != nil {
		t.Errorf("a second notification %q from backend %d: the release was notified twice", n.Payload, n.PID)
	}

	// Once bob holds the lease, a late notice of alice's release says
	// nothing.
	mustGrant(t, s, name, bob, time.Minute)
	if n := nextNotification(t, listener, 10*time.Second); n == nil || n.Payload != payloadGrant+name {
		t.Fatalf("want bob's grant's notification, got %+v", n)
	}
	s.notifyLater(ss, l.Term, true, 0)
	if n := nextNotification(t, listener, 300*time.Millisecond); n != nil {
		t.Errorf("a release notified after the lease was granted again: %q", n.Payload)
	}
}
