// Package filelock is the embedded single-host [leader.Store]: processes on
// one host elect a leader through files in a shared directory, with nothing
// to install or run. The leader command uses it by default (in [DefaultDir])
// and for file:///some/dir store URLs.
//
//	store, err := filelock.Open("/var/lib/myapp/leader")
//	...
//	defer store.Close()
//	elector, err := leader.New(store, leader.Config{Name: "nightly-report"})
//
// # How it works
//
// Each election name has these files in the directory (see [Open] for how
// names become file names):
//
//	<name>.state        the lease, as JSON: holder ID and token, pid, term,
//	                    acquired/renewed/expires times; the holder's priority,
//	                    why it was granted, a pending request to hand over,
//	                    or whom a released lease is reserved for (see Transfers)
//	<name>.state.lock   flocked for a moment around every read-modify-write
//	                    of the state (the "state lock")
//	<name>.leader.lock  flocked by the holder for as long as it holds the
//	                    lease (the "leader lock")
//	<name>.state.tmp    the next state, for a moment before it is renamed
//	                    over <name>.state
//	<name>.candidates   the candidates enlisted for handovers (see Transfers),
//	                    with <name>.candidates.tmp, its next version
//
// The state file is the truth. Acquire, Renew, Release and Observe each take
// the state lock, read the state, decide, and replace the state atomically
// (write a temporary file, fsync, rename), so two processes can never both be
// granted the lease: correctness comes from the state file alone.
//
// The leader lock adds what a file cannot: news of death. flock(2) locks
// belong to an open file, and the kernel drops them when the process that
// holds them exits, however it exits. A candidate granted the lease also
// takes the leader lock (without blocking) and keeps it open, and records in
// the state that it holds it. When another candidate finds the state held
// but the leader lock free, the holder has died (or been killed with
// SIGKILL), and the lease is free at once, long before its expiry. Watchers
// learn of it at once too (see Wake-ups below), so a follower's Elector takes
// over a killed leader's name within milliseconds whatever the TTL.
//
// Expiry still holds without a death. A holder that is alive but stops
// renewing loses the lease at its expiry like on any Store: the next
// candidate is granted it even though it cannot take the leader lock, which
// the stale holder still has. The new holder records that it does not hold
// the leader lock, so until it does, only its expiry frees the lease; it
// takes the lock at its first renewal after the old holder lets go (the old
// holder's Store drops the lock as soon as it learns the lease is lost). The
// rule that makes this safe: the state says "holds the leader lock" only when
// written by the holder while it held it, under the state lock, and a holder
// drops the lock only after the state stopped naming it or its lease ended.
//
// Every leader-lock attempt happens under the state lock, so a candidate
// probing whether the holder is alive never collides with one taking the
// lock for a grant. flock(2) conflicts between open file descriptions, not
// processes, so several Stores (and Electors) in one process campaign against
// each other exactly as separate processes do.
//
// # Wake-ups
//
// A Store wakes the watchers of a name (see [Store.Watch]) at once when it
// grants or releases the name itself. What other Stores and processes do,
// and the deaths of holders, it learns from one goroutine, which runs while
// something is watched and looks at a name the way Observe does: it reads
// the state and, if the holder recorded that it holds the leader lock, tries
// that lock. It wakes the name's watchers when the holder, the term or the
// verdict on the holder's life differs from its last look.
//
// On Linux the goroutine looks when the kernel reports, through inotify(7)
// on the directory, that a name's state file was renamed into place (a
// grant, renewal or release anywhere) or that its leader lock file was
// closed by someone: the kernel closes the files of a process that exits or
// is killed, which is how a holder's death shows. Wake-ups then come within
// a millisecond or so. Those reports are only hints to look; all they save
// is waiting. The goroutine also looks at a held lease at its expiry, and at
// every watched name once every poll interval ([WithPollInterval]; one
// second by default), as a safety net, and at every name after the kernel
// reports that it dropped reports. It tries the leader locks on files it
// keeps open: closing them would be reports for every Store watching the
// directory, whose looks would make more.
//
// Elsewhere, or when the Store cannot have an inotify instance (a user has
// at most fs.inotify.max_user_instances of them, 128 by default, and each
// Store that watches something uses one), the looks every poll interval
// ([DefaultPollInterval], 50ms, by default) are how it learns of changes,
// and wake-ups come up to that late; it says nothing about it.
//
// # Transfers
//
// A Store implements [leader.Transferer], so its Electors can hand
// leadership to a chosen candidate ([leader.Elector.Transfer],
// [leader.RequestTransfer], Config.Priority). All of it lives in the name's
// files, read and written under the state lock like the lease, so it works
// across processes. A grant records in the state the holder's priority and
// why it was granted (a released state names no holder, which tells a
// release from an expiry or a dead holder). A request to hand over is kept
// in the state with its expiry, until it lapses or a grant or a release ends
// it; the holder's next Renew reports it. ReleaseTo writes a released state
// reserved for the successor's token until the hold has passed, judged on
// the clock that judges expiry: meanwhile Acquire grants the lease to the
// successor alone (the next term, the handover's reason) and refuses every
// other candidate, reporting the successor and the time the reservation has
// left. The release wakes watchers as any release does, so the successor,
// woken within a millisecond or so on Linux, takes the lease at once. The
// enlisted candidates are kept in <name>.candidates, each entry with its
// expiry. That file is replaced whole but not synced (it is soft state: a
// file that a crash left torn reads as empty, and candidates enlist again
// every TTL), and watchers ignore it, so enlisting costs one small write per
// follower per TTL.
//
// The new fields left the state's format at version 1, so a binary that
// predates transfers, still running on the host, reads the state as before;
// mixed versions stay safe, but handovers involving old binaries may not
// happen. An old binary ignores a reservation: its candidates may be granted
// a reserved lease out of turn, but the state still names one holder, and
// the successor is then refused like any other candidate. Its grants and
// renewals drop the new fields: its leases report priority 0 and no reason,
// and a request made of its Electors (which never hand over) is dropped at
// their next renewal, and the requester then fails. Its candidates never
// enlist, so nobody picks them as successors.
//
// # Clock
//
// Expiry is judged on the host's CLOCK_MONOTONIC on Linux: one clock that
// every process on the host shares, that no one sets, and that the Elector's
// own deadlines also run on, so a wall-clock step (NTP, a user, a resume from
// suspend) neither ends a lease early nor lengthens it (DESIGN.md invariant
// 1). The state also records the kernel's boot ID: a state written before a
// reboot is free, since its holder died with the boot. Wall-clock times are
// recorded next to it for people and reported as Lease.AcquiredAt and
// ExpiresAt. Processes in different time namespaces (rare; not Docker's
// default) do not share CLOCK_MONOTONIC and must not share a directory.
// Other Unix systems judge expiry on the wall clock.
//
// # Limits
//
// The directory must be on a local file system: flock(2) on network file
// systems is emulated or absent, and the clock is only shared by one host.
// Files are never deleted; three small files per name remain after use, and
// deleting them while any process uses the name breaks mutual exclusion.
// Open creates the directory with mode 0700 and the files with mode 0600, so
// only processes of the same user take part.
// The terms survive restarts of every process, releases, expiries and
// reboots; the state is fsynced so that a power loss cannot make a term go
// back. Linux is the target; macOS and the BSDs work; other systems get an
// error from Open.
package filelock

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leaderelect/leader"
)

// ErrClosed is returned (wrapped) by every method of a Store after Close. From
// Renew and Release it comes with leader.ErrLeaseLost, so that an Elector
// still leading on a closed Store steps down at its next renewal.
var ErrClosed = errors.New("filelock: store closed")

// DefaultPollInterval is how often a Store that cannot learn of changes
// from the kernel checks each name it watches for grants, releases and dead
// holders, unless WithPollInterval says otherwise. A Store that can (on
// Linux, with inotify(7); see Wake-ups in the package doc) checks them once
// a second by default, as a safety net.
const DefaultPollInterval = 50 * time.Millisecond

// notifyPollInterval is the default interval of the safety-net checks of a
// Store that watches its directory with inotify(7).
const notifyPollInterval = time.Second

// Option configures Open.
type Option func(*options)

type options struct {
	pollInterval time.Duration
	pollSet      bool // WithPollInterval was given
	noNotify     bool // poll only, as where inotify is unavailable (tests)
}

// WithPollInterval sets how often the Store checks every watched name for a
// grant, a release or a holder that died. Where it cannot learn of changes
// from the kernel (outside Linux, or without an inotify(7) instance, for
// example when the user has fs.inotify.max_user_instances of them open
// already), these checks are how it learns of changes made by other Stores
// and processes, and a follower's wake-up comes at most this late; on Linux
// the kernel tells it within a millisecond or so, and the checks are a
// safety net. Each check reads a small file and tries a lock or two, without
// waiting. Default DefaultPollInterval (50ms) without inotify, one second
// with it; an interval given applies in both cases. At least 1ms.
func WithPollInterval(d time.Duration) Option {
	return func(o *options) { o.pollInterval, o.pollSet = d, true }
}

// Store is a leader.Store, and a leader.Transferer, kept in a directory on
// the local host. Create one with Open; many Stores, in one process or many,
// may share a directory. A Store's methods are safe for concurrent use.
// Close it when done.
type Store struct {
	dir        string
	poll       time.Duration // between checks of every watched name, without inotify
	notifyPoll time.Duration // between checks of every watched name, with inotify
	noNotify   bool          // never use inotify
	boot       string        // this boot's ID, or "" if unknown

	mu       sync.Mutex
	closed   bool
	names    map[string]*entry
	watchers map[string]map[chan struct{}]func() bool // name -> channel -> stops its context.AfterFunc
	polling  bool                                     // pollLoop is running
	changed  chan struct{}                            // (1) tells pollLoop that the watched names changed
	stop     chan struct{}                            // closed by Close
	pollers  sync.WaitGroup

	checks atomic.Uint64 // looks pollLoop took at names, for tests
}

// entry is a Store's local record of one name.
type entry struct {
	name string
	file string // the name's encoding: its files' names, less their suffix
	base string // path of the name's files, less their suffix

	// sem is held by one call on this name at a time, within this Store;
	// the state lock orders calls across Stores and processes. It guards
	// leader and leaderToken.
	sem         chan struct{}
	leader      *os.File // the leader lock, locked, while this Store's candidate leaderToken holds the lease
	leaderToken string

	obsMu sync.Mutex // guards obs; held by Watch while it sets a baseline and by the poller
	obs   observation
}

var _ leader.Store = (*Store)(nil)

// Open returns a Store kept in dir, creating the directory and its missing
// parents (mode 0700) if it does not exist. It fails if dir is not a
// directory, if its file system does not support flock(2), or if the
// platform lacks flock(2). Open starts nothing in the background; Watch does,
// while something is watched.
//
// Election names map to file names as follows: bytes a-z, 0-9, '-' and '_'
// stay; every other byte (upper-case letters, '.', '/', spaces, UTF-8) becomes
// %XX; an empty name or one whose encoding passes 200 bytes becomes up to 150
// bytes of its encoding, '~', and 32 hex digits of its SHA-256. So
// "nightly-report" is kept in nightly-report.state and "Jobs/Nightly" in
// %4Aobs%2F%4Eightly.state.
func Open(dir string, opts ...Option) (*Store, error) {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	notifyPoll := o.pollInterval
	if !o.pollSet {
		o.pollInterval, notifyPoll = DefaultPollInterval, notifyPollInterval
	}
	if dir == "" {
		return nil, errors.New("filelock: Open: dir is empty")
	}
	if o.pollInterval < time.Millisecond {
		return nil, fmt.Errorf("filelock: Open: poll interval %v is under 1ms", o.pollInterval)
	}
	if !supported {
		return nil, fmt.Errorf("filelock: Open: flock(2) is not available on %s", runtime.GOOS)
	}
	dir, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("filelock: Open: %w", err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("filelock: Open: %w", err)
	}
	if fi, err := os.Stat(dir); err != nil {
		return nil, fmt.Errorf("filelock: Open: %w", err)
	} else if !fi.IsDir() {
		return nil, fmt.Errorf("filelock: Open: %s is not a directory", dir)
	}
	if err := checkLocking(dir); err != nil {
		return nil, fmt.Errorf("filelock: Open %s: %w", dir, err)
	}
	if _, err := monotonicNow(); err != nil {
		return nil, fmt.Errorf("filelock: Open: reading the clock: %w", err)
	}
	return &Store{
		dir:        dir,
		poll:       o.pollInterval,
		notifyPoll: notifyPoll,
		noNotify:   o.noNotify,
		boot:       bootID(),
		names:      make(map[string]*entry),
		watchers:   make(map[string]map[chan struct{}]func() bool),
		changed:    make(chan struct{}, 1),
		stop:       make(chan struct{}),
	}, nil
}

// Dir returns the Store's directory, as an absolute path.
func (s *Store) Dir() string { return s.dir }

// Close stops the Store's background work, closes its watch channels and
// gives up the leader locks it holds, as the process's exit would: a lease
// whose holder used this Store becomes free at once for every other
// candidate. Stop the Electors that use the Store before closing it (their
// Run returns after releasing); an Elector still leading on a closed Store
// keeps believing it leads until its renewals fail. Close waits for calls in
// progress to return. Closing twice is harmless.
func (s *Store) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	close(s.stop)
	for name, chans := range s.watchers {
		for ch, stop := range chans {
			stop()
			close(ch)
		}
		delete(s.watchers, name)
	}
	entries := make([]*entry, 0, len(s.names))
	for _, e := range s.names {
		entries = append(entries, e)
	}
	s.mu.Unlock()

	s.pollers.Wait()
	var errs []error
	for _, e := range entries {
		e.sem <- struct{}{}
		if err := e.dropLeader(); err != nil {
			errs = append(errs, err)
		}
		<-e.sem
	}
	return errors.Join(errs...)
}

// Acquire implements leader.Store. A grant takes the name's leader lock if it
// can, so that the holder's death frees the lease at once.
func (s *Store) Acquire(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) (leader.Lease, bool, error) {
	const op = "acquire"
	if c.Token == "" {
		return leader.Lease{}, false, s.errorf(op, name, errors.New("candidate token is empty"))
	}
	if ttl <= 0 {
		return leader.Lease{}, false, s.errorf(op, name, fmt.Errorf("ttl %v is not positive", ttl))
	}
	e, stateLock, err := s.begin(ctx, op, name)
	if err != nil {
		return leader.Lease{}, false, err
	}
	defer s.end(e, stateLock)

	st, now, err := s.load(e)
	if err != nil {
		return leader.Lease{}, false, s.errorf(op, name, err)
	}
	held, freed, err := s.held(e, &st, now)
	if err != nil {
		return leader.Lease{}, false, s.errorf(op, name, err)
	}
	// Refused, c is enlisted among the candidates (see leader.Transferer).
	if held && st.Token != c.Token {
		return st.report(true, s.boot, now), false, s.editCandidatesLocked(e, op, name, s.enlist(c, leader.EnlistFactor*ttl))
	}
	// A reserved state is released, so its holder was not found dead:
	// freed is nil.
	r := st.reservation(s.boot, now)
	if r != nil && r.Token != c.Token {
		return st.report(false, s.boot, now), false, s.editCandidatesLocked(e, op, name, s.enlist(c, leader.EnlistFactor*ttl))
	}

	// Grant. The leader lock is this Store's already if c held the lease
	// through it; freed if the previous holder just proved dead; otherwise
	// it is free, or held by a live holder whose lease ended, which will drop
	// it when it learns so (then c takes it at a renewal).
	if e.leader != nil && e.leaderToken != c.Token {
		if err := e.dropLeader(); err != nil {
			return leader.Lease{}, false, s.errorf(op, name, err)
		}
	}
	lock := e.leader
	if lock == nil {
		lock = freed
	}
	if lock == nil {
		if lock, err = tryLockFile(e.base + leaderLockSuffix); err != nil {
			return leader.Lease{}, false, s.errorf(op, name, err)
		}
	}
	next := state{
		Version:      stateVersion,
		Name:         name,
		Term:         st.Term + 1,
		HolderID:     c.ID,
		Token:        c.Token,
		PID:          os.Getpid(),
		LeaderLock:   lock != nil,
		AcquiredAt:   now.wall,
		RenewedAt:    now.wall,
		ExpiresAt:    now.wall.Add(ttl),
		Clock:        clockName,
		BootID:       s.boot,
		RenewedClock: now.clock,
		ExpiresClock: now.clock + int64(ttl),
		Priority:     c.Priority,
		Reason:       st.grantReason(held, r),
	}
	if err := writeState(e.base+stateSuffix, next, true); err != nil {
		if lock != nil && lock != e.leader {
			_ = unlockFile(lock)
		}
		return leader.Lease{}, false, s.errorf(op, name, writeError(err))
	}
	e.leader, e.leaderToken = lock, c.Token
	s.wake(name)
	return next.report(true, s.boot, now), true, nil
}

// Renew implements leader.Store. A holder granted the lease while the
// previous holder still had the leader lock takes the lock here, once that
// holder has let go.
func (s *Store) Renew(ctx context.Context, name, token string, term uint64, ttl time.Duration) (leader.Lease, error) {
	const op = "renew"
	if ttl <= 0 {
		return leader.Lease{}, s.errorf(op, name, fmt.Errorf("ttl %v is not positive", ttl))
	}
	e, stateLock, err := s.begin(ctx, op, name)
	if err != nil {
		return leader.Lease{}, err
	}
	defer s.end(e, stateLock)

	st, now, err := s.load(e)
	if err != nil {
		return leader.Lease{}, s.errorf(op, name, err)
	}
	if err := s.checkHolder(e, &st, now, token, term); err != nil {
		return leader.Lease{}, s.errorf(op, name, err)
	}
	if e.leader == nil {
		lock, err := tryLockFile(e.base + leaderLockSuffix)
		if err != nil {
			return leader.Lease{}, s.errorf(op, name, err)
		}
		e.leader, e.leaderToken = lock, token
	}
	st.PID = os.Getpid()
	st.LeaderLock = e.leader != nil
	st.RenewedAt = now.wall
	st.ExpiresAt = now.wall.Add(ttl)
	st.Clock = clockName
	st.BootID = s.boot
	st.RenewedClock = now.clock
	st.ExpiresClock = now.clock + int64(ttl)
	if err := writeState(e.base+stateSuffix, st, false); err != nil {
		return leader.Lease{}, s.errorf(op, name, writeError(err))
	}
	return st.report(true, s.boot, now), nil
}

// Release implements leader.Store. It also gives up the name's leader lock.
func (s *Store) Release(ctx context.Context, name, token string, term uint64) error {
	return s.release(ctx, name, token, term, nil)
}

// handover is what ReleaseTo adds to a release: the successor to reserve
// the lease for, the reason of its grant, and for how long.
type handover struct {
	to     leader.Candidate
	reason leader.GrantReason
	hold   time.Duration
}

// release frees the lease for name if token holds it under term, reserved
// as h says if h is not nil, wakes the watchers, and gives up the leader
// lock. The state keeps the term and the last grant's reason; a pending
// request ends.
func (s *Store) release(ctx context.Context, name, token string, term uint64, h *handover) error {
	const op = "release"
	e, stateLock, err := s.begin(ctx, op, name)
	if err != nil {
		return err
	}
	defer s.end(e, stateLock)

	st, now, err := s.load(e)
	if err != nil {
		return s.errorf(op, name, err)
	}
	if err := s.checkHolder(e, &st, now, token, term); err != nil {
		return s.errorf(op, name, err)
	}
	// The term stays, so no directory sync: if a crash undid the rename,
	// the old state would hold the same term.
	free := state{Version: stateVersion, Name: name, Term: st.Term, Reason: st.Reason}
	if h != nil {
		free.Reserved = &reservation{ID: h.to.ID, Token: h.to.Token, Reason: h.reason, period: newPeriod(s.boot, now, h.hold)}
	}
	if err := writeState(e.base+stateSuffix, free, false); err != nil {
		return s.errorf(op, name, writeError(err))
	}
	s.wake(name)
	if err := e.dropLeader(); err != nil {
		return s.errorf(op, name, err)
	}
	return nil
}

// Observe implements leader.Store. It reports a lease whose holder died as
// free, and the holder's ID, term, acquired time and expiry otherwise.
func (s *Store) Observe(ctx context.Context, name string) (leader.Lease, error) {
	return s.judge(ctx, "observe", name, func(_ *entry, st *state, now reading, held bool) (leader.Lease, error) {
		return st.report(held, s.boot, now), nil
	})
}

// judge calls fn, under name's state lock, with the state, the time, and
// whether the lease is held (see held), and returns what fn returns, its
// error wrapped as op's. It grants nothing: a leader lock that held found
// free is unlocked.
func (s *Store) judge(ctx context.Context, op, name string, fn func(e *entry, st *state, now reading, held bool) (leader.Lease, error)) (leader.Lease, error) {
	e, stateLock, err := s.begin(ctx, op, name)
	if err != nil {
		return leader.Lease{}, err
	}
	defer s.end(e, stateLock)

	st, now, err := s.load(e)
	if err != nil {
		return leader.Lease{}, s.errorf(op, name, err)
	}
	held, err := s.alive(e, &st, now)
	if err != nil {
		return leader.Lease{}, s.errorf(op, name, err)
	}
	l, err := fn(e, &st, now, held)
	if err != nil {
		return l, s.errorf(op, name, err)
	}
	return l, nil
}

// Names returns the election names that have state in the Store's
// directory, in no particular order: every name ever granted by any Store on
// the directory, held or not.
func (s *Store) Names() ([]string, error) {
	entries, err := os.ReadDir(s.dir)
	if err != nil {
		return nil, fmt.Errorf("filelock: names: %w", err)
	}
	var names []string
	for _, de := range entries {
		if !de.Type().IsRegular() || !strings.HasSuffix(de.Name(), stateSuffix) {
			continue
		}
		st, err := parseState(filepath.Join(s.dir, de.Name()))
		if errors.Is(err, fs.ErrNotExist) {
			continue // removed since the listing
		}
		if err != nil {
			return nil, fmt.Errorf("filelock: names: %w", err)
		}
		names = append(names, st.Name)
	}
	return names, nil
}

// begin starts a call on name: it takes the name's place in this Store and
// then its state lock, waiting no longer than ctx allows.
func (s *Store) begin(ctx context.Context, op, name string) (*entry, *os.File, error) {
	if err := ctx.Err(); err != nil {
		return nil, nil, s.errorf(op, name, err)
	}
	e, err := s.entry(name)
	if err != nil {
		return nil, nil, s.errorf(op, name, closedError(op))
	}
	select {
	case e.sem <- struct{}{}:
	case <-ctx.Done():
		return nil, nil, s.errorf(op, name, ctx.Err())
	}
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		<-e.sem
		return nil, nil, s.errorf(op, name, closedError(op))
	}
	stateLock, err := lockFileWait(ctx, e.base+stateLockSuffix)
	if err != nil {
		<-e.sem
		return nil, nil, s.errorf(op, name, err)
	}
	return e, stateLock, nil
}

// end finishes a call that begin started.
func (s *Store) end(e *entry, stateLock *os.File) {
	_ = unlockFile(stateLock)
	<-e.sem
}

// entry returns the Store's record of name, creating it.
func (s *Store) entry(name string) (*entry, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, ErrClosed
	}
	e, ok := s.names[name]
	if !ok {
		file := encodeName(name)
		e = &entry{
			name: name,
			file: file,
			base: filepath.Join(s.dir, file),
			sem:  make(chan struct{}, 1),
		}
		s.names[name] = e
	}
	return e, nil
}

// load reads the name's state and the clocks. It also drops the leader lock
// if this Store holds it for a candidate the state no longer names: that
// candidate lost the lease, and the lock now only delays the detection of the
// new holder's death. The caller holds the state lock.
func (s *Store) load(e *entry) (state, reading, error) {
	st, err := readState(e.base+stateSuffix, e.name)
	if err != nil {
		return state{}, reading{}, err
	}
	now, err := readNow()
	if err != nil {
		return state{}, reading{}, err
	}
	if e.leader != nil && e.leaderToken != st.Token {
		if err := e.dropLeader(); err != nil {
			return state{}, reading{}, err
		}
	}
	return st, now, nil
}

// held reports whether st has a live holder at now: a holder, an unexpired
// lease, and, if the holder recorded that it holds the leader lock, the lock
// still held. If the lock was free, held returns it locked (freed), and the
// caller keeps it for a grant or unlocks it. The caller holds the state lock.
func (s *Store) held(e *entry, st *state, now reading) (held bool, freed *os.File, err error) {
	named, check := s.holder(e, st, now)
	if !check {
		return named, nil, nil
	}
	lock, err := tryLockFile(e.base + leaderLockSuffix)
	if err != nil {
		return false, nil, err
	}
	if lock == nil {
		return true, nil, nil // the holder's process has it
	}
	return false, lock, nil // the holder's process is gone
}

// alive is held for a caller that grants nothing: it unlocks the leader
// lock if held found it free. The caller holds the state lock.
func (s *Store) alive(e *entry, st *state, now reading) (bool, error) {
	held, freed, err := s.held(e, st, now)
	if freed != nil {
		err = errors.Join(err, unlockFile(freed))
	}
	return held, err
}

// holder judges st at now by the state alone: whether it names a holder
// whose lease has time left (named), and if so whether that holder's life
// must be checked by trying the leader lock (check): the holder recorded
// that it holds the lock, and it is not this Store that holds it for the
// holder.
func (s *Store) holder(e *entry, st *state, now reading) (named, check bool) {
	if st.Token == "" || !st.unexpired(s.boot, now) {
		return false, false
	}
	return true, st.LeaderLock && (e.leader == nil || e.leaderToken != st.Token)
}

// checkHolder returns nil if st is held at now by token under term, and an
// error wrapping ErrLeaseLost otherwise, after dropping the leader lock if
// this Store holds it for token and token no longer holds the lease. The
// caller holds the state lock.
func (s *Store) checkHolder(e *entry, st *state, now reading, token string, term uint64) error {
	held, err := s.alive(e, st, now)
	if err != nil {
		return err
	}
	if held && st.Token == token {
		if st.Term == term {
			return nil
		}
		// A stale term from the current holder: the holder keeps the
		// lease, and its leader lock.
		return fmt.Errorf("term %d (the holder's is %d): %w", term, st.Term, leader.ErrLeaseLost)
	}
	if e.leader != nil && e.leaderToken == token {
		if err := e.dropLeader(); err != nil {
			return err
		}
	}
	return fmt.Errorf("term %d: %w", term, leader.ErrLeaseLost)
}

// dropLeader unlocks and closes the leader lock if this Store holds it. The
// caller holds e.sem.
func (e *entry) dropLeader() error {
	if e.leader == nil {
		return nil
	}
	err := unlockFile(e.leader)
	e.leader, e.leaderToken = nil, ""
	return err
}

// closedError is the error of a call after Close. A renewal or release on a
// closed Store also wraps leader.ErrLeaseLost: Close gave up the leader lock,
// so another candidate may hold the lease already, and a leader must step
// down at once rather than retry.
func closedError(op string) error {
	if op == "renew" || op == "release" {
		return fmt.Errorf("%w: %w", ErrClosed, leader.ErrLeaseLost)
	}
	return ErrClosed
}

func (s *Store) errorf(op, name string, err error) error {
	return fmt.Errorf("filelock: %s %q: %w", op, name, err)
}

// writeError marks a failed write on a read-only file system with
// leader.ErrReadOnly, so that a leader steps down at once.
func writeError(err error) error {
	if isReadOnlyFS(err) {
		return fmt.Errorf("%w: %w", leader.ErrReadOnly, err)
	}
	return err
}
