package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leaderelect/leader"
)

var _ leader.HandoverPreparer = (*AdvisoryStore)(nil)

// handoverKey returns the second key of the advisory lock of name's
// prepared handovers (see LeaseStore.handoverKey), for the advisory
// table.
func (s *AdvisoryStore) handoverKey(name string) int32 {
	return handoverKeyOf(s.opts.qualifiedAdvisoryTable(), name)
}

// PrepareHandover implements leader.HandoverPreparer. On the holder's own
// session, which holds the lease's lock, it takes the lock of name's
// prepared handovers (a session lock, keys as for LeaseStore.PrepareHandover),
// and, on the store's connections, sends a NOTIFY that names the
// successor's token. The successor's store, told by its listener, makes
// the successor's next Acquire wait for that lock in a transaction (see
// grantAfterHandover). PrepareHandover then looks in pg_locks every
// millisecond until the successor waits, or wait has passed, and records
// the backend of the one session that waits.
//
// Commit is ReleaseTo, except that when one session waited, its release
// grants that session the lease (releaseGranting): the release's second
// statement unlocks the lease's lock and then the handover's, so that the
// successor's transaction, which claims the lease once it has that lock,
// finds the row naming it and the lease's lock free. Abort unlocks this
// lock alone: the successor's transaction then runs at once, claims
// nothing, and its grant statement finds the lease held.
//
// It returns an error wrapping leader.ErrLeaseLost if this store's
// session of token does not hold the lease under term, and an error
// without preparing anything if another preparation of the name holds
// the lock, or if the name and token are too long for a NOTIFY payload.
// The lease is not touched: it stays held, and can be renewed.
func (s *AdvisoryStore) PrepareHandover(ctx context.Context, name, token string, term uint64, successor leader.Candidate, wait time.Duration) (leader.PreparedHandover, error) {
	ctx, cancel := s.opts.bound(ctx)
	defer cancel()
	what, payload, err := prepareNotice(name, term, successor)
	if err != nil {
		return nil, err
	}
	ss := s.heldSession(name, token, term)
	if ss == nil {
		return nil, fmt.Errorf("postgres: %s: %w", what, leader.ErrLeaseLost)
	}
	p := &advisoryPrepared{s: s, ss: ss, name: name, token: token, term: term, successor: successor, key: s.handoverKey(name)}
	var locked bool
	err = ss.do(ctx, s, false, func(conn *pgx.Conn) error {
		if !ss.heldUnder(term) {
			return errNotHeld
		}
		return conn.QueryRow(ctx, `SELECT pg_try_advisory_lock($1, $2)`, int32(handoverClass), p.key).Scan(&locked)
	})
	switch {
	case errors.Is(err, errNotHeld) || errors.Is(err, errSessionGone) || errors.Is(err, errSessionDropped):
		return nil, fmt.Errorf("postgres: %s: %w", what, leader.ErrLeaseLost)
	case err != nil:
		// The session stays as it is: whether it took the lock is
		// unknown, and its release unlocks every lock it holds.
		return nil, wrapError(ctx, what, err)
	case !locked:
		return nil, fmt.Errorf("postgres: %s: another handover of the name is being prepared", what)
	}
	p.open = true
	if _, err := s.pool.Exec(ctx, `SELECT pg_notify($1, $2)`, s.opts.Channel, payload); err != nil {
		p.Abort()
		return nil, wrapError(ctx, what, err)
	}
	waited, pid, err := awaitHandoverWaiter(ctx, s.pool, p.key, wait)
	if err != nil {
		p.Abort()
		return nil, wrapError(ctx, what, err)
	}
	p.waited, p.waiter = waited, pid
	return p, nil
}

// advisoryPrepared is a handover that AdvisoryStore.PrepareHandover
// prepared: the holder's session holds the lock on which the successor
// waits, until Commit or Abort.
type advisoryPrepared struct {
	s             *AdvisoryStore
	ss            *session
	name, token   string
	term          uint64
	successor     leader.Candidate
	key           int32
	waited        bool  // the successor waited when PrepareHandover returned
	waiter        int32 // the backend PID of the one session that waited, if one alone did
	mu            sync.Mutex
	open          bool // neither committed nor aborted
	stagedRelease      // guarded by mu
	// abandoned: see abandon.
	abandoned atomic.Bool
}

var _ leader.HandoverStager = (*advisoryPrepared)(nil)

// Timing of staged releases.
const (
	// stageLockWait is the lock_timeout of a staged release's statement:
	// a fenced transaction that holds the lease row FOR SHARE (it began
	// before the staging) is not waited for; the release is then
	// committed unstaged, after OnDemoted.
	stageLockWait = 10 * time.Millisecond
	// stageTimeout is the statement_timeout of a staged release's
	// statements when Stage's context has no deadline.
	stageTimeout = time.Second
)

// stageSettings is the first statement of a staged release's
// transaction (see Stage): $1 its lock_timeout, $2 its statement_timeout.
const stageSettings = `SELECT set_config('lock_timeout', $1, true), set_config('statement_timeout', $2, true)`

// stageLocks is the third statement of a staged release (see Stage), in
// its transaction, after the release: $1 the lease's key, $2 and $3 the
// handover lock's two int4 keys, $4 the name's staged key, $5 the fence
// function's signature (see stagedFenceSQL). It takes the
// lease's lock and the handover's again at transaction level, at once (the
// session holds them already), so that Commit's unlocks of the session's
// holds (stagedUnlock) free neither before its COMMIT; and it tries the
// name's staged lock, which a fenced transaction that began before holds
// in shared mode (see stagedKeyPrefix), and checks that the fence
// function orders itself against staged releases: it returns whether both
// hold, and if not, Stage rolls back. As idle_session_timeout, which ends a
// holder whose client went, counts only outside a transaction, it sets
// idle_in_transaction_session_timeout to the same for this one (and lifts
// PostgreSQL 17's transaction_timeout, which a role may set: it would end
// the session, and the lease, before OnDemoted has run); and it lifts the
// transaction's lock_timeout and statement_timeout, so that
// the commit waits for the fenced transactions that hold the name's fence
// lock (as long as Commit's context allows: stagedUnlock sets the
// lock_timeout, and client_connection_check_interval, PostgreSQL 14 and
// later, ends a wait whose client went).
const stageLocks = `SELECT pg_advisory_xact_lock($1::bigint), pg_advisory_xact_lock($2::int4, $3::int4),
	set_config('idle_in_transaction_session_timeout', current_setting('idle_session_timeout'), true),
	` + stagedTxnSettings + `,
	CASE WHEN current_setting('server_version_num')::int >= 170000
		THEN set_config('transaction_timeout', '0', true) END,
	pg_try_advisory_xact_lock($4::bigint) AND ` + stagedFenceSQL

// stagedUnlock is the first statement of a staged release's commit (see
// commitStagedOn): $1 the lease's key, $2 and $3 the handover lock's two
// int4 keys, $4 the name's fence key, $5 how long it may wait for it
// (lock_timeout; see commitWait). It takes the name's fence lock,
// waiting for every fenced transaction that judged the row while the
// release was staged (see stagedKeyPrefix), and then unlocks the
// session's holds of the lease's lock and the handover's, in this order
// (the transaction's own holds keep both until the COMMIT); it returns
// whether it unlocked the lease's lock, and 1.
const stagedUnlock = `WITH wait AS MATERIALIZED (
	SELECT set_config('lock_timeout', $5, true)
), fence AS MATERIALIZED (
	SELECT pg_advisory_xact_lock($4::bigint) FROM wait
), lease AS MATERIALIZED (
	SELECT pg_advisory_unlock($1::bigint) AS ok FROM fence
), handover AS MATERIALIZED (
	SELECT pg_advisory_unlock($2::int4, $3::int4) FROM lease
)
SELECT (SELECT ok FROM lease), (SELECT count(*) FROM handover)`

// Stage implements leader.HandoverStager. When the successor waited (and
// its session alone), it runs Commit's release statement
// (releaseGranting, which grants the lease to the successor's waiting
// session) on the holder's session, in a transaction that it leaves open,
// takes the lease's lock and the handover's again at transaction level
// there, and the name's staged lock (stageLocks): Commit then only takes
// the name's fence lock, unlocks the session's holds and commits, and the
// successor's statement, which waits for the handover's lock, runs as the
// COMMIT frees both. Nobody sees the release until then: the lease stays
// held, by the session and in the row. Renewals are refused meanwhile
// (errStaged), as is any other call on the session; Abort rolls the
// transaction back. A fenced transaction of the name (see Fence) neither
// waits for the staged release nor is overtaken by it: the release's
// commit waits for it (see "Staged handovers" in the package
// documentation).
//
// The release's times (the grant's acquired_at, the reservation's end)
// are Stage's: a Commit later than half of hold after Stage rolls the
// staged release back and releases as an unstaged Commit does, so that
// the reservation still has half of hold to run.
//
// A handover is not staged, and Stage does nothing (Commit releases as
// ReleaseTo does), when its successor did not wait, when the lease row
// is locked by a fenced transaction (stageLockWait), when a fenced
// transaction holds the name's staged lock, or when the schema's fence
// function is one from before staged releases (run Migrate). Its
// statements are bounded on the server by ctx's deadline
// (statement_timeout; stageTimeout without one), not by closing the
// session, which would free the lease before OnDemoted has returned; the
// session is closed only if the server has not answered a second after
// that bound. If the statements fail, the transaction is rolled
// back and the handover stays prepared, not staged; if the rollback fails
// too, the session is closed, freeing the lease. Stage returns an error
// wrapping leader.ErrLeaseLost if the session does not hold the lease
// under the term any more.
func (p *advisoryPrepared) Stage(ctx context.Context, reason leader.GrantReason, hold time.Duration) error {
	if err := checkHandover(p.name, p.term, p.successor, reason, hold); err != nil {
		return err
	}
	if ctx.Err() != nil {
		return nil // the caller gave up: nothing staged
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.open || p.staged {
		return fmt.Errorf("postgres: stage the release of %q term %d to %s: the prepared handover was staged, committed or aborted already", p.name, p.term, p.successor.ID)
	}
	if !p.waited || p.waiter == 0 {
		return p.notStaged("the successor did not wait, or more than one session did")
	}
	s := p.s
	statementTimeout := stageTimeout
	if dl, ok := ctx.Deadline(); ok {
		statementTimeout = time.Until(dl)
	}
	if statementTimeout < time.Millisecond {
		return p.notStaged("no time left")
	}
	// Not ctx itself: its end would close the session, and the lease
	// with it, before OnDemoted has run. A second past the server's
	// bound, the server is not answering, and the session is closed.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), statementTimeout+time.Second)
	defer cancel()
	what := fmt.Sprintf("stage the release of %q term %d to %s", p.name, p.term, p.successor.ID)
	var staged bool
	err := p.ss.doStaged(ctx, s, func(conn *pgx.Conn) error {
		if !p.ss.heldUnder(p.term) {
			return errNotHeld
		}
		// Commit's statements, prepared now (a round trip the first time
		// on the session), are neither parsed nor planned in the gap.
		if conn.Config().DefaultQueryExecMode == pgx.QueryExecModeCacheStatement {
			for _, sql := range []string{stagedUnlock, s.sql.unlockRest, s.sql.dropHolder} {
				if _, err := conn.Prepare(ctx, sql, sql); err != nil {
					return err
				}
			}
		}
		b := &pgx.Batch{}
		b.Queue("BEGIN")
		b.Queue(stageSettings, strconv.FormatInt(stageLockWait.Milliseconds(), 10), strconv.FormatInt(max(statementTimeout.Milliseconds(), 1), 10))
		b.Queue(s.sql.releaseGrantingStaged, p.name, p.token, int64(p.term), p.successor.Token, p.successor.ID, string(reason),
			int64(interval(hold)/time.Microsecond), p.waiter, int32(p.successor.Priority))
		b.Queue(stageLocks, p.ss.key, int32(handoverClass), p.key, s.opts.stagedKey(p.name), stagedFenceSignature(s.opts))
		br := conn.SendBatch(ctx, b)
		_, errBegin := br.Exec()
		_, errSettings := br.Exec()
		var (
			released int64
			granted  bool
			locked   bool
			ignored  [7]any
		)
		errRelease := br.QueryRow().Scan(&released, &granted)
		errLocks := br.QueryRow().Scan(&ignored[0], &ignored[1], &ignored[2], &ignored[3], &ignored[4], &ignored[5], &ignored[6], &locked)
		err := errors.Join(errBegin, errSettings, errRelease, errLocks, br.Close())
		if err == nil && released == 1 && locked {
			p.ss.staged, p.ss.stagedBy, staged = true, p, true
			return nil
		}
		if err == nil && released != 1 {
			err = errNotHeld // the row no longer names this session
		}
		if _, errRollback := conn.Exec(ctx, "ROLLBACK"); errRollback != nil {
			return errors.Join(errSessionReset, err, errRollback)
		}
		if isLockTimeout(err) {
			err = nil // a fenced transaction locks the row: not staged
		}
		if err == nil {
			p.notStaged("a fenced transaction locks the lease row, or holds the name's staged lock, or the schema's fence function is older than staged releases (run Migrate)")
		}
		return err
	})
	switch {
	case err == nil:
		if staged {
			p.stagedRelease = stagedRelease{true, reason, hold, time.Now()}
		}
		return nil
	case errors.Is(err, errNotHeld), errors.Is(err, errSessionGone), errors.Is(err, errSessionDropped):
		return fmt.Errorf("postgres: %s: %w: %w", what, leader.ErrLeaseLost, err)
	default:
		return wrapError(ctx, what, err)
	}
}

// notStaged logs why p's release was not staged, and returns nil: Commit
// releases as if Stage had not been called.
func (p *advisoryPrepared) notStaged(why string) error {
	p.s.opts.Logger.Debug("a prepared handover's release is not staged; it is made at the commit",
		slog.String("name", p.name), slog.String("why", why))
	return nil
}

// abandon records that p's Commit or Abort ended without reaching its
// session (its context ended while it waited for the session's turn), so
// that the release stays staged on the session: the session's next call
// drops it (see session.run).
func (p *advisoryPrepared) abandon() { p.abandoned.Store(true) }

// end marks p ended, and reports whether it was open.
func (p *advisoryPrepared) end() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	was := p.open
	p.open = false
	return was
}

// Commit implements leader.PreparedHandover: it is ReleaseTo, whose
// second statement also frees the lock on which the successor waits,
// after the lease's lock. When the successor waited, the release grants
// the lease to its waiting session if PrepareHandover found that session
// alone waiting (releaseGranting; otherwise it reserves it, as ReleaseTo
// does), the release's notice (which only the followers of processes
// without a lock waiter need, and which wakes every listener's backend)
// is sent handoverNoticeDelay later, and only if the lease is still free
// then, and the holder's mark is freed as late, so that neither the
// listeners nor the lock waiters compete with the successor's claim for
// the CPU; Commit then returns that much later. Its release then neither
// looks for a candidate to name nor removes the holder's own entry among
// the candidates, which it does after freeing the mark (dropHolder).
//
// A staged handover (see Stage) is committed for the reason and hold it
// was staged for: Commit with others aborts it and returns an error.
func (p *advisoryPrepared) Commit(ctx context.Context, reason leader.GrantReason, hold time.Duration) error {
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
	if !p.end() {
		return fmt.Errorf("postgres: release %q term %d to %s: the prepared handover was committed or aborted already", p.name, p.term, p.successor.ID)
	}
	if stale {
		// Committed now, the staged release would leave its reservation
		// less than half of its hold: release as if unstaged instead.
		if err := p.unstage(ctx); err != nil {
			// Not ErrLeaseLost: the Elector then releases with ReleaseTo,
			// whose call on the session drops it if it is still staged.
			return wrapError(ctx, fmt.Sprintf("release %q term %d to %s: rolling back its staged release", p.name, p.term, p.successor.ID), err)
		}
		staged = false
	}
	h := &reservation{to: p.successor, reason: reason, hold: hold, staged: staged}
	if staged {
		h.stager = p
	}
	if p.waited {
		// The release's pipeline sleeps before it frees the mark, and
		// the notice follows its reply; the release grants the lease to
		// the successor's waiting session.
		h.markAfter, h.grantTo = handoverNoticeDelay, p.waiter
	}
	return p.s.release(ctx, p.name, p.token, p.term, h, 0)
}

// Abort implements leader.PreparedHandover: it unlocks the lock on which
// the successor waits, on the holder's session. If that fails the lock
// stays with the session until its release or its end (the successor
// waits for its lock_timeout at most), rather than the session, and the
// lease with it, being closed.
//
// A staged handover's transaction is rolled back first: the row is as it
// was, and the session keeps the lease's lock (the transaction's own holds
// go with it). If the rollback fails, the session is closed, freeing the
// lease.
func (p *advisoryPrepared) Abort() {
	if !p.end() {
		return
	}
	s := p.s
	ctx, cancel := s.opts.bound(context.Background())
	defer cancel()
	p.mu.Lock()
	staged := p.staged
	p.mu.Unlock()
	do := func(fn func(conn *pgx.Conn) error) error { return p.ss.do(ctx, s, false, fn) }
	if staged {
		do = func(fn func(conn *pgx.Conn) error) error { return p.ss.doStaged(ctx, s, fn) }
	}
	reached := false
	err := do(func(conn *pgx.Conn) error {
		reached = true
		if err := p.rollBackOn(ctx, conn); err != nil {
			return err
		}
		var unlocked bool
		err := conn.QueryRow(ctx, handoverUnlock, int32(handoverClass), p.key).Scan(&unlocked)
		if err == nil && !unlocked {
			err = errors.New("the session did not hold the lock")
		}
		return err
	})
	if staged && !reached {
		p.abandon()
	}
	if err != nil && !errors.Is(err, errNotHeld) && !errors.Is(err, errSessionGone) {
		s.opts.Logger.Debug("aborting a prepared handover failed; its successor waits until its lock_timeout",
			slog.String("name", p.name), slog.Any("error", err))
	}
}

// unstage rolls back p's staged release, on the session (see rollBackOn).
func (p *advisoryPrepared) unstage(ctx context.Context) error {
	ctx, cancel := p.s.opts.bound(ctx)
	defer cancel()
	reached := false
	err := p.ss.doStaged(ctx, p.s, func(conn *pgx.Conn) error {
		reached = true
		return p.rollBackOn(ctx, conn)
	})
	if !reached {
		p.abandon()
	}
	return err
}

// rollBackOn rolls back p's release if it is staged on conn, p.ss's
// connection (the caller holds the session's turn): the row is as it was,
// and the session keeps the lease's lock and the handover's (the
// transaction's own holds go with it). If the rollback fails, it returns
// an error wrapping errSessionReset: the session is closed, freeing the
// lease.
func (p *advisoryPrepared) rollBackOn(ctx context.Context, conn *pgx.Conn) error {
	if !p.ss.staged || p.ss.stagedBy != p {
		return nil
	}
	if _, err := conn.Exec(ctx, "ROLLBACK"); err != nil {
		return errors.Join(errSessionReset, err)
	}
	p.ss.staged, p.ss.stagedBy = false, nil
	return nil
}

// grantAfterHandover is the first grant attempt of a successor whose
// handover was prepared (see PrepareHandover), sent as one batch on conn
// (see waitThenRun): it waits for the handover's lock, for a quarter of
// ttl at most and never past half of what ctx leaves, and then claims the
// lease that the holder's release granted it (releaseGranting): claimLock
// takes the lease's lock, freed before the handover's, if the row names
// this session, and claimRow, whose snapshot is taken after that, checks
// that the row still does, and takes the mark and arms the holder's
// settings. waited reports whether the lease was so granted: false if the
// lock was not had in time, or the row did not name this session (a
// holder whose release did not grant it: it reserved the lease, or its
// session ended; or another session held the lease's lock for longer than
// the claim waits for it, beforeLockWait), when the caller tries as usual,
// at once.
func (s *AdvisoryStore) grantAfterHandover(ctx context.Context, conn *pgx.Conn, ss *session, name string, c leader.Candidate, ttl time.Duration) (r grantResult, waited bool, err error) {
	wait := ttl / 4
	if d, ok := ctx.Deadline(); ok {
		// The claim may wait beforeLockWait more, for the lease's lock.
		wait = min(wait, time.Until(d)/2-beforeLockWait)
	}
	if wait < time.Millisecond {
		return r, false, nil
	}
	iv, ms, idle, every := ttlSettings(ttl)
	var (
		term       *int64
		acquiredAt *time.Time
		n          int64
	)
	ran, errRow, err := waitThenRun(ctx, conn, s.handoverKey(name), wait,
		[]batchStatement{{s.sql.claimLock, []any{name, c.Token, ss.key}}},
		s.sql.claimRow, []any{name, c.Token, ss.key, iv, ms, idle, every}, func(row pgx.Row) error {
			return row.Scan(&term, &acquiredAt, &r.marked, &r.transfer.priority, &r.transfer.reason, &n)
		})
	switch {
	case err != nil:
		return grantResult{}, false, err
	case errRow != nil:
		return grantResult{}, false, errRow
	case !ran:
		// The wait for the handover's lock, or claimLock's for the
		// lease's, ran out. A lock granted at the moment its wait ran out
		// stays granted although the statement fails (see queue), and a
		// session lock outlives the rolled-back transaction: let go of
		// the lease's lock if the session holds it (claimLock takes the
		// mark only after the lock, in a statement that then failed).
		return grantResult{}, false, s.unlockIfHeld(ctx, conn, ss.key)
	case term == nil || acquiredAt == nil:
		return grantResult{}, false, nil
	}
	r.got, r.term, r.acquiredAt, r.mine, r.epochOK = true, term, acquiredAt, true, true
	r, err = s.finishGrant(ctx, conn, ss, name, c, r, nil)
	return r, true, err
}

// unlockIfHeld lets go of the lock of key (with the unlock statement, as
// a grant that took the lock and may not keep it does, see finishGrant) if
// the session of conn holds it, asking the server which it is. If that
// fails, whether the session holds it is unknown: the error wraps
// errSessionReset, and the session is closed, which frees it.
func (s *AdvisoryStore) unlockIfHeld(ctx context.Context, conn *pgx.Conn, key int64) error {
	held, err := s.holdsLock(ctx, conn, key)
	if err != nil || !held {
		return err
	}
	var (
		unlocked bool
		n        int64
	)
	if err := conn.QueryRow(ctx, s.sql.unlock, key).Scan(&unlocked, &n); err != nil || !unlocked {
		return errors.Join(errSessionReset, err)
	}
	return nil
}
