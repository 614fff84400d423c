package postgres

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leaderelect/leader"
)

// lockWaiter is the lock waiter of one watched name.
type lockWaiter struct {
	refs int
	stop context.CancelFunc
	// looked is closed after the lock waiter's first look, and the
	// wake-up that look may owe (see waitOn). Tests wait on it.
	looked   chan struct{}
	lookOnce sync.Once
}

// firstLookDone closes w.looked, once.
func (w *lockWaiter) firstLookDone() { w.lookOnce.Do(func() { close(w.looked) }) }

// Watch implements leader.Store. The channel receives a value soon after the
// lock for name is released or granted (a NOTIFY, as for the LeaseStore),
// and soon after the holder's session ends without a release: while anyone
// watches name, one connection of the store's waits in
// pg_advisory_lock_shared for the holder to go (see AdvisoryStore).
// Values are coalesced and may be spurious. The channel is closed after
// ctx ends.
func (s *AdvisoryStore) Watch(ctx context.Context, name string) (<-chan struct{}, error) {
	return s.watch(ctx, name, watcher{kind: watchAll})
}

// WatchFree implements leader.FreeWatcher: it is Watch without the
// wake-ups for grants. The channel receives a value soon after the lock
// for name is released, and soon after its holder's session ends without
// a release.
func (s *AdvisoryStore) WatchFree(ctx context.Context, name string) (<-chan struct{}, error) {
	return s.watch(ctx, name, watcher{kind: watchFree})
}

// WatchFreeFor implements leader.HandoverWatcher: it is WatchFree, but a
// handover of the lease to another candidate than c wakes the channel
// only if nobody was granted the lease by the end of the reservation.
// The lock waiter, woken as the holder lets go, reads the name's row
// in the same round trip: a handover's reservation is there.
func (s *AdvisoryStore) WatchFreeFor(ctx context.Context, name string, c leader.Candidate) (<-chan struct{}, error) {
	return s.watch(ctx, name, watcher{kind: watchFree, token: c.Token})
}

// watch registers a watcher of name (see wakeups.watch) and keeps a lock
// waiter for name while anyone watches it.
func (s *AdvisoryStore) watch(ctx context.Context, name string, wt watcher) (<-chan struct{}, error) {
	ch, err := s.wakeups.watch(ctx, name, wt)
	if err != nil {
		return nil, err
	}
	s.smu.Lock()
	defer s.smu.Unlock()
	if s.closing {
		return ch, nil
	}
	w := s.waiters[name]
	if w == nil {
		wctx, cancel := context.WithCancel(context.Background())
		w = &lockWaiter{stop: cancel, looked: make(chan struct{})}
		s.waiters[name] = w
		s.bg.Go(func() { s.waitLoop(wctx, name, w) })
	}
	w.refs++
	context.AfterFunc(ctx, func() {
		s.smu.Lock()
		defer s.smu.Unlock()
		w.refs--
		if w.refs == 0 && s.waiters[name] == w {
			delete(s.waiters, name)
			delete(s.freed, name)
			w.stop()
		}
	})
	return ch, nil
}

// waitLoop runs name's lock waiter until ctx ends, connecting again with
// backoff when its connection fails.
func (s *AdvisoryStore) waitLoop(ctx context.Context, name string, w *lockWaiter) {
	sub, unsubscribe := s.wakeups.subscribe(name, watchGrants)
	defer func() {
		unsubscribe()
		s.wakeups.uncover(name)
	}()
	log := s.wakeups.log.With(slog.String("election", name))
	loop := sessionLoop[*pgx.Conn]{
		connect: s.connectWaiter,
		serve: func(ctx context.Context, conn *pgx.Conn, ready func()) error {
			err := s.waitOn(ctx, conn, name, sub, w, ready)
			// Closed before the wake-up (the loop's own close then does
			// nothing), as the candidates it wakes should not meet a
			// lock request of this session that the server still queues.
			closeConn(conn)
			if ctx.Err() == nil {
				s.wake(name) // the holder may have gone while we were not waiting
			}
			return err
		},
		retryMin: listenRetryMin,
		retryMax: listenRetryMax,
		log:      log,
		lost:     "lock waiter lost; followers learn of a vanished holder only at its expiry until it is back",
		back:     "lock waiter is back",
	}
	if err := loop.run(ctx); err != nil {
		// ErrPooledSession, the loop's only permanent error here.
		log.Warn("lock waiter is off: it needs a session of its own", slog.Any("error", err))
	}
}

// connectWaiter opens a lock waiter's connection: a session of its own,
// whose blocking statement no server default may cut short, whose server
// process notices within a second that the waiter went away, and whose
// transactions read committed whatever the server's default, so that the
// read that follows a wait in the same round trip (see awaitGoing) sees
// what the holder committed as it let go.
func (s *AdvisoryStore) connectWaiter(ctx context.Context) (*pgx.Conn, error) {
	config := s.dialer.connConfig()
	for k, v := range map[string]string{
		"statement_timeout":                "0",
		"lock_timeout":                     "0",
		"idle_session_timeout":             "0",
		"client_connection_check_interval": "1000",
		"default_transaction_isolation":    "read committed",
	} {
		config.RuntimeParams[k] = v
	}
	conn, err := s.dialer.connect(ctx, config)
	if err != nil {
		return nil, err
	}
	callCtx, cancel := context.WithTimeout(ctx, listenCallTimeout)
	defer cancel()
	if err := checkSession(callCtx, conn, "the advisory store's lock waiter"); err != nil {
		closeConn(conn)
		return nil, err
	}
	// Its looks are planned before the first (see planAhead); best
	// effort.
	if err := planAhead(callCtx, conn, []string{s.sql.waiter, s.sql.reserved}); err != nil {
		if callCtx.Err() != nil {
			closeConn(conn)
			return nil, err
		}
		s.opts.Logger.Debug("planning a lock waiter's statements failed; they are planned as they run", slog.Any("error", err))
	}
	return conn, nil
}

// waitOn waits, while the lock of name is held, for its holder to go, and
// wakes name's watchers each time it does. While the lock is free it waits
// for a grant (sub) instead, so that it never spins.
//
// It waits on the holder's mark (see markClass), which the holder takes
// with the lock: the lock itself is left to candidates alone, and the
// first of them takes it at once. The release notifications of the
// holder it waits on, and of the last holder it saw go, wake only the
// watchers of every event (see coverage), so that a follower is woken once
// per handover. Its own subscription, sub, is to grants alone.
//
// A lock held without its mark, while the row names another backend or
// none, is most likely a grant in flight: it takes the lock, then its
// mark, then commits its row. So is one whose row a prepared handover's
// release wrote for its successor (claiming): the successor's claim takes
// the lock and its mark after the row was committed. waitOn looks again at the grant's
// announcement, or after markLook, then twice as long each time. A holder
// without its mark that the row names (a store of an older version, or
// one whose session ended and whose lock outlasts its mark), or a lock held
// without its mark and without a row naming its holder for grantInFlight
// (a stray session holds the lock's key), is waited for on the lock
// itself, as before the mark. Deciding by the row rather than by time
// alone, a lock waiter that looks twice while a slow grant runs, woken in
// between by another event, does not mistake the grant for a holder
// without its mark and wait on its lock until its release.
func (s *AdvisoryStore) waitOn(ctx context.Context, conn *pgx.Conn, name string, sub <-chan struct{}, w *lockWaiter, ready func()) error {
	key := s.Key(name)
	hi, lo := keyHalves(key)
	// inFlight is when the looks in a row that found the lock held
	// without its mark, and the row not naming its holder, began (zero
	// if the last look did not); inFlightWait is how long to wait before
	// the next such look.
	var (
		inFlight     time.Time
		inFlightWait time.Duration
	)
	// owed: a look found the lock held, and this lock waiter has not
	// woken the watchers since. A look that then finds the lock free
	// wakes them: a holder may go between two looks, as one whose lock
	// outlasts its mark, or one that dies within markLook of its grant.
	// The first look is owed too: a watcher may have seen a holder that
	// went before this lock waiter was connected, with no notification
	// (a session that ended) and after the listener's wake-up at LISTEN.
	owed := true
	// wokeFor is the last backend this lock waiter woke the watchers for
	// the going of; gone is the same while that backend's lock may still
	// outlast its mark, and 0 otherwise. A look that finds the lock free
	// while the row names a holder wakes the watchers if that holder is
	// gone (its lock outlasted its mark: its session ended, and its row
	// still names it), or one they were never woken for (granted and gone
	// between two looks, without a release). After a release (which clears
	// the row first) it does not: the candidates woken at the mark may
	// simply not have come yet.
	var gone, wokeFor int32
	// next is the backend that the last wait found granted the lease as
	// its predecessor let go (a handover's successor, or a named
	// candidate's grant), seen holding the lock: the next wait is on its
	// mark, without a look. Its grant took the mark before its row was
	// committed; if it has gone since, its mark is free and the wait on
	// it ends at once, as at any going. (A stray session that holds the
	// same two keys as its mark would make that wait last until it lets
	// go; a look would have waited on the lock itself.)
	var next holding
	// pending is a followed holder whose mark was freed while it still
	// held the lock (kept, below): the next look records its freeing
	// once it sees the lock freed, timed then. Recorded at the mark, the
	// sighting could come before the end: a holder without a mark (a
	// store of an older version, or a grant whose mark a stray session
	// held) has its mark "freed" at once, and may lead on for long.
	var pending freeing
	for {
		select {
		case <-sub: // about to look anyway
		default:
		}
		var (
			holder    *int32 // the PID of the lock's holder, if it is held
			marked    bool   // whether the holder holds its mark
			rowHolder *int32 // the backend the row names, if it has a holder
			rowTerm   *int64 // the row's term, with rowHolder
			claiming  bool   // the row is a handover's grant, perhaps not yet claimed
		)
		hinted := next.pid != 0
		if hinted {
			n, t := next.pid, next.term
			holder, marked, rowHolder, rowTerm, next = &n, true, &n, &t, holding{}
		} else {
			if err := conn.QueryRow(ctx, s.sql.waiter, hi, lo, name).Scan(&holder, &marked, &rowHolder, &rowTerm, &claiming); err != nil {
				return err // waitLoop wakes the watchers
			}
			ready() // the session looks: it got going (see sessionLoop)
		}
		if holder == nil || marked {
			inFlight = time.Time{}
		}
		followed := pending
		pending = freeing{}
		if holder == nil {
			if followed.pid != 0 && rowHolder != nil && *rowHolder == followed.pid {
				// Gone without a release: the row still names it.
				s.setFreed(name, freeing{pid: followed.pid, term: followed.term, at: time.Now()})
			}
			if owed || (rowHolder != nil && (*rowHolder == gone || *rowHolder != wokeFor)) {
				owed = false
				s.wake(name)
			}
			if rowHolder != nil {
				wokeFor = *rowHolder
			}
			gone = 0
			w.firstLookDone()
			if err := awaitEvent(ctx, sub, s.waiterPoll); err != nil {
				return err
			}
			continue
		}
		owed, gone = true, 0
		w.firstLookDone()
		if !marked && (rowHolder == nil || *rowHolder != *holder || claiming) {
			if inFlight.IsZero() {
				inFlight, inFlightWait = time.Now(), markLook
			}
			if time.Since(inFlight) < grantInFlight {
				// Most likely a grant in flight: look again at its
				// announcement.
				if err := awaitEvent(ctx, sub, inFlightWait); err != nil {
					return err
				}
				inFlightWait *= 2
				continue
			}
		}
		if !marked {
			// Granted the shared lock only once no one holds it
			// exclusively; it is let go in the same statement. The
			// holder may be a leader whose mark was already gone while
			// its lock was still seen (the look straddled its release,
			// or its session ended), or one whose mark is held by
			// another session: its release may be a handover, or the
			// lease taken already, as after a mark's (below).
			inFlight = time.Time{}
			h, now, err := s.awaitGoing(ctx, conn, name, *holder,
				"SELECT pg_advisory_lock_shared($1), pg_advisory_unlock_shared($1)", key)
			if err != nil {
				return err // waitLoop wakes the watchers
			}
			if followed.pid == *holder {
				// The followed holder's lock is freed now (and perhaps a
				// later holder's after it).
				s.setFreed(name, freeing{pid: followed.pid, term: followed.term, at: time.Now()})
			}
			owed = false
			taken := now.pid != 0 && now.pid != *holder
			s.wakeFor(name, h, taken)
			if taken {
				next = now
			}
			continue
		}
		s.wakeups.expect(name, uint32(*holder))
		h, now, err := s.awaitMark(ctx, conn, name, *holder)
		// A holder waited on without a look whose mark was free while
		// it still holds the lock has no mark (a store of an older
		// version), or its session ended and its lock outlasts its mark
		// for a moment, or it let go and was granted again: look,
		// without waking anyone yet. The look finds the lock free and
		// wakes the watchers (owed), or waits on the lock itself, whose
		// freeing wakes them.
		kept := hinted && now.pid == *holder
		// The wake below covers any release that came meanwhile.
		s.wakeups.settle(name, err == nil && !kept)
		if err != nil {
			return err // waitLoop wakes the watchers
		}
		// A release unlocks the lock before the mark. A session that
		// ended frees its locks one lock partition after another, so its
		// lock may outlast its mark by a moment: a candidate woken now
		// that finds the lock still held by that backend looks again
		// (see lingering), and this lock waiter's next look wakes the
		// watchers again if it finds the lock held (owed), or free with
		// the row still naming that backend (gone). When the lock was
		// kept, the next look records the sighting once it sees the lock
		// freed (pending); without it, a candidate would wait the whole
		// TakeoverGrace for a holder seen going.
		if kept {
			pending = freeing{pid: *holder, term: *rowTerm}
			continue
		}
		s.sawFreed(name, *holder, rowHolder, rowTerm)
		owed, gone, wokeFor = false, *holder, *holder
		taken := now.pid != 0 && now.pid != *holder
		s.wakeFor(name, h, taken)
		if taken {
			// Granted already, and no candidate woken: wait on the new
			// holder's mark at once, rather than look (a read of
			// pg_locks, in every follower process, at every handover).
			next = now
			continue
		}
		// Stay out of the way of the candidates just woken, whose
		// statements the winner's waits behind on a busy server: look
		// again at the next grant's notification, or after markLook. (A
		// winner granted, and gone, before that look is woken for by it:
		// see wokeFor.)
		select {
		case <-sub: // a grant before the one the candidates are racing for
		default:
		}
		if err := awaitEvent(ctx, sub, markLook); err != nil {
			return err
		}
	}
}

// sawFreed records that name's lock waiter saw the mark of the holder of
// backend pid freed, now (see graceLeft and lingering). The term tells
// this holder's tenure from an earlier one of the same backend: the
// row's, read with the wait (rowHolder, rowTerm), if the row named that
// backend, and 0 (unknown, which counts for nothing) otherwise.
func (s *AdvisoryStore) sawFreed(name string, pid int32, rowHolder *int32, rowTerm *int64) {
	f := freeing{pid: pid, at: time.Now()}
	if rowHolder != nil && *rowHolder == pid && rowTerm != nil {
		f.term = *rowTerm
	}
	s.setFreed(name, f)
}

// setFreed records f as the last freeing that name's lock waiter saw.
func (s *AdvisoryStore) setFreed(name string, f freeing) {
	s.smu.Lock()
	s.freed[name] = f
	s.smu.Unlock()
}

// wakeFor wakes the watchers of name once its holder has let go (see
// awaitGoing): none if the lease was taken already (granted to another
// backend: a prepared handover's successor, whose grant runs as the
// holder lets go; the lease is not free, and waking the followers would
// only have each of them try, beside the new leader's start), the
// successor first if it was handed over to one (h), and all of them
// otherwise.
func (s *AdvisoryStore) wakeFor(name string, h *handoff, taken bool) {
	switch {
	case taken:
		// Nor later: a plain release's notice that named a candidate
		// (see AdvisoryStore.Release) deferred the others' wake-up.
		s.wakeups.taken(name)
	case h != nil:
		s.handover(name, h.token, time.Until(h.until))
	default:
		s.wake(name)
	}
}

// awaitMark waits until the backend of PID holder lets go of its mark,
// and returns what awaitGoing does.
func (s *AdvisoryStore) awaitMark(ctx context.Context, conn *pgx.Conn, name string, holder int32) (h *handoff, now holding, err error) {
	return s.awaitGoing(ctx, conn, name, holder,
		"SELECT pg_advisory_lock_shared("+markClass+", $1), pg_advisory_unlock_shared("+markClass+", $1)", holder)
}

// awaitGoing runs wait, with arg, which returns once the backend of PID
// holder has let go of a lock (its mark, or the lease's lock), and
// returns, read in the same round trip once it has, the reservation of
// name's lease if it was handed over (nil if not), and now: the backend
// that the row names as its holder, with the row's term, if that backend
// holds the lease's lock now (zero otherwise). A now.pid other than
// holder means the lease was taken already: a holder's release clears
// (and reserves) the row before it unlocks, and a grant takes the lock
// and its mark before its row is committed. On the lease's lock, the wait ends when whoever holds
// it then lets go, which may be a later holder than holder.
//
// Each lock wait lasts s.waitSlice at most (its transaction's
// lock_timeout, set back to none before the read), and the next round
// trip waits again, with a snapshot of its own: see waitSlice.
func (s *AdvisoryStore) awaitGoing(ctx context.Context, conn *pgx.Conn, name string, holder int32, wait string, arg any) (h *handoff, now holding, err error) {
	hi, lo := keyHalves(s.Key(name))
	slice := strconv.FormatInt(max(s.waitSlice.Milliseconds(), 1), 10)
	for {
		var b pgx.Batch
		b.Queue(`SELECT set_config('lock_timeout', $1, true)`, slice)
		b.Queue(wait, arg)
		b.Queue(`SELECT set_config('lock_timeout', '0', true)`)
		b.Queue(s.sql.reserved, name, hi, lo)
		br := conn.SendBatch(ctx, &b)
		_, err = br.Exec()
		if err == nil {
			_, err = br.Exec()
			if sqlState(err) == "55P03" && ctx.Err() == nil { // lock_not_available: the slice is over
				if err := br.Close(); err != nil && sqlState(err) != "55P03" {
					return nil, holding{}, err
				}
				continue
			}
		}
		if err == nil {
			_, err = br.Exec()
		}
		var (
			token *string
			left  int64  // microseconds
			holds *int32 // the backend the row names as its holder, if it holds the lock
			term  *int64 // the row's term, with holds
		)
		if err == nil {
			err = br.QueryRow().Scan(&token, &left, &holds, &term)
		}
		read := time.Now()
		err = errors.Join(err, br.Close())
		switch {
		case err != nil && !errors.Is(err, pgx.ErrNoRows):
			return nil, holding{}, err
		case holds != nil:
			h := holding{pid: *holds}
			if term != nil {
				h.term = *term
			}
			return nil, h, nil
		case token == nil || *token == "" || left <= 0:
			return nil, holding{}, nil
		}
		return &handoff{token: *token, until: read.Add(time.Duration(left) * time.Microsecond)}, holding{}, nil
	}
}

// holding is a backend named by a lease's row as its holder, and the row's
// term (0 if not known): one that holds the lease's lock (awaitGoing's
// now), or one that left without a release (grantResult.leftUnreleased).
type holding struct {
	pid  int32
	term int64
}

// awaitEvent waits for a value on sub, or for d, or until ctx ends,
// returning ctx.Err() then.
func awaitEvent(ctx context.Context, sub <-chan struct{}, d time.Duration) error {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-sub:
	case <-timer.C:
	}
	return nil
}
