package postgres

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/pgtest"
)

// row is a lease row as stored.
type row struct {
	Term                          int64
	HolderToken                   *string
	HolderID                      string
	AcquiredAt, RenewedAt, Expiry *time.Time
}

// readRow reads the row for name from the default table; ok is false if
// there is none.
func readRow(t *testing.T, pool *pgxpool.Pool, name string) (r row, ok bool) {
	t.Helper()
	err := pool.QueryRow(callCtx(t), `SELECT term, holder_token, holder_id, acquired_at, renewed_at, expires_at
		FROM leader_leases WHERE name = $1`, name).
		Scan(&r.Term, &r.HolderToken, &r.HolderID, &r.AcquiredAt, &r.RenewedAt, &r.Expiry)
	if errors.Is(err, pgx.ErrNoRows) {
		return row{}, false
	}
	if err != nil {
		t.Fatalf("reading row %q: %v", name, err)
	}
	return r, true
}

func countRows(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(callCtx(t), "SELECT count(*) FROM leader_leases").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// dbNow reads the database server's clock.
func dbNow(t *testing.T, pool *pgxpool.Pool) time.Time {
	t.Helper()
	var now time.Time
	if err := pool.QueryRow(callCtx(t), "SELECT clock_timestamp()").Scan(&now); err != nil {
		t.Fatal(err)
	}
	return now
}

func mustAcquire(t *testing.T, s leader.Store, name string, c leader.Candidate, ttl time.Duration) (leader.Lease, bool) {
	t.Helper()
	l, granted, err := s.Acquire(callCtx(t), name, c, ttl)
	if err != nil {
		t.Fatalf("Acquire(%q, %s): %v", name, c.ID, err)
	}
	return l, granted
}

func mustGrant(t *testing.T, s leader.Store, name string, c leader.Candidate, ttl time.Duration) leader.Lease {
	t.Helper()
	l, granted := mustAcquire(t, s, name, c, ttl)
	if !granted {
		t.Fatalf("Acquire(%q, %s) not granted: %+v", name, c.ID, l)
	}
	return l
}

func mustRelease(t *testing.T, s leader.Store, name string, c leader.Candidate, term uint64) {
	t.Helper()
	if err := s.Release(callCtx(t), name, c.Token, term); err != nil {
		t.Fatalf("Release(%q, %s, %d): %v", name, c.ID, term, err)
	}
}

func wantErrorIs(t *testing.T, err error, target error, what string) {
	t.Helper()
	if !errors.Is(err, target) {
		t.Fatalf("%s: got error %v; want one wrapping %v", what, err, target)
	}
}

func TestLeaseLifecycle(t *testing.T) {
	t.Parallel()
	b := setup(t)
	s, pool := b.store, b.pool
	const name = "nightly-report"
	alice, bob := candidate("alice"), candidate("bob")
	const ttl = 10 * time.Second

	t.Run("a grant is stamped on the database clock", func(t *testing.T) {
		before := dbNow(t, pool)
		l := mustGrant(t, s, name, alice, ttl)
		after := dbNow(t, pool)
		if l.Term != 1 || l.HolderID != "alice" || l.Name != name {
			t.Fatalf("first grant: %+v", l)
		}
		if l.AcquiredAt.Before(before) || l.AcquiredAt.After(after) {
			t.Fatalf("AcquiredAt %v outside the database's clock readings %v .. %v", l.AcquiredAt, before, after)
		}
		if got := l.ExpiresAt.Sub(l.AcquiredAt); got != ttl {
			t.Fatalf("ExpiresAt - AcquiredAt = %v; want the ttl %v", got, ttl)
		}
		if l.Remaining <= 0 || l.Remaining > ttl {
			t.Fatalf("Remaining %v; want in (0, %v]", l.Remaining, ttl)
		}
		r, _ := readRow(t, pool, name)
		if r.HolderToken == nil || *r.HolderToken != alice.Token || r.HolderID != "alice" || r.Term != 1 ||
			!r.AcquiredAt.Equal(*r.RenewedAt) || !r.Expiry.Equal(l.ExpiresAt) {
			t.Fatalf("stored row %+v does not match the grant %+v", r, l)
		}
	})

	t.Run("a follower is told the holder and how long is left", func(t *testing.T) {
		l, granted := mustAcquire(t, s, name, bob, time.Minute)
		if granted || l.HolderID != "alice" || l.Term != 1 || !l.Held() {
			t.Fatalf("follower's view: granted=%v %+v", granted, l)
		}
		// Remaining is expires_at minus the database's now, not ours.
		now := dbNow(t, pool)
		if want := l.ExpiresAt.Sub(now); l.Remaining < want || l.Remaining > ttl {
			t.Fatalf("follower told Remaining %v; the database says at most %v is left after that answer", l.Remaining, want)
		}
	})

	t.Run("a renewal moves the expiry and keeps the grant", func(t *testing.T) {
		before, _ := readRow(t, pool, name)
		l, err := s.Renew(callCtx(t), name, alice.Token, 1, 2*ttl)
		if err != nil {
			t.Fatal(err)
		}
		after, _ := readRow(t, pool, name)
		if l.Term != 1 || l.HolderID != "alice" || !l.AcquiredAt.Equal(*before.AcquiredAt) || l.Remaining <= ttl {
			t.Fatalf("renewed lease %+v", l)
		}
		if !after.RenewedAt.After(*before.RenewedAt) || !after.Expiry.Equal(after.RenewedAt.Add(2*ttl)) {
			t.Fatalf("row before %+v, after %+v", before, after)
		}
	})

	t.Run("a release frees the lease and keeps the term and the row", func(t *testing.T) {
		mustRelease(t, s, name, alice, 1)
		o, err := s.Observe(callCtx(t), name)
		if err != nil {
			t.Fatal(err)
		}
		if o != (leader.Lease{Name: name, Term: 1}) {
			t.Fatalf("Observe after release = %+v; want only name and term", o)
		}
		r, ok := readRow(t, pool, name)
		if !ok || r.Term != 1 || r.HolderToken != nil || r.HolderID != "" || r.Expiry != nil {
			t.Fatalf("row after release: %+v (exists %v)", r, ok)
		}
	})

	t.Run("the next grant has the next term", func(t *testing.T) {
		l := mustGrant(t, s, name, bob, ttl)
		if l.Term != 2 || l.HolderID != "bob" {
			t.Fatalf("grant after release: %+v", l)
		}
		if n := countRows(t, pool); n != 1 {
			t.Fatalf("%d rows for one name", n)
		}
	})
}

func TestRenewNeverInsertsAndNeverSteals(t *testing.T) {
	t.Parallel()
	b := setup(t)
	s, pool := b.store, b.pool
	alice, mallory := candidate("alice"), candidate("mallory")

	_, err := s.Renew(callCtx(t), "never-granted", alice.Token, 1, time.Minute)
	wantErrorIs(t, err, leader.ErrLeaseLost, "renew of a name never granted")
	if _, ok := readRow(t, pool, "never-granted"); ok {
		t.Fatal("a renewal created a row")
	}

	l := mustGrant(t, s, "held", alice, time.Minute)
	before, _ := readRow(t, pool, "held")
	for _, tc := range []struct {
		what  string
		token string
		term  uint64
	}{
		{"another token", mallory.Token, l.Term},
		{"an empty token", "", l.Term},
		{"the holder's token under a later term", alice.Token, l.Term + 1},
		{"the holder's token under term 0", alice.Token, 0},
		{"the holder's token under a term beyond int64", alice.Token, 1 << 63},
	} {
		_, err := s.Renew(callCtx(t), "held", tc.token, tc.term, time.Hour)
		wantErrorIs(t, err, leader.ErrLeaseLost, "renew with "+tc.what)
		if !strings.Contains(err.Error(), `renew "held"`) {
			t.Fatalf("error %q does not name the operation and the name", err)
		}
		err = s.Release(callCtx(t), "held", tc.token, tc.term)
		wantErrorIs(t, err, leader.ErrLeaseLost, "release with "+tc.what)
	}
	if after, _ := readRow(t, pool, "held"); !after.RenewedAt.Equal(*before.RenewedAt) || !after.Expiry.Equal(*before.Expiry) || *after.HolderToken != alice.Token {
		t.Fatalf("refused renewals changed the row: before %+v, after %+v", before, after)
	}

	// An expired lease cannot be renewed back to life, even by its holder
	// and even when no one else took it.
	short := mustGrant(t, s, "expiring", alice, 300*time.Millisecond)
	waitFree(t, s, "expiring")
	_, err = s.Renew(callCtx(t), "expiring", alice.Token, short.Term, time.Minute)
	wantErrorIs(t, err, leader.ErrLeaseLost, "renew after expiry")
	if o, _ := s.Observe(callCtx(t), "expiring"); o.Held() {
		t.Fatalf("a refused renewal revived the lease: %+v", o)
	}
	if n := countRows(t, pool); n != 2 {
		t.Fatalf("%d rows; want 2 (held, expiring)", n)
	}
}

// waitFree polls Observe until name has no holder.
func waitFree(t *testing.T, s *LeaseStore, name string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		o, err := s.Observe(callCtx(t), name)
		if err != nil {
			t.Fatal(err)
		}
		if !o.Held() {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("lease %q still held: %+v", name, o)
		}
		time.Sleep(min(10*time.Millisecond, o.Remaining)) // poll interval
	}
}

func TestTermsStrictlyIncreaseAndSurviveRelease(t *testing.T) {
	t.Parallel()
	b := setup(t)
	s, pool := b.store, b.pool
	const name = "terms"
	candidates := []leader.Candidate{candidate("a"), candidate("b"), candidate("c")}
	var last uint64
	for i := range 60 {
		c := candidates[i%len(candidates)]
		l := mustGrant(t, s, name, c, time.Minute)
		if l.Term != last+1 {
			t.Fatalf("grant %d has term %d after %d; want %d", i, l.Term, last, last+1)
		}
		last = l.Term
		switch i % 3 {
		case 0: // released: the term stays with the free row
			mustRelease(t, s, name, c, l.Term)
			if r, _ := readRow(t, pool, name); r.Term != int64(last) || r.HolderToken != nil {
				t.Fatalf("after release the row is %+v; want free with term %d", r, last)
			}
		case 1: // re-granted to the same holder: a new grant
			again := mustGrant(t, s, name, c, time.Minute)
			if again.Term != last+1 {
				t.Fatalf("re-grant has term %d; want %d", again.Term, last+1)
			}
			last = again.Term
			mustRelease(t, s, name, c, last)
		case 2: // made to expire on the database's clock
			if _, err := pool.Exec(callCtx(t), "UPDATE leader_leases SET expires_at = clock_timestamp() WHERE name = $1", name); err != nil {
				t.Fatal(err)
			}
		}
	}
	if n := countRows(t, pool); n != 1 {
		t.Fatalf("%d rows; rows are never deleted nor duplicated", n)
	}
}

func TestExpiryIsJudgedOnTheDatabaseClock(t *testing.T) {
	t.Parallel()
	b := setup(t)
	s, pool := b.store, b.pool
	alice, bob := candidate("alice"), candidate("bob")

	t.Run("a short lease runs out after its ttl", func(t *testing.T) {
		const ttl = 300 * time.Millisecond
		sent := time.Now()
		held := mustGrant(t, s, "short", alice, ttl)
		for {
			l, granted := mustAcquire(t, s, "short", bob, time.Minute)
			if granted {
				if since := time.Since(sent); since < ttl {
					t.Fatalf("granted to another %v after the holder's request was sent; ttl %v", since, ttl)
				}
				if l.Term != held.Term+1 {
					t.Fatalf("term %d after %d", l.Term, held.Term)
				}
				return
			}
			if l.HolderID != "alice" || l.Remaining <= 0 || l.Remaining > ttl {
				t.Fatalf("follower told %+v", l)
			}
			if time.Since(sent) > 30*time.Second {
				t.Fatalf("lease of %v still held after 30s", ttl)
			}
			time.Sleep(min(20*time.Millisecond, l.Remaining)) // poll interval
		}
	})

	t.Run("only the database's time decides", func(t *testing.T) {
		// Move the stored expiry, as if the database's clock had run on:
		// the lease is free at once, though no time passed here.
		mustGrant(t, s, "moved", alice, time.Hour)
		if _, err := pool.Exec(callCtx(t), "UPDATE leader_leases SET expires_at = clock_timestamp() - interval '1 millisecond' WHERE name = $1", "moved"); err != nil {
			t.Fatal(err)
		}
		if o, _ := s.Observe(callCtx(t), "moved"); o.Held() {
			t.Fatalf("Observe reports a lease past its stored expiry as held: %+v", o)
		}
		if _, granted := mustAcquire(t, s, "moved", bob, time.Minute); !granted {
			t.Fatal("a lease past its stored expiry was not granted to another")
		}
		// And the other way: an expiry far ahead holds however long ago
		// the grant was made here.
		if _, err := pool.Exec(callCtx(t), "UPDATE leader_leases SET acquired_at = acquired_at - interval '1 day', expires_at = clock_timestamp() + interval '1 hour' WHERE name = $1", "moved"); err != nil {
			t.Fatal(err)
		}
		l, granted := mustAcquire(t, s, "moved", alice, time.Minute)
		if granted || l.HolderID != "bob" || l.Remaining < 59*time.Minute || l.Remaining > time.Hour {
			t.Fatalf("follower told granted=%v %+v; want bob's lease with about an hour left", granted, l)
		}
	})
}

func TestAcquireRaceGrantsExactlyOne(t *testing.T) {
	t.Parallel()
	b := setup(t)
	s, pool := b.store, b.pool
	const name, racers = "race", 20
	candidates := make([]leader.Candidate, racers)
	for i := range candidates {
		candidates[i] = candidate(fmt.Sprintf("racer-%d", i))
	}
	type result struct {
		lease   leader.Lease
		granted bool
		err     error
	}
	var lastTerm uint64
	for round := range 6 {
		results := make([]result, racers)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i, c := range candidates {
			wg.Go(func() {
				<-start
				l, granted, err := s.Acquire(callCtx(t), name, c, time.Minute)
				results[i] = result{l, granted, err}
			})
		}
		close(start)
		wg.Wait()
		winner := -1
		for i, r := range results {
			switch {
			case r.err != nil:
				t.Fatalf("round %d: racer %d: %v", round, i, r.err)
			case r.granted && winner >= 0:
				t.Fatalf("round %d: racers %d and %d both granted", round, winner, i)
			case r.granted:
				winner = i
			}
		}
		if winner < 0 {
			t.Fatalf("round %d: no racer granted", round)
		}
		w := results[winner].lease
		if w.Term != lastTerm+1 {
			t.Fatalf("round %d: term %d after %d", round, w.Term, lastTerm)
		}
		lastTerm = w.Term
		for i, r := range results {
			if !r.granted && (r.lease.HolderID != candidates[winner].ID || r.lease.Term != w.Term || !r.lease.Held()) {
				t.Errorf("round %d: refused racer %d told %+v; winner %s holds term %d", round, i, r.lease, candidates[winner].ID, w.Term)
			}
		}
		// Free the lease for the next round: by release, or by expiry on
		// the database's clock.
		if round%2 == 0 {
			mustRelease(t, s, name, candidates[winner], w.Term)
		} else if _, err := pool.Exec(callCtx(t), "UPDATE leader_leases SET expires_at = clock_timestamp() WHERE name = $1", name); err != nil {
			t.Fatal(err)
		}
	}
}

func TestReadOnlyDatabaseIsReported(t *testing.T) {
	t.Parallel()
	b := setup(t)
	s, pool := b.store, b.pool
	alice := candidate("alice")
	l := mustGrant(t, s, "ro", alice, time.Minute)

	db := pool.Config().ConnConfig.Database
	pgtest.Shared(t).Exec(t, "ALTER DATABASE "+pgx.Identifier{db}.Sanitize()+" SET default_transaction_read_only = on")
	pool.Reset()   // new connections pick up the setting
	s.pool.Reset() // the store's own connections too

	_, _, err := s.Acquire(callCtx(t), "ro", alice, time.Minute)
	wantErrorIs(t, err, leader.ErrReadOnly, "acquire on a read-only database")
	if !strings.Contains(err.Error(), `acquire "ro"`) {
		t.Fatalf("error %q does not name the operation and the name", err)
	}
	_, err = s.Renew(callCtx(t), "ro", alice.Token, l.Term, time.Minute)
	wantErrorIs(t, err, leader.ErrReadOnly, "renew on a read-only database")
	err = s.Release(callCtx(t), "ro", alice.Token, l.Term)
	wantErrorIs(t, err, leader.ErrReadOnly, "release on a read-only database")
	err = Migrate(callCtx(t), pool, Options{Table: "another"})
	wantErrorIs(t, err, leader.ErrReadOnly, "migrate on a read-only database")
	if errors.Is(err, leader.ErrUnavailable) {
		t.Fatalf("read-only error also claims the store is unavailable: %v", err)
	}
	o, err := s.Observe(callCtx(t), "ro")
	if err != nil || o.HolderID != "alice" {
		t.Fatalf("Observe on a read-only database = %+v, %v; reads still work", o, err)
	}
}

func TestCallsHonourTheirContextWhileTheRowIsLocked(t *testing.T) {
	t.Parallel()
	b := setup(t)
	s, pool := b.store, b.pool
	alice, bob := candidate("alice"), candidate("bob")
	l := mustGrant(t, s, "locked", alice, time.Minute)

	// Another transaction holds the row lock for the whole test.
	tx, err := pool.Begin(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	if _, err := tx.Exec(callCtx(t), "SELECT * FROM leader_leases WHERE name = 'locked' FOR UPDATE"); err != nil {
		t.Fatal(err)
	}

	calls := []struct {
		op   string
		call func(ctx context.Context) error
	}{
		{"renew", func(ctx context.Context) error {
			_, err := s.Renew(ctx, "locked", alice.Token, l.Term, time.Minute)
			return err
		}},
		// The holder's own attempt locks the row; another candidate's
		// is refused from its snapshot (below).
		{"acquire", func(ctx context.Context) error { _, _, err := s.Acquire(ctx, "locked", alice, time.Minute); return err }},
		{"release", func(ctx context.Context) error { return s.Release(ctx, "locked", alice.Token, l.Term) }},
	}
	t.Run("another candidate's acquire is refused without waiting", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		got, ok, err := s.Acquire(ctx, "locked", bob, time.Minute)
		if err != nil || ok || got.HolderID != "alice" || got.Term != l.Term || got.Remaining <= 0 {
			t.Fatalf("bob's Acquire on a locked row held by alice: %+v granted %v, %v; want refused at once, alice's term %d",
				got, ok, err, l.Term)
		}
	})
	for _, c := range calls {
		t.Run(c.op+" returns promptly when its deadline passes", func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
			defer cancel()
			start := time.Now()
			err := c.call(ctx)
			took := time.Since(start)
			wantErrorIs(t, err, context.DeadlineExceeded, c.op+" with a deadline on a locked row")
			if took > 5*time.Second {
				t.Fatalf("%s took %v with a 200ms deadline", c.op, took)
			}
			if !strings.Contains(err.Error(), c.op+` "locked"`) {
				t.Fatalf("error %q does not name the operation and the name", err)
			}
			t.Logf("%s returned after %v: %v", c.op, took, err)
		})
		t.Run(c.op+" returns promptly when cancelled", func(t *testing.T) {
			ctx, cancel := context.WithCancel(t.Context())
			timer := time.AfterFunc(200*time.Millisecond, cancel)
			defer timer.Stop()
			start := time.Now()
			err := c.call(ctx)
			wantErrorIs(t, err, context.Canceled, c.op+" cancelled on a locked row")
			if took := time.Since(start); took > 5*time.Second {
				t.Fatalf("%s took %v, cancelled after 200ms", c.op, took)
			}
		})
	}
}

func TestUnreachableServerIsUnavailable(t *testing.T) {
	t.Parallel()
	// A port nothing listens on.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	const password = "pa55-do-not-print"
	pool := pgtest.OpenPool(t, "postgres://leader:"+password+"@"+addr+"/app?sslmode=disable&connect_timeout=5")
	s, err := NewLeaseStore(pool, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	alice := candidate("alice")

	calls := map[string]func() error{
		`acquire "n"`: func() error { _, _, err := s.Acquire(callCtx(t), "n", alice, time.Minute); return err },
		`renew "n"`:   func() error { _, err := s.Renew(callCtx(t), "n", alice.Token, 1, time.Minute); return err },
		`release "n"`: func() error { return s.Release(callCtx(t), "n", alice.Token, 1) },
		`observe "n"`: func() error { _, err := s.Observe(callCtx(t), "n"); return err },
		`migrate`:     func() error { return Migrate(callCtx(t), pool, Options{}) },
	}
	for what, call := range calls {
		err := call()
		wantErrorIs(t, err, leader.ErrUnavailable, what+" on an unreachable server")
		msg := err.Error()
		if !strings.Contains(msg, what) {
			t.Errorf("error %q does not say %s", msg, what)
		}
		if strings.Contains(msg, password) {
			t.Errorf("error %q contains the password", msg)
		}
	}
	// Watch does not fail: its channel stays silent until the listener
	// can connect (and Close stops the retrying listener).
	if _, err := s.Watch(t.Context(), "n"); err != nil {
		t.Fatalf("Watch on an unreachable server: %v", err)
	}
}

func TestTTLMustBePositive(t *testing.T) {
	t.Parallel()
	s := setup(t).store
	for _, ttl := range []time.Duration{0, -time.Second} {
		if _, _, err := s.Acquire(callCtx(t), "n", candidate("a"), ttl); err == nil || !strings.Contains(err.Error(), "ttl") {
			t.Errorf("Acquire with ttl %v: %v", ttl, err)
		}
		if _, err := s.Renew(callCtx(t), "n", "token", 1, ttl); err == nil || !strings.Contains(err.Error(), "ttl") {
			t.Errorf("Renew with ttl %v: %v", ttl, err)
		}
	}
	// A ttl finer than the database's microseconds is rounded up, never
	// down, and the grant reports no more than was asked.
	l := mustGrant(t, s, "fine", candidate("a"), 1500*time.Millisecond+1)
	if got := l.ExpiresAt.Sub(l.AcquiredAt); got != 1500*time.Millisecond+time.Microsecond {
		t.Fatalf("ttl 1.5s+1ns stored as %v", got)
	}
	if l.Remaining > 1500*time.Millisecond+1 {
		t.Fatalf("Remaining %v exceeds the ttl asked", l.Remaining)
	}
}

func TestServerRestart(t *testing.T) {
	t.Parallel()
	cluster := pgtest.NewCluster(t)
	b := setupOn(t, cluster.NewPool(t), Options{})
	s := b.store
	alice := candidate("alice")
	ch, err := s.Watch(t.Context(), "restart")
	if err != nil {
		t.Fatal(err)
	}
	waitListening(t, b)
	held := mustGrant(t, s, "restart", alice, time.Minute)

	cluster.Stop(t)
	_, err = s.Renew(callCtx(t), "restart", alice.Token, held.Term, time.Minute)
	wantErrorIs(t, err, leader.ErrUnavailable, "renew while the server is down")
	t.Logf("renew while down: %v", err)
	cluster.Start(t)

	// The pool reconnects; the lease survived the restart.
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err := s.Renew(callCtx(t), "restart", alice.Token, held.Term, time.Minute)
		if err == nil {
			break
		}
		if !errors.Is(err, leader.ErrUnavailable) || time.Now().After(deadline) {
			t.Fatalf("renew after restart: %v", err)
		}
		time.Sleep(20 * time.Millisecond) // poll interval
	}
	// The listener reconnects by itself and wakes the watcher, then
	// delivers notifications again.
	waitListening(t, b)
	drain(ch)
	mustRelease(t, s, "restart", alice, held.Term)
	waitWake(t, ch, "after a release following a server restart")
}

// TestRefusedAcquireReportsTheLeaseAsCommitted makes Acquire wait for a
// transaction that grants the lease to another, and checks that it then
// reports that grant, not the lease as it was when the statement began.
func TestRefusedAcquireReportsTheLeaseAsCommitted(t *testing.T) {
	t.Parallel()
	b := setup(t)
	s, pool := b.store, b.pool
	alice, bob := candidate("alice"), candidate("bob")

	// grantInTx grants name to alice in a transaction held open while bob's
	// Acquire waits for its row lock, then commits.
	grantInTx := func(t *testing.T, name, sql string) {
		t.Helper()
		tx, err := pool.Begin(callCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(context.Background())
		if _, err := tx.Exec(callCtx(t), sql, name, alice.Token); err != nil {
			t.Fatal(err)
		}
		type result struct {
			lease   leader.Lease
			granted bool
			err     error
		}
		done := make(chan result, 1)
		go func() {
			l, granted, err := s.Acquire(callCtx(t), name, bob, time.Minute)
			done <- result{l, granted, err}
		}()
		waitForLockWait(t, pool)
		if err := tx.Commit(callCtx(t)); err != nil {
			t.Fatal(err)
		}
		r := <-done
		if r.err != nil || r.granted || r.lease.HolderID != "alice" || !r.lease.Held() {
			t.Fatalf("bob's acquire after alice's grant committed: granted=%v %+v, %v", r.granted, r.lease, r.err)
		}
		if row, _ := readRow(t, pool, name); r.lease.Term != uint64(row.Term) {
			t.Fatalf("bob told term %d; the row has %d", r.lease.Term, row.Term)
		}
	}

	t.Run("when the row was inserted meanwhile", func(t *testing.T) {
		// The statement's snapshot cannot see the row at all.
		grantInTx(t, "first", `INSERT INTO leader_leases (name, term, holder_token, holder_id, acquired_at, renewed_at, expires_at)
			VALUES ($1, 1, $2, 'alice', clock_timestamp(), clock_timestamp(), clock_timestamp() + interval '1 minute')`)
	})
	t.Run("when the row was taken over meanwhile", func(t *testing.T) {
		// The statement's snapshot sees the row free, under the old term.
		mustRelease(t, s, "taken", bob, mustGrant(t, s, "taken", bob, time.Minute).Term)
		grantInTx(t, "taken", `UPDATE leader_leases SET term = term + 1, holder_token = $2, holder_id = 'alice',
			acquired_at = clock_timestamp(), renewed_at = clock_timestamp(), expires_at = clock_timestamp() + interval '1 minute'
			WHERE name = $1`)
	})
}

// waitForLockWait waits until a session of the test database waits for a
// lock.
func waitForLockWait(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var waiting bool
		err := pool.QueryRow(callCtx(t), `SELECT EXISTS (SELECT FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock')`).Scan(&waiting)
		if err != nil {
			t.Fatal(err)
		}
		if waiting {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("no session waits for a lock")
		}
		time.Sleep(5 * time.Millisecond) // poll interval
	}
}
