package etcd

import (
	"context"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
)

// holderLease is an etcd lease that holds the names this Store was
// granted with one lease TTL: one lease, and one keep-alive request per
// round of renewals, for any number of names (see Renewals in the package
// documentation).
type holderLease struct {
	id   clientv3.LeaseID
	secs int64 // the TTL etcd granted, in seconds
	// own is the key of s.leases the Store granted it under (the lease
	// TTL asked for, in seconds), or 0 for a stand-in for a lease the
	// Store did not grant or no longer uses for new grants.
	own   int64
	names map[string]*held // the names held on it
	gone  bool             // etcd reported it not found: revoked or expired
}

// held is the Store's record of a grant it made: the name's key is on
// lease, and the Store keeps it there until deadline unless renewed.
type held struct {
	name, token string
	term        uint64
	ttl         time.Duration
	rec         record
	lease       *holderLease
	holderRev   int64 // the holder key's mod revision as the Store last wrote it
	recordRev   int64 // the record key's mod revision as the Store last wrote it
	// deadline is when the grant or the last renewal was sent, plus ttl,
	// on the monotonic clock: the holder's own deadline can only be
	// earlier. At deadline the Store deletes the holder key (see Expiry in
	// the package documentation) unless a quick renewal is under way.
	deadline time.Time
	renewing int // quick renewals under way, which hold off the expiry (a slow one finds the key gone)
	timer    *time.Timer
	lost     chan struct{} // closed once the grant is known to be over
}

// softLease is a lease for soft state (candidates' entries, requests to
// hand over): granted for twice the TTL asked for and used for new keys
// only during its first half, so that a key put on it lives at least the
// TTL and at most about twice that. Nothing keeps it alive.
type softLease struct {
	id      clientv3.LeaseID
	secs    int64     // the TTL asked for, in seconds
	granted time.Time // when the grant was sent
}

// holderLease returns the Store's lease for names held with ttl, kept
// alive by a request sent during this call, so that it ends no earlier
// than ttl after the call began: a fresh lease, or the shared one after a
// keep-alive.
func (s *Store) holderLease(ctx context.Context, ttl time.Duration) (*holderLease, error) {
	secs := leaseSeconds(ttl)
	for {
		s.mu.Lock()
		hl := s.leases[secs]
		s.mu.Unlock()
		if hl != nil {
			err := s.keepAlive(ctx, hl.id)
			if err == nil {
				return hl, nil
			}
			if !isLeaseNotFound(err) {
				return nil, err
			}
			s.leaseGone(hl)
			continue
		}
		if err := s.lockLeases(ctx); err != nil {
			return nil, err
		}
		s.mu.Lock()
		hl = s.leases[secs]
		s.mu.Unlock()
		if hl != nil { // granted meanwhile by another call
			s.unlockLeases()
			continue
		}
		resp, err := s.client.Grant(ctx, secs)
		if err != nil {
			s.unlockLeases()
			return nil, err
		}
		hl = &holderLease{id: resp.ID, secs: resp.TTL, own: secs, names: make(map[string]*held)}
		s.mu.Lock()
		if !s.closed {
			s.leases[secs] = hl
		}
		s.mu.Unlock()
		s.unlockLeases()
		return hl, nil
	}
}

// lockLeases takes the semaphore held while granting a lease, or returns
// ctx's error if ctx ends first: a call never waits past its own context
// for another's grant, however long etcd takes to answer that one.
func (s *Store) lockLeases(ctx context.Context) error {
	select {
	case s.leaseSem <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (s *Store) unlockLeases() { <-s.leaseSem }

// leaseGone forgets hl, which etcd no longer has: every name on it is
// lost, and the next grant with its TTL gets a new lease.
func (s *Store) leaseGone(hl *holderLease) {
	s.mu.Lock()
	defer s.mu.Unlock()
	hl.gone = true
	if s.leases[hl.secs] == hl {
		delete(s.leases, hl.secs)
	}
	for k, l := range s.leases {
		if l == hl {
			delete(s.leases, k)
		}
	}
	for _, h := range hl.names {
		s.forgetLocked(h)
	}
}

// softLease returns a lease on which a key lives at least ttl, and not
// much more than twice that.
func (s *Store) softLease(ctx context.Context, ttl time.Duration) (clientv3.LeaseID, error) {
	secs := leaseSeconds(ttl)
	fresh := func() clientv3.LeaseID {
		s.mu.Lock()
		defer s.mu.Unlock()
		if sl := s.softs[secs]; sl != nil && time.Since(sl.granted) < time.Duration(secs)*time.Second {
			return sl.id
		}
		return clientv3.NoLease
	}
	if id := fresh(); id != clientv3.NoLease {
		return id, nil
	}
	if err := s.lockLeases(ctx); err != nil {
		return clientv3.NoLease, err
	}
	defer s.unlockLeases()
	if id := fresh(); id != clientv3.NoLease {
		return id, nil
	}
	sent := time.Now()
	resp, err := s.client.Grant(ctx, 2*secs)
	if err != nil {
		return clientv3.NoLease, err
	}
	s.mu.Lock()
	s.softs[secs] = &softLease{id: resp.ID, secs: secs, granted: sent}
	s.mu.Unlock()
	return resp.ID, nil
}

// softLeaseGone forgets the soft lease id, which etcd no longer has.
func (s *Store) softLeaseGone(id clientv3.LeaseID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for secs, sl := range s.softs {
		if sl.id == id {
			delete(s.softs, secs)
		}
	}
}

// rememberLocked records the grant h, which replaces any earlier grant of
// its name by this Store, and arms its expiry. s.mu is held.
func (s *Store) rememberLocked(h *held) {
	if old := s.held[h.name]; old != nil {
		s.forgetLocked(old)
	}
	if s.closed {
		close(h.lost)
		return
	}
	s.held[h.name] = h
	h.lease.names[h.name] = h
	h.timer = time.AfterFunc(time.Until(h.deadline), func() { s.expire(h) })
}

// forgetLocked drops the record h: the grant is over (released, lost,
// expired or replaced), and its LossNotifier channel is closed. s.mu is
// held.
func (s *Store) forgetLocked(h *held) {
	if s.held[h.name] == h {
		delete(s.held, h.name)
	}
	if h.lease.names[h.name] == h {
		delete(h.lease.names, h.name)
	}
	if h.timer != nil {
		h.timer.Stop()
	}
	select {
	case <-h.lost:
	default:
		close(h.lost)
	}
}

// expire runs at h's deadline: unless a quick renewal is under way or moved the
// deadline on, the grant is over, and the Store deletes the holder key,
// which the shared lease would otherwise keep alive for as long as other
// names are renewed.
func (s *Store) expire(h *held) {
	s.mu.Lock()
	if s.closed || s.held[h.name] != h || h.renewing > 0 {
		s.mu.Unlock()
		return // a quick renewal under way arms the timer again
	}
	if wait := time.Until(h.deadline); wait > 0 {
		h.timer.Reset(wait)
		s.mu.Unlock()
		return
	}
	s.forgetLocked(h)
	s.wg.Add(1)
	s.mu.Unlock()
	defer s.wg.Done()

	k := s.keys(h.name)
	backoff := 10 * time.Millisecond
	for {
		ctx, cancel := context.WithTimeout(s.bg, s.callTimeout)
		_, err := s.client.Txn(ctx).
			If(clientv3.Compare(clientv3.ModRevision(k.holder), "=", h.holderRev)).
			Then(clientv3.OpDelete(k.holder), clientv3.OpDelete(k.held(h.lease.id))).
			Commit()
		cancel()
		if err == nil || s.bg.Err() != nil {
			return // deleted, or rewritten since by a grant or renewal
		}
		s.log.Warn("etcd: could not end an expired lease; its etcd lease will", "name", h.name, "term", h.term, "error", err)
		select {
		case <-time.After(backoff):
		case <-s.bg.Done():
			return
		}
		backoff = min(2*backoff, time.Second)
	}
}

// Lost implements leader.LossNotifier: the channel is closed once the
// Store knows that the grant of name to token under term is over: its
// shared lease was found gone (revoked, or expired while the Store could
// not reach etcd), a renewal found it lost, or its deadline passed
// unrenewed. It returns nil for a grant this Store did not make or no
// longer keeps.
func (s *Store) Lost(name, token string, term uint64) <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if h := s.held[name]; h != nil && h.token == token && h.term == term {
		return h.lost
	}
	return nil
}

// keepAlive sends one keep-alive request for the lease id and waits for
// its answer: etcd then ends the lease no earlier than its TTL after it
// received the request. Unlike the client's KeepAliveOnce, it does not
// retry, so a round of renewals costs exactly one request per lease, and
// an etcd without a leader fails the renewal (leader.ErrUnavailable)
// rather than making the client try again in a loop until ctx ends.
func (s *Store) keepAlive(ctx context.Context, id clientv3.LeaseID) error {
	// Fail at once, rather than wait, if the member has no leader.
	ctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	conn := s.client.ActiveConnection()
	if conn == nil {
		// A client of clientv3.NewCtxClient (an etcd proxy's, say) has
		// no connection of its own: keep alive through its Lease.
		resp, err := s.client.KeepAliveOnce(ctx, id)
		if err != nil {
			return err
		}
		if resp.TTL <= 0 {
			return rpctypes.ErrLeaseNotFound
		}
		return nil
	}
	stream, err := pb.NewLeaseClient(conn).LeaseKeepAlive(ctx, grpc.WaitForReady(true))
	if err != nil {
		return clientv3.ContextError(ctx, err)
	}
	if err := stream.Send(&pb.LeaseKeepAliveRequest{ID: int64(id)}); err != nil {
		return clientv3.ContextError(ctx, err)
	}
	resp, err := stream.Recv()
	if err != nil {
		return clientv3.ContextError(ctx, err)
	}
	_ = stream.CloseSend()
	if resp.TTL <= 0 {
		return rpctypes.ErrLeaseNotFound
	}
	return nil
}

// fence is what a write of unknown outcome compared against and wrote
// with: the mod revisions of the name's holder and record keys as its read
// saw them, the record's value then (nil if there was none), and the lease
// it put the holder key on.
type fence struct {
	holderRev, recordRev int64
	record               []byte
	lease                clientv3.LeaseID
}

// fenceOf is the fence of a write that compared against st and put the
// holder key on lease.
func fenceOf(st *state, lease clientv3.LeaseID) fence {
	f := fence{holderRev: st.holderRev(), recordRev: st.recordRev(), lease: lease}
	if st.recKV != nil {
		f.record = st.recKV.Value
	}
	return f
}

// settle runs after a write that put name's holder key for token under
// term on one of the Store's leases failed in a way that leaves its
// outcome unknown (a timeout, a broken connection, a context cut short).
// If it committed, nobody believes in that grant, but the Store's shared
// lease would keep the key alive for as long as other names are renewed.
// And it may still commit after any read: etcd applies a proposal it
// accepted even after the client gave up on it. So settle first fences
// the write off, in the background, until etcd answers or the Store
// closes: a transaction that rewrites the record key with the value it had
// when the write read it, if its mod revision is still the one the write
// compared against (every such write compares the record's revision).
// Once that commits, the write can never commit. If the record had
// changed, settle reads the name (in the same transaction) and, if the
// write did commit, makes the Store's record of the name describe it, with
// the deadline of the failed call (began + ttl): at that deadline the
// Store deletes the key, as for any grant not renewed, unless a grant or
// renewal has rewritten it since.
func (s *Store) settle(name, token string, term uint64, began time.Time, ttl time.Duration, f fence) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	s.wg.Add(1)
	go s.settling(name, token, term, began, ttl, f)
}

// settling is settle's work; s.wg counts it.
func (s *Store) settling(name, token string, term uint64, began time.Time, ttl time.Duration, f fence) {
	defer s.wg.Done()
	k := s.keys(name)
	rec := f.record
	if rec == nil {
		// No record yet: a record of term 0 is the same as none.
		rec = []byte(mustJSON(record{}))
	}
	backoff := 10 * time.Millisecond
	for {
		ctx, cancel := context.WithTimeout(s.bg, s.callTimeout)
		resp, err := s.client.Txn(ctx).
			If(clientv3.Compare(clientv3.ModRevision(k.record), "=", f.recordRev)).
			Then(clientv3.OpPut(k.record, string(rec))).
			Else(stateOps(k)...).
			Commit()
		cancel()
		if err == nil && resp.Succeeded {
			return // fenced off: the write did not commit, and never will
		}
		var st *state
		if err == nil {
			st, err = parseState(resp.Responses)
		}
		if err == nil {
			s.settled(name, token, term, began, ttl, f, st)
			return
		}
		select {
		case <-time.After(backoff):
		case <-s.bg.Done():
			return
		}
		backoff = min(2*backoff, time.Second)
	}
}

// settled is settle's verdict on what st, read after the record changed
// since the failed write f read it, shows. The write committed if st shows
// the key held by token under term, written after f's read, on f's lease;
// anything else is another write's, which its own Store keeps or ends.
func (s *Store) settled(name, token string, term uint64, began time.Time, ttl time.Duration, f fence, st *state) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || !st.heldBy(token, term) || st.holderRev() <= f.holderRev || clientv3.LeaseID(st.holder.Lease) != f.lease {
		return // the write did not commit, or its key is gone already
	}
	h := s.held[name]
	if h != nil && h.holderRev >= st.holderRev() {
		// The Store knows of this write or a later one: st is stale.
		return
	}
	hl := s.leaseByIDLocked(f.lease)
	if h != nil && h.token == token && h.term == term {
		// A renewal that moved the key committed: the record follows
		// the key, so that its expiry finds it, with the ttl and record
		// of that renewal (the ttl of the lease the key is on); its
		// deadline stays, which the holder's own, counted from its
		// last renewal that succeeded, cannot pass.
		delete(h.lease.names, name)
		h.lease, h.holderRev, h.recordRev = hl, st.holderRev(), st.recordRev()
		h.ttl, h.rec = st.rec.TTL, st.rec
		h.lease.names[name] = h
		return
	}
	// A grant that committed, newer than whatever the Store kept of the
	// name (whose grant st shows over).
	s.rememberLocked(&held{
		name: name, token: token, term: term, ttl: st.rec.TTL, rec: st.rec, lease: hl,
		holderRev: st.holderRev(), recordRev: st.recordRev(), deadline: began.Add(ttl), lost: make(chan struct{}),
	})
}

// leaseByIDLocked returns the Store's holder lease id, or one that stands
// for it if the Store no longer uses it for new grants.
func (s *Store) leaseByIDLocked(id clientv3.LeaseID) *holderLease {
	for _, hl := range s.leases {
		if hl.id == id {
			return hl
		}
	}
	return &holderLease{id: id, names: make(map[string]*held)}
}
