package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/wallclock"
)

// Acquire implements leader.Store. It takes the lock for name on the
// candidate's session (opening it if needed) and bumps the term in the same
// statement; for the holder it bumps the term only. When it grants nothing
// it reports the holder and how long the holder's session would last
// without another heartbeat. A candidate that calls while another
// candidate of the same name on this store is trying waits for that
// attempt; once one that began after its call has ended with the lease
// held, or reserved for another candidate, it is refused with that
// outcome, without a grant statement of its own (see enlistJoiners). A
// successor to which this store handed the lease over (ReleaseTo) does
// not wait for the others' attempts.
//
// A lease released and reserved for another candidate (see ReleaseTo) is
// refused without trying the lock, reporting the successor and how long
// the reservation has left (Lease.Successor and Reserved).
//
// An Acquire that does not grant enlists its candidate (see
// leader.Transferer): the grant statement that refuses it does, and a
// candidate refused with another's outcome is enlisted with the others
// refused with it, by one statement.
func (s *AdvisoryStore) Acquire(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) (leader.Lease, bool, error) {
	ctx, cancel := s.opts.bound(ctx)
	defer cancel()
	const op = "acquire"
	if err := checkTTL(op, name, ttl); err != nil {
		return leader.Lease{}, false, err
	}
	if err := checkPriority(op, name, c); err != nil {
		return leader.Lease{}, false, err
	}
	if err := ctx.Err(); err != nil {
		return leader.Lease{}, false, fmt.Errorf("postgres: %s: %w", call(op, name), err)
	}
	called := time.Now()
	claimed := false
	for {
		ss, err := s.session(name, c.Token)
		if err != nil {
			return leader.Lease{}, false, err
		}
		var f *flight
		if !ss.isHeld() {
			var lead bool
			if f, lead = s.flight(name, c, ttl); !lead {
				select {
				case <-f.done:
				case <-ctx.Done():
					return leader.Lease{}, false, fmt.Errorf("postgres: %s: %w", call(op, name), ctx.Err())
				}
				if l, ok := f.refusal(called, c.ID); ok {
					if err := s.enlistJoiners(ctx, f); err != nil {
						return leader.Lease{}, false, err
					}
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
			if err == nil && granted && !announce {
				ss.announced = l.Term // a re-grant announces itself
			}
			return err
		})
		s.land(f, l, err)
		switch {
		case errors.Is(err, errSessionGone):
			continue // reaped while we waited for it: a new one
		case errors.Is(err, errNotClaimed) && !claimed:
			// The name is not (yet) the advisory strategy's: claim it,
			// which fails with a *StrategyConflictError while the lease
			// strategy uses it, and try again.
			claimed = true
			if err := claimStrategy(ctx, s.pool, s.opts, name, StrategyAdvisory, ttl); err != nil {
				return leader.Lease{}, false, wrapError(ctx, call(op, name), err)
			}
			continue
		case errors.Is(err, errNotClaimed):
			// Claimed, and moved back before the second try.
			return leader.Lease{}, false, wrapError(ctx, call(op, name), errStrategyMoved)
		case err != nil:
			return leader.Lease{}, false, wrapError(ctx, call(op, name), err)
		}
		if granted {
			s.handedOver(name, nil) // the reservation, if any, is over
		}
		if announce {
			s.notifyLater(ss, l.Term, false, grantNoticeDelay)
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
	// joiners are the candidates that joined the attempt, by token, and
	// enlisted is closed once they are enlisted, with enlistErr (nil
	// until one of them is refused: see enlistJoiners).
	joiners   map[string]enlistment
	enlisted  chan struct{}
	enlistErr error
}

// flight returns name's flight in progress, which c joins, asking for
// ttl, or starts one that c leads (lead), which it must end with land. A
// candidate whose token this store handed the lease to (see handedOver)
// leads no flight and joins none (f nil, lead true): the others'
// attempts, refused, would only delay its grant.
func (s *AdvisoryStore) flight(name string, c leader.Candidate, ttl time.Duration) (f *flight, lead bool) {
	s.smu.Lock()
	defer s.smu.Unlock()
	if h, ok := s.handoffs[name]; ok {
		switch {
		case time.Now().After(h.until):
			delete(s.handoffs, name)
		case h.token == c.Token:
			return nil, true
		}
	}
	if f := s.flights[name]; f != nil {
		if f.joiners == nil {
			f.joiners = make(map[string]enlistment)
		}
		f.joiners[c.Token] = enlistment{c: c, ttl: ttl}
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

// refusal returns, for the candidate id that called Acquire at called,
// the refusal that f's outcome means for it, if it means one: f began
// after the call, so what f saw is an answer to the call too, and f ended
// with the lease held (by f's candidate or by another), or reserved for a
// candidate of another ID. Its Remaining (or Reserved) is as of now.
// Otherwise the candidate must try for itself.
func (f *flight) refusal(called time.Time, id string) (leader.Lease, bool) {
	if f.err != nil || f.began.Before(called) {
		return leader.Lease{}, false
	}
	l, since := f.lease, time.Since(f.landed)
	switch {
	case l.Held():
		l.Remaining -= since
		return l, l.Remaining > 0
	case l.Successor != "" && l.Successor != id:
		l.Reserved -= since
		return l, l.Reserved > 0
	}
	return leader.Lease{}, false
}

// enlistJoiners enlists f's joiners, once one of them is refused with f's
// outcome: such a candidate sent no grant statement, which would have
// enlisted it, so the first of them to call sends one statement that
// enlists them all (as many as took the refusal, and any that did not and
// tries again; see candidates.enlistShared). The statement is bounded by
// that caller's deadline but not ended with its ctx, so that a joiner
// that gives up fails none of the others; each waits for it until its
// own ctx ends. It returns the statement's error.
func (s *AdvisoryStore) enlistJoiners(ctx context.Context, f *flight) error {
	s.smu.Lock()
	if f.enlisted == nil {
		f.enlisted = make(chan struct{})
		deadline, ok := ctx.Deadline()
		if !ok {
			deadline = time.Now().Add(s.opts.CallTimeout)
		}
		if s.closing {
			f.enlistErr = fmt.Errorf("postgres: %s: %w", call("acquire", f.name), ErrClosed)
			close(f.enlisted)
		} else {
			s.bg.Go(func() {
				ctx, cancel := context.WithDeadline(s.bgCtx, deadline)
				defer cancel()
				f.enlistErr = s.enlistShared(ctx, f.name, f.joiners)
				close(f.enlisted)
			})
		}
	}
	enlisted := f.enlisted
	s.smu.Unlock()
	select {
	case <-enlisted:
		return f.enlistErr
	case <-ctx.Done():
		return fmt.Errorf("postgres: %s: %w", call("acquire", f.name), ctx.Err())
	}
}

// handoff is a handover that this store made (ReleaseTo): the token of
// the successor, and until when (on this process's clock, a little after
// the server's) the lease is reserved for it.
type handoff struct {
	token string
	until time.Time
}

// handedOver records that this store handed name over (h), or, if h is
// nil, that name's reservation is over (a grant ended it).
func (s *AdvisoryStore) handedOver(name string, h *handoff) {
	s.smu.Lock()
	defer s.smu.Unlock()
	if h == nil {
		delete(s.handoffs, name)
		return
	}
	s.handoffs[name] = *h
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
		err := conn.QueryRow(ctx, s.sql.regrant, name, c.Token, c.ID, iv, ms, idle, every, s.opts.Channel, hi, lo, int32(c.Priority)).
			Scan(&term, &acquiredAt, &n)
		switch {
		case err == nil:
			ss.grant(uint64(term), c.ID)
			return leader.Lease{Name: name, HolderID: c.ID, Term: uint64(term), AcquiredAt: acquiredAt,
				ExpiresAt: acquiredAt.Add(ttl), Remaining: ttl, Priority: c.Priority, Reason: leader.GrantFirst}, true, false, nil
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
	//
	// A successor whose handover was prepared (see PrepareHandover) makes
	// its first attempt after waiting for the handover, in one round trip
	// (see grantAfterHandover).
	queued := false
	var events <-chan struct{} // the name's events, from the first wait on
	prepared := s.wakeups.takePrepared(name, c.Token)
	for attempt := 0; ; attempt++ {
		stmt := s.sql.grant
		if attempt < quickAttempts {
			stmt = s.sql.grantQuick
		}
		var (
			r      grantResult
			err    error
			waited bool
		)
		if prepared && attempt == 0 {
			r, waited, err = s.grantAfterHandover(ctx, conn, ss, name, c, ttl)
		}
		if !waited && err == nil {
			r, err = s.grantOn(ctx, conn, ss, name, c, stmt, iv, ms, idle, every, hi, lo)
		}
		if err != nil {
			// The statement may have taken the lock before it failed, and
			// a session lock outlives the failed transaction: close the
			// session, which frees it.
			return leader.Lease{}, false, false, errors.Join(errSessionReset, err)
		}
		if r.reserved && !r.got {
			// Reserved for another candidate: refused, holding nothing.
			return r.lease(name, c.ID, ttl), false, false, nil
		}
		if !r.got && !r.locked && !queued && !r.raced {
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
				if !r.got && !r.raced {
					return leader.Lease{}, false, false, errors.Join(errSessionReset, errors.New("the lock, taken, is not held"))
				}
			}
		}
		if r.raced && attempt < settleAttempts {
			// A handover reserved the lease after the statement's
			// snapshot: the next one sees the reservation.
			continue
		}
		if r.inGrace {
			return leader.Lease{Name: name}, false, false, nil
		}
		if r.granted() && !r.marked {
			s.log.Debug("holding the lock without its mark: another session holds the two-int4 advisory lock of the same keys",
				slog.String("election", name))
		}
		if unreleased, who := r.leftUnreleased(); unreleased {
			// Taken from a holder whose session ended without a release:
			// give it TakeoverGrace to see that too and step down.
			if err := sleepCtx(ctx, s.graceLeft(name, who)); err != nil {
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
// grant that took name's lock from its holder who (its backend and term;
// zero if not known), which left without a release, may be reported. The
// grace is counted from when name's lock waiter saw that holder's mark
// freed, if it did so within the grace, and from now otherwise. The
// server frees a session's locks as the session ends, so the grace is
// never counted from before the end. The term tells that tenure from an
// earlier one of the same backend (a holder that released, was granted
// again on the same session, and went without a release): the freeing of
// the earlier one's mark says nothing of when the later one went.
func (s *AdvisoryStore) graceLeft(name string, who holding) time.Duration {
	grace := s.opts.TakeoverGrace
	if who.pid == 0 || who.term == 0 {
		return grace
	}
	s.smu.Lock()
	f, ok := s.freed[name]
	s.smu.Unlock()
	if !ok || f.pid != who.pid || f.term != who.term {
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

// freeing is when a lock waiter saw the holder of backend pid, under
// term, free a lock (see graceLeft).
//
// The term is never newer than the tenure whose freeing was seen, so that
// a sighting can only ever lengthen a grace, never shorten it wrongly. The
// lock waiter reads the row (its holder and term) and pg_locks (who holds
// the lock and the mark) in one statement, whose snapshot is taken before
// its read of pg_locks; a grant takes the mark before its row commits. So a
// row that names a backend under term T in the snapshot was committed by
// a grant whose mark was taken before pg_locks was read: the mark then
// waited on is of tenure T or of a later one of the same backend (granted
// again between the snapshot and the read). A later tenure recorded under
// T matches no grant's snapshot of it (see leftUnreleased), and the whole
// grace is waited. The same holds of the term read with a handover
// (awaitGoing's now), from which the next wait follows the successor
// without a look.
type freeing struct {
	pid  int32
	term int64 // the holder's term, as the row named it; 0 if unknown
	at   time.Time
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
// connection, for at most s.queueWait. It reports whether the session took
// the lock; if it did not, the session holds nothing.
func (s *AdvisoryStore) queue(ctx context.Context, conn *pgx.Conn, key int64) (bool, error) {
	_, err := conn.Exec(ctx, s.sql.queue, key, strconv.FormatInt(s.queueWait.Milliseconds(), 10))
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
		return s.holdsLock(ctx, conn, key)
	default:
		// Whether the lock was taken is unknown: close the session.
		return false, errors.Join(errSessionReset, err)
	}
}

// holdsLock asks the server whether the session of conn holds the lock of
// key. If it cannot tell, the error wraps errSessionReset: the session is
// closed, which frees the lock if it is held.
func (s *AdvisoryStore) holdsLock(ctx context.Context, conn *pgx.Conn, key int64) (bool, error) {
	hi, lo := keyHalves(key)
	var held bool
	if err := conn.QueryRow(ctx, s.sql.heldHere, hi, lo).Scan(&held); err != nil {
		return false, errors.Join(errSessionReset, err)
	}
	return held, nil
}

// grantResult is what the grant statement reports.
type grantResult struct {
	got                       bool
	term, curTerm             *int64
	acquiredAt, curAcquiredAt *time.Time
	other, curHolder          *string
	held, locked              bool
	remaining                 time.Duration
	unreleased                bool   // the snapshot shows the row naming a holder (see leftUnreleased)
	previousPID               *int32 // the backend of the holder the snapshot shows
	previousTerm              *int64 // the term the snapshot shows
	marked                    bool   // the grant took the lock's mark too
	mine                      bool   // the strategy table gives the name to this strategy
	epochOK                   bool   // no failover grace holds grants off (see epochCTEs)
	inGrace                   bool   // refused for the grace after a failover; the lock let go
	reserved                  bool   // the snapshot shows the lease reserved for another candidate
	raced                     bool   // the lock taken, and let go: reserved for another since the snapshot
	transfer                  transferRow
}

func (r grantResult) granted() bool { return r.got && r.term != nil }

// leftUnreleased reports whether r is a grant that took the lease from a
// holder that did not release it: one whose session ended with the row
// still naming it. That is the row as the grant's update found it, its
// latest version, which the grant's reason tells (GrantExpiry: the row
// named a holder). The statement's snapshot ("previous") can be older: a
// release that committed after the snapshot was taken and unlocked
// before the grant tried the lock left the row free, though the snapshot
// shows it held; and a holder granted and gone in that time left it
// held, though the snapshot shows it free.
//
// It also returns that holder, its backend and term, if the snapshot
// surely names the same one: if the grant's term is the snapshot's plus
// one, no grant came between (each bumps the term). Otherwise, a grant
// came after the snapshot or a term floor raised the term, and it returns
// the zero holding. The grace is counted from when that holder's mark
// was seen freed (see graceLeft), and from now for the zero holding: a
// longer wait, never a shorter one.
func (r grantResult) leftUnreleased() (bool, holding) {
	if !r.granted() || r.transfer.grantReason() != leader.GrantExpiry {
		return false, holding{}
	}
	if r.unreleased && r.previousPID != nil && r.previousTerm != nil && *r.term == *r.previousTerm+1 {
		return true, holding{pid: *r.previousPID, term: *r.previousTerm}
	}
	return true, holding{}
}

// lease reports r as a leader.Lease: the grant to holderID for ttl, or the
// lease as it stood.
func (r grantResult) lease(name, holderID string, ttl time.Duration) leader.Lease {
	if r.granted() {
		return leader.Lease{Name: name, HolderID: holderID, Term: uint64(*r.term), AcquiredAt: *r.acquiredAt,
			ExpiresAt: r.acquiredAt.Add(ttl), Remaining: ttl, Priority: r.transfer.holderPriority(), Reason: r.transfer.grantReason()}
	}
	l := leader.Lease{Name: name}
	if r.curTerm != nil {
		l.Term = uint64(*r.curTerm)
	}
	if r.held && r.remaining > 0 && r.curHolder != nil && r.curAcquiredAt != nil {
		l.HolderID, l.AcquiredAt, l.Remaining = *r.curHolder, *r.curAcquiredAt, r.remaining
		l.ExpiresAt = wallclock.Now().Add(r.remaining) // for display; decisions use Remaining
	}
	r.transfer.apply(&l)
	return l
}

// grantOn runs a grant statement, stmt (grant or grantLocked), once on
// conn, recording a grant in ss.
func (s *AdvisoryStore) grantOn(ctx context.Context, conn *pgx.Conn, ss *session, name string, c leader.Candidate, stmt string,
	iv time.Duration, ms, idle, every string, hi, lo int64) (grantResult, error) {
	return s.grantRow(ctx, conn, ss, name, c, conn.QueryRow(ctx, stmt, grantArgs(ss, name, c, iv, ms, idle, every, hi, lo)...))
}

// grantArgs are the arguments of the grant statements (see
// advisoryStatements.grant).
func grantArgs(ss *session, name string, c leader.Candidate, iv time.Duration, ms, idle, every string, hi, lo int64) []any {
	return []any{name, ss.key, c.Token, c.ID, iv, ms, idle, every, hi, lo, int32(c.Priority)}
}

// grantRow reads row, a grant statement's, run on conn, and does what its
// outcome calls for (see grantOn).
func (s *AdvisoryStore) grantRow(ctx context.Context, conn *pgx.Conn, ss *session, name string, c leader.Candidate, row pgx.Row) (grantResult, error) {
	r, err := scanGrant(row)
	return s.finishGrant(ctx, conn, ss, name, c, r, err)
}

// scanGrant reads a grant statement's row.
func scanGrant(row pgx.Row) (grantResult, error) {
	var (
		r grantResult
		n int64
	)
	err := row.Scan(append([]any{&r.got, &r.term, &r.acquiredAt, &r.other, &n, &r.curTerm, &r.curHolder, &r.curAcquiredAt, &r.held, &r.remaining,
		&r.locked, &r.unreleased, &r.previousPID, &r.previousTerm, &r.marked, &r.mine, &r.epochOK, &r.reserved}, r.transfer.dest()...)...)
	return r, err
}

// finishGrant does what a grant statement's outcome, r or err, read from
// its row on conn, calls for (see grantOn).
func (s *AdvisoryStore) finishGrant(ctx context.Context, conn *pgx.Conn, ss *session, name string, c leader.Candidate, r grantResult, err error) (grantResult, error) {
	if err != nil {
		if sqlState(err) == "23505" { // unique_violation: the key, taken by another name at the same moment
			return r, fmt.Errorf("advisory key %d of %q is used by another election name (raced for its first grant); give one of them another key with Options.Key: %w",
				ss.key, name, err)
		}
		return r, err
	}
	if r.got && r.term == nil {
		// Locked, but the name is not (yet) this strategy's, or the key
		// belongs to another name: let it go, and its mark.
		var (
			unlocked bool
			n        int64
		)
		if err := conn.QueryRow(ctx, s.sql.unlock, ss.key).Scan(&unlocked, &n); err != nil || !unlocked {
			return r, errors.Join(errSessionReset, err)
		}
		if !r.mine && r.other == nil {
			return r, errNotClaimed
		}
		if !r.epochOK && r.other == nil {
			// A failover's grace (see epochCTEs): refused, the lock let go.
			r.got, r.inGrace = false, true
			return r, nil
		}
		if r.other == nil {
			// The row, as it stood once locked, was reserved for
			// another candidate: a handover committed after the
			// statement's snapshot. Refused, the lock let go.
			r.got, r.raced = false, true
			return r, nil
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
