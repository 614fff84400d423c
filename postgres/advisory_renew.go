package postgres

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/wallclock"
)

// Renew implements leader.Store. It is the holder's heartbeat: one statement
// on its session that checks that the session still holds the lock and the
// row under term, re-arms the server's timeouts for ttl (see the type's
// documentation), and reads from the row the holder's priority, the reason
// of its grant and any pending request to hand over. If the session has
// ended, or a heartbeat fails and leaves the session's state unknown, the
// session is closed and Renew returns an error wrapping
// leader.ErrLeaseLost: the lock cannot be renewed from another session.
func (s *AdvisoryStore) Renew(ctx context.Context, name, token string, term uint64, ttl time.Duration) (leader.Lease, error) {
	ctx, cancel := s.opts.bound(ctx)
	defer cancel()
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
	var (
		acquiredAt time.Time
		transfer   transferRow
	)
	err := ss.do(ctx, s, false, func(conn *pgx.Conn) error {
		if !ss.heldUnder(term) {
			return errNotHeld
		}
		iv, ms, idle, every := ttlSettings(ttl)
		hi, lo := keyHalves(ss.key)
		var n int64
		err := conn.QueryRow(ctx, s.sql.renew, name, token, int64(term), iv, ms, idle, every, hi, lo).
			Scan(append([]any{&acquiredAt, &n}, transfer.dest()...)...)
		if errors.Is(err, pgx.ErrNoRows) {
			return errors.Join(errSessionReset, errNotHeld)
		}
		return err
	})
	switch {
	case err == nil:
		l := leader.Lease{Name: name, HolderID: ss.id(), Term: term, AcquiredAt: acquiredAt,
			ExpiresAt: wallclock.Now().Add(ttl), Remaining: ttl}
		transfer.apply(&l)
		return l, nil
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
