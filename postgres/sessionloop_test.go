package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"
)

// These tests drive a sessionLoop with scripted connect and serve funcs and
// a pause that only records the wait it is asked for, so that they need
// neither a server nor the clock (but for the waits that ctx cuts short).

const (
	testRetryMin = 10 * time.Millisecond
	testRetryMax = 80 * time.Millisecond
)

// attempt is what one scripted attempt of a sessionLoop does.
type attempt struct {
	connectErr error // connect fails with it, if not nil
	ready      bool  // serve calls ready
	serveErr   error // serve returns it
}

// fakeConn counts how often it was closed.
type fakeConn struct {
	mu     sync.Mutex
	closes int
}

func (c *fakeConn) Close(context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closes++
	return nil
}

func (c *fakeConn) closeCount() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closes
}

// loopBundle is a sessionLoop under test and what it did.
type loopBundle struct {
	loop  *sessionLoop[*fakeConn]
	logs  *recordedLogs
	waits []time.Duration // the waits the loop paused for, in order
	conns []*fakeConn     // the connections connect opened, in order
}

// setupLoop returns a sessionLoop that follows script, one attempt per
// connect, and after the last ends its ctx (cancel), so that run returns.
// Its pause records the wait and returns at once.
func setupLoop(t *testing.T, cancel context.CancelFunc, script ...attempt) *loopBundle {
	t.Helper()
	b := &loopBundle{logs: &recordedLogs{}}
	next := 0
	b.loop = &sessionLoop[*fakeConn]{
		connect: func(ctx context.Context) (*fakeConn, error) {
			if next == len(script) {
				cancel()
				return nil, fmt.Errorf("connecting: %w", ctx.Err())
			}
			if err := script[next].connectErr; err != nil {
				next++
				return nil, err
			}
			conn := &fakeConn{}
			b.conns = append(b.conns, conn)
			return conn, nil
		},
		serve: func(ctx context.Context, conn *fakeConn, ready func()) error {
			a := script[next]
			next++
			if a.ready {
				ready()
			}
			return a.serveErr
		},
		retryMin: testRetryMin,
		retryMax: testRetryMax,
		log:      slog.New(b.logs),
		lost:     "lost",
		back:     "back",
		pause: func(ctx context.Context, d time.Duration) error {
			b.waits = append(b.waits, d)
			return nil
		},
	}
	return b
}

// run runs the loop to its end, and checks that it closed every
// connection once.
func (b *loopBundle) run(t *testing.T, ctx context.Context) error {
	t.Helper()
	err := b.loop.run(ctx)
	for i, conn := range b.conns {
		if n := conn.closeCount(); n != 1 {
			t.Errorf("connection %d was closed %d times, want once", i+1, n)
		}
	}
	return err
}

// checkWaits checks that the loop paused once for each of want, for at
// least that long and at most a fifth longer.
func (b *loopBundle) checkWaits(t *testing.T, want ...time.Duration) {
	t.Helper()
	if len(b.waits) != len(want) {
		t.Fatalf("the loop paused %d times (%v), want %d (%v)", len(b.waits), b.waits, len(want), want)
	}
	for i, d := range b.waits {
		if d < want[i] || d > want[i]+want[i]/5 {
			t.Errorf("wait %d is %v, want %v plus at most a fifth (all waits: %v)", i+1, d, want[i], b.waits)
		}
	}
}

var errBroken = errors.New("broken")

func TestSessionLoop(t *testing.T) {
	t.Parallel()

	t.Run("the wait doubles from retryMin after each failure, up to retryMax, with at most a fifth added", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		fail := attempt{connectErr: errBroken}
		b := setupLoop(t, cancel, fail, fail, fail, fail, fail, fail)
		if err := b.run(t, ctx); err != nil {
			t.Fatalf("run returned %v after ctx ended, want nil", err)
		}
		b.checkWaits(t, 10*time.Millisecond, 20*time.Millisecond, 40*time.Millisecond,
			80*time.Millisecond, 80*time.Millisecond, 80*time.Millisecond)
	})

	t.Run("a session that got going resets the wait to retryMin", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		fail := attempt{connectErr: errBroken}
		b := setupLoop(t, cancel, fail, fail, fail, attempt{ready: true, serveErr: errBroken}, fail, fail)
		if err := b.run(t, ctx); err != nil {
			t.Fatalf("run returned %v after ctx ended, want nil", err)
		}
		b.checkWaits(t, 10*time.Millisecond, 20*time.Millisecond, 40*time.Millisecond,
			10*time.Millisecond, 20*time.Millisecond, 40*time.Millisecond)
	})

	t.Run("a session that failed before it got going is one more failed attempt", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		fail := attempt{connectErr: errBroken}
		b := setupLoop(t, cancel, fail, attempt{serveErr: errBroken}, fail)
		if err := b.run(t, ctx); err != nil {
			t.Fatalf("run returned %v after ctx ended, want nil", err)
		}
		b.checkWaits(t, 10*time.Millisecond, 20*time.Millisecond, 40*time.Millisecond)
		b.logs.check(t, "WARN lost failures=1", "DEBUG lost failures=2", "DEBUG lost failures=3")
	})

	t.Run("a loss is logged at warning level once per outage, later failures at debug level, and the recovery at info level", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		fail := attempt{connectErr: errBroken}
		b := setupLoop(t, cancel,
			fail, fail, // an outage from the start
			attempt{ready: true, serveErr: errBroken}, // back, then lost
			attempt{ready: true, serveErr: errBroken}, // back again, lost again
			fail)
		if err := b.run(t, ctx); err != nil {
			t.Fatalf("run returned %v after ctx ended, want nil", err)
		}
		b.logs.check(t,
			"WARN lost failures=1", "DEBUG lost failures=2",
			"INFO back", "WARN lost failures=1",
			"INFO back", "WARN lost failures=1", "DEBUG lost failures=2")
	})

	t.Run("a session that got going at once logs no recovery, and ready counts once", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		b := setupLoop(t, cancel)
		b.loop.connect = func(context.Context) (*fakeConn, error) {
			conn := &fakeConn{}
			b.conns = append(b.conns, conn)
			return conn, nil
		}
		b.loop.serve = func(ctx context.Context, conn *fakeConn, ready func()) error {
			ready()
			ready()
			if len(b.conns) == 2 {
				cancel()
				return ctx.Err()
			}
			return errBroken
		}
		if err := b.run(t, ctx); err != nil {
			t.Fatalf("run returned %v after ctx ended, want nil", err)
		}
		b.checkWaits(t, 10*time.Millisecond)
		b.logs.check(t, "WARN lost failures=1", "INFO back")
	})

	t.Run("a permanent error of serve stops the loop, which returns it unmarked and does not log it", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		fail := attempt{connectErr: errBroken}
		b := setupLoop(t, cancel, fail, attempt{ready: true, serveErr: permanent(errBroken)}, fail)
		if err := b.run(t, ctx); err != errBroken {
			t.Fatalf("run returned %v, want errBroken itself", err)
		}
		if len(b.conns) != 1 {
			t.Errorf("connect opened %d connections, want 1: none after the permanent error", len(b.conns))
		}
		b.checkWaits(t, 10*time.Millisecond)
		b.logs.check(t, "WARN lost failures=1", "INFO back")
	})

	t.Run("an error wrapping ErrPooledSession stops the loop, from connect or from serve", func(t *testing.T) {
		t.Parallel()
		pooled := fmt.Errorf("checking the session: %w", ErrPooledSession)
		for _, a := range []attempt{{connectErr: pooled}, {serveErr: pooled}} {
			ctx, cancel := context.WithCancel(t.Context())
			b := setupLoop(t, cancel, a, attempt{connectErr: errBroken})
			if err := b.run(t, ctx); err != pooled {
				t.Errorf("run returned %v, want the error wrapping ErrPooledSession", err)
			}
			cancel()
			b.checkWaits(t)
			b.logs.check(t)
		}
	})

	t.Run("ctx ending while the loop waits to connect again returns at once", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		b := setupLoop(t, cancel)
		b.loop.retryMin, b.loop.retryMax = time.Hour, time.Hour
		b.loop.pause = nil // the loop's own timer
		b.logs.logged = make(chan string, 1)
		connects := 0
		b.loop.connect = func(context.Context) (*fakeConn, error) {
			connects++
			return nil, errBroken
		}
		done := make(chan error, 1)
		go func() { done <- b.loop.run(ctx) }()
		<-b.logs.logged // the loop is about to wait an hour
		cancel()
		waitReturned(t, done)
		if connects != 1 {
			t.Errorf("connect was called %d times, want once", connects)
		}
	})

	t.Run("ctx ending while serve runs returns once serve has, closing the connection without logging a loss", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		b := setupLoop(t, cancel)
		b.loop.connect = func(context.Context) (*fakeConn, error) {
			conn := &fakeConn{}
			b.conns = append(b.conns, conn)
			return conn, nil
		}
		serving := make(chan struct{})
		b.loop.serve = func(ctx context.Context, conn *fakeConn, ready func()) error {
			ready()
			close(serving)
			<-ctx.Done()
			return fmt.Errorf("waiting for notifications: %w", ctx.Err())
		}
		done := make(chan error, 1)
		go func() { done <- b.run(t, ctx) }()
		<-serving
		cancel()
		waitReturned(t, done)
		b.checkWaits(t)
		b.logs.check(t)
	})

	t.Run("ctx ending while connect runs returns at once without logging a loss", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		b := setupLoop(t, cancel)
		connecting := make(chan struct{})
		b.loop.connect = func(ctx context.Context) (*fakeConn, error) {
			close(connecting)
			<-ctx.Done()
			return nil, fmt.Errorf("connecting: %w", ctx.Err())
		}
		done := make(chan error, 1)
		go func() { done <- b.loop.run(ctx) }()
		<-connecting
		cancel()
		waitReturned(t, done)
		b.checkWaits(t)
		b.logs.check(t)
	})
}

// waitReturned waits for the result of a loop's run whose ctx has ended:
// nil, at once. The bound only keeps a broken loop from hanging the tests.
func waitReturned(t *testing.T, done <-chan error) {
	t.Helper()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("run returned %v after ctx ended, want nil", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("run did not return after ctx ended")
	}
}

// recordedLogs is a slog.Handler that keeps each record as its level, its
// message and its failures attribute, if any.
type recordedLogs struct {
	mu      sync.Mutex
	records []string
	// logged, if not nil, receives each record, or misses it if full.
	logged chan string
}

func (l *recordedLogs) Enabled(context.Context, slog.Level) bool { return true }

func (l *recordedLogs) Handle(_ context.Context, r slog.Record) error {
	s := r.Level.String() + " " + r.Message
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "failures" {
			s += fmt.Sprintf(" failures=%d", a.Value.Int64())
		}
		return true
	})
	l.mu.Lock()
	l.records = append(l.records, s)
	l.mu.Unlock()
	if l.logged != nil {
		select {
		case l.logged <- s:
		default:
		}
	}
	return nil
}

func (l *recordedLogs) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *recordedLogs) WithGroup(string) slog.Handler      { return l }

// check checks that the records are want, in order.
func (l *recordedLogs) check(t *testing.T, want ...string) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	if !slices.Equal(l.records, want) {
		t.Errorf("logged %q, want %q", l.records, want)
	}
}
