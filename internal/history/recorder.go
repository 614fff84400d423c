package history

import (
	"bufio"
	"bytes"
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/monotime"
)

// fileSuffix ends the name of every history file; Load reads only those.
const fileSuffix = ".history.jsonl"

// Recorder appends the events of one election name's participants in one
// process to a file of its own. Its methods are safe for concurrent use.
type Recorder struct {
	name string
	path string

	mu     sync.Mutex
	f      *os.File
	err    error // first failure to record
	closed bool
}

// Create returns a Recorder for the election name that writes to a new file
// in dir (which must exist). Several Recorders, in one process or many, may
// write to the same dir; each has its own file.
func Create(dir, name string) (*Recorder, error) {
	var b [8]byte
	if _, err := crand.Read(b[:]); err != nil {
		return nil, fmt.Errorf("history: %w", err)
	}
	path := filepath.Join(dir, fmt.Sprintf("%d-%s%s", os.Getpid(), hex.EncodeToString(b[:]), fileSuffix))
	// O_APPEND: every write lands whole at the end, even if another
	// process appends to the same file.
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("history: %w", err)
	}
	return &Recorder{name: name, path: path, f: f}, nil
}

// Path returns the file the Recorder writes to.
func (r *Recorder) Path() string { return r.path }

// Name returns the election name the Recorder records.
func (r *Recorder) Name() string { return r.name }

// Err returns the first failure to record an event, or nil. The hooks cannot
// return errors, so a test should check Err after its Electors have stopped.
func (r *Recorder) Err() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.err
}

// Close closes the file and returns Err. Events recorded afterwards are lost
// and make Err fail.
func (r *Recorder) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.closed {
		r.closed = true
		if err := r.f.Close(); err != nil && r.err == nil {
			r.err = fmt.Errorf("history: %w", err)
		}
	}
	return r.err
}

// record appends e to the file as one line in one write(2).
func (r *Recorder) record(e Event) error {
	line, err := json.Marshal(e)
	if err != nil {
		return r.fail(err)
	}
	line = append(line, '\n')
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		err = errors.New("recorder closed")
	} else {
		// An *os.File issues one write(2) for a buffer this small; a
		// regular file takes it whole.
		_, err = r.f.Write(line)
	}
	if err != nil {
		err = fmt.Errorf("history: recording %s: %w", e, err)
		if r.err == nil {
			r.err = err
		}
	}
	return err
}

func (r *Recorder) fail(err error) error {
	err = fmt.Errorf("history: %w", err)
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.err == nil {
		r.err = err
	}
	return err
}

// now reads CLOCK_MONOTONIC, remembering a failure.
func (r *Recorder) now() (int64, error) {
	t, err := monotime.Now()
	if err != nil {
		return 0, r.fail(err)
	}
	return t, nil
}

// Hooks returns an OnElected and an OnDemoted for the Elector of instance
// (see leader.Config), recording its leaderships. Set them directly, or call
// them first thing from an OnElected and OnDemoted of your own, with the
// leader context itself:
//
//   - onElected records Elected with the term from the context and returns
//     at once; it registers an AfterFunc on the context that records Ended
//     when the context is cancelled, an upper bound of the end of belief (the
//     Elector turns IsLeader false before it cancels the context).
//   - onDemoted records Demoted, also an upper bound of the end, with the
//     term of the leadership it ends. The Elector calls OnElected on a
//     goroutine of its own, so after a short leadership OnDemoted can come
//     first: onDemoted then waits until onElected has been called for that
//     leadership. So every OnElected must call onElected, or OnDemoted
//     blocks for ever.
//
// Use one pair of hooks per Elector. A failure to record shows in Err.
func (r *Recorder) Hooks(instance string) (onElected func(ctx context.Context), onDemoted func()) {
	var (
		mu      sync.Mutex
		arrived = sync.NewCond(&mu)
		pending []uint64 // terms elected and not yet demoted, oldest first
	)
	onElected = func(ctx context.Context) {
		at, err := r.now()
		term, ok := leader.TermFrom(ctx)
		if !ok {
			_ = r.fail(fmt.Errorf("%s: the OnElected context carries no term", instance))
		}
		mu.Lock()
		pending = append(pending, term)
		arrived.Broadcast()
		mu.Unlock()
		if err == nil {
			_ = r.record(Event{At: at, Kind: Elected, Name: r.name, Instance: instance, Term: term})
		}
		context.AfterFunc(ctx, func() {
			if at, err := r.now(); err == nil {
				_ = r.record(Event{At: at, Kind: Ended, Name: r.name, Instance: instance, Term: term})
			}
		})
	}
	onDemoted = func() {
		at, err := r.now()
		mu.Lock()
		for len(pending) == 0 {
			arrived.Wait()
		}
		term := pending[0]
		pending = pending[1:]
		mu.Unlock()
		if err == nil {
			_ = r.record(Event{At: at, Kind: Demoted, Name: r.name, Instance: instance, Term: term})
		}
	}
	return onElected, onDemoted
}

// Store returns store wrapped in a RecordingStore for the Elector of
// instance. Use one per Elector.
func (r *Recorder) Store(store leader.Store, instance string) *RecordingStore {
	return &RecordingStore{store: store, rec: r, instance: instance}
}

// RecordingStore is a leader.Store that forwards every call to another and
// records what bounds its Elector's belief that it leads: when a granting
// Acquire was sent and when it returned (the belief starts after both), each
// successful Renew, and when each Release was sent (the belief has ended by
// then). It is a leader.LossNotifier (and LossWatchStopper) if the store it
// wraps is one.
//
// Acquire or Renew succeeding on the store but failing to be recorded
// returns an error instead, so that the Elector never leads unrecorded; a
// grant is then released, best effort.
type RecordingStore struct {
	store    leader.Store
	rec      *Recorder
	instance string
}

var (
	_ leader.Store            = (*RecordingStore)(nil)
	_ leader.LossNotifier     = (*RecordingStore)(nil)
	_ leader.LossWatchStopper = (*RecordingStore)(nil)
	_ leader.FreeWatcher      = (*RecordingStore)(nil)
)

// Acquire implements leader.Store.
func (s *RecordingStore) Acquire(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) (leader.Lease, bool, error) {
	sent, err := s.rec.now()
	if err != nil {
		return leader.Lease{}, false, err
	}
	l, granted, err := s.store.Acquire(ctx, name, c, ttl)
	if err != nil || !granted {
		return l, granted, err
	}
	at, err := s.rec.now()
	if err == nil {
		err = s.rec.record(Event{At: at, Sent: sent, Kind: Granted, Name: name, Instance: s.instance, Term: l.Term})
	}
	if err != nil {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ttl)
		defer cancel()
		_ = s.store.Release(rctx, name, c.Token, l.Term)
		return leader.Lease{}, false, err
	}
	return l, true, nil
}

// Renew implements leader.Store.
func (s *RecordingStore) Renew(ctx context.Context, name, token string, term uint64, ttl time.Duration) (leader.Lease, error) {
	sent, err := s.rec.now()
	if err != nil {
		return leader.Lease{}, err
	}
	l, err := s.store.Renew(ctx, name, token, term, ttl)
	if err != nil {
		return l, err
	}
	at, err := s.rec.now()
	if err == nil {
		err = s.rec.record(Event{At: at, Sent: sent, Kind: Renewed, Name: name, Instance: s.instance, Term: term})
	}
	if err != nil {
		return leader.Lease{}, err
	}
	return l, nil
}

// Release implements leader.Store.
func (s *RecordingStore) Release(ctx context.Context, name, token string, term uint64) error {
	if at, err := s.rec.now(); err == nil {
		_ = s.rec.record(Event{At: at, Kind: Released, Name: name, Instance: s.instance, Term: term})
	}
	return s.store.Release(ctx, name, token, term)
}

// Observe implements leader.Store.
func (s *RecordingStore) Observe(ctx context.Context, name string) (leader.Lease, error) {
	return s.store.Observe(ctx, name)
}

// Watch implements leader.Store.
func (s *RecordingStore) Watch(ctx context.Context, name string) (<-chan struct{}, error) {
	return s.store.Watch(ctx, name)
}

// WatchFree implements leader.FreeWatcher with the store's WatchFree, or
// its Watch if it has none.
func (s *RecordingStore) WatchFree(ctx context.Context, name string) (<-chan struct{}, error) {
	if fw, ok := s.store.(leader.FreeWatcher); ok {
		return fw.WatchFree(ctx, name)
	}
	return s.store.Watch(ctx, name)
}

// Lost implements leader.LossNotifier: it asks the wrapped store, and
// returns nil (cannot tell) if that store is not a LossNotifier.
func (s *RecordingStore) Lost(name, token string, term uint64) <-chan struct{} {
	if ln, ok := s.store.(leader.LossNotifier); ok {
		return ln.Lost(name, token, term)
	}
	return nil
}

// StopLossWatch implements leader.LossWatchStopper: it tells the wrapped
// store, if that store is one.
func (s *RecordingStore) StopLossWatch(name, token string, term uint64) {
	if ls, ok := s.store.(leader.LossWatchStopper); ok {
		ls.StopLossWatch(name, token, term)
	}
}

// Load reads the events of every history file in dir (those Create made),
// ordered by At. A last line without its newline, which only a write cut
// short by a crash of the host can leave, is ignored; any other line that
// does not parse is an error.
func Load(dir string) ([]Event, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("history: %w", err)
	}
	var events []Event
	for _, ent := range entries {
		if ent.IsDir() || !strings.HasSuffix(ent.Name(), fileSuffix) {
			continue
		}
		path := filepath.Join(dir, ent.Name())
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("history: %w", err)
		}
		if i := bytes.LastIndexByte(b, '\n'); i < len(b)-1 {
			b = b[:i+1] // an incomplete last line
		}
		sc := bufio.NewScanner(bytes.NewReader(b))
		sc.Buffer(nil, 1<<20)
		for line := 1; sc.Scan(); line++ {
			var e Event
			dec := json.NewDecoder(bytes.NewReader(sc.Bytes()))
			dec.DisallowUnknownFields()
			if err := dec.Decode(&e); err != nil {
				return nil, fmt.Errorf("history: %s:%d: %w", path, line, err)
			}
			if !e.Kind.valid() {
				return nil, fmt.Errorf("history: %s:%d: unknown event kind %q", path, line, e.Kind)
			}
			events = append(events, e)
		}
		if err := sc.Err(); err != nil {
			return nil, fmt.Errorf("history: %s: %w", path, err)
		}
	}
	slices.SortStableFunc(events, func(a, b Event) int { return cmpInt(a.At, b.At) })
	return events, nil
}

func cmpInt(a, b int64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}
