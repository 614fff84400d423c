package postgres

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leaderelect/leader"
)

// Heartbeats: RenewBatch, which the Electors of a process call once per
// renew round for all their leases, does not rewrite one lease row per
// name. The store keeps a heartbeat row per TTL (a random id, made when the
// store first renews with that TTL), and a lease it renews is moved under
// that heartbeat: its row names the heartbeat, and the lease is held while
// the heartbeat is unexpired and not dead. From then on a round renews the
// heartbeat alone, one row however many names, and moves only the leases
// new to it. See "Heartbeats" in the package documentation for why this
// keeps every invariant.

// beatLease is a lease the store moved under one of its heartbeats.
type beatLease struct {
	term       int64
	holderID   string
	acquiredAt time.Time
	priority   int
	reason     leader.GrantReason
	asked      time.Time // when RenewBatch last asked to renew it
}

// heartbeat is one of the store's heartbeat rows, for one TTL.
type heartbeat struct {
	id  string
	ttl time.Duration
	// sending is held while a statement renews the heartbeat: a
	// heartbeat's statements never overlap, so that only one of them at a
	// time moves leases under it.
	sending sync.Mutex

	// Guarded by beats.mu.
	created bool                  // its row was inserted
	leases  map[holder]*beatLease // the leases under it
}

// beats are a store's heartbeats, one per TTL.
type beats struct {
	mu    sync.Mutex
	byTTL map[time.Duration]*heartbeat
}

// get returns the heartbeat for ttl, making a new one (not yet inserted) if
// there is none.
func (b *beats) get(ttl time.Duration) (*heartbeat, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if hb := b.byTTL[ttl]; hb != nil {
		return hb, nil
	}
	var id [16]byte
	if _, err := crand.Read(id[:]); err != nil {
		return nil, fmt.Errorf("postgres: making a heartbeat id: %w", err)
	}
	hb := &heartbeat{id: hex.EncodeToString(id[:]), ttl: ttl, leases: map[holder]*beatLease{}}
	if b.byTTL == nil {
		b.byTTL = map[time.Duration]*heartbeat{}
	}
	b.byTTL[ttl] = hb
	return hb, nil
}

// drop forgets hb, which is dead or whose insertion failed: the next round
// for its TTL makes a new one, and the leases under it are no longer
// renewed by it.
func (b *beats) drop(hb *heartbeat) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.byTTL[hb.ttl] == hb {
		delete(b.byTTL, hb.ttl)
	}
}

// forget records that the lease of name under token is no longer under any
// of the store's heartbeats: it was granted again or is being released.
func (b *beats) forget(name, token string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, hb := range b.byTTL {
		delete(hb.leases, holder{name, token})
	}
}

// ttlOf returns the TTL of the heartbeat under which the store has the
// lease of name held by token under term, if it has it under one.
func (b *beats) ttlOf(name, token string, term int64) (time.Duration, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for ttl, hb := range b.byTTL {
		if l := hb.leases[holder{name, token}]; l != nil && l.term == term {
			return ttl, true
		}
	}
	return 0, false
}

// beatStatements are the statements of heartbeat rounds.
type beatStatements struct {
	// insert and renew: $1 heartbeat id, $2 ttl, $3 names, $4 tokens, $5
	// terms of the leases to move under it. insert makes the heartbeat,
	// renew renews it if it is unexpired and not dead; each then moves
	// the leases given that are held by their token under their term.
	// One row per lease moved (or one row of NULLs): the heartbeat's
	// expiry and time left, the count of leases that were under it when
	// the statement began, and the lease moved, with its transfer
	// columns (transferColumns). Then one row per lease that was under
	// it with a pending request to hand over: the count NULL, the lease
	// without its holder ID and acquired_at, and its transfer columns,
	// read through the partial index on the rows with a request
	// (migration 009), so that a round does not read every lease row
	// under the heartbeat. No row: the heartbeat was not renewed.
	insert, renew string
	// sweep, after a new heartbeat's insert: deletes up to 1,000
	// heartbeats of processes long gone, expired for a minute and more,
	// that no lease row names (nothing reads such a row again), skipping
	// any that another process is deleting; so the table stays the size
	// of the live processes (one new heartbeat per store and TTL each
	// start). Best effort: a role without DELETE on the table leaves them.
	sweep string
	// reconcile: $1 heartbeat id, $2 names, $3 tokens, $4 terms of the
	// leases the store has under it. Takes out from under the heartbeat
	// every other lease (each keeps the heartbeat's expiry as its own),
	// and returns the given ones still under it.
	reconcile string
}

func newBeatStatements(opts Options) beatStatements {
	table, hbTable := opts.qualifiedTable(), opts.qualifiedHeartbeatTable()
	move := fmt.Sprintf(`
), moved AS (
	UPDATE %[1]s AS l
	SET (heartbeat, renewed_at, expires_at) = ($1, clock_timestamp(), 'infinity')
	FROM beat AS b, unnest($3::text[], $4::text[], $5::bigint[]) AS r(name, token, term)
	WHERE l.name = r.name AND l.holder_token = r.token AND l.term = r.term
		AND %[2]s > clock_timestamp()
	RETURNING l.name, l.holder_token, l.term, l.holder_id, l.acquired_at, %[3]s
)
SELECT b.expires_at, b.expires_at - clock_timestamp(),
	(SELECT count(*) FROM %[1]s AS u WHERE u.heartbeat = $1),
	m.name, m.holder_token, m.term, m.holder_id, m.acquired_at, %[4]s
FROM beat AS b LEFT JOIN moved AS m ON true
UNION ALL
SELECT b.expires_at, b.expires_at - clock_timestamp(), NULL,
	q.name, q.holder_token, q.term, NULL, NULL, %[5]s
FROM beat AS b, %[1]s AS q
WHERE q.heartbeat = $1 AND q.request_until IS NOT NULL AND q.request_until > clock_timestamp()`,
		table, expiry(hbTable), transferColumns("l"), transferNames("m"), transferColumns("q"))
	return beatStatements{
		insert: fmt.Sprintf(`
WITH durable AS (
	SELECT %[2]s
), beat AS (
	INSERT INTO %[1]s AS h (id, expires_at)
	SELECT $1, clock_timestamp() + $2::interval FROM durable
	RETURNING h.expires_at`, hbTable, durableCommit) + move,
		sweep: fmt.Sprintf(`
DELETE FROM %[1]s AS g WHERE g.id IN (
	SELECT o.id FROM %[1]s AS o
	WHERE o.expires_at < clock_timestamp() - interval '1 minute'
		AND NOT EXISTS (SELECT FROM %[2]s AS l WHERE l.heartbeat = o.id)
	LIMIT 1000
	FOR UPDATE SKIP LOCKED)`, hbTable, table),
		// The renewal is an UPDATE: if a statement taking over one of
		// its leases marked it dead meanwhile, it waits for that
		// statement and then finds the heartbeat dead.
		renew: fmt.Sprintf(`
WITH durable AS (
	SELECT %[2]s
), beat AS (
	UPDATE %[1]s AS h SET expires_at = clock_timestamp() + $2::interval
	FROM durable
	WHERE h.id = $1 AND NOT h.dead AND h.expires_at > clock_timestamp()
	RETURNING h.expires_at`, hbTable, durableCommit) + move,
		reconcile: fmt.Sprintf(`
WITH known AS (
	SELECT * FROM unnest($2::text[], $3::text[], $4::bigint[]) AS r(name, token, term)
), detached AS (
	UPDATE %[1]s AS l
	SET (heartbeat, expires_at) = (NULL, CASE WHEN l.holder_token IS NULL THEN NULL ELSE h.expires_at END)
	FROM %[2]s AS h
	WHERE l.heartbeat = $1 AND h.id = $1
		AND NOT EXISTS (SELECT FROM known AS k WHERE k.name = l.name AND k.token = l.holder_token AND k.term = l.term)
	RETURNING l.name
)
SELECT l.name, l.holder_token, l.term
FROM %[1]s AS l JOIN known AS k ON k.name = l.name AND k.token = l.holder_token AND k.term = l.term
WHERE l.heartbeat = $1`, table, hbTable),
	}
}

// RenewBatch implements leader.BatchRenewer: it renews the leases of batch,
// each as Renew would, with one statement per TTL among them (per 50,000
// leases) that renews the store's heartbeat for that TTL and moves under
// it the leases not yet under it (see "Heartbeats" in the package
// documentation). The Electors of a process that share the store renew
// this way, once per renew round for all their names. Each lease renewed
// reports its holder's priority, the reason of its grant and any pending
// request to hand over, which the same statement reads.
func (s *LeaseStore) RenewBatch(ctx context.Context, batch []leader.Renewal) {
	ctx, cancel := s.opts.bound(ctx)
	defer cancel()
	byTTL := map[time.Duration][]*leader.Renewal{}
	var ttls []time.Duration
	for i := range batch {
		r := &batch[i]
		r.Lease, r.Err = leader.Lease{}, checkRenew(r.Name, r.Term, r.TTL)
		if r.Err != nil {
			continue
		}
		if byTTL[r.TTL] == nil {
			ttls = append(ttls, r.TTL)
		}
		byTTL[r.TTL] = append(byTTL[r.TTL], r)
	}
	for _, ttl := range ttls {
		group := byTTL[ttl]
		for len(group) > 0 {
			n := min(len(group), maxBatchSize)
			s.renewBeat(ctx, ttl, group[:n], true)
			group = group[n:]
		}
	}
	s.renewals.renewedElsewhere(batch)
	if s.sweepDue.CompareAndSwap(true, false) {
		s.sweep(ctx)
	}
}

// sweep deletes heartbeat rows of processes long gone (beatStatements.sweep),
// best effort: without the DELETE privilege it says so once, in a warning
// with the GRANT to run, and goes on.
func (s *LeaseStore) sweep(ctx context.Context) {
	_, err := s.pool.Exec(ctx, s.beatSQL.sweep)
	switch {
	case err == nil:
	case sqlState(err) == "42501":
		s.sweepRefused.Do(func() {
			s.opts.Logger.Warn("cannot delete the heartbeat rows of processes long gone, so the table grows by one row per process start: GRANT DELETE ON "+
				s.opts.qualifiedHeartbeatTable()+" TO the store's role", slog.Any("error", err))
		})
	default:
		s.opts.Logger.Debug("deleting the heartbeat rows of processes long gone failed; the next new heartbeat tries again", slog.Any("error", err))
	}
}

// renewBeat renews the leases of group, all asking for ttl, with the
// store's heartbeat for ttl. If that heartbeat turns out dead, the leases
// under it are lost, and those new to it are tried once more with a new
// heartbeat if retry is set.
func (s *LeaseStore) renewBeat(ctx context.Context, ttl time.Duration, group []*leader.Renewal, retry bool) {
	hb, err := s.beats.get(ttl)
	if err != nil {
		for _, r := range group {
			r.Err = err
		}
		return
	}
	hb.sending.Lock()
	defer hb.sending.Unlock()

	now := time.Now()
	var (
		under, fresh           []*leader.Renewal
		underLeases            []*beatLease // under's, in order
		names, tokens          []string
		terms                  []int64
		expected               int64
		created                bool
		beatExpires            time.Time
		beatLeft               time.Duration
		underCount             int64
		movedRows              = map[heldKey]*beatLease{}
		sawBeat, pruned        bool
		stale                  = 2 * ttl
		reconciled             map[heldKey]bool
		mName, mToken, mHolder *string
		mTerm, count           *int64
		mAcquired              *time.Time
		mTransfer              transferRow
		requests               = map[heldKey]leader.TransferRequest{}
	)
	s.beats.mu.Lock()
	for _, r := range group {
		k := holder{r.Name, r.Token}
		if l := hb.leases[k]; l != nil && l.term == int64(r.Term) {
			l.asked = now
			under, underLeases = append(under, r), append(underLeases, l)
			continue
		}
		fresh = append(fresh, r)
		names, tokens, terms = append(names, r.Name), append(tokens, r.Token), append(terms, int64(r.Term))
	}
	// A lease no Elector asked to renew for a while (its Elector stopped
	// without a release that went through) is let go: the reconciliation
	// below takes it out from under the heartbeat. (When every lease under
	// the heartbeat was asked for, none is stale.)
	if len(under) < len(hb.leases) {
		for k, l := range hb.leases {
			if now.Sub(l.asked) > stale {
				delete(hb.leases, k)
				pruned = true
			}
		}
	}
	expected, created = int64(len(hb.leases)), hb.created
	s.beats.mu.Unlock()

	stmt := s.beatSQL.insert
	if created {
		stmt = s.beatSQL.renew
	}
	rows, err := s.pool.Query(ctx, stmt, hb.id, interval(ttl), names, tokens, terms)
	if err == nil {
		dest := append([]any{&beatExpires, &beatLeft, &count, &mName, &mToken, &mTerm, &mHolder, &mAcquired}, mTransfer.dest()...)
		_, err = pgx.ForEachRow(rows, dest, func() error {
			sawBeat = true
			if count != nil {
				underCount = *count
			}
			if mName == nil || mToken == nil || mTerm == nil {
				return nil
			}
			k := heldKey{*mName, *mToken, *mTerm}
			if mHolder != nil && mAcquired != nil {
				movedRows[k] = &beatLease{term: *mTerm, holderID: *mHolder, acquiredAt: *mAcquired,
					priority: mTransfer.holderPriority(), reason: mTransfer.grantReason(), asked: now}
			}
			if req := mTransfer.request(); req.Pending() {
				requests[k] = req
			}
			return nil
		})
	}
	if err == nil && !created {
		s.sweepDue.Store(true) // a new heartbeat: sweep those of gone processes
	}
	if err != nil {
		if !created {
			// Its row may or may not exist: never use the id again.
			s.beats.drop(hb)
		}
		if note := exhausted(ctx, s.pool); note != "" {
			err = fmt.Errorf("%w (%s)", err, note)
		}
		for _, r := range group {
			r.Err = wrapError(ctx, call("renew", r.Name), err)
		}
		return
	}
	if !sawBeat {
		// Dead or expired: every lease under it is lost, for good.
		s.beats.drop(hb)
		for _, r := range under {
			r.Err = fmt.Errorf("postgres: renew %q term %d: the heartbeat it was under expired: %w", r.Name, r.Term, leader.ErrLeaseLost)
		}
		if retry && len(fresh) > 0 {
			s.renewBeat(ctx, ttl, fresh, false)
		} else {
			for _, r := range fresh {
				r.Err = fmt.Errorf("postgres: renew %q term %d: %w", r.Name, r.Term, leader.ErrLeaseLost)
			}
		}
		return
	}

	lease := func(r *leader.Renewal, l *beatLease) leader.Lease {
		return leader.Lease{Name: r.Name, HolderID: l.holderID, Term: r.Term, AcquiredAt: l.acquiredAt,
			ExpiresAt: beatExpires, Remaining: min(beatLeft, ttl), Priority: l.priority, Reason: l.reason,
			Transfer: requests[heldKey{r.Name, r.Token, int64(r.Term)}]}
	}
	s.beats.mu.Lock()
	hb.created = true
	for _, r := range fresh {
		m, ok := movedRows[heldKey{r.Name, r.Token, int64(r.Term)}]
		if !ok {
			r.Err = fmt.Errorf("postgres: renew %q term %d: %w", r.Name, r.Term, leader.ErrLeaseLost)
			continue
		}
		// Moved here from wherever it was, another heartbeat of ours
		// included.
		for _, other := range s.beats.byTTL {
			if other != hb {
				delete(other.leases, holder{r.Name, r.Token})
			}
		}
		hb.leases[holder{r.Name, r.Token}] = m
		r.Lease = lease(r, m)
	}
	s.beats.mu.Unlock()
	if len(under) == 0 && !pruned && underCount == expected {
		return
	}
	if underCount != expected || pruned {
		// Some lease left the heartbeat behind the store's back (or one
		// let go must leave it): ask which are still under it.
		reconciled, err = s.reconcileBeat(ctx, hb)
		if err != nil {
			for _, r := range under {
				r.Err = wrapError(ctx, call("renew", r.Name), err)
			}
			return
		}
	}
	s.beats.mu.Lock()
	defer s.beats.mu.Unlock()
	for i, r := range under {
		l := underLeases[i]
		if reconciled != nil && !reconciled[heldKey{r.Name, r.Token, l.term}] {
			if hb.leases[holder{r.Name, r.Token}] == l {
				delete(hb.leases, holder{r.Name, r.Token})
			}
			l = nil
		}
		if l == nil {
			r.Err = fmt.Errorf("postgres: renew %q term %d: %w", r.Name, r.Term, leader.ErrLeaseLost)
			continue
		}
		r.Lease = lease(r, l)
	}
}

// reconcileBeat takes out from under hb every lease the store does not have
// under it, and returns those it has that are still there.
func (s *LeaseStore) reconcileBeat(ctx context.Context, hb *heartbeat) (map[heldKey]bool, error) {
	s.beats.mu.Lock()
	var (
		names, tokens []string
		terms         []int64
	)
	for k, l := range hb.leases {
		names, tokens, terms = append(names, k.name), append(tokens, k.token), append(terms, l.term)
	}
	s.beats.mu.Unlock()
	rows, err := s.pool.Query(ctx, s.beatSQL.reconcile, hb.id, names, tokens, terms)
	if err != nil {
		return nil, err
	}
	still := map[heldKey]bool{}
	var k heldKey
	_, err = pgx.ForEachRow(rows, []any{&k.name, &k.token, &k.term}, func() error {
		still[k] = true
		return nil
	})
	if err != nil {
		return nil, err
	}
	return still, nil
}
