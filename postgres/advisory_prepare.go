package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
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
	s           *AdvisoryStore
	ss          *session
	name, token string
	term        uint64
	successor   leader.Candidate
	key         int32
	waited      bool  // the successor waited when PrepareHandover returned
	waiter      int32 // the backend PID of the one session that waited, if one alone did
	mu          sync.Mutex
	open        bool // neither committed nor aborted
}

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
func (p *advisoryPrepared) Commit(ctx context.Context, reason leader.GrantReason, hold time.Duration) error {
	if err := checkHandover(p.name, p.term, p.successor, reason, hold); err != nil {
		p.Abort()
		return err
	}
	if !p.end() {
		return fmt.Errorf("postgres: release %q term %d to %s: the prepared handover was committed or aborted already", p.name, p.term, p.successor.ID)
	}
	h := &reservation{to: p.successor, reason: reason, hold: hold}
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
func (p *advisoryPrepared) Abort() {
	if !p.end() {
		return
	}
	s := p.s
	ctx, cancel := s.opts.bound(context.Background())
	defer cancel()
	err := p.ss.do(ctx, s, false, func(conn *pgx.Conn) error {
		var unlocked bool
		err := conn.QueryRow(ctx, handoverUnlock, int32(handoverClass), p.key).Scan(&unlocked)
		if err == nil && !unlocked {
			err = errors.New("the session did not hold the lock")
		}
		return err
	})
	if err != nil && !errors.Is(err, errNotHeld) && !errors.Is(err, errSessionGone) {
		s.opts.Logger.Debug("aborting a prepared handover failed; its successor waits until its lock_timeout",
			slog.String("name", p.name), slog.Any("error", err))
	}
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
