package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// Why a session cannot do what was asked.
var (
	errNotHeld = errors.New("this session does not hold the lock under that term")
	// errSessionDropped is added to the error of a call after which the
	// session's connection was closed: any lock it held is freed (at once,
	// or as soon as the server notices).
	errSessionDropped = errors.New("session closed, freeing its lock")
	// errSessionGone means the session was closed for good (reaped or the
	// store closed) while the call waited for it.
	errSessionGone = errors.New("session closed while waiting for it")
	// errStaged refuses a call on a session on which a handover's release
	// is staged (see advisoryPrepared.Stage): only its Commit or Abort
	// may use the session until then.
	errStaged = errors.New("a handover's release is staged on this session")
)

type sessionKey struct{ name, token string }

// session is one candidate's connection: the one that campaigns for, holds
// and releases the lock of one election name for one Elector token.
//
// turn serializes the use of conn. While the session holds the lock and no
// call uses it, a reader goroutine waits on conn, so that the FATAL message
// a server sends before it ends the session is seen at once (see Lost).
type session struct {
	name, token string
	key         int64
	turn        chan struct{} // capacity 1: held while using conn

	// Owned by whoever holds turn.
	conn       *pgx.Conn
	opening    *opening // the connection being opened, if any (see open)
	stopReader context.CancelFunc
	readerDone chan struct{}

	gone bool // closed for good; owned by whoever holds turn
	// staged is set while a handover's release is staged on conn, in a
	// transaction left open (see advisoryPrepared.Stage); owned by
	// whoever holds turn.
	staged bool
	// stagedBy is the prepared handover whose release is staged, while
	// staged is set; owned by whoever holds turn.
	stagedBy *advisoryPrepared

	mu       sync.Mutex
	held     bool
	term     uint64
	holderID string
	lost     chan struct{} // while held: closed when the lease is known lost
	// unwatched is the term of the last tenure whose loss nobody watches
	// for any more (see AdvisoryStore.StopLossWatch): while the session
	// holds the lease under it, no reader runs between calls.
	unwatched uint64
	lastUsed  time.Time
	// announced is the last term whose grant's notification this session
	// sent (see notifyLater); owned by whoever holds turn.
	announced uint64
}

// session returns the session for name and token, creating it (without
// connecting) if needed.
func (s *AdvisoryStore) session(name, token string) (*session, error) {
	s.smu.Lock()
	defer s.smu.Unlock()
	if s.closing {
		return nil, fmt.Errorf("postgres: %s: %w", call("acquire", name), ErrClosed)
	}
	k := sessionKey{name, token}
	ss := s.sessions[k]
	if ss == nil {
		ss = &session{name: name, token: token, key: s.Key(name), turn: make(chan struct{}, 1), lastUsed: time.Now()}
		s.sessions[k] = ss
	}
	return ss, nil
}

// heldSession returns the session for name and token if it holds the lock
// under term, and nil otherwise.
func (s *AdvisoryStore) heldSession(name, token string, term uint64) *session {
	s.smu.Lock()
	ss := s.sessions[sessionKey{name, token}]
	s.smu.Unlock()
	if ss == nil || !ss.heldUnder(term) {
		return nil
	}
	return ss
}

// do runs fn on the session's connection, connecting first if connect is
// set and there is none (otherwise fn is not run and do returns
// errNotHeld). If fn fails leaving the session's state unknown
// (errSessionReset) or its connection closed, the session is dropped: its
// connection is closed, which frees any lock, a held lease is marked lost,
// and the error wraps errSessionDropped.
//
// While a handover's release is staged on the session, do returns
// errStaged without running fn (see doStaged); but once the handover's
// Commit or Abort has ended without reaching the session (its context
// ended while it waited for the session's turn; see
// advisoryPrepared.abandon), do drops the session, which rolls the staged
// release back and frees the lease, and returns an error wrapping
// errSessionDropped, so that a session is never left staged for good.
func (ss *session) do(ctx context.Context, s *AdvisoryStore, connect bool, fn func(conn *pgx.Conn) error) error {
	return ss.run(ctx, s, connect, false, fn)
}

// doStaged is do for the Commit and Abort of a handover staged on the
// session (see advisoryPrepared.Stage), and for Stage itself: it runs fn
// whether or not a release is staged.
func (ss *session) doStaged(ctx context.Context, s *AdvisoryStore, fn func(conn *pgx.Conn) error) error {
	return ss.run(ctx, s, false, true, fn)
}

// run is do; fn runs while a release is staged only if staged is set.
func (ss *session) run(ctx context.Context, s *AdvisoryStore, connect, staged bool, fn func(conn *pgx.Conn) error) error {
	select {
	case ss.turn <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	defer func() { <-ss.turn }()
	if ss.gone {
		return errSessionGone
	}
	ss.haltReader()
	defer ss.touch()
	if ss.conn != nil && ss.conn.IsClosed() {
		ss.drop() // ended while idle: the reader saw it, or it broke
	}
	if ss.conn == nil {
		ss.markLost()
		if !connect {
			return errNotHeld
		}
		conn, err := ss.open(ctx, s)
		if err != nil {
			return err
		}
		ss.conn = conn
	}
	var err error
	if ss.staged && !staged && ss.stagedBy != nil && ss.stagedBy.abandoned.Load() {
		ss.drop()
		err = fmt.Errorf("%w (%w)", errStaged, errSessionDropped)
	} else if ss.staged && !staged {
		err = errStaged
	} else if err = fn(ss.conn); err != nil && (errors.Is(err, errSessionReset) || ss.conn.IsClosed()) {
		ss.drop()
		err = fmt.Errorf("%w (%w)", err, errSessionDropped)
	}
	if ss.watched() {
		ss.startReader(s.log)
	}
	return err
}

// opening is a session's connection being opened in the background, on
// the store's context (see session.open).
type opening struct {
	cancel context.CancelFunc
	done   chan struct{} // closed once conn and err are set
	conn   *pgx.Conn
	err    error
}

// open returns a new connection for the session. It is opened in the
// background, within dialer.within of the store's context rather than
// ctx: pgx tries the hosts of a multi-host connection string in turn,
// each for the connect timeout, so a call's deadline (an Elector's is
// about its RenewInterval) would end every attempt on a first host that
// never answers, and the hosts after it would never be tried. If ctx ends
// first, open returns ctx's error, and the session's next call takes the
// connection. The caller holds turn.
func (ss *session) open(ctx context.Context, s *AdvisoryStore) (*pgx.Conn, error) {
	if ss.opening == nil {
		ss.opening = s.openLater()
	}
	o := ss.opening
	select {
	case <-o.done:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	ss.opening = nil
	return o.conn, o.err
}

// openLater starts opening a connection of the store's own in the
// background, ended by Close.
func (s *AdvisoryStore) openLater() *opening {
	ctx, cancel := context.WithTimeout(s.bgCtx, s.dialer.within()+listenCallTimeout)
	o := &opening{cancel: cancel, done: make(chan struct{})}
	s.bg.Go(func() {
		defer close(o.done)
		defer cancel()
		o.conn, o.err = s.connect(ctx)
	})
	return o
}

// abandon ends the opening of the session's connection, if any, and
// closes the connection if it was opened. The caller holds turn.
func (ss *session) abandon() {
	if o := ss.opening; o != nil {
		ss.opening = nil
		o.cancel()
		<-o.done
		if o.conn != nil {
			closeConn(o.conn)
		}
	}
}

// drop closes the connection (the server frees its locks when it sees it
// close) and marks a held lease lost. The caller holds turn, and the
// reader is stopped.
func (ss *session) drop() {
	if ss.conn != nil {
		closeConn(ss.conn)
		ss.conn = nil
	}
	ss.staged, ss.stagedBy = false, nil // with the connection, the staged transaction is gone
	ss.markLost()
}

// markLost marks a held lease lost.
func (ss *session) markLost() {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.held {
		ss.held = false
		close(ss.lost)
		ss.lost = nil
	}
}

func (ss *session) grant(term uint64, holderID string) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.held {
		close(ss.lost) // the previous term's lease is over
	}
	ss.held, ss.term, ss.holderID, ss.lost = true, term, holderID, make(chan struct{})
}

func (ss *session) release() { ss.markLost() }

func (ss *session) isHeld() bool {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.held
}

// watched reports whether the session holds the lease under a term
// whose loss is still watched for (see AdvisoryStore.StopLossWatch).
func (ss *session) watched() bool {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.held && ss.term != ss.unwatched
}

// unwatch records that nobody watches for the loss of term any more.
func (ss *session) unwatch(term uint64) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	ss.unwatched = term
}

func (ss *session) heldUnder(term uint64) bool {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.held && ss.term == term
}

func (ss *session) lostChan(term uint64) chan struct{} {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.held && ss.term == term {
		return ss.lost
	}
	return nil
}

func (ss *session) id() string {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.holderID
}

func (ss *session) touch() {
	ss.mu.Lock()
	ss.lastUsed = time.Now()
	ss.mu.Unlock()
}

// startReader waits on the idle connection until haltReader, or until the
// connection ends: the server's FATAL message (sent before it frees the
// session's locks) or a broken connection marks the lease lost at once,
// and is logged at debug level (the record's time is when the store
// learned of the loss). The caller holds turn.
func (ss *session) startReader(log *slog.Logger) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	ss.stopReader, ss.readerDone = cancel, done
	conn := ss.conn
	go func() {
		defer close(done)
		for {
			_, err := conn.WaitForNotification(ctx)
			switch {
			case ctx.Err() != nil:
				return // halted: a call needs the connection
			case err == nil:
				continue // a notification; the session does not LISTEN, but never mind
			default:
				ss.markLost()
				log.Debug("advisory session ended while idle; lease marked lost",
					slog.String("election", ss.name), slog.Any("error", err))
				return
			}
		}
	}()
}

// haltReader stops the reader, if any, and waits for it. The caller holds
// turn.
func (ss *session) haltReader() {
	if ss.stopReader != nil {
		ss.stopReader()
		<-ss.readerDone
		ss.stopReader, ss.readerDone = nil, nil
	}
}

// close closes the session for good.
func (ss *session) close() {
	ss.turn <- struct{}{}
	defer func() { <-ss.turn }()
	ss.closeLocked()
}

// closeLocked closes the session for good; the caller holds turn.
func (ss *session) closeLocked() {
	ss.gone = true
	ss.haltReader()
	ss.abandon()
	ss.drop()
}

// reap closes the sessions that hold nothing and were not used for
// sessionIdle, until the store is closed.
func (s *AdvisoryStore) reap() {
	tick := time.NewTicker(max(s.sessionIdle/4, 10*time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case <-s.bgCtx.Done():
			return
		case <-tick.C:
		}
		s.smu.Lock()
		var idle []*session
		for k, ss := range s.sessions {
			ss.mu.Lock()
			unused := !ss.held && time.Since(ss.lastUsed) > s.sessionIdle
			ss.mu.Unlock()
			if !unused {
				continue
			}
			select {
			case ss.turn <- struct{}{}: // not in use; kept until closed below
				delete(s.sessions, k)
				idle = append(idle, ss)
			default:
			}
		}
		s.smu.Unlock()
		for _, ss := range idle {
			ss.closeLocked()
			<-ss.turn
		}
	}
}
