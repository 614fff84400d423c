package filelock

import (
	"context"
	"os"
	"time"
)

// Watch implements leader.Store. The Store wakes a name's watchers at once
// when it grants or releases the name itself. Changes made by other Stores
// and processes, holders that die and leases that expire are noticed by one
// goroutine per Store, which runs only while something is watched: on Linux
// within a millisecond or so, from the kernel's inotify(7) reports on the
// directory; elsewhere, or without inotify, within a poll interval (see
// WithPollInterval, and Wake-ups in the package doc). The channel is also
// closed by Close.
func (s *Store) Watch(ctx context.Context, name string) (<-chan struct{}, error) {
	const op = "watch"
	if err := ctx.Err(); err != nil {
		return nil, s.errorf(op, name, err)
	}
	e, err := s.entry(name)
	if err != nil {
		return nil, s.errorf(op, name, err)
	}

	// The first watcher of a name sets the baseline the poller compares
	// with; holding obsMu keeps the poller away until the watcher is
	// registered, so no change after Watch returns goes unnoticed.
	e.obsMu.Lock()
	defer e.obsMu.Unlock()
	s.mu.Lock()
	first := len(s.watchers[name]) == 0
	s.mu.Unlock()
	if first {
		e.obs, _, _ = s.observe(e, observation{}, nil)
	}

	ch := make(chan struct{}, 1)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, s.errorf(op, name, ErrClosed)
	}
	if s.watchers[name] == nil {
		s.watchers[name] = make(map[chan struct{}]func() bool)
	}
	// If ctx has ended already, the function runs at once on its own
	// goroutine and waits for s.mu, so it finds the channel registered.
	s.watchers[name][ch] = context.AfterFunc(ctx, func() { s.unwatch(name, ch) })
	if !s.polling {
		s.polling = true
		s.pollers.Go(s.pollLoop)
	} else if first {
		s.watchedChanged()
	}
	return ch, nil
}

// unwatch removes and closes ch unless Close did already.
func (s *Store) unwatch(name string, ch chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.watchers[name][ch]; !ok {
		return
	}
	delete(s.watchers[name], ch)
	if len(s.watchers[name]) == 0 {
		delete(s.watchers, name)
		s.watchedChanged()
	}
	close(ch)
}

// watchedChanged tells pollLoop, without blocking, that a name is watched
// that was not, or no longer is.
func (s *Store) watchedChanged() {
	select {
	case s.changed <- struct{}{}:
	default:
	}
}

// wake gives every watcher of name a value, without blocking: a watcher
// that has one unread already keeps just that one.
func (s *Store) wake(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for ch := range s.watchers[name] {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}

// When pollLoop looks at a name again without being told to.
const (
	// busyRetry is how soon it looks again after a look that could not
	// judge whether the holder lives, because a call on the name was in
	// progress (in this Store or anywhere): the call may have been the
	// one to find the holder dead, which changes no file. The delay doubles
	// at each such look in a row, up to busyRetryMax.
	busyRetry    = time.Millisecond
	busyRetryMax = 50 * time.Millisecond
)

// settleDelays are when pollLoop looks again after an event saying that a
// name's leader lock was closed, if the holder still seemed alive. A
// process's exit closes its files, which makes the event, before the kernel
// drops their flock(2) locks, so the first look can come in between. (Most
// such events are other Stores trying the lock, and all say the same.)
var settleDelays = [...]time.Duration{time.Millisecond, 10 * time.Millisecond}

// watched is pollLoop's record of one watched name.
type watched struct {
	// probe is the name's leader lock file, opened at the first look and
	// kept open while the name is watched. The looks try the lock on it
	// without closing it: a close would be an event for every Store watching
	// the directory, each of whose looks would make another, without end.
	probe  *os.File
	due    time.Time // look again then, events or not; zero: no need
	busy   int       // looks in a row that could not judge the holder
	settle int       // looks left of settleDelays
}

// pollLoop looks at the watched names when the kernel reports a change to
// their files, when they are due, and all of them every poll interval, and
// wakes the watchers of those whose lease changed. It returns when nothing
// is watched or the Store closes.
func (s *Store) pollLoop() {
	interval := s.poll
	var n *notifier
	if !s.noNotify {
		// Quietly without events if this fails: most likely the user has
		// as many inotify instances as the kernel allows.
		if nn, err := openNotifier(s.dir); err == nil {
			n, interval = nn, s.notifyPoll
		}
	}
	ticker := time.NewTicker(interval)
	timer := time.NewTimer(time.Hour)
	names := make(map[*entry]*watched)
	defer func() {
		ticker.Stop()
		timer.Stop()
		if n != nil {
			n.close()
		}
		for _, w := range names {
			if w.probe != nil {
				w.probe.Close()
			}
		}
	}()

	// Every name is looked at first, after the notifier started: a change
	// between a name's baseline (set by Watch) and then made no event.
	var (
		all   bool
		hints map[string]hint
	)
	for {
		// Bring the record of the watched names up to date; a name newly
		// watched is due at once, for the same reason.
		now := time.Now()
		s.mu.Lock()
		if len(s.watchers) == 0 {
			s.polling = false
			s.mu.Unlock()
			return
		}
		for name := range s.watchers {
			e := s.names[name]
			if _, ok := names[e]; !ok {
				names[e] = &watched{due: now}
			}
		}
		for e, w := range names {
			if _, ok := s.watchers[e.name]; !ok {
				if w.probe != nil {
					w.probe.Close()
				}
				delete(names, e)
			}
		}
		s.mu.Unlock()

		var next time.Time
		for e, w := range names {
			if h := hints[e.file]; h != 0 || all || !w.due.IsZero() && !now.Before(w.due) {
				s.look(e, w, h)
			}
			if !w.due.IsZero() && (next.IsZero() || w.due.Before(next)) {
				next = w.due
			}
		}
		all, hints = false, nil
		if next.IsZero() {
			timer.Stop()
		} else {
			timer.Reset(time.Until(next))
		}

		var events <-chan struct{}
		if n != nil {
			events = n.ready
		}
		select {
		case <-s.stop:
			return
		case <-s.changed:
		case <-timer.C:
		case <-ticker.C:
			all = true
		case <-events:
			var lost, failed bool
			hints, lost, failed = n.take()
			all = lost || failed
			if failed {
				// No more events will come: poll as without them.
				n.close()
				n = nil
				ticker.Reset(s.poll)
			}
		}
	}
}

// look looks at the watched name e, wakes its watchers if its lease
// changed, and decides when to look again without an event. h is what an
// event said about the name, if an event is why it looks.
func (s *Store) look(e *entry, w *watched, h hint) {
	s.checks.Add(1)
	if w.probe == nil {
		// On failure the look opens and closes the lock file, as calls do.
		w.probe, _ = os.OpenFile(e.base+leaderLockSuffix, os.O_RDWR|os.O_CREATE, 0o600)
	}
	e.obsMu.Lock()
	prev := e.obs
	o, busy, left := s.observe(e, prev, w.probe)
	e.obs = o
	e.obsMu.Unlock()
	if o != prev {
		s.wake(e.name)
	}

	now := time.Now()
	w.due = time.Time{}
	after := func(d time.Duration) {
		if t := now.Add(d); w.due.IsZero() || t.Before(w.due) {
			w.due = t
		}
	}
	if busy {
		after(min(busyRetry<<min(w.busy, 8), busyRetryMax))
		w.busy++
	} else {
		w.busy = 0
	}
	if h&hintLock != 0 {
		w.settle = len(settleDelays)
	}
	if !o.held {
		w.settle = 0
	} else if w.settle > 0 {
		after(settleDelays[len(settleDelays)-w.settle])
		w.settle--
	}
	if left > 0 {
		after(left) // its expiry
	}
}

// observation is what the poller compares between two looks at a name:
// a grant raises the term, a release clears the token, and a holder's
// death (or expiry) clears held. Renewals change none of them.
type observation struct {
	ok    bool // the state could be read
	term  uint64
	token string
	held  bool
}

// observe looks at the name's state now. It never waits: if a call on the
// name is in progress here or anywhere, it reads the state without judging
// whether the holder lives, keeping prev's verdict for an unchanged state,
// and reports busy. Otherwise it judges, trying the leader lock on probe
// (see watched) or, if probe is nil, on a file it opens and closes, and
// reports the time left of a lease held. The caller holds e.obsMu.
func (s *Store) observe(e *entry, prev observation, probe *os.File) (o observation, busy bool, left time.Duration) {
	select {
	case e.sem <- struct{}{}:
		var judged bool
		o, left, judged, busy = s.observeLocked(e, probe)
		<-e.sem
		if judged {
			return o, false, left
		}
	default:
		busy = true
	}
	st, err := readState(e.base+stateSuffix, e.name)
	if err != nil {
		return observation{}, false, 0
	}
	o = observation{ok: true, term: st.Term, token: st.Token, held: prev.held}
	if !prev.ok || prev.term != o.term || prev.token != o.token {
		o.held = st.Token != "" // a new state: its holder lives until a look says otherwise
	}
	return o, busy, 0
}

// observeLocked looks at the name's state under its state lock, if that is
// free (else busy), and judges whether the holder lives (judged), unless
// something fails. The caller holds e.sem.
func (s *Store) observeLocked(e *entry, probe *os.File) (o observation, left time.Duration, judged, busy bool) {
	stateLock, err := tryLockFile(e.base + stateLockSuffix)
	if err != nil || stateLock == nil {
		return observation{}, 0, false, err == nil
	}
	defer unlockFile(stateLock)
	st, now, err := s.load(e)
	if err != nil {
		return observation{}, 0, false, false
	}
	var held bool
	if probe != nil {
		held, err = s.heldProbe(e, &st, now, probe)
	} else {
		var freed *os.File
		held, freed, err = s.held(e, &st, now)
		if freed != nil {
			_ = unlockFile(freed)
		}
	}
	if err != nil {
		return observation{}, 0, false, false
	}
	if held {
		left = time.Duration(st.ExpiresClock - now.clock)
	}
	return observation{ok: true, term: st.Term, token: st.Token, held: held}, left, true, false
}

// heldProbe is held for pollLoop: it tries the leader lock on probe, an
// open file of the name's leader lock that the caller keeps, and unlocks it
// at once. The caller holds the state lock.
func (s *Store) heldProbe(e *entry, st *state, now reading, probe *os.File) (bool, error) {
	named, check := s.holder(e, st, now)
	if !check {
		return named, nil
	}
	ok, err := tryLock(probe)
	if err != nil || !ok {
		return !ok && err == nil, err // locked: the holder's process has it
	}
	return false, unlock(probe) // the holder's process is gone
}
