package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/leaderelect/leader"
)

// Serve delivers messages to this Router's handlers while ctx lasts. Call
// it with the leader context given to leader.Config.OnElected, from
// OnElected itself, so that OnDemoted waits for it to return:
//
//	OnElected: func(ctx context.Context) { _ = r.Serve(ctx) },
//
// Serve opens one connection of its own (not from the pool, with the pool's
// configuration and DefaultConnectTimeout per host if it sets none),
// LISTENs on every handled channel and on
// Options.MessageChannel, delivers the durable messages waiting, and then
// handles messages as they come (see Router). If the connection breaks it
// is opened again with backoff, and the durable messages are read again.
// Handlers run on Serve's goroutine, one at a time.
//
// When ctx ends Serve closes its connection and returns nil, once no
// handler runs. It returns an error at once if ctx carries no term (it is
// not a leader context), if Serve is already running on this Router, if
// the connection goes through a transaction-pooling proxy (wrapping
// ErrPooledSession: such a proxy cannot deliver notifications), and if the
// message table does not exist. The Elector goes on leading after such an
// error; call its Resign if this instance should not lead without serving.
func (r *Router) Serve(ctx context.Context) error {
	term, ok := leader.TermFrom(ctx)
	if !ok {
		return errors.New("postgres: Router.Serve: ctx carries no leader term: call Serve with the ctx given to leader.Config.OnElected")
	}
	r.mu.Lock()
	if r.serving {
		r.mu.Unlock()
		return errors.New("postgres: Router.Serve: already running on this Router")
	}
	r.serving = true
	s := &serving{
		r:        r,
		handlers: maps.Clone(r.handlers),
		term:     term,
		log:      r.log.With(slog.Uint64("term", term)),
		retries:  make(map[string]retry),
	}
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		r.serving = false
		r.mu.Unlock()
	}()
	return s.run(ctx)
}

// serving is the state of one Serve call.
type serving struct {
	r        *Router
	handlers map[string]Handler // a copy: Handle cannot change it meanwhile
	term     uint64
	log      *slog.Logger
	// retries holds the durable channels whose handler failed, until it
	// succeeds; they are read again at their time, and not before.
	retries map[string]retry
}

// retry is when a durable channel is read again, and the backoff that led
// there.
type retry struct {
	at    time.Time
	delay time.Duration
}

// run keeps a connection open until ctx ends, opening it again with
// backoff whenever it fails. It returns nil when ctx ends, and the error
// for which Serve gives up otherwise.
func (s *serving) run(ctx context.Context) error {
	loop := sessionLoop[*pgx.Conn]{
		connect:  dial(s.r.dialer),
		serve:    s.serveConn,
		retryMin: routerReconnectMin,
		retryMax: routerReconnectMax,
		log:      s.log,
		lost:     "router connection lost; best-effort messages are dropped until it is back",
		back:     "router connection is back",
	}
	return loop.run(ctx)
}

// serveConn checks that conn has a session of its own, LISTENs, delivers
// the durable messages waiting, and then delivers messages as they come
// until the connection fails or ctx ends. It calls ready once LISTEN has
// succeeded, and returns why it stopped: an error marked permanent, or
// wrapping ErrPooledSession, means that Serve should give up.
func (s *serving) serveConn(ctx context.Context, conn *pgx.Conn, ready func()) error {
	callCtx, cancel := context.WithTimeout(ctx, routerCallTimeout)
	err := checkSession(callCtx, conn, "the Router")
	cancel()
	if errors.Is(err, ErrPooledSession) {
		return err
	}
	if err != nil {
		return fmt.Errorf("checking the session: %w", err)
	}

	var listen strings.Builder
	for _, channel := range append(slices.Sorted(maps.Keys(s.handlers)), s.r.opts.MessageChannel) {
		fmt.Fprintf(&listen, "LISTEN %s;", pgx.Identifier{channel}.Sanitize())
	}
	callCtx, cancel = context.WithTimeout(ctx, routerCallTimeout)
	_, err = conn.Exec(callCtx, listen.String())
	cancel()
	if err != nil {
		return fmt.Errorf("LISTEN: %w", err)
	}
	ready()
	if s.r.onListen != nil {
		s.r.onListen(conn.PgConn().PID())
	}

	// Announcements sent before LISTEN took effect were missed: read
	// every durable channel now.
	if err := s.drainAll(ctx); err != nil {
		return permanent(err)
	}
	nextPoll := time.Now().Add(s.r.pollEvery)
	for {
		wake := nextPoll
		for _, rt := range s.retries {
			if rt.at.Before(wake) {
				wake = rt.at
			}
		}
		waitCtx, cancel := context.WithDeadline(ctx, wake)
		n, err := conn.WaitForNotification(waitCtx)
		cancel()
		switch {
		case err == nil:
			if err := s.deliver(ctx, n); err != nil {
				return permanent(err)
			}
		case ctx.Err() != nil:
			return ctx.Err()
		case errors.Is(err, context.DeadlineExceeded) && !conn.IsClosed():
			now := time.Now()
			if now.Before(nextPoll) {
				// A channel's retry is due.
				if err := s.drainDue(ctx, now); err != nil {
					return permanent(err)
				}
				continue
			}
			// A while since the last poll: make sure the connection
			// still works, and read every channel in case an
			// announcement was missed.
			pingCtx, cancel := context.WithTimeout(ctx, routerCallTimeout)
			err := conn.Ping(pingCtx)
			cancel()
			if err != nil {
				return fmt.Errorf("ping: %w", err)
			}
			nextPoll = now.Add(s.r.pollEvery)
			if err := s.drainAll(ctx); err != nil {
				return permanent(err)
			}
		default:
			return fmt.Errorf("waiting for notifications: %w", err)
		}
	}
}

// deliver handles notification n: a best-effort message goes to its
// handler, an announcement of a durable message has its channel read.
func (s *serving) deliver(ctx context.Context, n *pgconn.Notification) error {
	if n.Channel == s.r.opts.MessageChannel {
		if _, ok := s.handlers[n.Payload]; !ok || s.waiting(n.Payload, time.Now()) {
			return nil // not ours, or read again at its retry time
		}
		return s.drain(ctx, n.Payload)
	}
	h, ok := s.handlers[n.Channel]
	if !ok {
		return nil
	}
	if err := h(ctx, Message{Channel: n.Channel, Payload: n.Payload, Term: s.term}); err != nil {
		s.log.Warn("router handler failed; the best-effort message is dropped",
			slog.String("channel", n.Channel), slog.Any("error", err))
	}
	return nil
}

// waiting reports whether channel waits for a retry later than now.
func (s *serving) waiting(channel string, now time.Time) bool {
	rt, ok := s.retries[channel]
	return ok && now.Before(rt.at)
}

// drainAll reads every handled channel that is not waiting for a retry.
func (s *serving) drainAll(ctx context.Context) error {
	now := time.Now()
	for _, channel := range slices.Sorted(maps.Keys(s.handlers)) {
		if ctx.Err() != nil {
			return nil
		}
		if s.waiting(channel, now) {
			continue
		}
		if err := s.drain(ctx, channel); err != nil {
			return err
		}
	}
	return nil
}

// drainDue reads the channels whose retry time has come.
func (s *serving) drainDue(ctx context.Context, now time.Time) error {
	var due []string
	for channel := range s.retries {
		if !s.waiting(channel, now) {
			due = append(due, channel)
		}
	}
	slices.Sort(due)
	for _, channel := range due {
		if ctx.Err() != nil {
			return nil
		}
		if err := s.drain(ctx, channel); err != nil {
			return err
		}
	}
	return nil
}

// drain delivers channel's durable messages in id order, deleting each once
// its handler returned nil, until a batch comes back short (later messages
// are announced), a delivery fails (the channel then waits for its retry),
// or ctx ends. It returns an error only when Serve should give up.
func (s *serving) drain(ctx context.Context, channel string) error {
	h := s.handlers[channel]
	for {
		batch, err := s.fetch(ctx, channel)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if sqlState(err) == "42P01" { // undefined_table
				return fmt.Errorf("%w (did Migrate run with the same Options?)",
					wrapError(ctx, fmt.Sprintf("router: reading channel %q from %s", channel, s.r.opts.qualifiedMessageTable()), err))
			}
			s.failed(channel, "router could not read durable messages", slog.Any("error", wrapError(ctx, call("read channel", channel), err)))
			return nil
		}
		for _, m := range batch {
			if ctx.Err() != nil {
				return nil
			}
			if err := h(ctx, m); err != nil {
				attrs := []any{slog.Int64("id", m.ID), slog.Int("attempts", m.Attempts+1), slog.Any("error", err)}
				if err := s.finish(ctx, s.r.sql.failed, m.ID); err != nil {
					attrs = append(attrs, slog.Any("counting_error", err))
				}
				s.failed(channel, "router handler failed; the channel waits and the message will be delivered again", attrs...)
				return nil
			}
			if err := s.finish(ctx, s.r.sql.remove, m.ID); err != nil {
				s.failed(channel, "router could not delete a handled message; it will be delivered again",
					slog.Int64("id", m.ID), slog.Any("error", err))
				return nil
			}
			delete(s.retries, channel) // a success ends a run of failures
		}
		if len(batch) < routerBatchSize {
			delete(s.retries, channel)
			return nil
		}
	}
}

// fetch reads the first batch of channel's durable messages.
func (s *serving) fetch(ctx context.Context, channel string) ([]Message, error) {
	rows, err := s.r.pool.Query(ctx, s.r.sql.fetch, channel, routerBatchSize)
	if err != nil {
		return nil, err
	}
	batch, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Message, error) {
		m := Message{Channel: channel, Durable: true, Term: s.term}
		err := row.Scan(&m.ID, &m.Payload, &m.Attempts)
		return m, err
	})
	return batch, err
}

// finish runs sql on message id after its delivery, even if ctx has ended
// meanwhile: a handled message must still be deleted.
func (s *serving) finish(ctx context.Context, sql string, id int64) error {
	finishCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), routerFinishTimeout)
	defer cancel()
	if _, err := s.r.pool.Exec(finishCtx, sql, id); err != nil {
		return wrapError(finishCtx, fmt.Sprintf("router: message %d", id), err)
	}
	return nil
}

// failed makes channel wait for its retry, with a backoff that doubles at
// each failure in a row, and logs why.
func (s *serving) failed(channel, msg string, attrs ...any) {
	rt, ok := s.retries[channel]
	if ok {
		rt.delay = min(2*rt.delay, routerRetryMax)
	} else {
		rt.delay = routerRetryMin
	}
	rt.at = time.Now().Add(rt.delay)
	s.retries[channel] = rt
	s.log.Warn(msg, append([]any{slog.String("channel", channel), slog.Duration("retry_in", rt.delay)}, attrs...)...)
}
