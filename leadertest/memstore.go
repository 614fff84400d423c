package leadertest

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/leaderelect/leader"
)

// MemStore is an in-memory leader.Store for unit tests of code that uses an
// Elector: many Electors in one process can campaign on one MemStore. It
// judges expiry on the process's monotonic clock. The zero value is not
// usable; create one with NewMemStore.
type MemStore struct {
	mu         sync.Mutex
	leases     map[string]*memLease
	watchers   map[string]map[chan struct{}]memWatcher
	candidates map[string]map[string]memCandidate // name → token → entry
}

type memLease struct {
	holderID   string
	token      string
	term       uint64
	acquiredAt time.Time
	expiresAt  time.Time
	priority   int
	reason     leader.GrantReason // of the last grant

	// A pending request that the holder hand over, until requestUntil.
	request      leader.TransferRequest // Remaining unused
	requestUntil time.Time

	// A released lease reserved for successor until reservedUntil.
	successor     leader.Candidate
	successorWhy  leader.GrantReason
	reservedUntil time.Time
}

// memWatcher is what wakes a watch channel: every event, or (freeOnly)
// releases alone; a free-watcher with a token (WatchFreeFor) is not woken
// by a handover to another token until its reservation has run out.
type memWatcher struct {
	freeOnly bool
	token    string
}

type memCandidate struct {
	c     leader.Candidate
	until time.Time
}

var (
	_ leader.Store        = (*MemStore)(nil)
	_ leader.FreeWatcher  = (*MemStore)(nil)
	_ leader.BatchRenewer = (*MemStore)(nil)
	_ leader.Transferer   = (*MemStore)(nil)

	_ leader.HandoverWatcher = (*MemStore)(nil)
)

// NewMemStore returns an empty MemStore.
func NewMemStore() *MemStore {
	return &MemStore{
		leases:     make(map[string]*memLease),
		watchers:   make(map[string]map[chan struct{}]memWatcher),
		candidates: make(map[string]map[string]memCandidate),
	}
}

func (s *MemStore) lease(name string) *memLease {
	l, ok := s.leases[name]
	if !ok {
		l = &memLease{}
		s.leases[name] = l
	}
	return l
}

// heldBy reports whether l is held, unexpired at now, by token under term.
// A freed lease has no token, so an empty token never matches it.
func (l *memLease) heldBy(token string, term uint64, now time.Time) bool {
	return l.token != "" && l.token == token && l.term == term && now.Before(l.expiresAt)
}

// held reports whether l is held, unexpired at now.
func (l *memLease) held(now time.Time) bool {
	return l.token != "" && now.Before(l.expiresAt)
}

// reservedFor returns the token a released lease is reserved for at now,
// or "".
func (l *memLease) reservedFor(now time.Time) string {
	if l.held(now) || !now.Before(l.reservedUntil) {
		return ""
	}
	return l.successor.Token
}

func (l *memLease) report(name string, now time.Time) leader.Lease {
	out := leader.Lease{Name: name, Term: l.term, Reason: l.reason}
	if l.held(now) {
		out.HolderID = l.holderID
		out.AcquiredAt = l.acquiredAt
		out.ExpiresAt = l.expiresAt
		out.Remaining = l.expiresAt.Sub(now)
		out.Priority = l.priority
		if now.Before(l.requestUntil) {
			out.Transfer = l.request
			out.Transfer.Remaining = l.requestUntil.Sub(now)
		}
	}
	if l.reservedFor(now) != "" {
		out.Successor = l.successor.ID
		out.Reserved = l.reservedUntil.Sub(now)
	}
	return out
}

// Acquire implements leader.Store.
func (s *MemStore) Acquire(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) (leader.Lease, bool, error) {
	if err := ctx.Err(); err != nil {
		return leader.Lease{}, false, fmt.Errorf("memstore: acquire %q: %w", name, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	l := s.lease(name)
	if l.held(now) && l.token != c.Token {
		s.enlistLocked(name, c, leader.EnlistFactor*ttl, now)
		return l.report(name, now), false, nil
	}
	reserved := l.reservedFor(now)
	if reserved != "" && reserved != c.Token {
		s.enlistLocked(name, c, leader.EnlistFactor*ttl, now)
		return l.report(name, now), false, nil
	}
	var why leader.GrantReason
	switch {
	case l.held(now) || l.term == 0:
		why = leader.GrantFirst
	case reserved != "":
		why = l.successorWhy
	case l.token == "":
		why = leader.GrantRelease
	default:
		why = leader.GrantExpiry
	}
	*l = memLease{holderID: c.ID, token: c.Token, term: l.term + 1, acquiredAt: now, expiresAt: now.Add(ttl), priority: c.Priority, reason: why}
	s.wakeLocked(name, true)
	return l.report(name, now), true, nil
}

// Renew implements leader.Store.
func (s *MemStore) Renew(ctx context.Context, name, token string, term uint64, ttl time.Duration) (leader.Lease, error) {
	if err := ctx.Err(); err != nil {
		return leader.Lease{}, fmt.Errorf("memstore: renew %q: %w", name, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	l, ok := s.leases[name]
	if !ok || !l.heldBy(token, term, now) {
		return leader.Lease{}, fmt.Errorf("memstore: renew %q term %d: %w", name, term, leader.ErrLeaseLost)
	}
	l.expiresAt = now.Add(ttl)
	return l.report(name, now), nil
}

// RenewBatch implements leader.BatchRenewer: it renews the leases of batch
// as Renew would, one by one.
func (s *MemStore) RenewBatch(ctx context.Context, batch []leader.Renewal) {
	for i := range batch {
		r := &batch[i]
		r.Lease, r.Err = s.Renew(ctx, r.Name, r.Token, r.Term, r.TTL)
	}
}

// Release implements leader.Store.
func (s *MemStore) Release(ctx context.Context, name, token string, term uint64) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("memstore: release %q: %w", name, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	l, ok := s.leases[name]
	if !ok || !l.heldBy(token, term, time.Now()) {
		return fmt.Errorf("memstore: release %q term %d: %w", name, term, leader.ErrLeaseLost)
	}
	*l = memLease{term: l.term, reason: l.reason}
	s.wakeLocked(name, false)
	return nil
}

// ReleaseTo implements leader.Transferer.
func (s *MemStore) ReleaseTo(ctx context.Context, name, token string, term uint64, successor leader.Candidate, reason leader.GrantReason, hold time.Duration) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("memstore: release %q: %w", name, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	l, ok := s.leases[name]
	if !ok || !l.heldBy(token, term, now) {
		return fmt.Errorf("memstore: release %q term %d to %s: %w", name, term, successor.ID, leader.ErrLeaseLost)
	}
	*l = memLease{term: l.term, reason: l.reason, successor: successor, successorWhy: reason, reservedUntil: now.Add(hold)}
	s.wakeHandoverLocked(name, successor.Token, hold)
	return nil
}

// RequestTransfer implements leader.Transferer.
func (s *MemStore) RequestTransfer(ctx context.Context, name string, req leader.TransferRequest, ttl time.Duration) (leader.Lease, error) {
	if err := ctx.Err(); err != nil {
		return leader.Lease{}, fmt.Errorf("memstore: request transfer %q: %w", name, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	l := s.lease(name)
	if !l.held(now) {
		return l.report(name, now), fmt.Errorf("memstore: request transfer %q: %w", name, leader.ErrNoLeader)
	}
	l.request, l.requestUntil = req, now.Add(ttl)
	l.request.Remaining = 0
	return l.report(name, now), nil
}

// Enlist implements leader.Transferer.
func (s *MemStore) Enlist(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("memstore: enlist %q: %w", name, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.enlistLocked(name, c, ttl, time.Now())
	return nil
}

// enlistLocked records c among name's candidates until ttl after now.
// s.mu is held.
func (s *MemStore) enlistLocked(name string, c leader.Candidate, ttl time.Duration, now time.Time) {
	if s.candidates[name] == nil {
		s.candidates[name] = make(map[string]memCandidate)
	}
	s.candidates[name][c.Token] = memCandidate{c: c, until: now.Add(ttl)}
}

// Withdraw implements leader.Transferer.
func (s *MemStore) Withdraw(ctx context.Context, name, token string) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("memstore: withdraw %q: %w", name, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.candidates[name], token)
	return nil
}

// Candidates implements leader.Transferer.
func (s *MemStore) Candidates(ctx context.Context, name string) ([]leader.Candidate, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("memstore: candidates %q: %w", name, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	var out []leader.Candidate
	for token, e := range s.candidates[name] {
		if !now.Before(e.until) {
			delete(s.candidates[name], token)
			continue
		}
		out = append(out, e.c)
	}
	return out, nil
}

// Observe implements leader.Store.
func (s *MemStore) Observe(ctx context.Context, name string) (leader.Lease, error) {
	if err := ctx.Err(); err != nil {
		return leader.Lease{}, fmt.Errorf("memstore: observe %q: %w", name, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	l, ok := s.leases[name]
	if !ok {
		return leader.Lease{Name: name}, nil
	}
	return l.report(name, time.Now()), nil
}

// Watch implements leader.Store: the channel receives a value when a
// lease for name is granted or released.
func (s *MemStore) Watch(ctx context.Context, name string) (<-chan struct{}, error) {
	return s.watch(ctx, name, memWatcher{})
}

// WatchFree implements leader.FreeWatcher: the channel receives a value
// when the lease for name is released, not when it is granted.
func (s *MemStore) WatchFree(ctx context.Context, name string) (<-chan struct{}, error) {
	return s.watch(ctx, name, memWatcher{freeOnly: true})
}

// WatchFreeFor implements leader.HandoverWatcher: it is WatchFree, but a
// lease handed over to another candidate than c wakes the channel only if
// it is still free when the reservation has run out.
func (s *MemStore) WatchFreeFor(ctx context.Context, name string, c leader.Candidate) (<-chan struct{}, error) {
	return s.watch(ctx, name, memWatcher{freeOnly: true, token: c.Token})
}

func (s *MemStore) watch(ctx context.Context, name string, w memWatcher) (<-chan struct{}, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("memstore: watch %q: %w", name, err)
	}
	ch := make(chan struct{}, 1)
	s.mu.Lock()
	if s.watchers[name] == nil {
		s.watchers[name] = make(map[chan struct{}]memWatcher)
	}
	s.watchers[name][ch] = w
	s.mu.Unlock()
	context.AfterFunc(ctx, func() {
		s.mu.Lock()
		delete(s.watchers[name], ch)
		s.mu.Unlock()
		close(ch)
	})
	return ch, nil
}

// wakeLocked wakes the watchers of name; for a grant, only those that
// watch grants too.
func (s *MemStore) wakeLocked(name string, granted bool) {
	for ch, w := range s.watchers[name] {
		if granted && w.freeOnly {
			continue
		}
		wake(ch)
	}
}

// wakeHandoverLocked wakes the watchers of name for a handover to token,
// reserved for hold: at once, every watcher but those of WatchFreeFor for
// another token; those once hold has passed, if the lease is still free.
func (s *MemStore) wakeHandoverLocked(name, token string, hold time.Duration) {
	later := false
	for ch, w := range s.watchers[name] {
		if w.token != "" && w.token != token {
			later = true
			continue
		}
		wake(ch)
	}
	if !later {
		return
	}
	time.AfterFunc(hold, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if l := s.leases[name]; l != nil && !l.held(time.Now()) {
			s.wakeLocked(name, false)
		}
	})
}

// wake sends a value on ch unless one is pending already.
func wake(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}
