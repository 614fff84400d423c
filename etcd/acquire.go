package etcd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leaderelect/leader"
)

// state is a name's keys as one read saw them.
type state struct {
	holder   *mvccpb.KeyValue // nil when the lease is not held
	recKV    *mvccpb.KeyValue // nil when the name was never granted
	rec      record
	reserved *mvccpb.KeyValue // nil when no reservation is in force
	req      *request         // nil when no request is pending
}

func (st *state) holderRev() int64   { return modRev(st.holder) }
func (st *state) recordRev() int64   { return modRev(st.recKV) }
func (st *state) reservedRev() int64 { return modRev(st.reserved) }

func modRev(kv *mvccpb.KeyValue) int64 {
	if kv == nil {
		return 0
	}
	return kv.ModRevision
}

// heldBy reports whether st shows the lease held by token under term.
func (st *state) heldBy(token string, term uint64) bool {
	return st.holder != nil && token != "" && string(st.holder.Value) == token && st.rec.Term == term
}

// stateOps are the reads of a name's state, in the order parseState takes.
func stateOps(k keys) []clientv3.Op {
	return []clientv3.Op{clientv3.OpGet(k.holder), clientv3.OpGet(k.record), clientv3.OpGet(k.reserve), clientv3.OpGet(k.request)}
}

// parseState decodes the responses of stateOps.
func parseState(rs []*pb.ResponseOp) (*state, error) {
	if len(rs) != 4 {
		return nil, fmt.Errorf("etcd answered %d reads of the state, not 4", len(rs))
	}
	one := func(r *pb.ResponseOp) *mvccpb.KeyValue {
		if kvs := r.GetResponseRange().GetKvs(); len(kvs) > 0 {
			return kvs[0]
		}
		return nil
	}
	st := &state{holder: one(rs[0]), recKV: one(rs[1]), reserved: one(rs[2])}
	if st.recKV != nil {
		if err := json.Unmarshal(st.recKV.Value, &st.rec); err != nil {
			return nil, fmt.Errorf("the record %s is not a lease record: %w", st.recKV.Key, err)
		}
	}
	if kv := one(rs[3]); kv != nil {
		var r request
		if err := json.Unmarshal(kv.Value, &r); err == nil {
			st.req = &r
		}
	}
	return st, nil
}

// lease reports st as a follower is told it. Without a clock of etcd's to
// read, a held lease is reported with the holder's whole ttl remaining:
// never less than the holder's own deadline leaves, never more than its
// ttl (see Expiry in the package documentation).
func (st *state) lease(name string) leader.Lease {
	now := time.Now()
	out := leader.Lease{Name: name, Term: st.rec.Term, Reason: st.rec.Reason}
	switch {
	case st.holder != nil:
		out.HolderID = st.rec.ID
		out.Priority = st.rec.Priority
		out.AcquiredAt = time.Unix(0, st.rec.Acquired)
		out.Remaining = max(st.rec.TTL, time.Nanosecond)
		out.ExpiresAt = now.Add(out.Remaining)
		if !out.ExpiresAt.After(out.AcquiredAt) { // another host's wall clock
			out.ExpiresAt = out.AcquiredAt.Add(out.Remaining)
		}
		out.Transfer = st.req.transfer(now)
	case st.reserved != nil:
		out.Successor = st.rec.SuccessorID
		out.Reserved = st.rec.Hold
		if st.rec.ReservedUntil != 0 { // on the releaser's wall clock: a hint
			out.Reserved = min(out.Reserved, time.Unix(0, st.rec.ReservedUntil).Sub(now))
		}
		out.Reserved = max(out.Reserved, time.Nanosecond) // the key is there
	}
	return out
}

// transfer reports r as Lease.Transfer at now.
func (r *request) transfer(now time.Time) leader.TransferRequest {
	if r == nil {
		return leader.TransferRequest{}
	}
	left := min(time.Unix(0, r.Until).Sub(now), r.TTL)
	if left <= 0 {
		return leader.TransferRequest{}
	}
	return leader.TransferRequest{To: r.To, Reason: r.Reason, Remaining: left}
}

// holderReport reports a grant or renewal to its holder: the Store keeps
// it at least ttl from when the call began.
func holderReport(name string, rec record, req *request, ttl time.Duration, began time.Time) leader.Lease {
	now := time.Now()
	left := max(ttl-now.Sub(began), time.Nanosecond)
	return leader.Lease{
		Name:       name,
		HolderID:   rec.ID,
		Term:       rec.Term,
		AcquiredAt: time.Unix(0, rec.Acquired),
		ExpiresAt:  now.Add(left),
		Remaining:  left,
		Priority:   rec.Priority,
		Reason:     rec.Reason,
		Transfer:   req.transfer(now),
	}
}

func checkArgs(name, token string, ttl time.Duration, needTTL bool) error {
	switch {
	case name == "":
		return errors.New("the name is empty")
	case token == "":
		return errors.New("the candidate's token is empty")
	case needTTL && ttl <= 0:
		return fmt.Errorf("the ttl %v is not positive", ttl)
	}
	return nil
}

// Acquire implements leader.Store. A grant costs three requests: a read
// (which, refused, enlists the candidate: see Transferer), a keep-alive of
// the shared lease for ttl (or a new lease), and a transaction that grants
// if nothing changed since the read.
func (s *Store) Acquire(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) (leader.Lease, bool, error) {
	began := time.Now()
	what := call("acquire", name)
	if err := checkArgs(name, c.Token, ttl, true); err != nil {
		return leader.Lease{}, false, fmt.Errorf("etcd: %s: %w", what, err)
	}
	cctx, cancel, err := s.begin(ctx)
	if err != nil {
		return leader.Lease{}, false, fmt.Errorf("etcd: %s: %w", what, err)
	}
	defer cancel()
	k := s.keys(name)
	for {
		st, refused, err := s.acquireRead(cctx, k, c, ttl)
		if err != nil {
			return leader.Lease{}, false, s.wrapError(ctx, what, err)
		}
		if refused {
			return st.lease(name), false, nil
		}
		hl, err := s.holderLease(cctx, ttl)
		if err != nil {
			return leader.Lease{}, false, s.wrapError(ctx, what, err)
		}
		why := leader.GrantFirst
		switch {
		case st.holder != nil: // its own: a new grant to the holder
		case st.reserved != nil:
			why = st.rec.SuccessorReason
		case st.rec.Term == 0:
		case st.rec.Released:
			why = leader.GrantRelease
		default:
			why = leader.GrantExpiry
		}
		rec := record{Term: st.rec.Term + 1, ID: c.ID, Priority: c.Priority, Reason: why, Acquired: time.Now().UnixNano(), TTL: ttl}
		ops := []clientv3.Op{
			clientv3.OpPut(k.holder, c.Token, clientv3.WithLease(hl.id)),
			clientv3.OpPut(k.record, mustJSON(rec)),
			clientv3.OpPut(k.held(hl.id), heldValue(rec.Term, c.Token), clientv3.WithLease(hl.id)),
			clientv3.OpDelete(k.reserve),
			clientv3.OpDelete(k.request),
		}
		if st.holder != nil && clientv3.LeaseID(st.holder.Lease) != hl.id {
			ops = append(ops, clientv3.OpDelete(k.held(clientv3.LeaseID(st.holder.Lease))))
		}
		resp, err := s.client.Txn(cctx).If(
			clientv3.Compare(clientv3.ModRevision(k.holder), "=", st.holderRev()),
			clientv3.Compare(clientv3.ModRevision(k.record), "=", st.recordRev()),
			clientv3.Compare(clientv3.ModRevision(k.reserve), "=", st.reservedRev()),
		).Then(ops...).Commit()
		switch {
		case err != nil && isLeaseNotFound(err):
			s.leaseGone(hl) // revoked since the keep-alive; try with a new one
			continue
		case err != nil:
			s.settle(name, c.Token, rec.Term, began, ttl, fenceOf(st, hl.id)) // it may have committed, or may yet
			return leader.Lease{}, false, s.wrapError(ctx, what, err)
		case !resp.Succeeded:
			continue // changed since the read: look again
		}
		rev := resp.Header.Revision
		s.mu.Lock()
		if hl.gone {
			s.mu.Unlock()
			continue
		}
		s.rememberLocked(&held{
			name: name, token: c.Token, term: rec.Term, ttl: ttl, rec: rec, lease: hl,
			holderRev: rev, recordRev: rev, deadline: began.Add(ttl), lost: make(chan struct{}),
		})
		s.mu.Unlock()
		return holderReport(name, rec, nil, ttl, began), true, nil
	}
}

// acquireRead reads name's state and, if the lease is held by another
// token or reserved for one, enlists c in the same transaction and
// reports it refused.
func (s *Store) acquireRead(ctx context.Context, k keys, c leader.Candidate, ttl time.Duration) (*state, bool, error) {
	for {
		soft, err := s.softLease(ctx, leader.EnlistFactor*ttl)
		if err != nil {
			return nil, false, err
		}
		enlist := clientv3.OpPut(k.candidate(c.Token), mustJSON(candidateEntry{ID: c.ID, Token: c.Token, Priority: c.Priority}), clientv3.WithLease(soft))
		refuse := append([]clientv3.Op{enlist}, stateOps(k)...)
		resp, err := s.client.Txn(ctx).
			If(clientv3.Compare(clientv3.Value(k.holder), "!=", c.Token)). // held by another (a missing key fails a value compare)
			Then(refuse...).
			Else(clientv3.OpTxn(
				[]clientv3.Cmp{
					clientv3.Compare(clientv3.CreateRevision(k.holder), "=", 0),
					clientv3.Compare(clientv3.Value(k.reserve), "!=", c.Token), // reserved for another
				},
				refuse, stateOps(k))).
			Commit()
		if err != nil && isLeaseNotFound(err) {
			s.softLeaseGone(soft)
			continue
		}
		if err != nil {
			return nil, false, err
		}
		rs, refused := resp.Responses, resp.Succeeded
		if !refused {
			inner := rs[0].GetResponseTxn()
			rs, refused = inner.GetResponses(), inner.GetSucceeded()
		}
		if refused {
			rs = rs[1:]
		}
		st, err := parseState(rs)
		return st, refused, err
	}
}

// Release implements leader.Store.
func (s *Store) Release(ctx context.Context, name, token string, term uint64) error {
	return closedLost(s.release(ctx, name, token, term, nil))
}

// handover is what ReleaseTo adds to a release.
type handover struct {
	successor leader.Candidate
	reason    leader.GrantReason
	hold      time.Duration
	lease     clientv3.LeaseID
	until     time.Time // when the grant of lease was sent, plus hold
}

// release frees name if token holds it under term, reserving it for a
// successor if to is not nil. It tries first with the revisions the Store
// wrote last, in one request, and reads the state if they changed.
func (s *Store) release(ctx context.Context, name, token string, term uint64, to *handover) (err error) {
	what := call("release", name)
	if to != nil {
		what = fmt.Sprintf("release %q to %s", name, to.successor.ID)
	}
	if name == "" {
		return fmt.Errorf("etcd: %s: the name is empty", what)
	}
	cctx, cancel, err := s.begin(ctx)
	if err != nil {
		if errors.Is(err, ErrClosed) {
			return fmt.Errorf("etcd: %s: %w: %w", what, err, leader.ErrLeaseLost)
		}
		return fmt.Errorf("etcd: %s: %w", what, err)
	}
	defer cancel()
	k := s.keys(name)
	var st *state
	s.mu.Lock()
	if h := s.held[name]; h != nil && token != "" && h.token == token && h.term == term {
		// What the Store wrote last; if anything changed, the
		// transaction fails and the state is read.
		st = &state{holder: &mvccpb.KeyValue{ModRevision: h.holderRev, Value: []byte(token), Lease: int64(h.lease.id)},
			recKV: &mvccpb.KeyValue{ModRevision: h.recordRev}, rec: h.rec}
	}
	s.mu.Unlock()
	written := false // whether a write may have committed
	if to != nil {
		sent := time.Now()
		id, gerr := s.client.Grant(cctx, leaseSeconds(to.hold))
		if gerr != nil {
			return s.wrapError(ctx, what, gerr)
		}
		to.lease, to.until = id.ID, sent.Add(to.hold)
		defer func() {
			if err != nil && !written {
				s.revoke(to.lease) // the reservation's lease, unused
			}
		}()
	}
	for {
		if st == nil {
			resp, err := s.client.Txn(cctx).Then(stateOps(k)...).Commit()
			if err != nil {
				return s.wrapError(ctx, what, err)
			}
			if st, err = parseState(resp.Responses); err != nil {
				return s.wrapError(ctx, what, err)
			}
		}
		if !st.heldBy(token, term) {
			s.forget(name, token, term)
			return lostError(what, term, "not held by that token and term")
		}
		rec := st.rec
		rec.Released, rec.SuccessorID, rec.SuccessorReason, rec.Hold, rec.ReservedUntil = true, "", "", 0, 0
		ops := []clientv3.Op{
			clientv3.OpDelete(k.holder),
			clientv3.OpDelete(k.held(clientv3.LeaseID(st.holder.Lease))),
			clientv3.OpDelete(k.request),
		}
		if to != nil {
			rec.SuccessorID, rec.SuccessorReason, rec.Hold = to.successor.ID, to.reason, to.hold
			rec.ReservedUntil = to.until.UnixNano()
			ops = append(ops, clientv3.OpPut(k.reserve, to.successor.Token, clientv3.WithLease(to.lease)))
		}
		ops = append(ops, clientv3.OpPut(k.record, mustJSON(rec)))
		written = true
		resp, err := s.client.Txn(cctx).If(
			clientv3.Compare(clientv3.ModRevision(k.holder), "=", st.holderRev()),
			clientv3.Compare(clientv3.ModRevision(k.record), "=", st.recordRev()),
		).Then(ops...).Commit()
		if err != nil {
			return s.wrapError(ctx, what, err)
		}
		if !resp.Succeeded {
			written = false
			st = nil
			continue
		}
		s.forget(name, token, term)
		return nil
	}
}

// revoke revokes the lease id, which nothing uses, in the background: one
// attempt, bounded by the call timeout and ended by Close. If it fails,
// etcd ends the lease at its TTL.
func (s *Store) revoke(id clientv3.LeaseID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	s.wg.Go(func() {
		ctx, cancel := context.WithTimeout(s.bg, s.callTimeout)
		defer cancel()
		if _, err := s.client.Revoke(ctx, id); err != nil && !isLeaseNotFound(err) && s.bg.Err() == nil {
			s.log.Warn("etcd: could not revoke the lease of a reservation unused; etcd will end it at its TTL", "lease", fmt.Sprintf("%016x", int64(id)), "error", err)
		}
	})
}

// forget drops the Store's record of the grant of name to token under
// term, if it has one.
func (s *Store) forget(name, token string, term uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if h := s.held[name]; h != nil && h.token == token && h.term == term {
		s.forgetLocked(h)
	}
}

// Observe implements leader.Store, with one linearizable read.
func (s *Store) Observe(ctx context.Context, name string) (leader.Lease, error) {
	what := call("observe", name)
	if name == "" {
		return leader.Lease{}, fmt.Errorf("etcd: %s: the name is empty", what)
	}
	cctx, cancel, err := s.begin(ctx)
	if err != nil {
		return leader.Lease{}, fmt.Errorf("etcd: %s: %w", what, err)
	}
	defer cancel()
	resp, err := s.client.Txn(cctx).Then(stateOps(s.keys(name))...).Commit()
	if err != nil {
		return leader.Lease{}, s.wrapError(ctx, what, err)
	}
	st, err := parseState(resp.Responses)
	if err != nil {
		return leader.Lease{}, s.wrapError(ctx, what, err)
	}
	return st.lease(name), nil
}
