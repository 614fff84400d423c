package filelock

import (
	"context"
	"time"
)

// Watch implements leader.Store. The Store wakes a name's watchers at once
// when it grants or releases the name itself; changes made by other Stores
// and processes, and holders that die, are noticed by one goroutine per
// Store that checks every watched name each poll interval (see
// WithPollInterval) and runs only while something is watched. The channel is
// also closed by Close.
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
		e.obs = s.observe(e, observation{})
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
	}
	close(ch)
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

// pollLoop checks the watched names every poll interval and wakes the
// watchers of those that changed. It returns when nothing is watched or the
// Store closes.
func (s *Store) pollLoop() {
	ticker := time.NewTicker(s.poll)
	defer ticker.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-ticker.C:
		}
		s.mu.Lock()
		watched := make([]*entry, 0, len(s.watchers))
		for name := range s.watchers {
			watched = append(watched, s.names[name])
		}
		if len(watched) == 0 {
			s.polling = false
			s.mu.Unlock()
			return
		}
		s.mu.Unlock()
		for _, e := range watched {
			e.obsMu.Lock()
			prev := e.obs
			e.obs = s.observe(e, prev)
			changed := e.obs != prev
			e.obsMu.Unlock()
			if changed {
				s.wake(e.name)
			}
		}
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
// whether the holder lives, keeping prev's verdict for an unchanged state.
func (s *Store) observe(e *entry, prev observation) observation {
	select {
	case e.sem <- struct{}{}:
		defer func() { <-e.sem }()
		if o, ok := s.observeLocked(e); ok {
			return o
		}
	default:
	}
	st, err := readState(e.base+stateSuffix, e.name)
	if err != nil {
		return observation{}
	}
	o := observation{ok: true, term: st.Term, token: st.Token, held: prev.held}
	if !prev.ok || prev.term != o.term || prev.token != o.token {
		o.held = st.Token != "" // a new state: its holder lives until a look says otherwise
	}
	return o
}

// observeLocked looks at the name's state under its state lock, if that is
// free, and judges whether the holder lives. The caller holds e.sem.
func (s *Store) observeLocked(e *entry) (observation, bool) {
	stateLock, err := tryLockFile(e.base + stateLockSuffix)
	if err != nil || stateLock == nil {
		return observation{}, false
	}
	defer unlockFile(stateLock)
	st, now, err := s.load(e)
	if err != nil {
		return observation{}, false
	}
	held, freed, err := s.held(e, &st, now)
	if freed != nil {
		_ = unlockFile(freed)
	}
	if err != nil {
		return observation{}, false
	}
	return observation{ok: true, term: st.Term, token: st.Token, held: held}, true
}
