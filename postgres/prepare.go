package postgres

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
)

// handoverClass is the first of the two int4 keys of the advisory lock on
// which a prepared handover's successor waits (see "Prepared handovers"
// in the package documentation): the first 4 bytes of the SHA-256 of
// "leader:handover", read as a big-endian int4. It is positive, so
// pg_locks shows it as it is.
const handoverClass = 1724485689

// Timing of prepared handovers.
const (
	// preparePoll is how often PrepareHandover looks whether the
	// successor waits.
	preparePoll = time.Millisecond
	// preparedFor is how long after a preparation's notice the
	// successor's Acquire waits for the handover: an Acquire later than
	// that is an ordinary one.
	preparedFor = 5 * time.Second
	// waitsConnWait bounds how long a successor's Acquire waits for one
	// of the store's connections for prepared handovers, when all are in
	// use, before it tries as usual instead.
	waitsConnWait = 100 * time.Millisecond
	// prepareConnWait bounds how long PrepareHandover waits for a new
	// connection for prepared handovers to open (see waitsRoom): long
	// enough for a loaded machine (100 ms was not), short enough not to
	// hold up a handover for long on a server slow to accept (the
	// Elector's own bound is a RenewInterval).
	prepareConnWait = time.Second
	// waitCheckEvery is the client_connection_check_interval of a
	// successor's waiting statement.
	waitCheckEvery = 100 * time.Millisecond
	// beforeLockWait is how long each of a successor's statements before
	// its last (see waitThenRun) may wait for a lock: an advisory
	// successor's claim waits for the lease's lock, which another session
	// may hold for a moment as the handover's lock is freed (a follower
	// whose grant's snapshot came before the release, and which lets go
	// once it finds the row reserved, or a lock waiter reading the row).
	beforeLockWait = 50 * time.Millisecond
)

// handoverKey returns the second key of the advisory lock of name's
// prepared handovers: the first 4 bytes of the SHA-256 of the lease
// table's qualified name and name, so that two tables' names of the same
// spelling do not share it. Two names that do share it only make a
// preparation of one fail while the other's holds the lock, and a
// successor of one wait for the other's commit (for its lock_timeout at
// most).
func (s *LeaseStore) handoverKey(name string) int32 {
	return handoverKeyOf(s.opts.qualifiedTable(), name)
}

// handoverKeyOf is the second key of the advisory lock of the prepared
// handovers of name in table (see LeaseStore.handoverKey).
func handoverKeyOf(table, name string) int32 {
	sum := sha256.Sum256([]byte("leader:handover:" + table + "\x00" + name))
	return int32(binary.BigEndian.Uint32(sum[:4]))
}

// preparedHandover is a handover that LeaseStore.PrepareHandover
// prepared: the connection that holds the advisory lock on which the
// successor waits, until Commit or Abort.
type preparedHandover struct {
	s             *LeaseStore
	name, token   string
	term          uint64
	successor     leader.Candidate
	key           int32
	mu            sync.Mutex
	conn          *pgxpool.Conn // nil once ended
	waited        bool          // the successor waited when PrepareHandover returned
	stagedRelease               // guarded by mu
}

var _ leader.HandoverStager = (*preparedHandover)(nil)

// handoverStagedUnlockStmt is the name of stagedUnlockLease, prepared on
// the preparation's connection by Stage.
const handoverStagedUnlockStmt = "leader_handover_staged_unlock"

// stageLocksLease is the statement of a staged release (see
// preparedHandover.Stage) after the release, in its transaction: $1 and
// $2 the handover lock's two int4 keys, $3 the name's staged key, $4 the
// transaction's idle_in_transaction_session_timeout, $5 the fence
// function's signature (see stagedFenceSQL). It takes the
// handover's lock again at transaction level, at once (the session holds
// it already), so that Commit's unlock of the session's hold
// (stagedUnlockLease) does not free it before the COMMIT; lifts the
// transaction's lock_timeout and statement_timeout, so that the commit
// waits for the fenced transactions that hold the name's fence lock; and
// tries the name's staged lock (see stagedKeyPrefix) and checks the fence
// function, returning whether both hold; client_connection_check_interval
// (PostgreSQL 14 and later) ends the commit's wait for the fence lock if
// the client went. The idle timeout ends the transaction, and the connection, if
// neither Commit nor Abort comes (the handover's process gone without a
// word): the lease row is not held locked past it, and the lease itself
// stays as it was, held by the holder, who no longer renews it. Its last
// column says whether a session still waits for the handover's lock, as
// the successor's did when the preparation returned: one whose wait ran
// out before the release locked the row was refused the lease, and would
// not learn of a staged grant (no notice tells of it) until the holder's
// lease would have run out; one whose wait runs out after it waits for
// the row's lock (statements.acquireLocking).
var stageLocksLease = `SELECT pg_advisory_xact_lock($1::int4, $2::int4),
	set_config('idle_in_transaction_session_timeout', $4, true),
	` + stagedTxnSettings + `,
	pg_try_advisory_xact_lock($3::bigint) AND ` + stagedFenceSQL + `,
	EXISTS (SELECT FROM pg_locks AS w WHERE ` + handoverWaiters("w", "$1::int4", "($2::int4::bigint & 4294967295)") + `)`

// handoverWaiters returns the SQL condition for a row a of pg_locks that
// is a session of the current database waiting for the lock of prepared
// handovers whose two int4 keys are the expressions class and key (key
// as pg_locks shows it: unsigned, as a bigint).
func handoverWaiters(a, class, key string) string {
	return fmt.Sprintf(`%[1]s.locktype = 'advisory'
		AND %[1]s.database = (SELECT d.oid FROM pg_database AS d WHERE d.datname = current_database())
		AND %[1]s.classid::bigint = %[2]s AND %[1]s.objid::bigint = %[3]s AND %[1]s.objsubid = 2 AND NOT %[1]s.granted`, a, class, key)
}

// stagedUnlockLease is the first statement of a staged release's commit
// (see preparedHandover.Commit): $1 and $2 the handover lock's two int4
// keys, $3 the name's fence key, $4 how long it may wait for it
// (lock_timeout; see commitWait). It takes the name's fence lock, waiting
// for every fenced transaction that judged the row while the release was
// staged, and then unlocks the session's hold of the handover's lock (the
// transaction's own hold keeps it until the COMMIT); it returns whether it
// unlocked it.
const stagedUnlockLease = `WITH wait AS MATERIALIZED (
	SELECT set_config('lock_timeout', $4, true)
), fence AS MATERIALIZED (
	SELECT pg_advisory_xact_lock($3::bigint) FROM wait
)
SELECT pg_advisory_unlock($1::int4, $2::int4) FROM fence`

// Stage implements leader.HandoverStager. When the successor waited, it
// runs, on the preparation's connection, a release that grants the
// successor the lease (statements.releaseGranting, with the holder's TTL)
// in a transaction that it leaves open, takes the handover's lock again
// at transaction level there, and the name's staged lock
// (stageLocksLease): Commit then only takes the name's fence lock, unlocks
// the session's hold and commits, and the successor's statement, which
// waits for the handover's lock, runs as the COMMIT frees it, and only
// reads the row that names it (claimStaged). Nobody sees the release
// until then: the lease stays held, and the row names the holder. A
// fenced transaction of the name (see Fence) neither waits for the
// staged release nor is overtaken by it: the release's commit waits for
// it (see "Staged handovers" in the package documentation).
//
// The grant's times (acquired_at, the expiry) are Stage's: a Commit later
// than half of hold after Stage rolls the staged release back and
// releases as an unstaged Commit does.
//
// A handover is not staged, and Stage does nothing (Commit releases as
// before), when its successor did not wait, when the store does not have
// the lease under one of its heartbeats (whose TTL the grant takes), when
// the lease row is locked by a fenced transaction (stageLockWait), when a
// fenced transaction holds the name's staged lock, when the release
// grants nothing (the lease lost, the strategy row or a failover's grace
// refusing), or when the schema's fence function is one from before
// staged releases (run Migrate). Its statements are bounded on the
// server by ctx's deadline (statement_timeout; stageTimeout without one).
// If they fail, the transaction is rolled back and the handover stays
// prepared, not staged; if the rollback fails too, the connection is
// closed, which frees the lock on which the successor waits (Commit then
// fails, and the Elector releases with ReleaseTo).
func (p *preparedHandover) Stage(ctx context.Context, reason leader.GrantReason, hold time.Duration) error {
	if err := checkHandover(p.name, p.term, p.successor, reason, hold); err != nil {
		return err
	}
	if ctx.Err() != nil {
		return nil // the caller gave up: nothing staged
	}
	s := p.s
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.conn == nil || p.staged {
		return fmt.Errorf("postgres: stage the release of %q term %d to %s: the prepared handover was staged, committed or aborted already", p.name, p.term, p.successor.ID)
	}
	if !p.waited {
		return p.notStaged("the successor did not wait")
	}
	ttl, ok := s.heldTTL(p.name, p.token, int64(p.term))
	if !ok {
		return p.notStaged("the store did not grant or renew the lease, and knows not its TTL")
	}
	statementTimeout := stageTimeout
	if dl, ok := ctx.Deadline(); ok {
		statementTimeout = time.Until(dl)
	}
	if statementTimeout < time.Millisecond {
		return p.notStaged("no time left")
	}
	// The preparation's connection holds no lease: closing it when ctx
	// ends frees only the handover's lock, and rolls the release back.
	ctx, cancel := context.WithTimeout(ctx, statementTimeout+time.Second)
	defer cancel()
	what := fmt.Sprintf("stage the release of %q term %d to %s", p.name, p.term, p.successor.ID)
	conn := p.conn.Conn()
	if conn.Config().DefaultQueryExecMode == pgx.QueryExecModeCacheStatement {
		if _, err := conn.Prepare(ctx, handoverStagedUnlockStmt, stagedUnlockLease); err != nil {
			return wrapError(ctx, what, err)
		}
	}
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	b.Queue(stageSettings, strconv.FormatInt(stageLockWait.Milliseconds(), 10), strconv.FormatInt(max(statementTimeout.Milliseconds(), 1), 10))
	b.Queue(s.sql.releaseGranting, p.name, p.token, int64(p.term), p.successor.Token, p.successor.ID, string(reason),
		int32(p.successor.Priority), interval(ttl))
	b.Queue(stageLocksLease, int32(handoverClass), p.key, s.opts.stagedKey(p.name), strconv.FormatInt(max(hold.Milliseconds(), 1), 10),
		stagedFenceSignature(s.opts))
	br := conn.SendBatch(ctx, b)
	_, errBegin := br.Exec()
	_, errSettings := br.Exec()
	var (
		granted, durable int64
		locked, waits    bool
		ignored          [5]any
	)
	errRelease := br.QueryRow().Scan(&granted, &durable)
	errLocks := br.QueryRow().Scan(&ignored[0], &ignored[1], &ignored[2], &ignored[3], &ignored[4], &locked, &waits)
	err := errors.Join(errBegin, errSettings, errRelease, errLocks, br.Close())
	if err == nil && granted == 1 && locked && waits {
		p.stagedRelease = stagedRelease{true, reason, hold, time.Now()}
		return nil
	}
	if _, errRollback := conn.Exec(ctx, "ROLLBACK"); errRollback != nil {
		c := p.conn
		p.conn = nil
		s.preps.remove(p)
		closeHijacked(c)
		return wrapError(ctx, what, errors.Join(err, errRollback))
	}
	if err != nil && !isLockTimeout(err) {
		return wrapError(ctx, what, err)
	}
	switch {
	case err != nil:
		return p.notStaged("a fenced transaction locks the lease row")
	case granted != 1:
		return p.notStaged("the release granted nothing (the lease lost, or the strategy row or a failover's grace refused)")
	case locked && !waits:
		return p.notStaged("the successor no longer waits for the handover (its wait ran out)")
	default:
		return p.notStaged("a fenced transaction holds the name's staged lock, or the schema's fence function is older than staged releases (run Migrate)")
	}
}

// notStaged logs why p's release was not staged, and returns nil: Commit
// releases as if Stage had not been called.
func (p *preparedHandover) notStaged(why string) error {
	p.s.opts.Logger.Debug("a prepared handover's release is not staged; it is made at the commit",
		slog.String("name", p.name), slog.String("why", why))
	return nil
}

// heldTTL returns the TTL of the lease of name held by token under term:
// its heartbeat's, if the store has it under one, else that of its last
// grant or renewal here.
func (s *LeaseStore) heldTTL(name, token string, term int64) (time.Duration, bool) {
	if ttl, ok := s.beats.ttlOf(name, token, term); ok {
		return ttl, true
	}
	return s.renewals.ttlOf(name, token, term)
}

// handoverUnlock frees a prepared handover's lock: $1 handoverClass, $2
// the name's key.
const handoverUnlock = `SELECT pg_advisory_unlock($1, $2)`

// The names of Commit's statements, prepared on the preparation's
// connection (pgx keeps them with the connection, so that a connection
// prepares each once).
const (
	handoverReleaseStmt      = "leader_handover_release"
	handoverReleaseQuietStmt = "leader_handover_release_quiet"
	handoverUnlockStmt       = "leader_handover_unlock"
	handoverSleepStmt        = "leader_handover_sleep"
	handoverNoticeStmt       = "leader_handover_notice"
	handoverDropStmt         = "leader_handover_drop"
	// waitedAcquireStmt is the grant statement (statements.grantReleased)
	// of a successor that waits for a prepared handover
	// (acquireWaiting), prepared on the connection of its wait.
	waitedAcquireStmt = "leader_waited_acquire"
	// waitedClaimStmt is the claim of a staged grant
	// (statements.claimStaged) of a successor that waits for a prepared
	// handover, prepared on the connection of its wait.
	waitedClaimStmt = "leader_waited_claim"
)

// handoverWarmUp has the server plan Commit's statements on a
// preparation's connection, under force_generic_plan, without running
// them: the plans are kept with the prepared statements. The connection
// keeps the setting; the store's waits connections run the store's
// statements alone (and whatever hooks the caller's pool configuration
// gave them), for which generic plans are the right ones. Its arguments
// are placeholders; a generic plan does not depend on them. It runs
// outside a transaction, so that the planning's locks on the tables are
// let go at once.
const handoverWarmUp = `SET plan_cache_mode = force_generic_plan;
EXPLAIN (COSTS OFF) EXECUTE ` + handoverReleaseStmt + `(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);
EXPLAIN (COSTS OFF) EXECUTE ` + handoverReleaseQuietStmt + `(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);
EXPLAIN (COSTS OFF) EXECUTE ` + handoverUnlockStmt + `(NULL, NULL);
EXPLAIN (COSTS OFF) EXECUTE ` + handoverStagedUnlockStmt + `(NULL, NULL, NULL, NULL)`

// waitedAcquireWarmUp has the server plan waitedAcquireStmt, under
// force_generic_plan (which the connection keeps, as for
// handoverWarmUp), without running it: the plan is kept with the
// prepared statement, so that the statement, run once the handover
// comes, neither plans nor reads the catalog for it. Its arguments are
// placeholders; a generic plan does not depend on them.
const waitedAcquireWarmUp = `SET plan_cache_mode = force_generic_plan;
EXPLAIN (COSTS OFF) EXECUTE ` + waitedAcquireStmt + `(NULL, NULL, NULL, NULL, NULL, NULL);
EXPLAIN (COSTS OFF) EXECUTE ` + waitedClaimStmt + `(NULL, NULL, NULL)`

// warmWaitedAcquire prepares waitedAcquireStmt on conn and has the
// server plan it (waitedAcquireWarmUp), in a round trip before the
// waiting transaction, so that the planning's locks on the tables are
// not held while the successor waits (DDL would queue behind them, and
// everything else behind the DDL). It reports whether the statement is
// ready. It is not under the simple protocol, which runs no prepared
// statement, or when a statement failed: the wait then runs the
// statement's text, planned after the release, as before.
func (s *LeaseStore) warmWaitedAcquire(ctx context.Context, conn *pgx.Conn) bool {
	if conn.Config().DefaultQueryExecMode == pgx.QueryExecModeSimpleProtocol {
		return false
	}
	_, err := conn.Prepare(ctx, waitedAcquireStmt, s.sql.grantReleased)
	if err == nil {
		_, err = conn.Prepare(ctx, waitedClaimStmt, s.sql.claimStaged)
	}
	if err == nil {
		_, err = conn.Exec(ctx, waitedAcquireWarmUp, pgx.QueryExecModeSimpleProtocol)
	}
	if err != nil {
		s.opts.Logger.Debug("planning a successor's statement before its wait failed; it is planned after the release",
			slog.Any("error", err))
		return false
	}
	return true
}

// handoverNoticeDelay is how long after a prepared handover's unlock its
// Commit sends the release's NOTIFY, if the lease is still free then,
// when the successor waited for it: the successor, granted by then in
// most handovers, does not need it, and the notification wakes every
// listener's backend and process, which would otherwise compete for the
// CPU with the successor's grant.
const handoverNoticeDelay = 5 * time.Millisecond

var _ leader.HandoverPreparer = (*LeaseStore)(nil)

// PrepareHandover implements leader.HandoverPreparer. On a connection of
// its own, which it keeps until Commit or Abort, it takes the advisory
// lock of name's prepared handovers (a session lock; see "Prepared
// handovers" in the package documentation) and sends a NOTIFY that names
// the successor's token. The successor's store, told by its listener,
// makes the successor's next Acquire wait for that lock in the
// transaction of its statement. PrepareHandover then looks in pg_locks
// every millisecond until the successor waits, or wait has passed.
//
// It prepares nothing and returns an error if the connection is not a
// session of its own (a transaction-pooling proxy, see ErrPooledSession),
// if another preparation of the name holds the lock, if the name and
// token are too long for a NOTIFY payload, or if every connection for
// prepared handovers (Options.MaxConns) stays in use for wait or 100 ms,
// whichever is longer, or if opening one takes over a second. The lease
// is not touched: it stays held, and can be renewed.
func (s *LeaseStore) PrepareHandover(ctx context.Context, name, token string, term uint64, successor leader.Candidate, wait time.Duration) (leader.PreparedHandover, error) {
	ctx, cancel := s.opts.bound(ctx)
	defer cancel()
	what, payload, err := prepareNotice(name, term, successor)
	if err != nil {
		return nil, err
	}
	if s.pooled.Load() {
		return nil, fmt.Errorf("postgres: %s: %w: a prepared handover needs one", what, ErrPooledSession)
	}
	// A connection of the store's waits. When every one of them is in
	// use or being opened (other names' preparations, successors'
	// waits, deferred notices), it waits for one a little only, and the Elector hands over
	// unprepared. Otherwise it waits for a new one's opening, up to
	// prepareConnWait: the lease is still held meanwhile, and an
	// unprepared handover's gap is the longer one.
	connWait := max(wait, waitsConnWait)
	if s.waitsRoom() {
		connWait = max(wait, prepareConnWait)
	}
	actx, cancelAcquire := context.WithTimeout(ctx, connWait)
	conn, err := s.waits.Acquire(actx)
	cancelAcquire()
	if err != nil {
		return nil, wrapError(ctx, what, err)
	}
	p := &preparedHandover{s: s, name: name, token: token, term: term, successor: successor, key: s.handoverKey(name), conn: conn}
	// The lock is taken only where the statement runs in the backend
	// that the connection started with: behind a transaction-pooling
	// proxy it would stay with a server connection that others use.
	var locked bool
	err = conn.QueryRow(ctx, `SELECT pg_try_advisory_lock($1, $2) FROM (SELECT) AS x WHERE pg_backend_pid()::bigint = $3::bigint`,
		int32(handoverClass), p.key, int64(conn.Conn().PgConn().PID())).Scan(&locked)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		p.release() // it took no lock
		s.pooled.Store(true)
		return nil, fmt.Errorf("postgres: %s: %w: a prepared handover needs one", what, ErrPooledSession)
	case err != nil:
		p.drop() // whether the lock was taken is unknown
		return nil, wrapError(ctx, what, err)
	case !locked:
		p.release()
		return nil, fmt.Errorf("postgres: %s: another handover of the name is being prepared", what)
	}
	// Commit's statements are prepared now, so that the commit is one
	// round trip in which the server neither parses nor plans.
	for _, st := range []struct{ name, sql string }{
		{handoverReleaseStmt, s.sql.release},
		{handoverReleaseQuietStmt, s.sql.releaseQuiet},
		{handoverUnlockStmt, handoverUnlock},
		{handoverSleepStmt, `SELECT pg_sleep($1)`},
		{handoverNoticeStmt, s.sql.freedNotice},
		{handoverDropStmt, s.sql.dropHolder},
		{handoverStagedUnlockStmt, stagedUnlockLease},
	} {
		if _, err = conn.Conn().Prepare(ctx, st.name, st.sql); err != nil {
			break
		}
	}
	if err == nil {
		_, err = conn.Exec(ctx, `SELECT pg_notify($1, $2)`, s.opts.Channel, payload)
	}
	if err != nil {
		p.Abort()
		return nil, wrapError(ctx, what, err)
	}
	// While the successor wakes, the server plans the commit's
	// statements (see handoverWarmUp), so that the commit neither plans
	// nor reads the catalog for them; best effort.
	if _, err := conn.Exec(ctx, handoverWarmUp, pgx.QueryExecModeSimpleProtocol); err != nil {
		if ctx.Err() != nil {
			p.Abort()
			return nil, wrapError(ctx, what, err)
		}
		s.opts.Logger.Debug("planning a handover's commit before it failed; it is planned at the commit",
			slog.String("name", name), slog.Any("error", err))
	}
	p.waited, err = p.awaitSuccessor(ctx, wait)
	if err != nil {
		p.Abort()
		return nil, wrapError(ctx, what, err)
	}
	// Recorded only now, so that Close never uses the connection at the
	// same time as the statements above (it waits for it instead).
	if !s.preps.add(p) {
		p.Abort()
		return nil, fmt.Errorf("postgres: %s: %w", what, ErrClosed)
	}
	return p, nil
}

// prepareNotice returns, for a preparation of the handover of name's
// lease under term to successor, what its errors say it was and the
// payload of its NOTIFY (see parsePayload), or an error if the successor
// has no token or the payload is too long.
func prepareNotice(name string, term uint64, successor leader.Candidate) (what, payload string, err error) {
	what = fmt.Sprintf("prepare handover of %q term %d to %s", name, term, successor.ID)
	payload = payloadPrepare + strconv.Itoa(len(successor.Token)) + ":" + successor.Token + name
	switch {
	case successor.Token == "":
		return what, "", fmt.Errorf("postgres: %s: the successor has no token", what)
	case len(payload) > maxPayloadLength:
		return what, "", fmt.Errorf("postgres: %s: the name and the successor's token are too long for a NOTIFY payload (%d bytes, at most %d)", what, len(payload), maxPayloadLength)
	}
	return what, payload, nil
}

// awaitSuccessor looks in pg_locks every preparePoll until a session
// waits for p's lock, or wait has passed, and reports whether one did.
func (p *preparedHandover) awaitSuccessor(ctx context.Context, wait time.Duration) (bool, error) {
	waiting, _, err := awaitHandoverWaiter(ctx, p.conn, p.key, wait)
	return waiting, err
}

// awaitHandoverWaiter looks in pg_locks, on q, every preparePoll until a
// session waits for the lock of prepared handovers of key, or wait has
// passed, and reports whether one did, and the backend PID of the one
// session that waits (0 if more than one do).
func awaitHandoverWaiter(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, key int32, wait time.Duration) (waiting bool, pid int32, err error) {
	until := time.Now().Add(wait)
	for {
		var (
			n   int64
			one *int32
		)
		err := q.QueryRow(ctx, `SELECT count(*), CASE WHEN count(*) = 1 THEN min(l.pid) END FROM pg_locks AS l
	WHERE `+handoverWaiters("l", "$1", "$2"),
			int64(handoverClass), int64(uint32(key))).Scan(&n, &one)
		left := time.Until(until)
		if err != nil || n > 0 || left <= 0 {
			if one != nil {
				pid = *one
			}
			return n > 0, pid, err
		}
		t := time.NewTimer(min(preparePoll, left))
		select {
		case <-ctx.Done():
			t.Stop()
			return false, 0, ctx.Err()
		case <-t.C:
		}
	}
}

// waitsRoom reports whether a connection of the store's waits can be had
// without waiting for another caller to let go of one: one is idle, or
// fewer than MaxConns are open or being opened. Another caller may take
// it first; the caller's wait is bounded all the same.
func (s *LeaseStore) waitsRoom() bool {
	st := s.waits.Stat()
	return st.IdleConns() > 0 || st.TotalConns() < st.MaxConns()
}

// take returns p's connection and marks p ended, or nil if it was.
func (p *preparedHandover) take() *pgxpool.Conn {
	p.mu.Lock()
	c := p.conn
	p.conn = nil
	p.mu.Unlock()
	if c != nil {
		p.s.preps.remove(p)
	}
	return c
}

// preparations are a store's prepared handovers not yet ended, which
// Close aborts: each holds one of the store's connections, and the pool
// waits for it to close.
type preparations struct {
	mu     sync.Mutex
	open   map[*preparedHandover]struct{}
	closed bool
}

// add records p, unless the store is closed.
func (ps *preparations) add(p *preparedHandover) bool {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.closed {
		return false
	}
	if ps.open == nil {
		ps.open = make(map[*preparedHandover]struct{})
	}
	ps.open[p] = struct{}{}
	return true
}

func (ps *preparations) remove(p *preparedHandover) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	delete(ps.open, p)
}

// close ends every open preparation by closing its connection, and
// refuses new ones.
func (ps *preparations) close() {
	ps.mu.Lock()
	ps.closed = true
	open := make([]*preparedHandover, 0, len(ps.open))
	for p := range ps.open {
		open = append(open, p)
	}
	ps.mu.Unlock()
	for _, p := range open {
		p.drop() // closing the session frees its lock, whatever the server's state
	}
}

// release returns p's connection, which holds no lock, to the pool.
func (p *preparedHandover) release() {
	if c := p.take(); c != nil {
		c.Release()
	}
}

// drop closes p's connection, whose session may hold the lock: closing
// the session frees it.
func (p *preparedHandover) drop() {
	if c := p.take(); c != nil {
		closeHijacked(c)
	}
}

// closeHijacked takes c out of its pool and closes it.
func closeHijacked(c *pgxpool.Conn) {
	conn := c.Hijack()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = conn.Close(ctx)
}

// Commit implements leader.PreparedHandover: on the preparation's
// connection, in one round trip, the release of ReleaseTo and then, in a
// transaction of its own, the lock's unlock, so that the successor's
// waiting statement, which takes its snapshot once it has the lock, finds
// the lease released and reserved for it. When the successor waited, the
// release's NOTIFY is left out of its statement, and sent by two more in
// the same round trip, handoverNoticeDelay later, if the lease is still
// free; the removal of the holder's own entry among the candidates is
// left out too, and made by a last statement (dropReleasedHolder): then
// Commit returns after that delay. If the statements fail, the connection
// is closed, which frees the lock.
func (p *preparedHandover) Commit(ctx context.Context, reason leader.GrantReason, hold time.Duration) error {
	s := p.s
	if err := checkHandover(p.name, p.term, p.successor, reason, hold); err != nil {
		p.Abort()
		return err
	}
	p.mu.Lock()
	staged, stale, mismatch := p.staged, p.stale(), p.mismatch(p.name, p.term, p.successor, reason, hold)
	p.mu.Unlock()
	if mismatch != nil {
		p.Abort()
		return mismatch
	}
	conn := p.take()
	if conn == nil {
		return fmt.Errorf("postgres: release %q term %d to %s: the prepared handover was committed or aborted already", p.name, p.term, p.successor.ID)
	}
	ctx, cancel := s.opts.bound(ctx)
	defer cancel()
	const op = "release"
	if staged && stale {
		// Committed now, the staged grant would have less than half of
		// the hold behind it: release as if unstaged instead.
		if _, err := conn.Exec(ctx, "ROLLBACK"); err != nil {
			closeHijacked(conn)
			return wrapError(ctx, fmt.Sprintf("%s %q term %d to %s: rolling back its staged release", op, p.name, p.term, p.successor.ID), err)
		}
		staged = false
	}
	if staged {
		// Forgotten by the heartbeat only once committed: a heartbeat
		// round's reconciliation would take the lease out from under it,
		// and wait for the staged release's row lock meanwhile.
		err := p.commitStaged(ctx, conn)
		if err == nil {
			s.stagedCommits.Add(1)
		}
		s.renewals.ended(p.name, p.token, int64(p.term))
		s.beats.forget(p.name, p.token)
		return err
	}
	s.renewals.ended(p.name, p.token, int64(p.term))
	s.beats.forget(p.name, p.token)
	args := [][]byte{[]byte(p.name), []byte(p.token), strconv.AppendUint(nil, p.term, 10), []byte(s.opts.Channel),
		[]byte(p.successor.Token), []byte(p.successor.ID), []byte(reason),
		fmt.Appendf(nil, "%d microseconds", interval(hold)/time.Microsecond)}
	// With the successor waiting, the release's NOTIFY is sent later,
	// and only if the lease is still free (see handoverNoticeDelay).
	quiet := p.waited
	pl := conn.Conn().PgConn().StartPipeline(ctx)
	if quiet {
		pl.SendQueryPrepared(handoverReleaseQuietStmt, args, nil, nil)
	} else {
		pl.SendQueryPrepared(handoverReleaseStmt, args, nil, nil)
	}
	pl.SendPipelineSync()
	pl.SendQueryPrepared(handoverUnlockStmt, [][]byte{strconv.AppendInt(nil, handoverClass, 10), strconv.AppendInt(nil, int64(p.key), 10)}, nil, nil)
	pl.SendPipelineSync()
	if quiet {
		pl.SendQueryPrepared(handoverSleepStmt, [][]byte{[]byte(strconv.FormatFloat(s.noticeDelay.Seconds(), 'f', -1, 64))}, nil, nil)
		pl.SendPipelineSync()
		pl.SendQueryPrepared(handoverNoticeStmt, [][]byte{[]byte(p.name), []byte(s.opts.Channel)}, nil, nil)
		pl.SendPipelineSync()
		pl.SendQueryPrepared(handoverDropStmt, [][]byte{[]byte(p.name), []byte(p.token)}, nil, nil)
		pl.SendPipelineSync()
	}
	// The release and the unlock decide the outcome; the deferred
	// notice's failure only costs the wake-ups it would have sent, and the
	// removal's leaves the holder's entry among the candidates, with its
	// place in the queue (see firstCandidate), until it runs out.
	var first, second [][]byte
	err := pl.Flush()
	if err == nil {
		var err1, err2 error
		first, err1 = pipelineRow(pl)
		second, err2 = pipelineRow(pl)
		err = errors.Join(err1, err2)
	}
	var errNotice error
	if err == nil && quiet {
		_, err3 := pipelineRow(pl)
		_, err4 := pipelineRow(pl)
		_, err5 := pipelineRow(pl)
		errNotice = errors.Join(err3, err4, err5)
	}
	err = errors.Join(err, pl.Close())
	if err == nil && (len(first) < 1 || len(second) < 1) {
		err = errors.New("a statement returned no value")
	}
	if err != nil && (first == nil || second == nil) {
		closeHijacked(conn)
		return wrapError(ctx, fmt.Sprintf("%s %q term %d to %s", op, p.name, p.term, p.successor.ID), err)
	}
	if err != nil || errNotice != nil {
		// The release and the unlock were answered; what failed after
		// them leaves the connection in doubt.
		s.opts.Logger.Debug("the deferred notice of a prepared handover, or the removal of the holder's entry among the candidates after it, failed; the connection is closed",
			slog.String("name", p.name), slog.Any("error", errors.Join(err, errNotice)))
		closeHijacked(conn)
	} else if string(second[0]) != "t" {
		// Not this session's lock any more (unlocked by hand?): close the
		// session to be sure that it holds nothing.
		closeHijacked(conn)
	} else {
		conn.Release()
	}
	if string(first[0]) == "0" {
		return fmt.Errorf("postgres: %s %q term %d to %s: %w", op, p.name, p.term, p.successor.ID, leader.ErrLeaseLost)
	}
	return nil
}

// commitStaged commits the release that Stage ran in conn's open
// transaction, in one round trip: it takes the name's fence lock,
// waiting for the fenced transactions that judged the row while the
// release was staged, unlocks the session's hold of the handover's lock
// (stagedUnlockLease; the transaction's own hold keeps it until the
// COMMIT, which frees it once the grant is visible), commits, and then,
// handoverNoticeDelay later, removes the holder's own entry among the
// candidates (dropReleasedHolder). The grant's notice is the successor's
// to send, as for any grant. If the statements fail before the COMMIT's
// answer, the connection is closed, which rolls the release back and frees
// the lock: the lease is then still the holder's, and Commit returns the
// error (not ErrLeaseLost), so that the Elector releases with ReleaseTo.
func (p *preparedHandover) commitStaged(ctx context.Context, conn *pgxpool.Conn) error {
	s := p.s
	what := fmt.Sprintf("release %q term %d to %s", p.name, p.term, p.successor.ID)
	args := [][]byte{strconv.AppendInt(nil, handoverClass, 10), strconv.AppendInt(nil, int64(p.key), 10),
		strconv.AppendInt(nil, s.opts.fenceKey(p.name), 10), []byte(commitWait(ctx))}
	prepared := conn.Conn().Config().DefaultQueryExecMode == pgx.QueryExecModeCacheStatement
	pl := conn.Conn().PgConn().StartPipeline(ctx)
	if prepared {
		pl.SendQueryPrepared(handoverStagedUnlockStmt, args, nil, nil)
	} else {
		pl.SendQueryParams(stagedUnlockLease, args, nil, nil, nil)
	}
	pl.SendPipelineSync()
	pl.SendQueryParams("COMMIT", nil, nil, nil, nil)
	pl.SendPipelineSync()
	pl.SendQueryPrepared(handoverSleepStmt, [][]byte{[]byte(strconv.FormatFloat(s.noticeDelay.Seconds(), 'f', -1, 64))}, nil, nil)
	pl.SendPipelineSync()
	pl.SendQueryPrepared(handoverDropStmt, [][]byte{[]byte(p.name), []byte(p.token)}, nil, nil)
	pl.SendPipelineSync()
	var (
		first [][]byte
		tag   pgconn.CommandTag
	)
	err := pl.Flush()
	if err == nil {
		var err1, err2 error
		first, err1 = pipelineRow(pl)
		tag, err2 = pipelineTag(pl)
		err = errors.Join(err1, err2)
	}
	if err == nil && tag.String() != "COMMIT" {
		err = fmt.Errorf("the staged release's transaction ended with %q, not COMMIT", tag.String())
	}
	if err != nil {
		closeHijacked(conn) // pl with it
		return wrapError(ctx, what, err)
	}
	_, err3 := pipelineRow(pl)
	_, err4 := pipelineRow(pl)
	if err := errors.Join(err3, err4, pl.Close()); err != nil || len(first) < 1 || string(first[0]) != "t" {
		// Committed; what failed after, or a hold of the lock that was
		// not there, leaves the connection in doubt.
		s.opts.Logger.Debug("after a staged handover's commit, the removal of the holder's entry among the candidates failed, or the session did not hold the handover's lock; the connection is closed",
			slog.String("name", p.name), slog.Any("error", err))
		closeHijacked(conn)
		return nil
	}
	conn.Release()
	return nil
}

// Abort implements leader.PreparedHandover: it rolls back a staged
// release, and unlocks the lock on which the successor waits, or closes
// the connection (which does both) if that fails.
func (p *preparedHandover) Abort() {
	conn := p.take()
	if conn == nil {
		return
	}
	ctx, cancel := p.s.opts.bound(context.Background())
	defer cancel()
	p.mu.Lock()
	staged := p.staged
	p.mu.Unlock()
	if staged {
		if _, err := conn.Exec(ctx, "ROLLBACK"); err != nil {
			closeHijacked(conn)
			return
		}
	}
	var unlocked bool
	if err := conn.QueryRow(ctx, handoverUnlock, int32(handoverClass), p.key).Scan(&unlocked); err != nil || !unlocked {
		closeHijacked(conn)
		return
	}
	conn.Release()
}

// acquireWaiting is Acquire's statement for a successor whose handover
// was prepared (see PrepareHandover), sent as one batch on one
// connection: in a transaction, it waits for the handover's lock (shared,
// so that it never holds up the preparer's unlock), for wait at most
// (lock_timeout), and then runs the statement of a released lease's grant
// (statements.grantReleased), whose snapshot, taken then, shows the
// release. dest receives its row, which is acquire's. It reports whether
// the statement granted the lease: false if the lock was not had in time,
// or the lease was not found released and free for c (the caller then
// tries as usual), or err; and whether the statement ran, granted or not.
func (s *LeaseStore) acquireWaiting(ctx context.Context, name string, c leader.Candidate, ttl, wait time.Duration, dest []any) (granted, ran bool, err error) {
	// A connection of the store's waits: when every one of them waits
	// already, this Acquire is an ordinary one unless one comes soon;
	// otherwise it may take a new one's opening.
	connWait := min(wait, waitsConnWait)
	if s.waitsRoom() {
		connWait = wait
	}
	actx, cancel := context.WithTimeout(ctx, connWait)
	conn, err := s.waits.Acquire(actx)
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return false, false, err
		}
		return false, false, nil
	}
	defer conn.Release()
	claim, grant := s.sql.claimStaged, s.sql.grantReleased
	if s.warmWaitedAcquire(ctx, conn.Conn()) {
		claim, grant = waitedClaimStmt, waitedAcquireStmt
	} else if ctx.Err() != nil {
		return false, false, ctx.Err()
	}
	ran, errRow, err := waitThenRun(ctx, conn.Conn(), s.handoverKey(name), wait, nil, claim,
		[]any{name, c.Token, interval(ttl)}, func(row pgx.Row) error { return row.Scan(dest...) })
	switch {
	case err != nil && !ran && ctx.Err() == nil && !errors.Is(err, errWaitBatch):
		// The ROLLBACK after a wait that ran out failed: the pool closes
		// the connection; try as usual.
		return false, false, nil
	case err != nil:
		return false, false, err
	case !ran:
		return false, false, nil // the lock was not had in time
	case errors.Is(errRow, pgx.ErrNoRows):
		// No staged release granted c the lease (see
		// preparedHandover.Stage): the grant of a released lease, in a
		// statement whose snapshot shows the release.
		err := conn.QueryRow(ctx, grant, name, c.Token, c.ID, interval(ttl), s.opts.Channel, int32(c.Priority)).Scan(dest...)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			return false, true, nil // not free for c: try as usual
		case err != nil:
			return false, false, err
		}
		return true, true, nil
	case errRow != nil:
		return false, false, errRow
	}
	s.stagedClaims.Add(1)
	return true, true, nil
}

// batchStatement is a statement and its arguments, queued in a batch.
type batchStatement struct {
	sql  string
	args []any
}

// errWaitBatch marks waitThenRun's errors of the batch itself, as
// opposed to those of the ROLLBACK after a wait that ran out.
var errWaitBatch = errors.New("waiting for a prepared handover")

// waitThenRun sends, as one batch on conn, the transaction of a successor
// whose handover was prepared (see LeaseStore.PrepareHandover and
// AdvisoryStore.PrepareHandover): it waits for the lock of the prepared
// handovers of key, in shared mode (so that it never holds up the
// preparer's unlock), for wait at most (lock_timeout), and then runs stmt
// with args, whose row read reads. The transaction is read committed
// whatever the role's default, so that stmt's snapshot is taken after the
// lock, and shows the release; before stmt, it runs each of before, each a
// statement with a snapshot of its own. While it waits, the server looks
// every waitCheckEvery whether this client is still there (PostgreSQL 14
// and later), so that a successor that died meanwhile is not granted the
// lease; each of before waits for locks for beforeLockWait at most, and
// stmt itself waits for row locks as usual.
//
// ran reports whether the lock was had in time, and stmt ran; errRow is
// read's error then (an error of one of before is an error of the batch).
// If the wait ran out (lock_not_available, or a
// statement_timeout of the role's that came first), or a lock wait of one
// of before did, nothing after it ran and the transaction is rolled back:
// ran is false, and err is the ROLLBACK's error, if any (a session lock
// that one of before was granted as its wait ran out outlives the
// rollback: the caller checks, see AdvisoryStore.unlockIfHeld). Any other
// error of the batch wraps errWaitBatch.
func waitThenRun(ctx context.Context, conn *pgx.Conn, key int32, wait time.Duration, before []batchStatement, stmt string, args []any, read func(pgx.Row) error) (ran bool, errRow, err error) {
	b := &pgx.Batch{}
	b.Queue("BEGIN ISOLATION LEVEL READ COMMITTED")
	b.Queue(`SELECT set_config('lock_timeout', $1, true),
	CASE WHEN current_setting('server_version_num')::int >= 140000
		THEN set_config('client_connection_check_interval', $2, true) END,
	pg_advisory_xact_lock_shared($3, $4)`,
		strconv.FormatInt(max(wait.Milliseconds(), 1), 10)+"ms", strconv.FormatInt(waitCheckEvery.Milliseconds(), 10),
		int32(handoverClass), key)
	// The statements between the lock's and stmt: lock_timeout set for
	// before, before, and lock_timeout reset.
	between := 1
	if len(before) > 0 {
		b.Queue(`SELECT set_config('lock_timeout', $1, true)`, strconv.FormatInt(beforeLockWait.Milliseconds(), 10)+"ms")
		for _, st := range before {
			b.Queue(st.sql, st.args...)
		}
		between += 1 + len(before)
	}
	b.Queue(`SELECT set_config('lock_timeout', '0', true)`)
	b.Queue(stmt, args...)
	b.Queue("COMMIT")
	br := conn.SendBatch(ctx, b)
	_, errBegin := br.Exec()
	_, errLock := br.Exec()
	var errBefore error // the first error between the lock's and stmt
	for range between {
		if _, err := br.Exec(); err != nil && errBefore == nil {
			errBefore = err
		}
	}
	errRow = read(br.QueryRow())
	tag, errCommit := br.Exec()
	errClose := br.Close() // the first of the errors above, if any
	var pgErr *pgconn.PgError
	switch {
	case errBegin != nil:
		return false, nil, fmt.Errorf("%w: %w", errWaitBatch, errBegin)
	case errors.As(errLock, &pgErr) && (pgErr.Code == "55P03" || pgErr.Code == "57014"),
		errLock == nil && errors.As(errBefore, &pgErr) && pgErr.Code == "55P03":
		// The server skipped the rest up to the batch's end, and the
		// transaction is still open: end it, so that the connection can
		// be used again.
		_, err := conn.Exec(ctx, "ROLLBACK")
		return false, nil, err
	case errLock != nil:
		return false, nil, fmt.Errorf("%w: %w", errWaitBatch, errLock)
	case errBefore != nil:
		return false, nil, fmt.Errorf("%w: %w", errWaitBatch, errBefore)
	case errRow != nil:
		return true, errRow, nil
	case errCommit != nil:
		return true, nil, fmt.Errorf("%w: %w", errWaitBatch, errCommit)
	case errClose != nil:
		return true, nil, fmt.Errorf("%w: %w", errWaitBatch, errClose)
	case tag.String() != "COMMIT":
		return true, nil, fmt.Errorf("%w: the transaction ended with %q, not COMMIT", errWaitBatch, tag.String())
	}
	return true, nil, nil
}
