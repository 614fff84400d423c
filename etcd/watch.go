package etcd

import (
	"context"
	"fmt"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// nameWatch is one etcd watch of a name's keys, shared by the Store's
// watchers of that name.
type nameWatch struct {
	name   string
	cancel context.CancelFunc
	subs   map[chan struct{}]*watcher
}

// watcher is one channel returned by Watch or WatchFree.
type watcher struct {
	freeOnly bool
	stop     func() bool // stops the context.AfterFunc that closes it
}

// Watch implements leader.Store: the channel receives a value soon after
// the name's holder key is written (a grant) or deleted (a release, or the
// end of its etcd lease), or its reservation ends.
func (s *Store) Watch(ctx context.Context, name string) (<-chan struct{}, error) {
	return s.watch(ctx, name, false)
}

// WatchFree implements leader.FreeWatcher: the channel receives a value
// soon after the name's holder key is deleted (a release, the end of its
// etcd lease, or its holder's deadline passing unrenewed) or its
// reservation ends unused; never for a grant.
func (s *Store) WatchFree(ctx context.Context, name string) (<-chan struct{}, error) {
	return s.watch(ctx, name, true)
}

func (s *Store) watch(ctx context.Context, name string, freeOnly bool) (<-chan struct{}, error) {
	what := call("watch", name)
	if name == "" {
		return nil, fmt.Errorf("etcd: %s: the name is empty", what)
	}
	cctx, cancel, err := s.begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("etcd: %s: %w", what, err)
	}
	defer cancel()
	s.mu.Lock()
	if w := s.watches[name]; w != nil {
		// Its etcd watch started at a revision before this call, so it
		// delivers every event after this call returns.
		defer s.mu.Unlock()
		return s.subscribeLocked(ctx, w, freeOnly), nil
	}
	s.mu.Unlock()
	// A new etcd watch starts at the revision after a read made now, so
	// that it delivers every event after this call returns.
	k := s.keys(name)
	resp, err := s.client.Get(cctx, k.holder, clientv3.WithCountOnly())
	if err != nil {
		return nil, s.wrapError(ctx, what, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, fmt.Errorf("etcd: %s: %w", what, ErrClosed)
	}
	w := s.watches[name]
	if w == nil {
		wctx, stop := context.WithCancel(s.bg)
		w = &nameWatch{name: name, cancel: stop, subs: make(map[chan struct{}]*watcher)}
		s.watches[name] = w
		s.wg.Add(1)
		go s.runWatch(wctx, w, k, resp.Header.Revision+1)
	}
	return s.subscribeLocked(ctx, w, freeOnly), nil
}

// subscribeLocked returns a new channel of w's, closed after ctx ends.
func (s *Store) subscribeLocked(ctx context.Context, w *nameWatch, freeOnly bool) chan struct{} {
	ch := make(chan struct{}, 1)
	sub := &watcher{freeOnly: freeOnly}
	w.subs[ch] = sub
	sub.stop = context.AfterFunc(ctx, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if w.subs[ch] != sub {
			return // closed by Close
		}
		delete(w.subs, ch)
		close(ch)
		if len(w.subs) == 0 {
			w.cancel()
			if s.watches[w.name] == w {
				delete(s.watches, w.name)
			}
		}
	})
	return ch
}

// closeLocked closes every channel of w and ends its etcd watch (Close).
// A context.AfterFunc of a channel that runs meanwhile finds the channel
// gone from w.subs and leaves it alone.
func (w *nameWatch) closeLocked() {
	w.cancel()
	for ch, sub := range w.subs {
		sub.stop()
		delete(w.subs, ch)
		close(ch)
	}
}

// runWatch watches the name's keys from revision rev on, until ctx ends,
// and wakes w's watchers. When etcd ends the watch (a compaction, a member
// that lost its leader), it wakes every watcher, since it may have missed
// an event, and watches again from where it was.
func (s *Store) runWatch(ctx context.Context, w *nameWatch, k keys, rev int64) {
	defer s.wg.Done()
	backoff := 10 * time.Millisecond
	for ctx.Err() == nil {
		wch := s.client.Watch(clientv3.WithRequireLeader(ctx), k.names, clientv3.WithPrefix(), clientv3.WithRev(rev))
		for resp := range wch {
			if err := resp.Err(); err != nil {
				if resp.CompactRevision > 0 {
					rev = resp.CompactRevision
				}
				s.log.Warn("etcd: a watch ended; watching again", "name", w.name, "error", err)
				break
			}
			s.dispatch(w, k, resp.Events)
			if n := len(resp.Events); n > 0 {
				rev = resp.Events[n-1].Kv.ModRevision + 1
			}
			backoff = 10 * time.Millisecond
		}
		if ctx.Err() != nil {
			return
		}
		s.wakeAll(w, false)
		if s.client.Ctx().Err() != nil {
			// The client is closed: no watch will start again. The
			// watchers were woken once, and rely on expiries from now
			// on; stay silent until the watch ends.
			s.log.Warn("etcd: the client is closed; watch wake-ups stop", "name", w.name)
			<-ctx.Done()
			return
		}
		select {
		case <-time.After(backoff):
		case <-ctx.Done():
			return
		}
		backoff = min(2*backoff, time.Second)
	}
}

// dispatch wakes w's watchers for events. A revision that writes the
// holder key is a grant (or a renewal that moved the key to another
// lease), which wakes only plain watchers; one that deletes the holder
// key or the reservation, and writes no holder, frees the lease, and
// wakes them all.
func (s *Store) dispatch(w *nameWatch, k keys, events []*clientv3.Event) {
	granted := make(map[int64]bool)
	freed := make(map[int64]bool)
	for _, ev := range events {
		key, rev := string(ev.Kv.Key), ev.Kv.ModRevision
		switch {
		case key == k.holder && ev.Type == mvccpb.PUT:
			granted[rev] = true
		case key == k.holder && ev.Type == mvccpb.DELETE,
			key == k.reserve && ev.Type == mvccpb.DELETE:
			freed[rev] = true
		}
	}
	anyFreed := false
	for rev := range freed {
		if !granted[rev] {
			anyFreed = true
		}
	}
	if anyFreed || len(granted) > 0 {
		s.wakeAll(w, !anyFreed)
	}
}

// wakeAll wakes w's watchers; if grantsOnly, only those that watch
// grants too.
func (s *Store) wakeAll(w *nameWatch, grantsOnly bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for ch, sub := range w.subs {
		if grantsOnly && sub.freeOnly {
			continue
		}
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}
