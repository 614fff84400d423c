package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/leaderelect/leader"
)

// Release implements leader.Store. On the holder's session it clears the
// row (keeping the term) in one statement and unlocks in a second, in one
// round trip; the wake-up follows, once Release has their replies (see
// advisoryStatements.releaseNotice). The session stays open for the next
// campaign.
func (s *AdvisoryStore) Release(ctx context.Context, name, token string, term uint64) error {
	return s.release(ctx, name, token, term, nil, 0)
}

// ReleaseTo implements leader.Transferer. It is Release, with the
// reservation of the freed lease for successor's token until hold has
// passed on the server's clock recorded by the statement that clears the
// row: the same round trip. The unlock wakes the lock waiters of the
// name, and they its followers: the successor takes the lock and is
// granted the lease; the others, finding the reservation in the row, are
// refused without trying the lock (see Acquire).
func (s *AdvisoryStore) ReleaseTo(ctx context.Context, name, token string, term uint64, successor leader.Candidate, reason leader.GrantReason, hold time.Duration) error {
	if err := checkHandover(name, term, successor, reason, hold); err != nil {
		return err
	}
	return s.release(ctx, name, token, term, &reservation{to: successor, reason: reason, hold: hold}, 0)
}

// reservation is what ReleaseTo adds to a release: the successor the
// lease is reserved for, the reason of its grant, and for how long.
type reservation struct {
	to     leader.Candidate
	reason leader.GrantReason
	hold   time.Duration
	// markAfter, if positive (a prepared handover whose successor waits,
	// see advisoryPrepared.Commit), frees the lease's lock and the
	// handover's at once and the session's other locks, the mark among
	// them, markAfter later (see releaseOn).
	markAfter time.Duration
	// grantTo, if not 0 (with markAfter), is the backend PID of the
	// successor's session, which waits for a prepared handover: the
	// release grants it the lease (see advisoryStatements.releaseGranting).
	grantTo int32
	// staged, with markAfter and grantTo, says that the release ran
	// already, in the session's open transaction (see
	// advisoryPrepared.Stage): the release unlocks and commits it (see
	// commitStagedOn).
	staged bool
	// stager is the prepared handover whose release is staged, if
	// staged is set: its Commit uses its session whatever the session's
	// state, so as never to leave it staged.
	stager *advisoryPrepared
}

// release frees the lease of name held by token under term on its
// session (see Release), reserved as h says if h is not nil, and sends
// the release's notice noticeDelay after (see notifyLater).
func (s *AdvisoryStore) release(ctx context.Context, name, token string, term uint64, h *reservation, noticeDelay time.Duration) error {
	ctx, cancel := s.opts.bound(ctx)
	defer cancel()
	const op = "release"
	if err := ctx.Err(); err != nil {
		if h != nil && h.staged {
			h.stager.abandon() // the session's next call drops it
		}
		return fmt.Errorf("postgres: %s: %w", call(op, name), err)
	}
	lost := fmt.Errorf("postgres: %s %q term %d: %w", op, name, term, leader.ErrLeaseLost)
	if h != nil {
		lost = fmt.Errorf("postgres: %s %q term %d to %s: %w", op, name, term, h.to.ID, leader.ErrLeaseLost)
	}
	staged := h != nil && h.staged
	ss := s.heldSession(name, token, term)
	if staged {
		ss = h.stager.ss
	}
	if ss == nil {
		return lost
	}
	do := func(fn func(conn *pgx.Conn) error) error { return ss.do(ctx, s, false, fn) }
	if staged {
		do = func(fn func(conn *pgx.Conn) error) error { return ss.doStaged(ctx, s, fn) }
	}
	reached := false // fn ran: the session's staged state was dealt with
	err := do(func(conn *pgx.Conn) error {
		reached = true
		if staged && (!ss.staged || !ss.heldUnder(term)) {
			// The staged transaction is gone, or the lease with it:
			// close the session, which ends whatever is left.
			return errors.Join(errSessionReset, errNotHeld)
		}
		if !ss.heldUnder(term) {
			return errNotHeld
		}
		var (
			released, unlocked bool
			err                error
		)
		if staged {
			released = true // by Stage
			unlocked, err = s.commitStagedOn(ctx, conn, name, token, term, ss.key, h)
			if err == nil {
				ss.staged, ss.stagedBy = false, nil
			}
		} else {
			released, unlocked, err = s.releaseOn(ctx, conn, name, token, term, ss.key, h)
		}
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
	if staged && !reached {
		h.stager.abandon() // the session's next call drops it
	}
	switch {
	case err == nil:
		if staged {
			s.stagedCommits.Add(1)
		}
		if h != nil {
			s.handedOver(name, &handoff{token: h.to.Token, until: time.Now().Add(h.hold)})
		}
		s.notifyLater(ss, term, true, noticeDelay)
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
// row is free (and reserved as h says, if h is not nil) before the lock is
// (see advisoryStatements.release). A prepared handover whose successor
// waits (h.markAfter) runs the release cut to the row's update
// (releaseHandedOver), and, after the rest, the removal of the holder's
// own entry among the candidates (dropHolder). The unlock runs even if the first
// statement failed or released nothing; the caller then closes the
// session anyway.
func (s *AdvisoryStore) releaseOn(ctx context.Context, conn *pgx.Conn, name, token string, term uint64, key int64, h *reservation) (released, unlocked bool, err error) {
	args := [][]byte{[]byte(name), []byte(token), strconv.AppendUint(nil, term, 10), nil, nil, nil, nil, []byte(s.opts.Channel)}
	if h != nil {
		args[3], args[4], args[5] = []byte(h.to.Token), []byte(h.to.ID), []byte(h.reason)
		args[6] = strconv.AppendInt(nil, int64(interval(h.hold)/time.Microsecond), 10)
	}
	// Prepared on the session when it was opened (see planAhead), the
	// release and the unlock after it (a prepared handover's too) are
	// neither parsed nor planned now (Prepare finds
	// them; if planning ahead failed, it prepares them, a round trip
	// each); in another query exec mode than pgx's default they are sent
	// with their text.
	// A plain release may name a candidate on its candidate channel (see
	// advisoryStatements.release); if it did, the mark is freed markAfter
	// later.
	named := h == nil && len(s.opts.Channel) <= maxCandidateChannel
	markAfter := h != nil && h.markAfter > 0
	// A prepared handover's release leaves the holder's own entry among
	// the candidates to a statement after the successor's grant
	// (releaseHandedOver, dropHolder).
	releaseSQL, releaseArgs := s.sql.release, args
	switch {
	case markAfter && h.grantTo != 0:
		// It grants the lease to the successor's waiting session, whose
		// statements then only claim it.
		releaseSQL = s.sql.releaseGranting
		releaseArgs = append(args[:7:7], strconv.AppendInt(nil, int64(h.grantTo), 10), strconv.AppendInt(nil, int64(h.to.Priority), 10))
	case markAfter:
		releaseSQL, releaseArgs = s.sql.releaseHandedOver, args[:7]
	}
	var release, unlock, mark, rest, drop *pgconn.StatementDescription
	errRelease, errUnlock, errMark, errRest, errDrop := errors.ErrUnsupported, errors.ErrUnsupported, errors.ErrUnsupported, errors.ErrUnsupported, errors.ErrUnsupported
	if conn.Config().DefaultQueryExecMode == pgx.QueryExecModeCacheStatement {
		release, errRelease = conn.Prepare(ctx, releaseSQL, releaseSQL)
		switch {
		case named:
			unlock, errUnlock = conn.Prepare(ctx, s.sql.namedUnlock, s.sql.namedUnlock)
			mark, errMark = conn.Prepare(ctx, s.sql.namedMark, s.sql.namedMark)
			rest, errRest = conn.Prepare(ctx, s.sql.unlockRest, s.sql.unlockRest)
		case markAfter:
			unlock, errUnlock = conn.Prepare(ctx, s.sql.unlockHandedOver, s.sql.unlockHandedOver)
			rest, errRest = conn.Prepare(ctx, s.sql.unlockRest, s.sql.unlockRest)
			drop, errDrop = conn.Prepare(ctx, s.sql.dropHolder, s.sql.dropHolder)
		default:
			unlock, errUnlock = conn.Prepare(ctx, s.sql.unlock, s.sql.unlock)
		}
	}
	p := conn.PgConn().StartPipeline(ctx)
	sendPrepared(p, releaseSQL, release, errRelease, releaseArgs)
	switch {
	case markAfter:
		// The successor's statement, waiting for the handover's lock,
		// runs as it is freed, and takes the lease's lock, freed first.
		// The lock waiters, which wait on the mark, wake only after the
		// successor's grant (and find the lease taken, see awaitMark),
		// rather than beside it.
		sendPrepared(p, s.sql.unlockHandedOver, unlock, errUnlock,
			[][]byte{strconv.AppendInt(nil, key, 10), strconv.AppendInt(nil, handoverClass, 10), strconv.AppendInt(nil, int64(s.handoverKey(name)), 10)})
		p.SendQueryParams(`SELECT pg_sleep($1::float8)`, [][]byte{[]byte(strconv.FormatFloat(h.markAfter.Seconds(), 'f', -1, 64))}, nil, nil, nil)
		p.SendPipelineSync()
		sendPrepared(p, s.sql.unlockRest, rest, errRest, nil)
		sendPrepared(p, s.sql.dropHolder, drop, errDrop, args[:2])
	case named:
		// The named candidate, woken by the notice that the unlock sends
		// as it commits, takes the lease's lock, freed first. The lock
		// waiters, which wait on the mark, wake only after its grant (and
		// find the lease taken, see awaitMark), rather than beside it; at
		// once if the release named nobody.
		unlockArgs := [][]byte{strconv.AppendInt(nil, key, 10), []byte(name), strconv.AppendUint(nil, term, 10)}
		markArgs := [][]byte{[]byte(strconv.FormatFloat(s.markAfter.Seconds(), 'f', -1, 64))}
		sendPrepared(p, s.sql.namedUnlock, unlock, errUnlock, unlockArgs)
		sendPrepared(p, s.sql.namedMark, mark, errMark, markArgs)
		sendPrepared(p, s.sql.unlockRest, rest, errRest, nil)
	case errUnlock == nil:
		p.SendQueryPrepared(unlock.Name, [][]byte{strconv.AppendInt(nil, key, 10)}, nil, nil)
		p.SendPipelineSync()
	default:
		p.SendQueryParams(s.sql.unlock, [][]byte{strconv.AppendInt(nil, key, 10)}, nil, nil, nil)
		p.SendPipelineSync()
	}
	if err := p.Flush(); err != nil {
		return false, false, errors.Join(err, p.Close())
	}
	first, err1 := pipelineRow(p)
	second, err2 := pipelineRow(p)
	if err1 != nil || err2 != nil {
		return false, false, errors.Join(err1, err2, p.Close())
	}
	if markAfter || named {
		// The release and the unlock were answered: what fails after
		// them only leaves the session in doubt, which closing it ends
		// (the next call on it finds it closed).
		_, err3 := pipelineRow(p)
		_, err4 := pipelineRow(p)
		var err5 error
		if markAfter {
			_, err5 = pipelineRow(p)
		}
		if err := errors.Join(err3, err4, err5, p.Close()); err != nil {
			s.afterReleaseFailed(ctx, conn, name, term, err)
		}
	} else if err := p.Close(); err != nil {
		return false, false, err
	}
	if len(first) < 1 || len(second) < 1 {
		return false, false, errors.New("release: a statement returned no value")
	}
	return string(first[0]) == "1", string(second[0]) == "t", nil
}

// afterReleaseFailed ends a release whose statements after the release
// and the unlock (the mark's unlock, the removal of the holder's entry
// among the candidates) failed with err: only the session is in doubt, so
// it is closed, which frees the mark; and as the session's own notice
// (see notifyLater) will find it closed, the release's notice is sent on
// the store's connections, best effort (it checks the row itself).
func (s *AdvisoryStore) afterReleaseFailed(ctx context.Context, conn *pgx.Conn, name string, term uint64, err error) {
	s.log.Debug("freeing a released lease's mark, or removing the holder's entry among the candidates, failed; the session is closed, which frees the mark",
		slog.String("election", name), slog.Any("error", err))
	closeConn(conn)
	nctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), listenCallTimeout)
	defer cancel()
	if _, err := s.pool.Exec(nctx, s.sql.releaseNotice, name, int64(term), s.opts.Channel); err != nil {
		s.log.Debug("the release's notice failed; followers without a lock waiter learn of it later",
			slog.String("election", name), slog.Any("error", err))
	}
}

// commitStagedOn commits the release that advisoryPrepared.Stage ran in
// the session's open transaction, in one round trip: it takes the name's
// fence lock, waiting for the fenced transactions that judged the row
// while the release was staged, unlocks the session's holds of the
// lease's lock and the handover's (stagedUnlock; the transaction's own
// holds keep both until the COMMIT, which frees them once the release is
// visible), commits, and then,
// as releaseOn does for a prepared handover, frees the session's other
// locks (the mark among them) h.markAfter later and removes the holder's
// own entry among the candidates. It reports whether the session held the
// lease's lock. An error before the COMMIT's answer leaves the session in
// doubt (the caller closes it); one after it, only the mark's unlock or
// the removal, closes the session here (see afterReleaseFailed).
func (s *AdvisoryStore) commitStagedOn(ctx context.Context, conn *pgx.Conn, name, token string, term uint64, key int64, h *reservation) (unlocked bool, err error) {
	var unlock, rest, drop *pgconn.StatementDescription
	errUnlock, errRest, errDrop := errors.ErrUnsupported, errors.ErrUnsupported, errors.ErrUnsupported
	if conn.Config().DefaultQueryExecMode == pgx.QueryExecModeCacheStatement {
		unlock, errUnlock = conn.Prepare(ctx, stagedUnlock, stagedUnlock)
		rest, errRest = conn.Prepare(ctx, s.sql.unlockRest, s.sql.unlockRest)
		drop, errDrop = conn.Prepare(ctx, s.sql.dropHolder, s.sql.dropHolder)
	}
	p := conn.PgConn().StartPipeline(ctx)
	sendPrepared(p, stagedUnlock, unlock, errUnlock,
		[][]byte{strconv.AppendInt(nil, key, 10), strconv.AppendInt(nil, handoverClass, 10), strconv.AppendInt(nil, int64(s.handoverKey(name)), 10),
			strconv.AppendInt(nil, s.opts.fenceKey(name), 10), []byte(commitWait(ctx))})
	p.SendQueryParams("COMMIT", nil, nil, nil, nil)
	p.SendPipelineSync()
	p.SendQueryParams(`SELECT pg_sleep($1::float8)`, [][]byte{[]byte(strconv.FormatFloat(h.markAfter.Seconds(), 'f', -1, 64))}, nil, nil, nil)
	p.SendPipelineSync()
	sendPrepared(p, s.sql.unlockRest, rest, errRest, nil)
	sendPrepared(p, s.sql.dropHolder, drop, errDrop, [][]byte{[]byte(name), []byte(token)})
	if err := p.Flush(); err != nil {
		return false, errors.Join(err, p.Close())
	}
	first, err1 := pipelineRow(p)
	tag, err2 := pipelineTag(p)
	if err := errors.Join(err1, err2); err != nil {
		return false, errors.Join(err, p.Close())
	}
	if tag.String() != "COMMIT" {
		return false, errors.Join(fmt.Errorf("the staged release's transaction ended with %q, not COMMIT", tag.String()), p.Close())
	}
	if len(first) < 1 {
		return false, errors.Join(errors.New("release: a statement returned no value"), p.Close())
	}
	_, err3 := pipelineRow(p)
	_, err4 := pipelineRow(p)
	_, err5 := pipelineRow(p)
	if err := errors.Join(err3, err4, err5, p.Close()); err != nil {
		s.afterReleaseFailed(ctx, conn, name, term, err)
	}
	return string(first[0]) == "t", nil
}

// pipelineTag reads the next statement's result and the sync after it
// from p, and returns the statement's command tag.
func pipelineTag(p *pgconn.Pipeline) (pgconn.CommandTag, error) {
	var tag pgconn.CommandTag
	for {
		res, err := p.GetResults()
		if err != nil {
			return tag, err
		}
		switch r := res.(type) {
		case *pgconn.ResultReader:
			if tag, err = r.Close(); err != nil {
				return tag, err
			}
		case *pgconn.PipelineSync:
			return tag, nil
		case nil:
			return tag, errors.New("release: the pipeline ended early")
		}
	}
}

// sendPrepared queues, on p, the statement sql with args, by the
// description sd of its preparation if err (the preparation's) is nil, and
// by its text otherwise, and a sync after it.
func sendPrepared(p *pgconn.Pipeline, sql string, sd *pgconn.StatementDescription, err error, args [][]byte) {
	if err == nil {
		p.SendQueryPrepared(sd.Name, args, nil, nil)
	} else {
		p.SendQueryParams(sql, args, nil, nil, nil)
	}
	p.SendPipelineSync()
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
