package postgres

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// noticeGrantLater sends the NOTIFY of a grant (the acquire statement
// sends none) once noticeDelay has passed, if the grant still holds. Sent
// as the grant commits, it would wake every listening backend and process
// of the database just as the new leader starts, and they would take the
// CPU that its first moments as leader need; followers do not wait for a
// grant, so only the watchers of grants (Watch) learn of it that much
// later (see Wake-ups in the package documentation).
func (s *LeaseStore) noticeGrantLater(name, token string, term int64) {
	s.noticeLater(false, "grant", "watchers of grants learn of it at their own time",
		s.sql.grantNotice, name, token, term, s.opts.Channel)
}

// noticeFreedLater sends the NOTIFY of a release on the store's channel
// once noticeDelay has passed, if the lease is still free then: after a
// release whose notice went to the candidate channel of the candidate it
// wakes first (see candidateChannel), so that the other candidates learn
// of the release if that one did not take the lease, and nobody else
// wakes if it did. Close does not call it off: it waits for it, and it is
// sent (the other candidates would otherwise wait for the expiry they
// last saw, up to a TTL).
func (s *LeaseStore) noticeFreedLater(name string) {
	s.noticeLater(true, "release", "candidates other than the one woken first try at the expiry they last saw",
		s.sql.freedNotice, name, s.opts.Channel)
}

// noticeLater runs stmt with args (args[0] is the name) on the store's
// waits connections (not the lease's: see below) once noticeDelay has
// passed, on a goroutine of its own that Close
// waits for. Close calls it off unless must is set; what names the notice
// and cost what its failure costs, in the log (a warning if must).
func (s *LeaseStore) noticeLater(must bool, what, cost, stmt string, args ...any) {
	l := &s.later
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		if must {
			s.opts.Logger.Warn("the store is closed: the deferred notice of a "+what+" is not sent; "+cost,
				slog.String("name", args[0].(string)))
		}
		return
	}
	delay := s.noticeDelay
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		t := time.NewTimer(delay)
		defer t.Stop()
		ctx := l.ctx
		select {
		case <-l.ctx.Done():
			if !must {
				return
			}
			<-t.C // the rest of the delay, while Close waits
			ctx = context.Background()
		case <-t.C:
		}
		ctx, cancel := s.opts.bound(ctx)
		defer cancel()
		// On the waits' connections, not the lease's: a release or a
		// renewal that came as it ran would otherwise open (and plan
		// ahead on) a connection of its own, tens of milliseconds in a
		// handover's gap.
		if _, err := s.waits.Exec(ctx, stmt, args...); err != nil && (must || l.ctx.Err() == nil) {
			level := slog.LevelDebug
			if must {
				level = slog.LevelWarn
			}
			s.opts.Logger.Log(ctx, level, "the deferred notice of a "+what+" failed; "+cost,
				slog.String("name", args[0].(string)), slog.Any("error", err))
		}
	}()
}

// laterNotices are the notices that a store sends after a delay: Close
// cancels them, and waits for them to end.
type laterNotices struct {
	ctx    context.Context
	cancel context.CancelFunc
	mu     sync.Mutex
	closed bool
	wg     sync.WaitGroup
}

// close cancels the notices not yet sent and waits for those under way.
func (l *laterNotices) close() {
	l.mu.Lock()
	l.closed = true
	l.mu.Unlock()
	l.cancel()
	l.wg.Wait()
}
