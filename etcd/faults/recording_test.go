//go:build unix

package faults_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/history"
	"github.com/leaderelect/leader/leadertest"
)

// batchStore is what a recordingStore wraps: an etcd.Store, or any other
// store that renews in batches.
type batchStore interface {
	leader.Store
	leader.BatchRenewer
}

// recordingStore is the leader.Store that the Electors of one process
// share, over one store of theirs: it records what internal/history needs
// of each Elector's calls, as a history.RecordingStore does, and it is a
// leader.BatchRenewer too, so that the Electors renew as they do on an
// etcd.Store of their own: together, with one RenewBatch call per round
// for every name the process leads (one keep-alive of the shared etcd
// lease and one transaction). A history.RecordingStore is a plain
// leader.Store, which Electors renew with Renew, one call per name.
//
// Each name has one Elector in the process, registered with add, and two
// history.RecordingStores of that Elector's Recorder: direct, over the
// wrapped store, for Acquire, Renew and Release; and replay, over a
// replayStore, through which RenewBatch records the renewals of a batch.
// For each renewal RenewBatch calls replay's Renew, which takes its send
// time and then, in the replayStore, waits; once every renewal of the
// batch has its send time, RenewBatch sends the batch to the wrapped
// store, hands each outcome to its waiting Renew, and returns what those
// return: replay records each renewal that succeeded, sent before the
// batch was and answered after it was, which is what Check needs (the
// last successful send under each term); and a renewal whose recording
// failed is reported failed, so that no Elector leads on unrecorded.
type recordingStore struct {
	store batchStore
	// trace, if not nil, gets a line per call of RenewBatch (how many
	// renewals it had) and of Renew ("renew"), for a test that reads them
	// from another process.
	trace io.Writer

	mu    sync.Mutex // guards names, and serializes writes to trace
	names map[string]*recordedName

	batches, renewals, multiName, renews atomic.Int64
}

// recordedName is the recording of the one Elector of a name.
type recordedName struct {
	direct, replay *history.RecordingStore
}

var (
	_ leader.Store        = (*recordingStore)(nil)
	_ leader.BatchRenewer = (*recordingStore)(nil)
	_ leader.FreeWatcher  = (*recordingStore)(nil)
	_ leader.LossNotifier = (*recordingStore)(nil)
)

// newRecordingStore returns a recordingStore over store, with no name
// yet; trace may be nil.
func newRecordingStore(store batchStore, trace io.Writer) *recordingStore {
	return &recordingStore{store: store, trace: trace, names: map[string]*recordedName{}}
}

// add registers the Elector of instance for the name rec records: its
// calls are recorded with rec. Call it before the Elector starts.
func (s *recordingStore) add(rec *history.Recorder, instance string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.names[rec.Name()] = &recordedName{
		direct: rec.Store(s.store, instance),
		replay: rec.Store(replayStore{}, instance),
	}
}

// name returns the recording of name's Elector.
func (s *recordingStore) name(name string) (*recordedName, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if n := s.names[name]; n != nil {
		return n, nil
	}
	return nil, fmt.Errorf("recordingStore: no Elector registered for %q", name)
}

// stats returns how many RenewBatch calls were made, how many renewals
// they carried, how many had more than one, and how many Renew calls were
// made.
func (s *recordingStore) stats() (batches, renewals, multiName, renews int64) {
	return s.batches.Load(), s.renewals.Load(), s.multiName.Load(), s.renews.Load()
}

// note writes line to trace, if set.
func (s *recordingStore) note(line string) {
	if s.trace == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	_, _ = io.WriteString(s.trace, line+"\n")
}

// Acquire implements leader.Store.
func (s *recordingStore) Acquire(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) (leader.Lease, bool, error) {
	n, err := s.name(name)
	if err != nil {
		return leader.Lease{}, false, err
	}
	return n.direct.Acquire(ctx, name, c, ttl)
}

// Renew implements leader.Store. Electors on a BatchRenewer do not call
// it: it is counted, so that a test can tell.
func (s *recordingStore) Renew(ctx context.Context, name, token string, term uint64, ttl time.Duration) (leader.Lease, error) {
	s.renews.Add(1)
	s.note("renew")
	n, err := s.name(name)
	if err != nil {
		return leader.Lease{}, err
	}
	return n.direct.Renew(ctx, name, token, term, ttl)
}

// RenewBatch implements leader.BatchRenewer: it renews batch with one
// RenewBatch call of the wrapped store, and records each renewal that
// succeeded (see recordingStore).
func (s *recordingStore) RenewBatch(ctx context.Context, batch []leader.Renewal) {
	if len(batch) == 0 {
		return
	}
	s.batches.Add(1)
	s.renewals.Add(int64(len(batch)))
	if len(batch) > 1 {
		s.multiName.Add(1)
	}
	s.note(fmt.Sprint(len(batch)))

	type outcome struct {
		lease leader.Lease
		err   error
	}
	outcomes := make([]outcome, len(batch))
	done := make(chan struct{}) // closed once the batch has its outcomes
	var entered, returned sync.WaitGroup
	for i := range batch {
		r := &batch[i]
		n, err := s.name(r.Name)
		if err != nil {
			outcomes[i].err = err
			continue
		}
		sl := &slot{renewal: r, done: done, entered: &entered}
		entered.Add(1)
		returned.Go(func() {
			// If replay's Renew failed before it reached the
			// replayStore, the batch must not wait for it.
			defer sl.enter()
			l, err := n.replay.Renew(context.WithValue(ctx, slotKey{}, sl), r.Name, r.Token, r.Term, r.TTL)
			outcomes[i] = outcome{l, err}
		})
	}
	entered.Wait()
	s.store.RenewBatch(ctx, batch)
	close(done)
	returned.Wait()
	for i := range batch {
		batch[i].Lease, batch[i].Err = outcomes[i].lease, outcomes[i].err
	}
}

// Release implements leader.Store.
func (s *recordingStore) Release(ctx context.Context, name, token string, term uint64) error {
	n, err := s.name(name)
	if err != nil {
		return err
	}
	return n.direct.Release(ctx, name, token, term)
}

// Observe implements leader.Store.
func (s *recordingStore) Observe(ctx context.Context, name string) (leader.Lease, error) {
	return s.store.Observe(ctx, name)
}

// Watch implements leader.Store.
func (s *recordingStore) Watch(ctx context.Context, name string) (<-chan struct{}, error) {
	return s.store.Watch(ctx, name)
}

// WatchFree implements leader.FreeWatcher, as a history.RecordingStore
// does.
func (s *recordingStore) WatchFree(ctx context.Context, name string) (<-chan struct{}, error) {
	n, err := s.name(name)
	if err != nil {
		return nil, err
	}
	return n.direct.WatchFree(ctx, name)
}

// Lost implements leader.LossNotifier, as a history.RecordingStore does.
func (s *recordingStore) Lost(name, token string, term uint64) <-chan struct{} {
	n, err := s.name(name)
	if err != nil {
		return nil
	}
	return n.direct.Lost(name, token, term)
}

// slot is one renewal of a RenewBatch call in progress, for the
// replayStore: entered is done once its send time is taken, and its
// outcome is in renewal once done is closed.
type slot struct {
	renewal *leader.Renewal
	done    <-chan struct{}
	entered *sync.WaitGroup
	once    sync.Once
}

// enter marks the slot's send time taken, once.
func (sl *slot) enter() { sl.once.Do(sl.entered.Done) }

// slotKey is the context key of a slot.
type slotKey struct{}

// errReplayOnly is what a replayStore answers to anything but Renew.
var errReplayOnly = errors.New("replayStore: only Renew, within RenewBatch")

// replayStore is the store under a name's replay RecordingStore: its
// Renew reports the outcome the RenewBatch call in progress gets for the
// renewal in its context's slot, once the batch has it.
type replayStore struct{}

// Renew implements leader.Store.
func (replayStore) Renew(ctx context.Context, name, token string, term uint64, ttl time.Duration) (leader.Lease, error) {
	sl, _ := ctx.Value(slotKey{}).(*slot)
	if sl == nil {
		return leader.Lease{}, errReplayOnly
	}
	sl.enter()
	<-sl.done
	return sl.renewal.Lease, sl.renewal.Err
}

// Acquire implements leader.Store; it is never called.
func (replayStore) Acquire(context.Context, string, leader.Candidate, time.Duration) (leader.Lease, bool, error) {
	return leader.Lease{}, false, errReplayOnly
}

// Release implements leader.Store; it is never called.
func (replayStore) Release(context.Context, string, string, uint64) error { return errReplayOnly }

// Observe implements leader.Store; it is never called.
func (replayStore) Observe(context.Context, string) (leader.Lease, error) {
	return leader.Lease{}, errReplayOnly
}

// Watch implements leader.Store; it is never called.
func (replayStore) Watch(context.Context, string) (<-chan struct{}, error) {
	return nil, errReplayOnly
}

// A recordingStore makes the Electors that share it renew together, with
// RenewBatch alone, and records each of their renewals: two Electors of
// two names on an in-memory store, leading both at once.
func TestRecordingStoreRenewsInBatches(t *testing.T) {
	t.Parallel()
	const shortTTL = time.Second
	dir := t.TempDir()
	rs := newRecordingStore(leadertest.NewMemStore(), nil)
	var recs []*history.Recorder
	var electors []*leader.Elector
	for _, name := range []string{"a", "b"} {
		rec, err := history.Create(dir, name)
		if err != nil {
			t.Fatal(err)
		}
		recs = append(recs, rec)
		rs.add(rec, "p")
		onElected, onDemoted := rec.Hooks("p")
		e, err := leader.New(rs, leader.Config{Name: name, ID: "p", TTL: shortTTL, Logger: testLogger("p/" + name),
			OnElected: onElected, OnDemoted: onDemoted})
		if err != nil {
			t.Fatal(err)
		}
		electors = append(electors, e)
	}
	var stops []func()
	for _, e := range electors {
		stops = append(stops, electortest.Run(t, e))
	}
	electortest.Eventually(t, 10*time.Second, "both Electors lead", func() bool {
		return electors[0].IsLeader() && electors[1].IsLeader()
	})
	time.Sleep(4 * shortTTL / 3) // four renewal rounds
	for _, stop := range stops {
		stop()
	}
	for _, rec := range recs {
		if err := rec.Close(); err != nil {
			t.Fatal(err)
		}
	}

	batches, renewals, multiName, renews := rs.stats()
	t.Logf("%d RenewBatch calls (%d renewals, %d of both names), %d Renew calls", batches, renewals, multiName, renews)
	if batches == 0 || multiName == 0 || renews != 0 {
		t.Errorf("%d RenewBatch calls (%d renewals, %d of both names) and %d Renew calls; want RenewBatch alone, some calls of both names",
			batches, renewals, multiName, renews)
	}
	evs, err := history.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	renewed := map[string]int{}
	for _, e := range evs {
		if e.Kind == history.Renewed {
			renewed[e.Name]++
			if e.Sent == 0 || e.Sent > e.At {
				t.Errorf("a renewal recorded as sent at %d and answered at %d: %v", e.Sent, e.At, e)
			}
		}
	}
	if int64(renewed["a"]+renewed["b"]) != renewals || renewed["a"] == 0 || renewed["b"] == 0 {
		t.Errorf("renewals recorded per name: %v; want each of the %d renewals of the RenewBatch calls, of both names", renewed, renewals)
	}
	if rep := history.Check(evs, history.Bounds{}); !rep.OK() {
		t.Errorf("the history fails:\n%v", rep)
	}
}
