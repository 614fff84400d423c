package etcd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leaderelect/leader"
)

// maxRangesPerTxn bounds the reads of one transaction of a renewal round,
// well under etcd's default --max-txn-ops (128).
const maxRangesPerTxn = 64

// Renew implements leader.Store: it is RenewBatch with a batch of one.
func (s *Store) Renew(ctx context.Context, name, token string, term uint64, ttl time.Duration) (leader.Lease, error) {
	batch := []leader.Renewal{{Name: name, Token: token, Term: term, TTL: ttl}}
	s.RenewBatch(ctx, batch)
	return batch[0].Lease, batch[0].Err
}

// RenewBatch implements leader.BatchRenewer. A lease this Store granted,
// renewed with the ttl of its grant, costs nothing of its own: a round
// sends one keep-alive per shared lease and one read of the names each of
// those leases holds (and of the pending requests to hand over), however
// many names the batch has. Any other renewal (a new ttl, or a lease this
// Store did not grant or no longer keeps) reads the name's state and
// moves its key onto this Store's lease for the ttl in a transaction of
// its own.
func (s *Store) RenewBatch(ctx context.Context, batch []leader.Renewal) {
	began := time.Now()
	if len(batch) == 0 {
		return
	}
	what := func(r *leader.Renewal) string { return call("renew", r.Name) }
	cctx, cancel, err := s.begin(ctx)
	if err != nil {
		for i := range batch {
			r := &batch[i]
			r.Lease, r.Err = leader.Lease{}, fmt.Errorf("etcd: %s: %w", what(r), err)
			if errors.Is(err, ErrClosed) {
				r.Err = fmt.Errorf("etcd: %s: %w: %w", what(r), err, leader.ErrLeaseLost)
			}
		}
		return
	}
	defer cancel()

	// Sort the batch: a renewal of a grant the Store keeps, with its ttl,
	// is quick; the others are slow.
	quick := make(map[*holderLease][]int)
	var slow []int
	records := make([]*held, len(batch))
	s.mu.Lock()
	for i := range batch {
		r := &batch[i]
		r.Lease, r.Err = leader.Lease{}, nil
		if err := checkArgs(r.Name, r.Token, r.TTL, true); err != nil {
			r.Err = fmt.Errorf("etcd: %s: %w", what(r), err)
			if r.Token == "" {
				r.Err = lostError(what(r), r.Term, "the token is empty")
			}
			continue
		}
		h := s.held[r.Name]
		mine := h != nil && h.token == r.Token && h.term == r.Term
		switch {
		case mine && began.After(h.deadline):
			// The Store's own deadline for the grant passed before this
			// call began (so did the holder's, which is no later): the
			// grant is over, whether or not its expiry has run yet. Let
			// the expiry delete the key now.
			r.Err = lostError(what(r), r.Term, "its deadline passed before the renewal began")
			h.timer.Reset(0)
		case mine && s.quickLocked(h, r.TTL):
			h.renewing++
			records[i] = h
			quick[h.lease] = append(quick[h.lease], i)
		default:
			slow = append(slow, i)
		}
	}
	s.mu.Unlock()

	var wg sync.WaitGroup
	for _, i := range slow {
		wg.Go(func() {
			r := &batch[i]
			r.Lease, r.Err = s.renewSlowly(ctx, cctx, r, began)
		})
	}
	if len(quick) > 0 {
		s.renewQuickly(ctx, cctx, batch, quick, records, began)
	}
	wg.Wait()
	for i := range batch {
		batch[i].Err = closedLost(batch[i].Err)
	}
}

// quickLocked reports whether a renewal of h for ttl may be quick: only if
// h is on the Store's own lease for ttl, which the Store keeps alive for
// names held with ttl, and was granted or last renewed with ttl. Then a
// keep-alive of that lease keeps the key for at least ttl. A key on any
// other lease (another Store's, one the Store no longer uses, one for
// another ttl) may end sooner: its renewal moves it, slowly. s.mu is
// held.
func (s *Store) quickLocked(h *held, ttl time.Duration) bool {
	secs := leaseSeconds(ttl)
	return h.ttl == ttl && !h.lease.gone && h.lease.own == secs && s.leases[secs] == h.lease
}

// renewQuickly renews the leases of batch at the indices in quick, which
// this Store keeps on the shared leases they are grouped by: a
// keep-alive of each lease, and, at the same time, one transaction that
// reads the names each lease holds and the pending requests.
func (s *Store) renewQuickly(ctx, cctx context.Context, batch []leader.Renewal, quick map[*holderLease][]int, records []*held, began time.Time) {
	leases := make([]*holderLease, 0, len(quick))
	for hl := range quick {
		leases = append(leases, hl)
	}
	alive := make([]error, len(leases))
	var wg sync.WaitGroup
	for j, hl := range leases {
		wg.Go(func() {
			alive[j] = s.keepAlive(cctx, hl.id)
		})
	}
	// The names on each lease, as this Store indexed them, and the
	// pending requests.
	indexed := make(map[*holderLease]map[string]string) // lease → escaped name → held value
	requests := make(map[string]*request)               // escaped name → request
	var readErr error
	for start := 0; start < len(leases) && readErr == nil; start += maxRangesPerTxn {
		part := leases[start:min(start+maxRangesPerTxn, len(leases))]
		ops := []clientv3.Op{clientv3.OpGet(requestsPrefix(s.prefix), clientv3.WithPrefix())}
		for _, hl := range part {
			ops = append(ops, clientv3.OpGet(heldPrefix(s.prefix, hl.id), clientv3.WithPrefix()))
		}
		resp, err := s.client.Txn(cctx).Then(ops...).Commit()
		if err != nil {
			readErr = err
			break
		}
		for _, kv := range resp.Responses[0].GetResponseRange().GetKvs() {
			var r request
			if json.Unmarshal(kv.Value, &r) == nil {
				requests[string(kv.Key[len(requestsPrefix(s.prefix)):])] = &r
			}
		}
		for j, hl := range part {
			m := make(map[string]string)
			p := heldPrefix(s.prefix, hl.id)
			for _, kv := range resp.Responses[j+1].GetResponseRange().GetKvs() {
				m[string(kv.Key[len(p):])] = string(kv.Value)
			}
			indexed[hl] = m
		}
	}
	wg.Wait()

	for j, hl := range leases {
		if alive[j] != nil && isLeaseNotFound(alive[j]) {
			s.leaseGone(hl)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for j, hl := range leases {
		for _, i := range quick[hl] {
			r, h := &batch[i], records[i]
			h.renewing--
			k := s.keys(r.Name)
			switch {
			case alive[j] != nil && isLeaseNotFound(alive[j]):
				r.Err = lostError(call("renew", r.Name), r.Term, "its etcd lease is gone (revoked, or expired)")
			case alive[j] != nil:
				r.Err = s.wrapError(ctx, call("renew", r.Name), alive[j])
			case readErr != nil:
				r.Err = s.wrapError(ctx, call("renew", r.Name), readErr)
			case indexed[hl][k.esc] != heldValue(r.Term, r.Token):
				r.Err = lostError(call("renew", r.Name), r.Term, "no longer held by that token and term")
				s.forgetLocked(h)
			case s.held[r.Name] != h:
				// Released, or its lease found gone, by another call
				// meanwhile.
				r.Err = lostError(call("renew", r.Name), r.Term, "ended while the renewal was under way")
			default:
				if d := began.Add(r.TTL); d.After(h.deadline) {
					h.deadline = d
				}
				r.Lease = holderReport(r.Name, h.rec, requests[k.esc], r.TTL, began)
			}
			s.rearmLocked(h)
		}
	}
}

// rearmLocked sets h's expiry timer to its deadline, if the Store still
// keeps h.
func (s *Store) rearmLocked(h *held) {
	if s.held[h.name] == h && !s.closed {
		h.timer.Reset(time.Until(h.deadline))
	}
}

// renewSlowly renews r by reading the name's state and, if token and term
// hold it, writing the holder key onto this Store's lease for r.TTL (with
// the new ttl in the record) in a transaction that fails if anything
// changed since the read.
func (s *Store) renewSlowly(ctx, cctx context.Context, r *leader.Renewal, began time.Time) (leader.Lease, error) {
	what := call("renew", r.Name)
	k := s.keys(r.Name)
	for {
		resp, err := s.client.Txn(cctx).Then(stateOps(k)...).Commit()
		if err != nil {
			return leader.Lease{}, s.wrapError(ctx, what, err)
		}
		st, err := parseState(resp.Responses)
		if err != nil {
			return leader.Lease{}, s.wrapError(ctx, what, err)
		}
		if !st.heldBy(r.Token, r.Term) {
			s.forget(r.Name, r.Token, r.Term)
			return leader.Lease{}, lostError(what, r.Term, "not held by that token and term")
		}
		hl, err := s.holderLease(cctx, r.TTL)
		if err != nil {
			return leader.Lease{}, s.wrapError(ctx, what, err)
		}
		rec := st.rec
		rec.TTL = r.TTL
		ops := []clientv3.Op{
			clientv3.OpPut(k.holder, r.Token, clientv3.WithLease(hl.id)),
			clientv3.OpPut(k.held(hl.id), heldValue(r.Term, r.Token), clientv3.WithLease(hl.id)),
			clientv3.OpPut(k.record, mustJSON(rec)),
		}
		if old := clientv3.LeaseID(st.holder.Lease); old != hl.id {
			ops = append(ops, clientv3.OpDelete(k.held(old)))
		}
		tresp, err := s.client.Txn(cctx).If(
			clientv3.Compare(clientv3.ModRevision(k.holder), "=", st.holderRev()),
			clientv3.Compare(clientv3.ModRevision(k.record), "=", st.recordRev()),
		).Then(ops...).Commit()
		switch {
		case err != nil && isLeaseNotFound(err):
			s.leaseGone(hl)
			continue
		case err != nil:
			s.settle(r.Name, r.Token, r.Term, began, r.TTL, fenceOf(st, hl.id)) // it may have committed, or may yet
			return leader.Lease{}, s.wrapError(ctx, what, err)
		case !tresp.Succeeded:
			continue
		}
		rev := tresp.Header.Revision
		s.mu.Lock()
		if hl.gone {
			s.mu.Unlock()
			continue
		}
		h := s.held[r.Name]
		if h != nil && h.token == r.Token && h.term == r.Term {
			// Moved: keep the record, and its LossNotifier channel.
			delete(h.lease.names, h.name)
			h.lease, h.ttl, h.rec, h.holderRev, h.recordRev = hl, r.TTL, rec, rev, rev
			hl.names[h.name] = h
			h.deadline = began.Add(r.TTL)
			s.rearmLocked(h)
		} else {
			s.rememberLocked(&held{
				name: r.Name, token: r.Token, term: r.Term, ttl: r.TTL, rec: rec, lease: hl,
				holderRev: rev, recordRev: rev, deadline: began.Add(r.TTL), lost: make(chan struct{}),
			})
		}
		s.mu.Unlock()
		return holderReport(r.Name, rec, st.req, r.TTL, began), nil
	}
}
