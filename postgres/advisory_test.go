package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/pgtest"
	"github.com/leaderelect/leader/leadertest"
)

// setupAdvisory returns an AdvisoryStore on pool, migrated with opts, closed
// when t ends.
func setupAdvisory(t *testing.T, pool *pgxpool.Pool, opts Options) *AdvisoryStore {
	t.Helper()
	if err := Migrate(callCtx(t), pool, opts); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	s, err := NewAdvisoryStore(callCtx(t), pool, opts)
	if err != nil {
		t.Fatalf("NewAdvisoryStore: %v", err)
	}
	t.Cleanup(s.Close)
	return s
}

// TestAdvisoryConformance runs the Store conformance suite on the advisory
// strategy, each subtest on a store of its own in a fresh database.
func TestAdvisoryConformance(t *testing.T) {
	t.Parallel()
	leadertest.TestStore(t, func(t *testing.T) leader.Store {
		return setupAdvisory(t, pgtest.NewPool(t), Options{})
	})
}

// advisoryElector returns an Elector for id on its own AdvisoryStore (as if
// in a process of its own) on pool, recording its leadership in h.
func advisoryElector(t *testing.T, pool *pgxpool.Pool, h *beliefs, name, id string, ttl time.Duration) (*leader.Elector, *AdvisoryStore) {
	t.Helper()
	logger := slog.New(slog.DiscardHandler)
	if os.Getenv("LEADER_TEST_LOG") != "" {
		logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})).
			With("instance", id, "database", pool.Config().ConnConfig.Database)
	}
	s, err := NewAdvisoryStore(callCtx(t), pool, Options{Logger: logger})
	if err != nil {
		t.Fatalf("NewAdvisoryStore: %v", err)
	}
	t.Cleanup(s.Close)
	cfg := leader.Config{Name: name, ID: id, TTL: ttl, Logger: logger}
	cfg.OnElected, cfg.OnDemoted = h.Hooks(t, id)
	e, err := leader.New(s, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return e, s
}

// beliefs checks, each time an Elector is elected, that every other
// Elector's leader context has already been cancelled, and that the term
// grew. This is the invariant itself: a leader's belief ends when its
// context is cancelled (IsLeader turns false just before), which may be
// well before its OnDemoted runs, so a history of OnDemoted calls would
// be stricter than the guarantee.
type beliefs struct {
	mu    sync.Mutex
	live  map[string]context.Context
	last  uint64
	count int
}

func newBeliefs() *beliefs { return &beliefs{live: make(map[string]context.Context)} }

// Hooks returns OnElected and OnDemoted callbacks for instance.
func (b *beliefs) Hooks(t *testing.T, instance string) (func(context.Context), func()) {
	onElected := func(ctx context.Context) {
		term, _ := leader.TermFrom(ctx)
		b.mu.Lock()
		defer b.mu.Unlock()
		for other, octx := range b.live {
			if other != instance && octx.Err() == nil {
				t.Errorf("%s elected (term %d) while %s's leader context is still live", instance, term, other)
			}
		}
		if term <= b.last {
			t.Errorf("%s elected with term %d after term %d", instance, term, b.last)
		}
		b.last, b.live[instance] = term, ctx
		b.count++
	}
	return onElected, func() {}
}

func (b *beliefs) elections() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.count
}

// holderSession returns the session of s that holds name.
func (s *AdvisoryStore) holderSession(t *testing.T, name string) *session {
	t.Helper()
	s.smu.Lock()
	defer s.smu.Unlock()
	for k, ss := range s.sessions {
		if k.name == name && ss.isHeld() {
			return ss
		}
	}
	t.Fatalf("no session of the store holds %q", name)
	return nil
}

// cutConnection closes the socket of the session holding name, as the
// kernel does when the holder's process dies.
func (s *AdvisoryStore) cutConnection(t *testing.T, name string) {
	t.Helper()
	ss := s.holderSession(t, name)
	ss.turn <- struct{}{} // no call uses conn; the reader only reads it
	nc := ss.conn.PgConn().Conn()
	<-ss.turn
	if err := nc.Close(); err != nil {
		t.Fatal(err)
	}
}

// leaderOf returns the one Elector of es that leads, waiting for it.
func leaderOf(t *testing.T, es []*leader.Elector, within time.Duration) *leader.Elector {
	t.Helper()
	electortest.Eventually(t, within, "one leader", func() bool { return len(electortest.Leaders(es)) == 1 })
	return electortest.Leaders(es)[0]
}

func TestAdvisoryElectors(t *testing.T) {
	t.Parallel()
	// A TTL far longer than any takeover measured here: a takeover that
	// waited for a TTL would show. Takeovers must take less than
	// maxTakeover, generous for a busy machine and still well under the
	// TTL.
	const (
		ttl         = 20 * time.Second
		maxTakeover = 5 * time.Second
	)

	// takeovers runs four Electors and, three times, ends the leader's
	// leadership with end and measures how long until another leads.
	takeovers := func(t *testing.T, what string, end func(t *testing.T, pool *pgxpool.Pool, e *leader.Elector, s *AdvisoryStore, stop func())) {
		pool := pgtest.NewPool(t)
		t.Logf("database %s", pool.Config().ConnConfig.Database) // as the logs of LEADER_TEST_LOG name it
		if err := Migrate(callCtx(t), pool, Options{}); err != nil {
			t.Fatal(err)
		}
		h := newBeliefs()
		var es []*leader.Elector
		stores := map[*leader.Elector]*AdvisoryStore{}
		stops := map[*leader.Elector]func(){}
		for i := range 4 {
			id := fmt.Sprint("c", i)
			e, s := advisoryElector(t, pool, h, "advisory", id, ttl)
			es = append(es, e)
			stores[e] = s
			stops[e] = electortest.Run(t, e)
		}
		var took []time.Duration
		for range 3 {
			old := leaderOf(t, es, 15*time.Second)
			oldTerm := old.Status().Term
			// Let every follower settle into waiting. A follower may not
			// have seen the term yet: once one candidate has taken the
			// lease, the lock waiters that look after its grant do not
			// wake their followers (see AdvisoryStore.awaitMark), which
			// learn of the term at their next attempt.
			electortest.Eventually(t, 10*time.Second, "followers to see a lease", func() bool {
				for _, e := range es {
					if st := e.Status(); st.Term == 0 || st.Term > oldTerm || (e != old && st.IsLeader) {
						return false
					}
				}
				return true
			})
			time.Sleep(100 * time.Millisecond)
			start := time.Now()
			end(t, pool, old, stores[old], stops[old])
			es = slices.DeleteFunc(es, func(e *leader.Elector) bool { return e == old })
			next := leaderOf(t, es, 2*ttl)
			took = append(took, time.Since(start))
			if term := next.Status().Term; term <= oldTerm {
				t.Errorf("term went from %d to %d", oldTerm, term)
			}
			stops[old]()
		}
		t.Logf("advisory takeover after %s (TTL %v): %v", what, ttl, took)
		for _, d := range took {
			if d > maxTakeover {
				t.Errorf("takeover after %s took %v; it must not wait for the TTL (%v)", what, d, ttl)
			}
		}
	}

	t.Run("a graceful stop hands over in well under a second", func(t *testing.T) {
		t.Parallel()
		takeovers(t, "a graceful stop", func(t *testing.T, _ *pgxpool.Pool, _ *leader.Elector, _ *AdvisoryStore, stop func()) {
			stop()
		})
	})

	t.Run("a leader whose connection closes is replaced as soon as the server notices", func(t *testing.T) {
		t.Parallel()
		takeovers(t, "the leader's connection closed", func(t *testing.T, _ *pgxpool.Pool, e *leader.Elector, s *AdvisoryStore, _ func()) {
			s.cutConnection(t, "advisory")
		})
	})

	t.Run("a leader whose backend is terminated steps down before the next is elected", func(t *testing.T) {
		t.Parallel()
		takeovers(t, "pg_terminate_backend", func(t *testing.T, pool *pgxpool.Pool, e *leader.Elector, s *AdvisoryStore, _ func()) {
			var terminated bool
			err := pool.QueryRow(callCtx(t), `SELECT pg_terminate_backend(holder_pid) FROM leader_advisory WHERE name = 'advisory'`).Scan(&terminated)
			if err != nil || !terminated {
				t.Fatalf("pg_terminate_backend: %v, %v", terminated, err)
			}
		})
	})

	t.Run("five electors on one name never both lead, through handovers and cut connections", func(t *testing.T) {
		t.Parallel()
		pool := pgtest.NewPool(t)
		if err := Migrate(callCtx(t), pool, Options{}); err != nil {
			t.Fatal(err)
		}
		h := newBeliefs() // fails the test on any overlap
		var es []*leader.Elector
		stores := map[*leader.Elector]*AdvisoryStore{}
		for i := range 5 {
			id := fmt.Sprint("c", i)
			e, s := advisoryElector(t, pool, h, "five", id, 2*time.Second)
			es = append(es, e)
			stores[e] = s
			electortest.Run(t, e)
		}
		for i := range 6 {
			l := leaderOf(t, es, 10*time.Second)
			if i%2 == 0 {
				stores[l].cutConnection(t, "five")
			} else if err := l.Resign(callCtx(t)); err != nil {
				t.Fatalf("Resign: %v", err)
			}
			electortest.Never(t, 300*time.Millisecond, "two leaders at once", func() bool { return len(electortest.Leaders(es)) > 1 })
		}
		if n := h.elections(); n < 7 {
			t.Errorf("%d elections; want at least 7", n)
		}
	})
}

// TestAdvisoryKeys checks that the lock taken for a name is the advisory
// lock on exactly its key, as the server itself sees it, and that the
// store's ownership checks tell it apart from locks that share half of it,
// for keys on both sides of 2^31 and 2^32, negative keys and the extremes.
func TestAdvisoryKeys(t *testing.T) {
	t.Parallel()
	keys := []int64{0, 1, 1<<31 - 1, 1 << 31, 1<<32 - 1, 1 << 32, 1<<32 + 5, 1<<40 | 7, 5 << 32,
		-1, -(1 << 31), -(1 << 32), -(1<<32 + 5), math.MaxInt64, math.MinInt64}
	pool := pgtest.NewPool(t)
	byName := map[string]int64{}
	for _, k := range keys {
		byName[fmt.Sprint("key", k)] = k
	}
	s := setupAdvisory(t, pool, Options{Key: func(name string) int64 { return byName[name] }})

	// other is another session, the server's own judge of who holds what.
	other, err := pgx.ConnectConfig(callCtx(t), pool.Config().ConnConfig)
	if err != nil {
		t.Fatal(err)
	}
	defer closeConn(other)
	try := func(sql string, args ...any) bool {
		t.Helper()
		var got bool
		if err := other.QueryRow(callCtx(t), sql, args...).Scan(&got); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
		return got
	}

	for _, k := range keys {
		name := fmt.Sprint("key", k)
		alice := candidate("alice")
		if s.Key(name) != k {
			t.Fatalf("Key(%q) = %d, want %d", name, s.Key(name), k)
		}
		// Locks that share the key's low half, or both halves in the
		// two-int4 form, are not the name's lock.
		hi, lo := keyHalves(k)
		lookalike := k ^ (1 << 32)
		if !try("SELECT pg_try_advisory_lock($1)", lookalike) || !try("SELECT pg_try_advisory_lock($1::int, $2::int)", int32(hi), int32(lo)) {
			t.Fatalf("key %d: could not take the look-alike locks", k)
		}
		if o := observe(t, s, name); o.Held() {
			t.Errorf("key %d: Observe reports a lease held before any grant (look-alike locks only): %+v", k, o)
		}
		held := mustGrant(t, s, name, alice, time.Minute)
		if try("SELECT pg_try_advisory_lock($1)", k) {
			t.Errorf("key %d: another session could take the lock of a granted name", k)
		}
		if o := observe(t, s, name); !o.Held() || o.HolderID != "alice" || o.Term != held.Term {
			t.Errorf("key %d: Observe of the held name = %+v", k, o)
		}
		if l, granted := mustAcquire(t, s, name, candidate("bob"), time.Minute); granted || l.HolderID != "alice" {
			t.Errorf("key %d: another candidate got %+v, granted %v; want refused and told alice holds it", k, l, granted)
		}
		mustRenew(t, s, name, alice, held.Term, time.Minute)
		if err := s.Release(callCtx(t), name, alice.Token, held.Term); err != nil {
			t.Fatalf("key %d: Release: %v", k, err)
		}
		if !try("SELECT pg_try_advisory_lock($1)", k) {
			t.Errorf("key %d: the lock was not freed by Release", k)
		}
		if !try("SELECT pg_advisory_unlock($1) AND pg_advisory_unlock($2) AND pg_advisory_unlock($3::int, $4::int)", k, lookalike, int32(hi), int32(lo)) {
			t.Fatalf("key %d: could not let the test's locks go", k)
		}
	}
}

func TestAdvisoryKeyCollision(t *testing.T) {
	t.Parallel()
	s := setupAdvisory(t, pgtest.NewPool(t), Options{Key: func(string) int64 { return 1<<32 + 42 }})
	alice, bob := candidate("alice"), candidate("bob")
	a := mustGrant(t, s, "first", alice, time.Minute)
	if err := s.Release(callCtx(t), "first", alice.Token, a.Term); err != nil {
		t.Fatal(err)
	}
	// The lock is free now, but the key is the first name's.
	_, granted, err := s.Acquire(callCtx(t), "second", bob, time.Minute)
	if granted || err == nil {
		t.Fatalf("a second name with the first one's key: granted %v, error %v; want refused with an error", granted, err)
	}
	for _, want := range []string{`"second"`, `"first"`, "Options.Key", "4294967338"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %s", err, want)
		}
	}
	// The refused attempt let the lock go: the first name is free to take.
	mustGrant(t, s, "first", bob, time.Minute)
}

// TestAdvisoryServerEndsSilentHolder checks the server's side of the
// holder's deadline: the holder's session is armed with the TTL, and a
// holder that stops sending (paused, or its packets lost) has its lock
// freed by the server no earlier than the TTL after its last heartbeat and
// not much later.
func TestAdvisoryServerEndsSilentHolder(t *testing.T) {
	t.Parallel()
	s := setupAdvisory(t, pgtest.NewPool(t), Options{})
	const ttl = 1500 * time.Millisecond
	alice, bob := candidate("alice"), candidate("bob")
	held := mustGrant(t, s, "silent", alice, ttl)

	ss := s.holderSession(t, "silent")
	var idle, user, kaIdle, kaInterval, kaCount string
	err := ss.do(callCtx(t), s, false, func(conn *pgx.Conn) error {
		return conn.QueryRow(callCtx(t), `SELECT current_setting('idle_session_timeout'), current_setting('tcp_user_timeout'),
			current_setting('tcp_keepalives_idle'), current_setting('tcp_keepalives_interval'), current_setting('tcp_keepalives_count')`).
			Scan(&idle, &user, &kaIdle, &kaInterval, &kaCount)
	})
	if err != nil {
		t.Fatal(err)
	}
	// (current_setting shows tcp_user_timeout in ms and keepalives in s.)
	if idle != "1500ms" || user != "1500" || kaIdle != "2" || kaInterval != "1" || kaCount != "3" {
		t.Errorf("holder session settings: idle_session_timeout %s, tcp_user_timeout %s, keepalives idle %s interval %s count %s; want 1500ms, 1500, 2, 1, 3",
			idle, user, kaIdle, kaInterval, kaCount)
	}

	sent := time.Now()
	mustRenew(t, s, "silent", alice, held.Term, ttl)
	// Alice now goes silent. Bob tries until the server has freed the lock.
	for {
		l, granted := mustAcquire(t, s, "silent", bob, time.Minute)
		after := time.Since(sent)
		if granted {
			t.Logf("the server freed a silent holder's lock %v after its last heartbeat (TTL %v)", after, ttl)
			if after < ttl {
				t.Errorf("the lock was freed %v after the last heartbeat, before the TTL (%v)", after, ttl)
			}
			if l.Term != held.Term+1 {
				t.Errorf("term %d after %d", l.Term, held.Term)
			}
			break
		}
		if after > ttl+3*time.Second {
			t.Fatalf("the server has not freed a silent holder's lock %v after its last heartbeat (TTL %v)", after, ttl)
		}
		time.Sleep(20 * time.Millisecond)
	}
	// Alice's session is gone; so is her lease.
	_, err = s.Renew(callCtx(t), "silent", alice.Token, held.Term, ttl)
	if !errors.Is(err, leader.ErrLeaseLost) {
		t.Errorf("renewal by the silent holder: %v; want ErrLeaseLost", err)
	}
}

// TestAdvisoryReleaseAfterTheServerEndedTheSession checks that a release
// whose session the server ended at the lease's expiry is refused with
// ErrLeaseLost, also when the session's reader has not yet read the
// server's FATAL message (on a busy host it may read it later than the
// Release call comes): the message then answers the release's statements.
func TestAdvisoryReleaseAfterTheServerEndedTheSession(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	s := setupAdvisory(t, pool, Options{})
	others := setupAdvisory(t, pool, Options{})
	const ttl = 500 * time.Millisecond
	alice := candidate("alice")
	held := mustGrant(t, s, "ended", alice, ttl)
	ss := s.holderSession(t, "ended")
	ss.turn <- struct{}{}
	ss.haltReader() // as if the reader had not run yet
	<-ss.turn
	electortest.Eventually(t, 10*time.Second, "the server to end the holder's session", func() bool {
		return !observe(t, others, "ended").Held()
	})
	err := s.Release(callCtx(t), "ended", alice.Token, held.Term)
	if !errors.Is(err, leader.ErrLeaseLost) || errors.Is(err, leader.ErrUnavailable) {
		t.Errorf("release after the server ended the session: %v; want ErrLeaseLost, not ErrUnavailable", err)
	}
	t.Logf("release after the server ended the session: %v", err)
}

func TestAdvisoryRefusals(t *testing.T) {
	t.Parallel()
	t.Run("behind a transaction-pooling proxy", func(t *testing.T) {
		t.Parallel()
		url := pgtest.NewDatabase(t)
		direct := pgtest.OpenPool(t, url)
		if err := Migrate(callCtx(t), direct, Options{}); err != nil {
			t.Fatal(err)
		}
		pooled := pgtest.OpenPool(t, pgtest.PgBouncer(t, url, "transaction"))
		_, err := NewAdvisoryStore(callCtx(t), pooled, Options{})
		if !errors.Is(err, ErrPooledSession) {
			t.Fatalf("NewAdvisoryStore behind PgBouncer: %v; want an error wrapping ErrPooledSession", err)
		}
		for _, want := range []string{"PgBouncer", "advisory strategy", "directly"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("error %q does not mention %q", err, want)
			}
		}
	})
	t.Run("before Migrate", func(t *testing.T) {
		t.Parallel()
		_, err := NewAdvisoryStore(callCtx(t), pgtest.NewPool(t), Options{})
		if err == nil || !strings.Contains(err.Error(), "run Migrate") || !strings.Contains(err.Error(), `"public"."leader_advisory"`) {
			t.Fatalf("NewAdvisoryStore before Migrate: %v; want an error naming the table and Migrate", err)
		}
	})
	t.Run("bad options", func(t *testing.T) {
		t.Parallel()
		_, err := NewAdvisoryStore(callCtx(t), pgtest.NewPool(t), Options{AdvisoryTable: strings.Repeat("x", 64)})
		var oe *OptionsError
		if !errors.As(err, &oe) || oe.Field != "AdvisoryTable" {
			t.Fatalf("NewAdvisoryStore with a 64-byte table name: %v; want an *OptionsError for AdvisoryTable", err)
		}
	})
}

func observe(t *testing.T, s leader.Store, name string) leader.Lease {
	t.Helper()
	l, err := s.Observe(callCtx(t), name)
	if err != nil {
		t.Fatalf("Observe(%q): %v", name, err)
	}
	return l
}

func mustRenew(t *testing.T, s leader.Store, name string, c leader.Candidate, term uint64, ttl time.Duration) leader.Lease {
	t.Helper()
	l, err := s.Renew(callCtx(t), name, c.Token, term, ttl)
	if err != nil {
		t.Fatalf("Renew(%q, %s, %d): %v", name, c.ID, term, err)
	}
	return l
}

// TestAdvisoryLossWhileIdleIsLogged checks that the store marks an idle
// holder's lease lost as soon as the server ends its session, and logs
// when it learned of it (at debug level), so that a late step-down can be
// told from a late notice.
func TestAdvisoryLossWhileIdleIsLogged(t *testing.T) {
	t.Parallel()
	logs := &electortest.LogBuffer{}
	pool := pgtest.NewPool(t)
	s := setupAdvisory(t, pool, Options{
		Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
	})
	alice := candidate("alice")
	held := mustGrant(t, s, "idle-loss", alice, 10*time.Second)
	lost := s.Lost("idle-loss", alice.Token, held.Term)
	waitAnnounced(t, pool, s, "idle-loss")
	var terminated bool
	err := pool.QueryRow(callCtx(t),
		`SELECT pg_terminate_backend(holder_pid) FROM leader_advisory WHERE name = 'idle-loss'`).Scan(&terminated)
	if err != nil || !terminated {
		t.Fatalf("pg_terminate_backend: %v, %v", terminated, err)
	}
	select {
	case <-lost:
	case <-time.After(10 * time.Second):
		t.Fatal("the lease is not marked lost 10s after the server ended the idle holder's session")
	}
	defer func() {
		if t.Failed() {
			t.Logf("logs:\n%s", logs.String())
		}
	}()
	electortest.Eventually(t, 5*time.Second, "the loss to be logged", func() bool {
		out := logs.String()
		return strings.Contains(out, "level=DEBUG") &&
			strings.Contains(out, `msg="advisory session ended while idle; lease marked lost"`) &&
			strings.Contains(out, "election=idle-loss") &&
			strings.Contains(out, "terminating connection due to administrator command")
	})
}

// waitAnnounced waits until the session of s that holds name has sent its
// grant's notification (see AdvisoryStore.notifyLater) and is idle on both
// ends, with its reader waiting, so that what happens to the session next
// finds it idle.
func waitAnnounced(t *testing.T, pool *pgxpool.Pool, s *AdvisoryStore, name string) {
	t.Helper()
	defer func() {
		// The server shows the session idle just before it sends the
		// reply: wait for the notifying call to hand the session back.
		ss := s.holderSession(t, name)
		ss.turn <- struct{}{}
		<-ss.turn
	}()
	electortest.Eventually(t, 10*time.Second, "the grant of "+name+" to be announced", func() bool {
		var idle bool
		err := pool.QueryRow(callCtx(t), `SELECT coalesce(bool_or(act.state = 'idle' AND act.query = $2), false)
			FROM leader_advisory AS a JOIN pg_stat_activity AS act ON act.pid = a.holder_pid
			WHERE a.name = $1`, name, s.sql.announce).Scan(&idle)
		if err != nil {
			t.Fatalf("reading the holder's activity: %v", err)
		}
		return idle
	})
}

// sharedHolder holds the advisory lock of key shared on a connection of its
// own, as a lock waiter does for an instant after a holder goes (see
// AdvisoryStore.Watch), until let go.
type sharedHolder struct {
	conn *pgxpool.Conn
	key  int64
}

// holdShared takes the lock of key shared, waiting for an exclusive holder
// to go first; it returns at once, and took is closed once it holds it.
func holdShared(t *testing.T, pool *pgxpool.Pool, key int64) (h *sharedHolder, took chan struct{}) {
	t.Helper()
	conn, err := pool.Acquire(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	took = make(chan struct{})
	go func() {
		defer close(took)
		if _, err := conn.Exec(context.Background(), "SELECT pg_advisory_lock_shared($1)", key); err != nil {
			t.Errorf("pg_advisory_lock_shared: %v", err)
		}
	}()
	return &sharedHolder{conn: conn, key: key}, took
}

// letGo lets the shared lock go, and the connection with it.
func (h *sharedHolder) letGo(t *testing.T) {
	t.Helper()
	if _, err := h.conn.Exec(callCtx(t), "SELECT pg_advisory_unlock_shared($1)", h.key); err != nil {
		t.Errorf("pg_advisory_unlock_shared: %v", err)
	}
	h.conn.Release()
}

// TestAdvisoryCandidateQueuesBehindLockWaiters checks that a candidate
// that finds the lock free of any holder, but held shared by lock
// waiters, waits for them in the lock's queue rather than giving up or
// polling: it is granted as soon as they let go, if that is within
// queueWait, and otherwise is refused with the lease free and its session
// intact. Taken from a holder that did not release, the grant still waits
// the TakeoverGrace.
func TestAdvisoryCandidateQueuesBehindLockWaiters(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	const ttl = time.Minute
	// The lock waiters' hold: longer than polling lasts, far shorter than
	// queueWait and the TakeoverGrace of the first subtest, so that a busy
	// machine neither makes the wait run out nor passes a grant that waited
	// the grace.
	const hold = 300 * time.Millisecond

	t.Run("granted as soon as the lock waiters let go", func(t *testing.T) {
		const grace = 10 * time.Second
		s := setupAdvisory(t, pool, Options{TakeoverGrace: grace})
		s.queueWait = 5 * time.Second
		alice, bob := candidate("alice"), candidate("bob")
		held := mustGrant(t, s, "queue", alice, ttl)
		mustRelease(t, s, "queue", alice, held.Term)
		w, took := holdShared(t, pool, s.Key("queue"))
		<-took
		start := time.Now()
		time.AfterFunc(hold, func() { w.letGo(t) })
		l, granted := mustAcquire(t, s, "queue", bob, ttl)
		took2 := time.Since(start)
		if !granted || l.Term != held.Term+1 || l.HolderID != "bob" {
			t.Fatalf("Acquire after the lock waiters let go: %+v granted %v; want granted to bob with term %d", l, granted, held.Term+1)
		}
		if took2 < hold/2 || took2 >= grace {
			t.Errorf("Acquire took %v; want about %v: the lock waiters' hold, and no TakeoverGrace (%v) after a release", took2, hold, grace)
		}
		mustRelease(t, s, "queue", bob, l.Term)
	})

	// The grace is waited out below: shorter than the first subtest's, and
	// still far longer than a grant that skipped it would take.
	const grace = 3 * time.Second
	s := setupAdvisory(t, pool, Options{TakeoverGrace: grace})

	t.Run("refused with the lease free if they hold on longer than queueWait", func(t *testing.T) {
		carol := candidate("carol")
		w, took := holdShared(t, pool, s.Key("queue"))
		<-took
		start := time.Now()
		l, granted := mustAcquire(t, s, "queue", carol, ttl)
		took2 := time.Since(start)
		if granted || l.Held() {
			t.Fatalf("Acquire while the lock is held shared: %+v granted %v; want refused, with no holder", l, granted)
		}
		if took2 < s.queueWait {
			t.Errorf("Acquire refused after %v, before queueWait (%v)", took2, s.queueWait)
		}
		pid := func() int32 {
			ss, err := s.session("queue", carol.Token)
			if err != nil {
				t.Fatal(err)
			}
			var pid int32
			if err := ss.do(callCtx(t), s, false, func(conn *pgx.Conn) error {
				pid = int32(conn.PgConn().PID())
				return nil
			}); err != nil {
				t.Fatal(err)
			}
			return pid
		}
		// A wait that ran out leaves the session holding nothing, as the
		// server sees it.
		ss, err := s.session("queue", carol.Token)
		if err != nil {
			t.Fatal(err)
		}
		hi, lo := keyHalves(s.Key("queue"))
		var holds bool
		if err := ss.do(callCtx(t), s, false, func(conn *pgx.Conn) error {
			return conn.QueryRow(callCtx(t), s.sql.heldHere, hi, lo).Scan(&holds)
		}); err != nil {
			t.Fatal(err)
		}
		if holds {
			t.Fatal("the candidate's session holds the lock after its wait ran out and Acquire refused it")
		}
		before := pid()
		w.letGo(t)
		l, granted = mustAcquire(t, s, "queue", carol, ttl)
		if !granted {
			t.Fatalf("Acquire once the lock is free: %+v, not granted", l)
		}
		if after := pid(); after != before {
			t.Errorf("the candidate's session changed (backend %d, then %d): a lock wait that runs out must leave it intact", before, after)
		}
	})

	t.Run("taken from a holder that did not release, the grant waits the TakeoverGrace", func(t *testing.T) {
		dave := candidate("dave")
		// carol holds "queue" from the subtest before. A lock waiter
		// queues behind her; her session ends; the waiter holds the lock
		// shared for a while; dave tries meanwhile.
		w, took := holdShared(t, pool, s.Key("queue"))
		cur, err := s.Observe(callCtx(t), "queue")
		if err != nil || cur.HolderID != "carol" {
			t.Fatalf("Observe: %+v, %v; want carol holding", cur, err)
		}
		s.queueWait = 5 * time.Second
		// The grace is counted from when the store saw the lock freed, which
		// is after the cut: measure from the cut.
		cut := time.Now()
		s.cutConnection(t, "queue")
		select {
		case <-took:
		case <-time.After(10 * time.Second):
			t.Fatal("the lock waiter got nothing 10s after the holder's connection closed")
		}
		time.AfterFunc(hold, func() { w.letGo(t) })
		l, granted := mustAcquire(t, s, "queue", dave, ttl)
		since := time.Since(cut)
		if !granted || l.Term != cur.Term+1 {
			t.Fatalf("Acquire: %+v granted %v; want granted with term %d", l, granted, cur.Term+1)
		}
		if since < grace {
			t.Errorf("Acquire granted %v after the holder's connection was cut, less than the TakeoverGrace (%v): a grant from a holder that did not release must wait it", since, grace)
		}
	})
}

// TestAdvisoryReleaseFreesALockTakenTwice checks that a release frees the
// lock even if the holder's session took it more than once (advisory
// locks count), as a session that held it unknown to the store would at
// its next grant: otherwise the session would keep it after the release,
// and no one could lead until it ended.
func TestAdvisoryReleaseFreesALockTakenTwice(t *testing.T) {
	t.Parallel()
	s := setupAdvisory(t, pgtest.NewPool(t), Options{})
	alice, bob := candidate("alice"), candidate("bob")
	held := mustGrant(t, s, "twice", alice, time.Minute)
	ss := s.holderSession(t, "twice")
	if err := ss.do(callCtx(t), s, false, func(conn *pgx.Conn) error {
		_, err := conn.Exec(callCtx(t), "SELECT pg_advisory_lock($1)", s.Key("twice"))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	mustRelease(t, s, "twice", alice, held.Term)
	if l, granted := mustAcquire(t, s, "twice", bob, time.Minute); !granted {
		t.Fatalf("Acquire after the release of a lock taken twice: %+v, not granted", l)
	}
}

// TestAdvisoryStopLossWatchHaltsTheReader checks that StopLossWatch stops,
// in the background, the reader that waits on the holder's idle session
// (see Lost), and that the session reads again once it is granted the
// lease again: a release, or a prepared handover's Commit, need not stop it
// first. The lease is untouched: it is released as usual.
func TestAdvisoryStopLossWatchHaltsTheReader(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	s := setupAdvisory(t, pool, Options{})
	alice := candidate("alice")
	const ttl = time.Minute
	held := mustGrant(t, s, "unwatched", alice, ttl)
	waitAnnounced(t, pool, s, "unwatched")
	ss := s.holderSession(t, "unwatched")
	reading := func() bool {
		ss.turn <- struct{}{}
		defer func() { <-ss.turn }()
		return ss.stopReader != nil
	}
	if !reading() {
		t.Fatal("no reader waits on the holder's idle session")
	}
	s.StopLossWatch("unwatched", alice.Token, held.Term)
	electortest.Eventually(t, 10*time.Second, "the reader to stop", func() bool { return !reading() })
	if !ss.heldUnder(held.Term) {
		t.Fatal("StopLossWatch changed the session's lease")
	}
	if _, err := s.Renew(callCtx(t), "unwatched", alice.Token, held.Term, ttl); err != nil {
		t.Fatalf("Renew after StopLossWatch: %v", err)
	}
	if reading() {
		t.Fatal("a call after StopLossWatch started the reader again")
	}
	if err := s.Release(callCtx(t), "unwatched", alice.Token, held.Term); err != nil {
		t.Fatalf("Release after StopLossWatch: %v", err)
	}
	again := mustGrant(t, s, "unwatched", alice, ttl)
	if again.Term != held.Term+1 {
		t.Fatalf("granted again under term %d; want %d", again.Term, held.Term+1)
	}
	if !reading() {
		t.Fatal("no reader waits on the session granted the lease again")
	}
}
