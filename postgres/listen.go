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

// Timing of the wake-up listener.
const (
	// listenRetryMin and listenRetryMax bound the backoff between attempts
	// to open the listener connection again; it doubles at each failure.
	listenRetryMin = 50 * time.Millisecond
	listenRetryMax = 5 * time.Second
	// listenPingEvery is how long the listener waits for a notification
	// before it checks that its connection still works, so that a
	// connection that died silently is noticed.
	listenPingEvery = 30 * time.Second
	// listenCallTimeout bounds connecting, LISTEN, a ping and closing.
	listenCallTimeout = 10 * time.Second
)

// Watch implements leader.Store. The channel receives a value soon after the
// lease for name is released or granted by any LeaseStore on the same table
// and channel, and once after the listener connection is (re)established,
// as a notification may have been missed before. Values are coalesced (the
// channel has a buffer of one) and may be spurious. The channel is closed
// after ctx ends.
//
// The first Watch opens the store's listener connection in the background;
// Watch does not wait for it. While the listener cannot LISTEN (the server
// is down, or refuses LISTEN), the channel stays silent. After Close it
// stays silent too, and Watch returns an error wrapping ErrClosed.
func (s *LeaseStore) Watch(ctx context.Context, name string) (<-chan struct{}, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("postgres: %s: %w", call("watch", name), err)
	}
	ch := make(chan struct{}, 1)
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, fmt.Errorf("postgres: %s: %w", call("watch", name), ErrClosed)
	}
	set := s.watchers[name]
	if set == nil {
		set = make(map[chan struct{}]struct{})
		s.watchers[name] = set
	}
	set[ch] = struct{}{}
	if s.stop == nil {
		// The watcher is registered before the listener starts, so the
		// wake-up it sends once listening reaches this watcher, covering
		// events between now and then.
		listenCtx, stop := context.WithCancel(context.Background())
		s.stop, s.stopped = stop, make(chan struct{})
		go s.listen(listenCtx, s.stopped)
	}
	s.mu.Unlock()

	context.AfterFunc(ctx, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if set := s.watchers[name]; set != nil {
			delete(set, ch)
			if len(set) == 0 {
				delete(s.watchers, name)
			}
		}
		close(ch) // under mu, so wake never sends on a closed channel
	})
	return ch, nil
}

// Close stops the wake-up listener and closes its connection, and waits
// until it has. Watchers then stay silent until their contexts end. The
// store's other methods keep working while the pool is open; Close does not
// close the pool. Close may be called more than once.
func (s *LeaseStore) Close() {
	s.mu.Lock()
	s.closed = true
	stop, stopped := s.stop, s.stopped
	s.mu.Unlock()
	if stop != nil {
		stop()
		<-stopped
	}
}

// wake wakes the watchers of the name in payload, or all watchers for an
// empty payload (see maxPayloadLength).
func (s *LeaseStore) wake(payload string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if payload == "" {
		s.wakeAllLocked()
		return
	}
	for ch := range s.watchers[payload] {
		select {
		case ch <- struct{}{}:
		default: // a value is pending already; coalesce
		}
	}
}

func (s *LeaseStore) wakeAllLocked() {
	for _, set := range s.watchers {
		for ch := range set {
			select {
			case ch <- struct{}{}:
			default:
			}
		}
	}
}

// listen keeps a listener connection open until ctx ends, opening it again
// with backoff whenever it fails, and closes stopped when it returns.
func (s *LeaseStore) listen(ctx context.Context, stopped chan<- struct{}) {
	defer close(stopped)
	retry := listenRetryMin
	failures := 0
	for {
		listened, err := s.listenOnce(ctx, failures > 0)
		if ctx.Err() != nil {
			return
		}
		if listened {
			retry, failures = listenRetryMin, 0
		}
		failures++
		level := slog.LevelWarn
		if failures > 1 {
			level = slog.LevelDebug // said once per outage
		}
		wait := retry + rand.N(retry/5+1)
		s.log.Log(ctx, level, "wake-up listener lost; watchers are silent until it is back",
			slog.Any("error", err), slog.Duration("retry_in", wait), slog.Int("failures", failures))
		timer := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			timer.Stop()
			return
		case <-timer.C:
		}
		retry = min(2*retry, listenRetryMax)
	}
}

// listenOnce opens a connection, LISTENs, wakes every watcher, and passes
// notifications on until the connection fails or ctx ends. It reports
// whether LISTEN succeeded, and why it returned.
func (s *LeaseStore) listenOnce(ctx context.Context, recovering bool) (listened bool, err error) {
	callCtx, cancel := context.WithTimeout(ctx, listenCallTimeout)
	conn, err := pgx.ConnectConfig(callCtx, s.listenConfig)
	cancel()
	if err != nil {
		return false, fmt.Errorf("connecting: %w", err)
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(closeCtx) // best effort; the connection is dropped either way
	}()

	callCtx, cancel = context.WithTimeout(ctx, listenCallTimeout)
	_, err = conn.Exec(callCtx, "LISTEN "+pgx.Identifier{s.opts.Channel}.Sanitize())
	cancel()
	if err != nil {
		return false, fmt.Errorf("LISTEN: %w", err)
	}
	if recovering {
		s.log.Info("wake-up listener is back")
	}
	// Notifications sent before LISTEN took effect were missed: wake
	// everyone so that followers look now instead of at the expiry.
	s.mu.Lock()
	s.wakeAllLocked()
	s.mu.Unlock()
	if s.onListen != nil {
		s.onListen(conn.PgConn().PID())
	}

	for {
		waitCtx, cancel := context.WithTimeout(ctx, s.pingEvery)
		n, err := conn.WaitForNotification(waitCtx)
		cancel()
		switch {
		case err == nil:
			s.wake(n.Payload)
		case ctx.Err() != nil:
			return true, ctx.Err()
		case errors.Is(err, context.DeadlineExceeded) && !conn.IsClosed():
			// Quiet for a while: make sure the connection still works.
			pingCtx, cancel := context.WithTimeout(ctx, listenCallTimeout)
			err := conn.Ping(pingCtx)
			cancel()
			if err != nil {
				return true, fmt.Errorf("ping: %w", err)
			}
		default:
			return true, fmt.Errorf("waiting for notifications: %w", err)
		}
	}
}
