package etcd

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leaderelect/leader"
)

// Enlist implements leader.Transferer. The entry is a key on a lease of
// the Store's for soft state, which etcd ends between ttl and about twice
// ttl (in whole seconds) after the entry was written, unless c enlists
// again.
func (s *Store) Enlist(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) error {
	what := call("enlist", name)
	if err := checkArgs(name, c.Token, ttl, true); err != nil {
		return fmt.Errorf("etcd: %s: %w", what, err)
	}
	cctx, cancel, err := s.begin(ctx)
	if err != nil {
		return fmt.Errorf("etcd: %s: %w", what, err)
	}
	defer cancel()
	k := s.keys(name)
	for {
		id, err := s.softLease(cctx, ttl)
		if err != nil {
			return s.wrapError(ctx, what, err)
		}
		_, err = s.client.Put(cctx, k.candidate(c.Token), mustJSON(candidateEntry{ID: c.ID, Token: c.Token, Priority: c.Priority}), clientv3.WithLease(id))
		if err != nil && isLeaseNotFound(err) {
			s.softLeaseGone(id)
			continue
		}
		if err != nil {
			return s.wrapError(ctx, what, err)
		}
		return nil
	}
}

// Withdraw implements leader.Transferer.
func (s *Store) Withdraw(ctx context.Context, name, token string) error {
	what := call("withdraw", name)
	if err := checkArgs(name, token, 0, false); err != nil {
		return fmt.Errorf("etcd: %s: %w", what, err)
	}
	cctx, cancel, err := s.begin(ctx)
	if err != nil {
		return fmt.Errorf("etcd: %s: %w", what, err)
	}
	defer cancel()
	if _, err := s.client.Delete(cctx, s.keys(name).candidate(token)); err != nil {
		return s.wrapError(ctx, what, err)
	}
	return nil
}

// Candidates implements leader.Transferer.
func (s *Store) Candidates(ctx context.Context, name string) ([]leader.Candidate, error) {
	what := call("list the candidates of", name)
	if name == "" {
		return nil, fmt.Errorf("etcd: %s: the name is empty", what)
	}
	cctx, cancel, err := s.begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("etcd: %s: %w", what, err)
	}
	defer cancel()
	resp, err := s.client.Get(cctx, s.keys(name).cands, clientv3.WithPrefix())
	if err != nil {
		return nil, s.wrapError(ctx, what, err)
	}
	out := make([]leader.Candidate, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		var e candidateEntry
		if json.Unmarshal(kv.Value, &e) == nil && e.Token != "" {
			out = append(out, leader.Candidate{ID: e.ID, Token: e.Token, Priority: e.Priority})
		}
	}
	return out, nil
}

// RequestTransfer implements leader.Transferer. The request lapses on the
// wall clocks of the clients that read it, ttl after the requester's; etcd
// removes it with its lease within about twice ttl (in whole seconds),
// whatever the clocks say.
func (s *Store) RequestTransfer(ctx context.Context, name string, req leader.TransferRequest, ttl time.Duration) (leader.Lease, error) {
	what := call("request a handover of", name)
	switch {
	case name == "":
		return leader.Lease{}, fmt.Errorf("etcd: %s: the name is empty", what)
	case ttl < 0:
		return leader.Lease{}, fmt.Errorf("etcd: %s: the ttl %v is negative", what, ttl)
	}
	cctx, cancel, err := s.begin(ctx)
	if err != nil {
		return leader.Lease{}, fmt.Errorf("etcd: %s: %w", what, err)
	}
	defer cancel()
	k := s.keys(name)
	for {
		var write clientv3.Op
		var soft clientv3.LeaseID
		if ttl == 0 {
			write = clientv3.OpDelete(k.request)
		} else {
			if soft, err = s.softLease(cctx, ttl); err != nil {
				return leader.Lease{}, s.wrapError(ctx, what, err)
			}
			r := request{To: req.To, Reason: req.Reason, Until: time.Now().Add(ttl).UnixNano(), TTL: ttl}
			write = clientv3.OpPut(k.request, mustJSON(r), clientv3.WithLease(soft))
		}
		resp, err := s.client.Txn(cctx).
			If(clientv3.Compare(clientv3.CreateRevision(k.holder), ">", 0)).
			Then(append([]clientv3.Op{write}, stateOps(k)...)...).
			Else(stateOps(k)...).
			Commit()
		if err != nil && isLeaseNotFound(err) {
			s.softLeaseGone(soft)
			continue
		}
		if err != nil {
			return leader.Lease{}, s.wrapError(ctx, what, err)
		}
		rs := resp.Responses
		if resp.Succeeded {
			rs = rs[1:]
		}
		st, err := parseState(rs)
		if err != nil {
			return leader.Lease{}, s.wrapError(ctx, what, err)
		}
		if !resp.Succeeded {
			return st.lease(name), fmt.Errorf("etcd: %s: %w", what, leader.ErrNoLeader)
		}
		return st.lease(name), nil
	}
}

// ReleaseTo implements leader.Transferer. The reservation is a key on a
// lease of its own, granted for hold rounded up to whole seconds (and to
// etcd's shortest lease TTL): etcd ends it that long after the release,
// and its end wakes the name's free-watchers.
func (s *Store) ReleaseTo(ctx context.Context, name, token string, term uint64, successor leader.Candidate, reason leader.GrantReason, hold time.Duration) error {
	what := fmt.Sprintf("release %q to %s", name, successor.ID)
	switch {
	case successor.Token == "":
		return fmt.Errorf("etcd: %s: the successor's token is empty", what)
	case reason != leader.GrantTransfer && reason != leader.GrantPriority:
		return fmt.Errorf("etcd: %s: the reason %q is neither %q nor %q", what, reason, leader.GrantTransfer, leader.GrantPriority)
	case hold <= 0:
		return fmt.Errorf("etcd: %s: the hold %v is not positive", what, hold)
	}
	return closedLost(s.release(ctx, name, token, term, &handover{successor: successor, reason: reason, hold: hold}))
}
