package postgres

import (
	"context"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leaderelect/leader"
)

// Renew calls are batched: those that reach a LeaseStore together are sent
// as one statement, which renews every lease in it on its own row, on the
// server's clock. (Electors do not call Renew on a LeaseStore: they renew
// with RenewBatch, one call per round, which renews the store's heartbeat;
// see heartbeat.go. This path serves other callers of Renew.)
//
// A batch is sent as soon as every lease the store granted and has not
// seen end has asked for its renewal, and otherwise once no call has come
// for a while, or at most a linger after the batch began (batchLinger). A
// store whose Electors hold one name sends each renewal at once. While a batch is on the wire the next
// one gathers, so a slow statement delays the next round but never splits
// it into more statements than rounds.
const (
	// minBatchLinger and maxBatchLinger bound how long a batch that is not
	// yet a whole round waits for the rest of it: TTL/30 (a tenth of the
	// default renew interval) within these bounds. The calls of a round
	// arrive together, as their Electors' timers fire at the same moment,
	// but on a busy machine ten thousand of them take tens of
	// milliseconds to arrive. Waiting costs no safety: each Elector's
	// deadline counts from before its call was queued.
	minBatchLinger = 5 * time.Millisecond
	maxBatchLinger = 250 * time.Millisecond
	// maxBatchSize bounds the leases renewed by one statement.
	maxBatchSize = 50_000
)

// batchLinger returns how long a batch whose first call asks for ttl waits
// for the rest of its round, and how long it waits for one more call
// before it is sent without them (a quarter of that).
func batchLinger(ttl time.Duration) (linger, quiet time.Duration) {
	linger = min(max(ttl/30, minBatchLinger), maxBatchLinger)
	return linger, linger / 4
}

// renewCall is one Renew waiting for its batch.
type renewCall struct {
	ctx       context.Context
	name      string
	token     string
	term      int64
	ttlMicros int64
	ttl       time.Duration
	done      chan renewOutcome // buffered: the batcher never blocks on it
}

// renewOutcome is what the batch found for one renewCall.
type renewOutcome struct {
	lease leader.Lease
	err   error
}

// heldKey is a lease the store granted: a name under a token and a term.
type heldKey struct {
	name, token string
	term        int64
}

// holder is a name under a token: at most one lease of it is held at once.
type holder struct{ name, token string }

// renewBatcher gathers the store's renewals into batches and sends each
// batch as one statement, on a goroutine that runs only while there are
// renewals to send.
type renewBatcher struct {
	store *LeaseStore

	mu      sync.Mutex
	pending []*renewCall
	sending bool          // the goroutine is running
	kick    chan struct{} // a call arrived; capacity 1
	// held has the leases granted here and not seen to end, with when
	// each surely expires if not renewed (on this process's clock).
	held map[holder]heldLease
}

func newRenewBatcher(s *LeaseStore) *renewBatcher {
	return &renewBatcher{store: s, kick: make(chan struct{}, 1), held: map[holder]heldLease{}}
}

// heldLease is an entry of renewBatcher.held.
type heldLease struct {
	term    int64
	expires time.Time     // sent+ttl of the last grant or renewal seen, or later
	ttl     time.Duration // the TTL of that grant or renewal
}

// granted records a lease the store granted, so that rounds know how many
// renewals to wait for.
func (b *renewBatcher) granted(name, token string, term int64, ttl time.Duration) {
	b.mu.Lock()
	b.held[holder{name, token}] = heldLease{term: term, expires: time.Now().Add(ttl), ttl: ttl}
	b.mu.Unlock()
}

// ttlOf returns the TTL of the last grant or renewal of the lease of name
// held by token under term that the store saw, if it has the lease.
func (b *renewBatcher) ttlOf(name, token string, term int64) (time.Duration, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	h, ok := b.held[holder{name, token}]
	return h.ttl, ok && h.term == term && h.ttl > 0
}

// ended records that a lease granted here is no longer held (released,
// lost, or renewed by nobody).
func (b *renewBatcher) ended(name, token string, term int64) {
	b.mu.Lock()
	if h, ok := b.held[holder{name, token}]; ok && h.term == term {
		delete(b.held, holder{name, token})
	}
	b.mu.Unlock()
}

// renewedElsewhere records that the leases of batch renewed without error
// are renewed by RenewBatch, so Renew's rounds need not wait for them.
func (b *renewBatcher) renewedElsewhere(batch []leader.Renewal) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.held) == 0 {
		return
	}
	for _, r := range batch {
		k := holder{r.Name, r.Token}
		if h, ok := b.held[k]; ok && r.Err == nil && h.term == int64(r.Term) {
			delete(b.held, k)
		}
	}
}

// renewed records that the leases of batch in renewed were renewed, and
// forgets the leases that surely expired without a renewal (their Elector
// stopped without a word), so that rounds stop waiting for them.
func (b *renewBatcher) renewed(renewed map[heldKey]leaseRow, batch []*renewCall) {
	now := time.Now()
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, c := range batch {
		k := holder{c.name, c.token}
		if h, ok := b.held[k]; ok && h.term == c.term {
			if _, ok := renewed[heldKey{c.name, c.token, c.term}]; ok {
				b.held[k] = heldLease{term: c.term, expires: now.Add(c.ttl), ttl: c.ttl}
			}
		}
	}
	if len(batch) < len(b.held) {
		for k, h := range b.held {
			if now.After(h.expires) {
				delete(b.held, k)
			}
		}
	}
}

// renew queues c for the next batch and waits for its outcome or for ctx
// to end.
func (b *renewBatcher) renew(c *renewCall) (leader.Lease, error) {
	b.mu.Lock()
	b.pending = append(b.pending, c)
	if !b.sending {
		b.sending = true
		go b.send()
	}
	b.mu.Unlock()
	select {
	case b.kick <- struct{}{}:
	default:
	}
	select {
	case o := <-c.done:
		return o.lease, o.err
	case <-c.ctx.Done():
		// The batch may still renew this lease; the caller counts the
		// renewal as failed, which is the safe reading.
		return leader.Lease{}, wrapError(c.ctx, call("renew", c.name), c.ctx.Err())
	}
}

// send sends batches until none is pending, then exits.
func (b *renewBatcher) send() {
	for {
		batch := b.gather()
		if batch == nil {
			return
		}
		b.sendBatch(batch)
	}
}

// gather waits until the pending calls make up a round (one per lease
// held), or no call has arrived for a while, or the linger (batchLinger)
// has passed since gathering began; then it takes them, dropping those
// whose context has ended. It returns nil, with the goroutine marked stopped,
// when nothing is pending.
func (b *renewBatcher) gather() []*renewCall {
	b.mu.Lock()
	var first time.Duration
	if len(b.pending) > 0 {
		first = b.pending[0].ttl
	}
	b.mu.Unlock()
	lingerFor, quietFor := batchLinger(first)
	linger := time.NewTimer(lingerFor)
	defer linger.Stop()
	quiet := time.NewTimer(quietFor)
	defer quiet.Stop()
	for {
		b.mu.Lock()
		if len(b.pending) == 0 {
			b.sending = false
			b.mu.Unlock()
			return nil
		}
		full := len(b.pending) >= len(b.held) || len(b.pending) >= maxBatchSize
		b.mu.Unlock()
		if !full {
			select {
			case <-b.kick:
				quiet.Reset(quietFor)
				continue
			case <-quiet.C:
			case <-linger.C:
			}
		}
		b.mu.Lock()
		n := min(len(b.pending), maxBatchSize)
		batch := make([]*renewCall, 0, n)
		for _, c := range b.pending[:n] {
			if c.ctx.Err() == nil {
				batch = append(batch, c)
			}
		}
		b.pending = append(b.pending[:0:0], b.pending[n:]...)
		b.mu.Unlock()
		if len(batch) > 0 {
			return batch
		}
	}
}

// sendBatch renews the leases of batch in one statement and hands each
// call its outcome. The statement ends at the earliest deadline of the
// calls, or when every call has given up.
func (b *renewBatcher) sendBatch(batch []*renewCall) {
	ctx, cancel := batchContext(batch)
	defer cancel()

	leases := make([]renewArgs, len(batch))
	for i, c := range batch {
		leases[i] = renewArgs{c.name, c.token, c.term, c.ttlMicros}
	}
	renewed, err := b.store.renewRows(ctx, leases)
	if err == nil {
		b.renewed(renewed, batch)
	}
	for _, c := range batch {
		var o renewOutcome
		o.lease, o.err = b.outcome(ctx, renewed, err, c.name, c.token, c.term, c.ttl)
		c.done <- o
	}
}

// renewArgs is one lease of a renewal statement.
type renewArgs struct {
	name, token string
	term        int64
	ttlMicros   int64
}

// renewRows renews leases with one statement and returns the leases it
// renewed.
func (s *LeaseStore) renewRows(ctx context.Context, leases []renewArgs) (map[heldKey]leaseRow, error) {
	names := make([]string, len(leases))
	tokens := make([]string, len(leases))
	terms := make([]int64, len(leases))
	ttls := make([]int64, len(leases))
	for i, l := range leases {
		names[i], tokens[i], terms[i], ttls[i] = l.name, l.token, l.term, l.ttlMicros
	}
	renewed := make(map[heldKey]leaseRow, len(leases))
	rows, err := s.pool.Query(ctx, s.sql.renewBatch, names, tokens, terms, ttls)
	if err != nil {
		return nil, err
	}
	var (
		r   leaseRow
		key heldKey
	)
	dest := append([]any{&key.name, &key.token, &key.term, &r.holderID, &r.acquiredAt, &r.expiresAt, &r.remaining}, r.transfer.dest()...)
	_, err = pgx.ForEachRow(rows, dest, func() error {
		row := r
		row.term, row.held = key.term, true
		renewed[key] = row
		return nil
	})
	if err != nil {
		return nil, err
	}
	return renewed, nil
}

// outcome is what Renew reports for one lease of a statement that renewed
// the leases in renewed or failed with err; a lease it did not renew is
// forgotten as ended.
func (b *renewBatcher) outcome(ctx context.Context, renewed map[heldKey]leaseRow, err error, name, token string, term int64, ttl time.Duration) (leader.Lease, error) {
	if err != nil {
		return leader.Lease{}, wrapError(ctx, call("renew", name), err)
	}
	r, ok := renewed[heldKey{name, token, term}]
	if !ok {
		b.ended(name, token, term)
		return leader.Lease{}, fmt.Errorf("postgres: renew %q term %d: %w", name, term, leader.ErrLeaseLost)
	}
	l := r.lease(name)
	l.Remaining = min(l.Remaining, ttl)
	return l, nil
}

// batchContext returns the context of a batch's statement: it ends at the
// earliest deadline among the calls, and once every call's context has
// ended.
func batchContext(batch []*renewCall) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(context.Background())
	var earliest time.Time
	for _, c := range batch {
		if d, ok := c.ctx.Deadline(); ok && (earliest.IsZero() || d.Before(earliest)) {
			earliest = d
		}
	}
	if !earliest.IsZero() {
		var cancelDeadline context.CancelFunc
		ctx, cancelDeadline = context.WithDeadline(ctx, earliest)
		prev := cancel
		cancel = func() { cancelDeadline(); prev() }
	}
	var (
		mu      sync.Mutex
		waiting = len(batch)
		stops   = make([]func() bool, 0, len(batch))
	)
	for _, c := range batch {
		stops = append(stops, context.AfterFunc(c.ctx, func() {
			mu.Lock()
			waiting--
			all := waiting == 0
			mu.Unlock()
			if all {
				cancel()
			}
		}))
	}
	return ctx, func() {
		for _, stop := range stops {
			stop()
		}
		cancel()
	}
}

// checkRenew refuses what no lease can match, before queueing.
func checkRenew(name string, term uint64, ttl time.Duration) error {
	if err := checkTTL("renew", name, ttl); err != nil {
		return err
	}
	if term > math.MaxInt64 {
		return fmt.Errorf("postgres: renew %q term %d: %w", name, term, leader.ErrLeaseLost)
	}
	return nil
}
