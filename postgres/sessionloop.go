package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
)

// sessionLoop keeps a dedicated session alive: a connection of its own,
// not from a pool, that something needs for as long as it runs. The
// wake-up listener, each lock waiter of an AdvisoryStore and Router.Serve
// run one.
//
// run opens a connection with connect, runs serve on it, closes it when
// serve returns, and opens the next one. Between a failure and the next
// attempt it waits: retryMin at first, twice as long after each wait up to
// retryMax, plus up to a fifth more at random, so that the sessions that one
// server restart broke do not all come back at the same moment. A session
// that got going (its serve called ready) resets the wait to retryMin.
//
// A loss is logged once per outage: the first failure after a session that
// got going (or the first failure of all) at warning level, the failed
// attempts after it at debug level, and the session that gets going again
// at info level.
type sessionLoop[C sessionConn] struct {
	// connect opens a connection. Its error is logged as the session's
	// loss, unless it is permanent (see run).
	connect func(ctx context.Context) (C, error)
	// serve uses conn until it fails or ctx ends, and returns why: an
	// error wrapped with permanent (or wrapping ErrPooledSession) stops
	// the loop for good. It calls ready once its set-up is done and the
	// session does what it is for: the wait is then reset, and a recovery
	// logged. Calls of ready after the first of a session do nothing.
	serve func(ctx context.Context, conn C, ready func()) error

	// retryMin and retryMax bound the wait between attempts, before the
	// random part is added.
	retryMin, retryMax time.Duration

	log *slog.Logger
	// lost is the message logged, with the error, the wait and the count
	// of failed attempts, when the session is lost or cannot be opened.
	lost string
	// back is the message logged when a session gets going after a loss.
	back string

	// pause waits d, or until ctx ends and then returns ctx's error. Nil
	// but in tests, which replace the wait.
	pause func(ctx context.Context, d time.Duration) error
}

// sessionConn is what a sessionLoop needs of a connection: *pgx.Conn, or a
// fake in tests.
type sessionConn interface {
	Close(ctx context.Context) error
}

// permanentError marks an error of a sessionLoop's serve after which
// another session would do no better.
type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// permanent marks err so that the sessionLoop that serve runs in stops and
// returns err.
func permanent(err error) error { return &permanentError{err: err} }

// run keeps the session until ctx ends, and returns nil then, at once,
// whether it was waiting, connecting or serving (serve must return soon
// after ctx ends). It returns at once with a permanent error of connect or
// serve: one marked with permanent, which it returns unmarked, or one
// wrapping ErrPooledSession, which no other connection with the same
// configuration would avoid. Such an error is not logged.
//
// connect, serve and ready are called on run's goroutine, one at a time;
// serve once for each connection connect opened, after which run closes the
// connection (serve may close it first).
func (l *sessionLoop[C]) run(ctx context.Context) error {
	wait := l.retryMin
	failures := 0 // failed attempts since a session last got going
	for {
		conn, err := l.connect(ctx)
		if err == nil {
			going := false
			ready := func() {
				if going {
					return
				}
				going = true
				if failures > 0 {
					l.log.Info(l.back)
				}
				wait, failures = l.retryMin, 0
			}
			err = l.serve(ctx, conn, ready)
			closeCtx, cancel := context.WithTimeout(context.Background(), time.Second)
			_ = conn.Close(closeCtx) // best effort; the connection is dropped either way
			cancel()
		}
		if ctx.Err() != nil {
			return nil
		}
		if p, ok := errors.AsType[*permanentError](err); ok {
			return p.err
		}
		if errors.Is(err, ErrPooledSession) {
			return err
		}
		failures++
		level := slog.LevelWarn
		if failures > 1 {
			level = slog.LevelDebug // said once per outage
		}
		jittered := wait + rand.N(wait/5+1)
		l.log.Log(ctx, level, l.lost,
			slog.Any("error", err), slog.Duration("retry_in", jittered), slog.Int("failures", failures))
		if err := l.sleep(ctx, jittered); err != nil {
			return nil
		}
		wait = min(2*wait, l.retryMax)
	}
}

// sleep waits d, or until ctx ends and then returns ctx's error.
func (l *sessionLoop[C]) sleep(ctx context.Context, d time.Duration) error {
	if l.pause != nil {
		return l.pause(ctx, d)
	}
	return sleepCtx(ctx, d)
}

// dial returns a sessionLoop's connect that opens a connection with d.
func dial(d dialer) func(context.Context) (*pgx.Conn, error) {
	return func(ctx context.Context) (*pgx.Conn, error) {
		conn, err := d.connect(ctx, d.connConfig())
		if err != nil {
			return nil, fmt.Errorf("connecting: %w", err)
		}
		return conn, nil
	}
}
