package postgres

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
)

// notifyLater sends, in the background, the wake-up of a grant under term
// to the session ss (or, if released, of its release of the lease under
// term), on the session, delay after the call that made it due has its
// reply (a prepared handover's commit delays its release's, see
// advisoryPrepared.Commit):
// see advisoryStatements.announce and releaseNotice. A grant's is sent
// only while the session still holds the lease under term, and the
// statements check the row themselves. A failure of the statement is the
// session's: the session is closed, and a lease it holds is lost with it,
// as it would be at the next heartbeat.
func (s *AdvisoryStore) notifyLater(ss *session, term uint64, released bool, delay time.Duration) {
	what, stmt := "grant", s.sql.announce
	args := []any{ss.name, ss.token, int64(term), s.opts.Channel}
	if released {
		what = "release"
		args = []any{ss.name, int64(term), s.opts.Channel}
	}
	s.smu.Lock()
	defer s.smu.Unlock()
	if s.closing {
		return
	}
	s.bg.Go(func() {
		if delay > 0 {
			t := time.NewTimer(delay)
			select {
			case <-t.C:
			case <-s.bgCtx.Done():
				t.Stop()
				return
			}
		}
		ctx, cancel := context.WithTimeout(s.bgCtx, listenCallTimeout)
		defer cancel()
		err := ss.do(ctx, s, false, func(conn *pgx.Conn) error {
			switch {
			case !released && !ss.heldUnder(term):
				return nil // released first: the release's notice announces it
			case released && ss.announced != term:
				// The grant was released before its notification went
				// out: announce it with the release, in order. Lock
				// waiters of other processes that saw the previous holder
				// of this backend go would otherwise take the release for
				// that one's, and cover it (see coverage), waking no
				// free-watcher.
				stmt = s.sql.announcedReleaseNotice
			case released:
				stmt = s.sql.releaseNotice
			}
			_, err := conn.Exec(ctx, stmt, args...)
			if err == nil && !released {
				ss.announced = term
			}
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
