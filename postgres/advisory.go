package postgres

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/wallclock"
)

// AdvisoryStore is a leader.Store on PostgreSQL session advisory locks: the
// advisory strategy. Where the LeaseStore keeps a lease in a row and lets it
// run out, the AdvisoryStore's lease is a lock that the server frees the
// moment the holder's session ends, so a leader whose process dies is
// replaced as soon as the server notices the closed connection, without
// waiting for a TTL.
//
// # Sessions
//
// Each candidate (an election name and an Elector's token) campaigns and
// holds the lock on a connection of its own, opened from the pool's
// configuration, never taken from the pool and never returned to it: a lock
// left on a pooled connection would outlive its holder. The connection is
// kept between attempts and closed after sessionIdle unused, or by Close.
// Closing it frees any lock it holds, so a candidate that stops without
// releasing still hands over at once.
//
// # The fencing term
//
// A grant takes the lock with pg_try_advisory_lock and, in the same
// statement, bumps the name's term in Options.AdvisoryTable: the term grows
// at every grant, and rows are never deleted. Renew and Release check the
// row's token, term and holder backend.
//
// # Deadlines on both sides
//
// The holder's Renew is a heartbeat: one statement on its session, bounded
// by the Elector's context, so the leader steps down at its local deadline
// (sent + TTL - DriftMargin) if heartbeats stop succeeding. Each grant and
// heartbeat also sets, on the holder's server session, idle_session_timeout
// and tcp_user_timeout to the TTL and the TCP keepalive idle time to the TTL
// rounded up to a second. So the server frees the lock of a holder that has
// vanished silently (its host gone, or its packets black-holed) no earlier
// than TTL after it last heard from it, which is after the holder's own
// deadline, and no later than about TTL plus a little timer slack: the
// session is idle between heartbeats, and idle_session_timeout ends it.
// A holder that is paused (SIGSTOP) is ended the same way. The keepalive
// and user timeout cover a session that is not idle (a heartbeat whose
// reply could not be delivered), ending it within about TTL plus four
// seconds.
//
// This needs PostgreSQL 14 or later (idle_session_timeout);
// NewAdvisoryStore refuses older servers.
//
// The heartbeat writes (it updates the name's row), so on a server that
// turns read-only (a hot standby after a failover, or
// default_transaction_read_only) it fails with leader.ErrReadOnly and the
// leader steps down, although its session may still hold the lock. Nobody
// else is granted the name until the server takes writes again: a grant
// writes the term.
//
// # When the server ends a holder's session
//
// If the server itself ends the holder's session (pg_terminate_backend, a
// restart, a crash), the lock is freed at once, while the holder may still
// believe it leads until its next heartbeat. So the store reads the
// holder's idle session all the time: the server sends its FATAL message
// before it frees the lock (and a reset connection reaches both ends at
// once), and the store then tells the Elector at once
// (leader.LossNotifier), which steps down. On the other side, a grant of a
// lock whose previous holder left without a release is reported only after
// Options.TakeoverGrace (50 ms by default), which the previous holder, if
// it is alive, has to see its session end and step down. Only a holder
// stalled for longer than that (paused, or starved of CPU) can still
// believe it leads when its successor starts: writes made under
// leadership should carry the fencing term (leader.TermFrom), and the
// resource should refuse a smaller term than it has seen.
//
// # Wake-ups
//
// Followers learn of a release or a grant from a NOTIFY, as with the
// LeaseStore (see Watch), and of the end of a hold, released or not, from
// a lock waiter. A holder takes, with the lock, its mark: the advisory
// lock whose two int4 keys are a constant (-1385121490) and the holder's
// backend PID. For each watched name, a connection of the store's blocks
// in pg_advisory_lock_shared on the holder's mark while the lock is held
// (costing the server nothing), is granted the mark the moment the holder
// lets go of it or its session ends, unlocks at once, and wakes the name's
// watchers. Lock waiters never touch the lock itself, so the first
// candidate to come takes it in one round trip; and as the mark belongs
// to the holder's backend, the next holder takes its own at once, without
// waiting for the lock waiters to let go of the last one. A process whose
// lock waiter is waiting on a holder's mark, or has seen it go, keeps
// that holder's release notification from waking its followers of free
// leases (leader.FreeWatcher) a second time: each is woken once per
// handover.
// Having woken them, a lock waiter looks at the lock again only at the next
// grant's notification, or 20 ms later: a look reads the server's lock
// view, which would slow the candidates' statements. A refused candidate
// is told the holder from the row, checked by a try of the holder's mark
// rather than read from the lock view, for the same reason. Notifications
// keep out of the way too: every listener's backend and process wakes at
// one, so the holder sends the notification of its release once the
// release and unlock have their replies, and the new holder that of its
// grant once it has the grant's reply, each in a statement of its own.
// Sent with the release, it would wake that crowd beside the followers
// the unlock wakes; sent with the grant, it would wake it, and every lock
// waiter's look, while the winner waits for its reply. A candidate
// refused while another's grant is still in flight waits for that
// notification (or 10 ms) before it looks again, rather than polling. A
// session that ends frees its locks one after another, so its lock may
// outlast its mark by a moment: a candidate woken then that finds the lock
// still held by the backend that went looks again, for up to 500 ms,
// instead of taking the refusal; and the lock waiter wakes the watchers
// again if it finds the lock free 20 ms later. A lock held without its
// mark by a backend that the row does not name is taken for a grant in
// flight, and looked at again at its announcement (or 20, 40, 80 ms
// later, and so on). A holder without its mark (a stray session holds the
// same two int4 keys, or a store of an older version holds the lock, and
// the row names it; or the lock has been held so for a second) is waited
// for on the lock itself; a follower
// that then comes while lock waiters hold the lock shared waits for them
// in the lock's queue (at most 100 ms).
//
// # Keys
//
// The lock's 64-bit key is Options.Key(name), by default AdvisoryKey(name).
// See AdvisoryKey for the hash and the risk of collisions. A name's key is
// recorded in its row and must be unique: a second name whose key is
// already used by another name is refused at its first grant with an error
// naming both, instead of silently sharing the lock.
//
// # Poolers
//
// The advisory strategy needs a session of its own with the server: behind
// a transaction-pooling proxy such as PgBouncer the lock would stay on a
// server connection that other clients go on using. NewAdvisoryStore, and
// every session the store opens, refuse such a connection with an error
// wrapping ErrPooledSession. Use the LeaseStore there.
type AdvisoryStore struct {
	pool   *pgxpool.Pool
	opts   Options
	config *pgx.ConnConfig // for sessions and lock waiters
	sql    advisoryStatements
	wakeups

	smu      sync.Mutex
	sessions map[sessionKey]*session
	waiters  map[string]*lockWaiter
	freed    map[string]freeing // the last freeing each lock waiter saw
	flights  map[string]*flight // attempts in progress, by name
	closing  bool
	bg       sync.WaitGroup     // the reaper and the lock waiters
	stopBg   context.CancelFunc // stops the reaper
	bgCtx    context.Context

	// sessionIdle is how long an unused session that holds nothing is kept;
	// tests shorten it.
	sessionIdle time.Duration
	// settleWait is the const settleWait; tests lengthen it.
	settleWait time.Duration
}

var (
	_ leader.Store        = (*AdvisoryStore)(nil)
	_ leader.LossNotifier = (*AdvisoryStore)(nil)
	_ leader.FreeWatcher  = (*AdvisoryStore)(nil)
)

// Timing of the advisory store.
const (
	// sessionIdle is how long a candidate's session that holds nothing is
	// kept open after its last use. A follower uses it at least once per
	// TTL, so only sessions of stopped Electors are closed.
	sessionIdle = 2 * time.Minute
	// waiterPoll bounds how long a lock waiter trusts that a free lock is
	// still free without a notification saying it was granted.
	waiterPoll = 5 * time.Second
	// markLook is how long a lock waiter that found the lock held
	// without its mark, by a backend the row does not name (most likely a
	// grant in flight), waits before it looks again, unless the grant's
	// announcement comes first; it waits twice as long before each
	// further look, and once it has found the same for grantInFlight, it
	// waits on the lock itself. A lock waiter that has woken the watchers
	// waits as long before it looks again.
	markLook      = 20 * time.Millisecond
	grantInFlight = time.Second
	// lingerFor is how long after a lock waiter saw a holder's mark
	// freed a candidate that finds the lock still held by that holder's
	// backend looks again (see lingering).
	lingerFor = 500 * time.Millisecond
	// minAdvisoryServer is the oldest server version (server_version_num)
	// with idle_session_timeout.
	minAdvisoryServer = 140000
)

// AdvisoryKey returns the default advisory lock key for an election name:
// the first 8 bytes, read as a big-endian two's-complement int64, of the
// SHA-256 of "leader:" followed by the name.
//
// Two different names get the same key with probability about n²/2⁶⁵ for n
// names (about 3 in a trillion for 10,000 names). The AdvisoryStore catches
// a collision between its own names at the second name's first grant. It
// cannot know of other programs' advisory locks in the same database: a
// program that happens to lock the same key would block the election
// while it holds it (never elect two leaders). To choose keys yourself, set
// Options.Key.
func AdvisoryKey(name string) int64 {
	sum := sha256.Sum256([]byte("leader:" + name))
	return int64(binary.BigEndian.Uint64(sum[:8]))
}

// keyHalves returns how pg_locks shows key: its high and low 32 bits as
// unsigned numbers (classid and objid).
func keyHalves(key int64) (hi, lo int64) {
	u := uint64(key)
	return int64(u >> 32), int64(u & math.MaxUint32)
}

// NewAdvisoryStore returns an AdvisoryStore on the table that Migrate created
// with the same opts. It connects once to check that the server can serve
// the advisory strategy: PostgreSQL 14 or later, a session of its own (no
// transaction-pooling proxy, see ErrPooledSession), and the table migrated.
// It returns an *OptionsError if opts break a rule. Close the store when
// done: it keeps connections, and a goroutine that closes those unused. The
// pool stays the caller's: Close does not close it.
func NewAdvisoryStore(ctx context.Context, pool *pgxpool.Pool, opts Options) (*AdvisoryStore, error) {
	if pool == nil {
		return nil, errors.New("postgres: NewAdvisoryStore: pool is nil")
	}
	opts = opts.withDefaults()
	if err := opts.validate(); err != nil {
		return nil, err
	}
	config := pool.Config().ConnConfig.Copy()
	// A context that ends must only cut the connection short (which frees
	// any lock), never open another one to cancel the statement.
	config.BuildContextWatcherHandler = func(c *pgconn.PgConn) ctxwatch.Handler {
		return &pgconn.DeadlineContextWatcherHandler{Conn: c.Conn()}
	}
	s := &AdvisoryStore{
		pool:        pool,
		opts:        opts,
		config:      config,
		sql:         newAdvisoryStatements(opts.qualifiedAdvisoryTable()),
		wakeups:     newWakeups(config, opts, "the advisory store's wake-ups"),
		sessions:    make(map[sessionKey]*session),
		waiters:     make(map[string]*lockWaiter),
		freed:       make(map[string]freeing),
		flights:     make(map[string]*flight),
		sessionIdle: sessionIdle,
		settleWait:  settleWait,
	}
	if err := s.check(ctx); err != nil {
		return nil, err
	}
	s.bgCtx, s.stopBg = context.WithCancel(context.Background())
	s.bg.Go(s.reap)
	return s, nil
}

// check opens a connection and checks the server, the session and the
// table.
func (s *AdvisoryStore) check(ctx context.Context) error {
	const what = "NewAdvisoryStore"
	conn, err := s.connect(ctx)
	if err != nil {
		return wrapError(ctx, what, err)
	}
	defer closeConn(conn)
	var version int
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		return wrapError(ctx, what, err)
	}
	if version < minAdvisoryServer {
		return fmt.Errorf("postgres: %s: the advisory strategy needs PostgreSQL 14 or later (for idle_session_timeout, which frees a vanished holder's lock); the server is version %d; use the lease strategy (NewLeaseStore)",
			what, version)
	}
	if _, err := conn.Exec(ctx, "SELECT FROM "+s.opts.qualifiedAdvisoryTable()+" LIMIT 0"); err != nil {
		if sqlState(err) == "42P01" { // undefined_table
			return fmt.Errorf("postgres: %s: table %s does not exist; run Migrate with the same Options first: %w",
				what, s.opts.qualifiedAdvisoryTable(), err)
		}
		return wrapError(ctx, what, err)
	}
	return nil
}

// connect opens a connection of the store's own and checks that it is a
// session of its own with the server.
func (s *AdvisoryStore) connect(ctx context.Context) (*pgx.Conn, error) {
	conn, err := pgx.ConnectConfig(ctx, s.config)
	if err != nil {
		return nil, err
	}
	if err := checkSession(ctx, conn, "the advisory strategy"); err != nil {
		closeConn(conn)
		return nil, err
	}
	return conn, nil
}

// closeConn closes conn, best effort, within a second: the server frees the
// session's locks when it sees the connection close.
func closeConn(conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = conn.Close(ctx)
}

// Options returns the store's options with their defaults filled in.
func (s *AdvisoryStore) Options() Options { return s.opts }

// Key returns the advisory lock key the store uses for name.
func (s *AdvisoryStore) Key(name string) int64 {
	if s.opts.Key != nil {
		return s.opts.Key(name)
	}
	return AdvisoryKey(name)
}

// ttlSettings returns the TTL as an interval, and as the text values of the
// server settings that arm the holder's deadline: milliseconds (rounded up),
// keepalive idle seconds (rounded up, at least 1) and keepalive interval
// seconds (a third of that, at least 1).
func ttlSettings(ttl time.Duration) (iv time.Duration, ms, idle, every string) {
	msec := (ttl + time.Millisecond - 1) / time.Millisecond
	msec = min(max(msec, 1), math.MaxInt32)
	secs := min(max((ttl+time.Second-1)/time.Second, 1), math.MaxInt32)
	return interval(ttl), strconv.FormatInt(int64(msec), 10), strconv.FormatInt(int64(secs), 10),
		strconv.FormatInt(int64(max(secs/3, 1)), 10)
}

// Acquire implements leader.Store. It takes the lock for name on the
// candidate's session (opening it if needed) and bumps the term in the same
// statement; for the holder it bumps the term only. When it grants nothing
// it reports the holder and how long the holder's session would last
// without another heartbeat. A candidate that calls while another
// candidate of the same name on this store is trying waits for that
// attempt; once one that began after its call has ended with the lease
// held, it is refused with that outcome, without a statement of its own.
func (s *AdvisoryStore) Acquire(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) (leader.Lease, bool, error) {
	const op = "acquire"
	if err := checkTTL(op, name, ttl); err != nil {
		return leader.Lease{}, false, err
	}
	if err := ctx.Err(); err != nil {
		return leader.Lease{}, false, fmt.Errorf("postgres: %s: %w", call(op, name), err)
	}
	called := time.Now()
	for {
		ss, err := s.session(name, c.Token)
		if err != nil {
			return leader.Lease{}, false, err
		}
		var f *flight
		if !ss.isHeld() {
			var lead bool
			if f, lead = s.flight(name); !lead {
				select {
				case <-f.done:
				case <-ctx.Done():
					return leader.Lease{}, false, fmt.Errorf("postgres: %s: %w", call(op, name), ctx.Err())
				}
				if l, ok := f.refusal(called); ok {
					return l, false, nil
				}
				continue
			}
		}
		var (
			l                 leader.Lease
			granted, announce bool
		)
		err = ss.do(ctx, s, true, func(conn *pgx.Conn) error {
			l, granted, announce, err = s.acquireOn(ctx, ss, conn, name, c, ttl)
			return err
		})
		s.land(f, l, err)
		switch {
		case errors.Is(err, errSessionGone):
			continue // reaped while we waited for it: a new one
		case err != nil:
			return leader.Lease{}, false, wrapError(ctx, call(op, name), err)
		}
		if announce {
			s.notifyLater(ss, l.Term, false)
		}
		return l, granted, nil
	}
}

// A flight is one candidate's attempt at a name, which the store's other
// candidates of the name that call Acquire meanwhile wait for and share
// instead of each sending its own: with many followers of a name in one
// process, a release would otherwise have them all send a grant statement
// at once, each on a session of its own, and the winner's would be one of
// many on a busy server.
type flight struct {
	name   string
	began  time.Time
	done   chan struct{} // closed when the attempt has ended
	lease  leader.Lease  // what the attempt saw, or granted
	landed time.Time     // when it ended
	err    error
}

// flight returns name's flight in progress, or starts one that the caller
// leads (lead), which it must end with land.
func (s *AdvisoryStore) flight(name string) (f *flight, lead bool) {
	s.smu.Lock()
	defer s.smu.Unlock()
	if f := s.flights[name]; f != nil {
		return f, false
	}
	f = &flight{name: name, began: time.Now(), done: make(chan struct{})}
	s.flights[name] = f
	return f, true
}

// land ends f (nil if the caller led none) with the attempt's outcome.
func (s *AdvisoryStore) land(f *flight, l leader.Lease, err error) {
	if f == nil {
		return
	}
	s.smu.Lock()
	delete(s.flights, f.name)
	s.smu.Unlock()
	f.lease, f.err, f.landed = l, err, time.Now()
	close(f.done)
}

// notifyLater sends, in the background, the wake-up of a grant under term
// to the session ss (or, if released, of its release of the lease under
// term), on the session, once the call that made it due has its reply:
// see advisoryStatements.announce and releaseNotice. A grant's is sent
// only while the session still holds the lease under term, and the
// statements check the row themselves. A failure of the statement is the
// session's: the session is closed, and a lease it holds is lost with it,
// as it would be at the next heartbeat.
func (s *AdvisoryStore) notifyLater(ss *session, term uint64, released bool) {
	what, stmt := "grant", s.sql.announce
	args := []any{ss.name, ss.token, int64(term), s.opts.Channel}
	if released {
		what, stmt = "release", s.sql.releaseNotice
		args = []any{ss.name, int64(term), s.opts.Channel}
	}
	s.smu.Lock()
	defer s.smu.Unlock()
	if s.closing {
		return
	}
	s.bg.Go(func() {
		ctx, cancel := context.WithTimeout(s.bgCtx, listenCallTimeout)
		defer cancel()
		err := ss.do(ctx, s, false, func(conn *pgx.Conn) error {
			if !released && !ss.heldUnder(term) {
				return nil
			}
			_, err := conn.Exec(ctx, stmt, args...)
			return err
		})
		if err == nil || errors.Is(err, errNotHeld) || errors.Is(err, errSessionGone) {
			return
		}
		log := s.log.With(slog.String("election", ss.name), slog.Uint64("term", term), slog.Any("error", err))
		if errors.Is(err, errSessionDropped) {
			// A lease held is told lost to the Elector
			// (leader.LossNotifier), as by the session's reader when the
			// session ends while idle.
			log.Debug("advisory session ended while notifying of a " + what)
			return
		}
		log.Warn("could not notify of a " + what + "; followers without a lock waiter learn of it later")
	})
}

// refusal returns, for a candidate that called Acquire at called, the
// refusal that f's outcome means for it, if it means one: f began after
// the call, so what f saw is an answer to the call too, and f ended with
// the lease held (by f's candidate or by another). Its Remaining is as of
// now. Otherwise the candidate must try for itself.
func (f *flight) refusal(called time.Time) (leader.Lease, bool) {
	if f.err != nil || f.began.Before(called) || !f.lease.Held() {
		return leader.Lease{}, false
	}
	l := f.lease
	l.Remaining -= time.Since(f.landed)
	if l.Remaining <= 0 {
		return leader.Lease{}, false
	}
	return l, true
}

// acquireOn runs the grant (or re-grant) on the session's connection; the
// caller holds the session's turn. It reports whether the lease was
// granted, and whether the grant is still to be announced (see
// notifyLater): a re-grant announces itself.
func (s *AdvisoryStore) acquireOn(ctx context.Context, ss *session, conn *pgx.Conn, name string, c leader.Candidate, ttl time.Duration) (leader.Lease, bool, bool, error) {
	iv, ms, idle, every := ttlSettings(ttl)
	hi, lo := keyHalves(ss.key)
	if ss.isHeld() {
		var (
			term       int64
			acquiredAt time.Time
			n          int64
		)
		err := conn.QueryRow(ctx, s.sql.regrant, name, c.Token, c.ID, iv, ms, idle, every, s.opts.Channel, hi, lo).
			Scan(&term, &acquiredAt, &n)
		switch {
		case err == nil:
			ss.grant(uint64(term), c.ID)
			return leader.Lease{Name: name, HolderID: c.ID, Term: uint64(term), AcquiredAt: acquiredAt,
				ExpiresAt: acquiredAt.Add(ttl), Remaining: ttl}, true, false, nil
		case errors.Is(err, pgx.ErrNoRows):
			// The session no longer holds the row or the lock (someone
			// changed the row by hand?): close it, freeing whatever it
			// holds; the next attempt starts afresh.
			return leader.Lease{}, false, false, errors.Join(errSessionReset, errNotHeld)
		default:
			return leader.Lease{}, false, false, err
		}
	}
	// A refusal is reported as the lease stood when the statement began. If
	// that view is not settled, look again: another candidate has taken the
	// lock but its statement has not committed the row yet (locked but not
	// held), a release has cleared the row but not yet unlocked, or no one
	// holds the lock and the attempt lost only to lock waiters' shared
	// locks. Lock waiters hold the lock shared only for a holder without
	// its mark (see AdvisoryStore, Wake-ups), and let it go within their
	// statement, but on a busy server that takes a few milliseconds: the
	// first time, queue for the lock behind them instead of polling (see
	// queue).
	//
	// The first attempts are quick (grantQuick): a refused candidate is
	// settled if the row names a holder whose backend holds its mark, and
	// that this store's lock waiter has not just seen go; it reads neither
	// the server's lock view nor its whole activity view, which would slow
	// the winner's statement beside it. The later attempts read the lease
	// as Observe does, and tell a lock held by lock waiters alone (see
	// queue) from one held by a candidate.
	//
	// Between attempts, a candidate waits for the next event of the name
	// that this store hears of, or for settleWait. Each unsettled state
	// ends with one: a grant with its notification (see notifyLater); a
	// release, and a holder's lock that outlasts its mark, with the lock
	// waiter's wake-up once the lock is free. Candidates that looked again
	// every millisecond instead were, on a busy server, what slowed the
	// grant they were waiting for.
	queued := false
	var events <-chan struct{} // the name's events, from the first wait on
	for attempt := 0; ; attempt++ {
		stmt := s.sql.grant
		if attempt < quickAttempts {
			stmt = s.sql.grantQuick
		}
		r, err := s.grantOn(ctx, conn, ss, name, c, stmt, iv, ms, idle, every, hi, lo)
		if err != nil {
			// The statement may have taken the lock before it failed, and
			// a session lock outlives the failed transaction: close the
			// session, which frees it.
			return leader.Lease{}, false, false, errors.Join(errSessionReset, err)
		}
		if !r.got && !r.locked && !queued {
			queued = true
			took, err := s.queue(ctx, conn, ss.key)
			if err != nil {
				return leader.Lease{}, false, false, err
			}
			if took {
				// Holding the lock, in a statement of its own: its snapshot
				// shows the row as the last holder left it.
				if r, err = s.grantOn(ctx, conn, ss, name, c, s.sql.grantLocked, iv, ms, idle, every, hi, lo); err != nil {
					return leader.Lease{}, false, false, errors.Join(errSessionReset, err)
				}
				if !r.got {
					return leader.Lease{}, false, false, errors.Join(errSessionReset, errors.New("the lock, taken, is not held"))
				}
			}
		}
		if r.granted() && !r.marked {
			s.log.Debug("holding the lock without its mark: another session holds the two-int4 advisory lock of the same keys",
				slog.String("election", name))
		}
		if r.granted() && r.unreleased {
			// Taken from a holder whose session ended without a release:
			// give it TakeoverGrace to see that too and step down.
			if err := sleepCtx(ctx, s.graceLeft(name, r.previousPID)); err != nil {
				return leader.Lease{}, false, false, errors.Join(errSessionReset, err)
			}
		}
		if r.granted() || (r.held && !s.lingering(name, r.previousPID)) || attempt == settleAttempts {
			return r.lease(name, c.ID, ttl), r.granted(), r.granted(), nil
		}
		if events == nil {
			var unsubscribe func()
			events, unsubscribe = s.wakeups.subscribe(name, watchAll)
			defer unsubscribe()
		}
		if err := awaitEvent(ctx, events, s.settleWait); err != nil {
			return leader.Lease{}, false, false, err
		}
	}
}

// graceLeft returns how much of TakeoverGrace is still to pass before a
// grant that took name's lock from its holder of backend pid, which left
// without a release, may be reported. The grace is counted from when
// name's lock waiter saw that holder's mark freed, if it did so within the
// grace, and from now otherwise. The server frees a session's locks as the
// session ends, so the grace is never counted from before the end.
func (s *AdvisoryStore) graceLeft(name string, pid *int32) time.Duration {
	grace := s.opts.TakeoverGrace
	if pid == nil {
		return grace
	}
	s.smu.Lock()
	f, ok := s.freed[name]
	s.smu.Unlock()
	if !ok || f.pid != *pid {
		return grace
	}
	if since := time.Since(f.at); since >= 0 && since < grace {
		return grace - since
	}
	return grace
}

// lingering reports whether name's lock waiter saw the mark of the holder
// of backend pid freed within lingerFor: a session that ends frees its
// locks one lock partition after another, so a candidate that finds the
// lock held by that backend still is to look again, not to be refused for
// the rest of the lease.
func (s *AdvisoryStore) lingering(name string, pid *int32) bool {
	if pid == nil {
		return false
	}
	s.smu.Lock()
	f, ok := s.freed[name]
	s.smu.Unlock()
	return ok && f.pid == *pid && time.Since(f.at) < lingerFor
}

// freeing is when a lock waiter saw the holder of backend pid free a
// lock (see graceLeft).
type freeing struct {
	pid int32
	at  time.Time
}

// sleepCtx waits for d or until ctx ends, returning ctx.Err() then.
func sleepCtx(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-timer.C:
		return nil
	}
}

// settleAttempts bounds how often acquireOn tries when the lease's state is
// not settled; it waits for at most settleWait between two attempts (see
// acquireOn), so for at most about 100 ms in all. The first quickAttempts
// of them read the row alone.
const (
	settleAttempts = 10
	settleWait     = 10 * time.Millisecond
	quickAttempts  = 3
)

// queueWait bounds how long a candidate waits in the lock's queue for lock
// waiters to let go of it (see acquireOn). It is long enough for a busy
// server to run the lock waiters' statements to their end, and short
// enough that a candidate that lost to another one in the queue answers
// soon.
const queueWait = 100 * time.Millisecond

// queue waits in the queue for the lock of key, on the session's
// connection, for at most queueWait. It reports whether the session took
// the lock; if it did not, the session holds nothing.
func (s *AdvisoryStore) queue(ctx context.Context, conn *pgx.Conn, key int64) (bool, error) {
	_, err := conn.Exec(ctx, s.sql.queue, key, strconv.FormatInt(queueWait.Milliseconds(), 10))
	switch {
	case err == nil:
		return true, nil
	case sqlState(err) == "55P03": // lock_not_available: the wait ran out
		// A lock granted at the moment the wait ran out stays granted
		// although the statement fails (PostgreSQL keeps a lock it was
		// granted while handling the timeout, and a session lock outlives
		// the failed transaction): ask the server which it was. Taking it
		// for not granted would leave the session holding the lock
		// unknown to the store, and the next grant on it would take it a
		// second time, which its release would not undo.
		hi, lo := keyHalves(key)
		var held bool
		if err := conn.QueryRow(ctx, s.sql.heldHere, hi, lo).Scan(&held); err != nil {
			return false, errors.Join(errSessionReset, err)
		}
		return held, nil
	default:
		// Whether the lock was taken is unknown: close the session.
		return false, errors.Join(errSessionReset, err)
	}
}

// grantResult is what the grant statement reports.
type grantResult struct {
	got                       bool
	term, curTerm             *int64
	acquiredAt, curAcquiredAt *time.Time
	other, curHolder          *string
	held, locked              bool
	remaining                 time.Duration
	unreleased                bool   // the previous holder did not release
	previousPID               *int32 // the previous holder's backend
	marked                    bool   // the grant took the lock's mark too
}

func (r grantResult) granted() bool { return r.got && r.term != nil }

// lease reports r as a leader.Lease: the grant to holderID for ttl, or the
// lease as it stood.
func (r grantResult) lease(name, holderID string, ttl time.Duration) leader.Lease {
	if r.granted() {
		return leader.Lease{Name: name, HolderID: holderID, Term: uint64(*r.term), AcquiredAt: *r.acquiredAt,
			ExpiresAt: r.acquiredAt.Add(ttl), Remaining: ttl}
	}
	l := leader.Lease{Name: name}
	if r.curTerm != nil {
		l.Term = uint64(*r.curTerm)
	}
	if r.held && r.remaining > 0 && r.curHolder != nil && r.curAcquiredAt != nil {
		l.HolderID, l.AcquiredAt, l.Remaining = *r.curHolder, *r.curAcquiredAt, r.remaining
		l.ExpiresAt = wallclock.Now().Add(r.remaining) // for display; decisions use Remaining
	}
	return l
}

// grantOn runs a grant statement, stmt (grant or grantLocked), once on
// conn, recording a grant in ss.
func (s *AdvisoryStore) grantOn(ctx context.Context, conn *pgx.Conn, ss *session, name string, c leader.Candidate, stmt string,
	iv time.Duration, ms, idle, every string, hi, lo int64) (grantResult, error) {
	var (
		r grantResult
		n int64
	)
	err := conn.QueryRow(ctx, stmt, name, ss.key, c.Token, c.ID, iv, ms, idle, every, hi, lo).
		Scan(&r.got, &r.term, &r.acquiredAt, &r.other, &n, &r.curTerm, &r.curHolder, &r.curAcquiredAt, &r.held, &r.remaining, &r.locked, &r.unreleased, &r.previousPID, &r.marked)
	if err != nil {
		if sqlState(err) == "23505" { // unique_violation: the key, taken by another name at the same moment
			return r, fmt.Errorf("advisory key %d of %q is used by another election name (raced for its first grant); give one of them another key with Options.Key: %w",
				ss.key, name, err)
		}
		return r, err
	}
	if r.got && r.term == nil {
		// Locked, but the key belongs to another name: let it go, and
		// its mark.
		var (
			unlocked bool
			n        int64
		)
		if err := conn.QueryRow(ctx, s.sql.unlock, ss.key).Scan(&unlocked, &n); err != nil || !unlocked {
			return r, errors.Join(errSessionReset, err)
		}
		return r, fmt.Errorf("advisory key %d of %q is already used by election %q (a hash collision, or the same Options.Key given twice); give one of them another key with Options.Key, or delete the unused name's row from %s",
			ss.key, name, deref(r.other), s.opts.qualifiedAdvisoryTable())
	}
	if r.granted() {
		ss.grant(uint64(*r.term), c.ID)
	}
	return r, nil
}

func deref(p *string) string {
	if p == nil {
		return ""
	}
	return *p
}

// errSessionReset means the session's state is unknown after a failed step:
// the session is closed (freeing any lock) and the call fails.
var errSessionReset = errors.New("session state unknown; connection closed, which frees the lock")

// Renew implements leader.Store. It is the holder's heartbeat: one statement
// on its session that checks that the session still holds the lock and the
// row under term, and re-arms the server's timeouts for ttl (see the type's
// documentation). If the session has ended, or a heartbeat fails and
// leaves the session's state unknown, the session is closed and Renew
// returns an error wrapping leader.ErrLeaseLost: the lock cannot be renewed
// from another session.
func (s *AdvisoryStore) Renew(ctx context.Context, name, token string, term uint64, ttl time.Duration) (leader.Lease, error) {
	const op = "renew"
	if err := checkTTL(op, name, ttl); err != nil {
		return leader.Lease{}, err
	}
	if err := ctx.Err(); err != nil {
		return leader.Lease{}, fmt.Errorf("postgres: %s: %w", call(op, name), err)
	}
	lost := fmt.Errorf("postgres: %s %q term %d: %w", op, name, term, leader.ErrLeaseLost)
	ss := s.heldSession(name, token, term)
	if ss == nil {
		return leader.Lease{}, lost
	}
	var acquiredAt time.Time
	err := ss.do(ctx, s, false, func(conn *pgx.Conn) error {
		if !ss.heldUnder(term) {
			return errNotHeld
		}
		iv, ms, idle, every := ttlSettings(ttl)
		hi, lo := keyHalves(ss.key)
		var n int64
		err := conn.QueryRow(ctx, s.sql.renew, name, token, int64(term), iv, ms, idle, every, hi, lo).Scan(&acquiredAt, &n)
		if errors.Is(err, pgx.ErrNoRows) {
			return errors.Join(errSessionReset, errNotHeld)
		}
		return err
	})
	switch {
	case err == nil:
		return leader.Lease{Name: name, HolderID: ss.id(), Term: term, AcquiredAt: acquiredAt,
			ExpiresAt: wallclock.Now().Add(ttl), Remaining: ttl}, nil
	case errors.Is(err, errNotHeld), errors.Is(err, errSessionGone):
		return leader.Lease{}, fmt.Errorf("%w: %w", lost, err)
	case errors.Is(err, errSessionDropped):
		// The heartbeat failed and the session was closed: the lock is
		// gone with it (or will be, as soon as the server notices), and
		// no other session can renew it.
		return leader.Lease{}, fmt.Errorf("%w: %w", lost, wrapError(ctx, call(op, name), err))
	default:
		return leader.Lease{}, wrapError(ctx, call(op, name), err)
	}
}

// Release implements leader.Store. On the holder's session it clears the
// row (keeping the term) in one statement and unlocks in a second, in one
// round trip; the wake-up follows, once Release has their replies (see
// advisoryStatements.releaseNotice). The session stays open for the next
// campaign.
func (s *AdvisoryStore) Release(ctx context.Context, name, token string, term uint64) error {
	const op = "release"
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("postgres: %s: %w", call(op, name), err)
	}
	lost := fmt.Errorf("postgres: %s %q term %d: %w", op, name, term, leader.ErrLeaseLost)
	ss := s.heldSession(name, token, term)
	if ss == nil {
		return lost
	}
	err := ss.do(ctx, s, false, func(conn *pgx.Conn) error {
		if !ss.heldUnder(term) {
			return errNotHeld
		}
		released, unlocked, err := s.releaseOn(ctx, conn, name, token, term, ss.key)
		switch {
		case err != nil:
			// Whether the row was released and the lock freed is unknown:
			// close the session, which frees the lock.
			return errors.Join(errSessionReset, err)
		case !released:
			// The row no longer names this session (changed by hand?):
			// close the session, freeing whatever it holds.
			return errors.Join(errSessionReset, errNotHeld)
		case !unlocked:
			// The row said this session held it, but the lock was not
			// there to unlock: close the session to be sure.
			return errors.Join(errSessionReset, errNotHeld)
		}
		ss.release()
		return nil
	})
	switch {
	case err == nil:
		s.notifyLater(ss, term, true)
		return nil
	case errors.Is(err, errNotHeld), errors.Is(err, errSessionGone):
		return fmt.Errorf("%w: %w", lost, err)
	case errors.Is(err, errSessionDropped) && endedByServer(err):
		// The server ended the session (its idle_session_timeout at the
		// lease's expiry, or pg_terminate_backend) before the session's
		// reader saw its FATAL message: the lock went with it.
		return fmt.Errorf("%w: %w", lost, err)
	default:
		return wrapError(ctx, call(op, name), err)
	}
}

// endedByServer reports whether err carries the FATAL message with which
// the server ends a session, freeing its locks.
func endedByServer(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Severity == "FATAL" || pgErr.Severity == "PANIC")
}

// releaseOn runs the release's two statements on the holder's
// connection, in one round trip: each is a transaction of its own, so the
// row is free before the lock is (see advisoryStatements.release). The
// unlock runs even if the first
// statement failed or released nothing; the caller then closes the
// session anyway.
func (s *AdvisoryStore) releaseOn(ctx context.Context, conn *pgx.Conn, name, token string, term uint64, key int64) (released, unlocked bool, err error) {
	p := conn.PgConn().StartPipeline(ctx)
	p.SendQueryParams(s.sql.release, [][]byte{[]byte(name), []byte(token), strconv.AppendUint(nil, term, 10)}, nil, nil, nil)
	p.SendPipelineSync()
	p.SendQueryParams(s.sql.unlock, [][]byte{strconv.AppendInt(nil, key, 10)}, nil, nil, nil)
	p.SendPipelineSync()
	if err := p.Flush(); err != nil {
		return false, false, errors.Join(err, p.Close())
	}
	first, err1 := pipelineRow(p)
	second, err2 := pipelineRow(p)
	if err := errors.Join(err1, err2, p.Close()); err != nil {
		return false, false, err
	}
	if len(first) < 1 || len(second) < 1 {
		return false, false, errors.New("release: a statement returned no value")
	}
	return string(first[0]) == "1", string(second[0]) == "t", nil
}

// pipelineRow reads the next statement's result and the sync after it
// from p, and returns the statement's first row, as text.
func pipelineRow(p *pgconn.Pipeline) ([][]byte, error) {
	var row [][]byte
	for {
		res, err := p.GetResults()
		if err != nil {
			return nil, err
		}
		switch r := res.(type) {
		case *pgconn.ResultReader:
			for r.NextRow() {
				if row == nil {
					for _, v := range r.Values() {
						row = append(row, append([]byte(nil), v...))
					}
				}
			}
			if _, err := r.Close(); err != nil {
				return nil, err
			}
		case *pgconn.PipelineSync:
			return row, nil
		case nil:
			return nil, errors.New("release: the pipeline ended early")
		}
	}
}

// Observe implements leader.Store. It reads the row and, in the same
// statement, whether the recorded holder's backend holds the lock now.
func (s *AdvisoryStore) Observe(ctx context.Context, name string) (leader.Lease, error) {
	hi, lo := keyHalves(s.Key(name))
	var (
		term       int64
		holderID   string
		acquiredAt *time.Time
		ttl        *time.Duration
		held       bool
		locked     bool
		remaining  time.Duration
	)
	err := s.pool.QueryRow(ctx, s.sql.observe, name, hi, lo).Scan(&term, &holderID, &acquiredAt, &ttl, &held, &locked, &remaining)
	if errors.Is(err, pgx.ErrNoRows) {
		return leader.Lease{Name: name}, nil
	}
	if err != nil {
		return leader.Lease{}, wrapError(ctx, call("observe", name), err)
	}
	l := leader.Lease{Name: name, Term: uint64(term)}
	if held && remaining > 0 && acquiredAt != nil {
		l.HolderID, l.AcquiredAt, l.Remaining = holderID, *acquiredAt, remaining
		l.ExpiresAt = wallclock.Now().Add(remaining)
	}
	return l, nil
}

// Lost implements leader.LossNotifier: the channel is closed as soon as the
// store learns that the session holding name for token under term has
// ended (the server ended it, or the connection broke), and at once if the
// session does not hold it.
func (s *AdvisoryStore) Lost(name, token string, term uint64) <-chan struct{} {
	if ss := s.heldSession(name, token, term); ss != nil {
		if ch := ss.lostChan(term); ch != nil {
			return ch
		}
	}
	closed := make(chan struct{})
	close(closed)
	return closed
}

// Close closes every session the store opened (freeing any lock they hold,
// so Electors should have stopped first), stops the lock waiters and the
// wake-up listener, and waits for them. Close may be called more than once.
func (s *AdvisoryStore) Close() {
	s.smu.Lock()
	s.closing = true
	sessions := s.sessions
	s.sessions = make(map[sessionKey]*session)
	for _, w := range s.waiters {
		w.stop()
	}
	s.smu.Unlock()
	s.stopBg()
	for _, ss := range sessions {
		ss.close()
	}
	s.wakeups.Close()
	s.bg.Wait()
}
