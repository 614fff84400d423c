package etcd

import (
	"context"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Fence is what a write of unknown outcome compared against, for tests:
// the mod revisions of the holder and record keys its read saw, the
// record's value then (nil if none), and the lease it put the holder key
// on.
type Fence struct {
	HolderRev, RecordRev int64
	Record               []byte
	Lease                clientv3.LeaseID
}

// Settle is settle, for tests, except that it returns once settled.
func (s *Store) Settle(name, token string, term uint64, began time.Time, ttl time.Duration, f Fence) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.wg.Add(1)
	s.mu.Unlock()
	s.settling(name, token, term, began, ttl, fence{holderRev: f.HolderRev, recordRev: f.RecordRev, record: f.Record, lease: f.Lease})
}

// Forget makes the Store forget its grant of name to token under term, as
// if the write that made it had failed with an unknown outcome, for tests.
func (s *Store) Forget(name, token string, term uint64) {
	s.forget(name, token, term)
}

// State is a name's keys as one read saw them, for tests.
type State = state

// ReadState reads name's state, for tests.
func (s *Store) ReadState(ctx context.Context, name string) (*State, error) {
	resp, err := s.client.Txn(ctx).Then(stateOps(s.keys(name))...).Commit()
	if err != nil {
		return nil, err
	}
	return parseState(resp.Responses)
}

// Settled is settle's verdict on st, read after the fence failed, for
// tests: st may be stale by the time the verdict runs.
func (s *Store) Settled(name, token string, term uint64, began time.Time, ttl time.Duration, f Fence, st *State) {
	s.settled(name, token, term, began, ttl, fence{holderRev: f.HolderRev, recordRev: f.RecordRev, record: f.Record, lease: f.Lease}, st)
}

// SetDeadline sets the Store's deadline for its grant of name without
// moving its expiry timer, as if the timer were late, for tests.
func (s *Store) SetDeadline(name string, d time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if h := s.held[name]; h != nil {
		h.deadline = d
	}
}

// FenceOf is the fence of a write that read st and put the holder key on
// lease, for tests.
func FenceOf(st *State, lease clientv3.LeaseID) Fence {
	f := fenceOf(st, lease)
	return Fence{HolderRev: f.holderRev, RecordRev: f.recordRev, Record: f.record, Lease: f.lease}
}
