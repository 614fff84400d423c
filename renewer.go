package leader

import (
	"context"
	"errors"
	"log/slog"
	"reflect"
	"runtime"
	"sync"
	"time"

	"github.com/leaderelect/leader/internal/wallclock"
)

// A leadership (a tenure) is renewed by a renewer. The tenures of every
// Elector of the process that leads on one Store implementing BatchRenewer,
// with one RenewInterval, share one renewer: at each point of their grid it
// renews every lease that is due with one RenewBatch call, and extends each
// tenure's local deadline itself, so that a round costs one call and one
// goroutine wake-up however many names the process holds. Any other tenure
// has a renewer of its own, which calls Store.Renew. A renewer runs a
// goroutine only while it has tenures to renew.
type renewer struct {
	every time.Duration
	renew func(ctx context.Context, batch []Renewal)
	base  context.Context // the calls' context: never cancelled
	key   *renewerKey     // in the registry; nil for a tenure's own renewer

	buf []Renewal // the batch, reused; only run's goroutine touches it

	mu      sync.Mutex
	members map[*tenure]struct{}
	running bool          // the goroutine is running
	kick    chan struct{} // members changed; capacity 1
	// The batch in flight: cancelBatch ends its call, and inBatch counts
	// its tenures still joined. The call is cut short once all have left.
	cancelBatch context.CancelFunc
	inBatch     int
}

// renewerKey identifies a shared renewer.
type renewerKey struct {
	store BatchRenewer
	every time.Duration
}

// renewers is the registry of shared renewers, each present while it has
// members. Lock order: renewers.mu before renewer.mu.
var renewers struct {
	mu sync.Mutex
	m  map[renewerKey]*renewer
}

// join adds t to the renewer that renews e's leases: the shared one for e's
// store and RenewInterval, or a new one of its own. ctx is e's Run context,
// whose values (not its cancellation) a renewer of its own passes on.
func (e *Elector) join(ctx context.Context, t *tenure) *renewer {
	br, ok := e.store.(BatchRenewer)
	if !ok || !reflect.TypeOf(br).Comparable() {
		r := &renewer{
			every: e.cfg.RenewInterval,
			renew: e.renewEach,
			base:  context.WithoutCancel(ctx),
		}
		r.add(t)
		return r
	}
	key := renewerKey{store: br, every: e.cfg.RenewInterval}
	renewers.mu.Lock()
	defer renewers.mu.Unlock()
	r := renewers.m[key]
	if r == nil {
		r = &renewer{every: key.every, renew: br.RenewBatch, base: context.Background(), key: &key}
		if renewers.m == nil {
			renewers.m = map[renewerKey]*renewer{}
		}
		renewers.m[key] = r
	}
	r.add(t)
	return r
}

// renewEach renews the leases of batch one by one with Store.Renew.
func (e *Elector) renewEach(ctx context.Context, batch []Renewal) {
	for i := range batch {
		b := &batch[i]
		b.Lease, b.Err = e.store.Renew(ctx, b.Name, b.Token, b.Term, b.TTL)
	}
}

// add makes t a member, due at t.next, and starts the goroutine if needed.
func (r *renewer) add(t *tenure) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.members == nil {
		r.members = map[*tenure]struct{}{}
		r.kick = make(chan struct{}, 1)
	}
	r.members[t] = struct{}{}
	r.kickLocked()
	if !r.running {
		r.running = true
		go r.run()
	}
}

func (r *renewer) kickLocked() {
	select {
	case r.kick <- struct{}{}:
	default:
	}
}

// drop stops renewing t: no renewal of it starts after drop returns. A
// renewal in flight goes on until finish. Dropping twice is harmless.
func (r *renewer) drop(t *tenure) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.members, t)
	r.kickLocked()
}

// finish waits until t's renewal in flight, if any, has finished, or wait
// has passed; then it leaves the call (cut short once no tenure of its
// batch is waiting for it). Call it after drop.
func (r *renewer) finish(t *tenure, wait time.Duration) {
	r.mu.Lock()
	settled := t.settled
	r.mu.Unlock()
	if settled != nil && wait > 0 {
		timer := time.NewTimer(wait)
		select {
		case <-settled:
		case <-timer.C:
		}
		timer.Stop()
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if t.settled != nil {
		t.settled = nil
		r.inBatch--
		if r.inBatch == 0 && r.cancelBatch != nil {
			r.cancelBatch()
		}
	}
}

// inFlight reports whether a renewal of t's lease was sent and has not
// settled (finish has not been called for it).
func (r *renewer) inFlight(t *tenure) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return t.settled != nil
}

// run renews the members' leases as they fall due, until none is left.
func (r *renewer) run() {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		due, wait, ok := r.due()
		if !ok {
			return
		}
		if len(due) == 0 {
			timer.Reset(wait)
			select {
			case <-r.kick:
			case <-timer.C:
			}
			continue
		}
		r.send(due)
	}
}

// due returns the members whose renewal is due, or how long until the next
// one is; ok is false, and the goroutine marked stopped, once there are no
// members.
func (r *renewer) due() (due []*tenure, wait time.Duration, ok bool) {
	r.mu.Lock()
	if len(r.members) == 0 {
		if r.key == nil {
			r.running = false
			r.mu.Unlock()
			return nil, 0, false
		}
		// A shared renewer leaves the registry, unless a tenure joined
		// while the lock was let go.
		r.mu.Unlock()
		renewers.mu.Lock()
		defer renewers.mu.Unlock()
		r.mu.Lock()
		if len(r.members) == 0 {
			r.running = false
			delete(renewers.m, *r.key)
			r.mu.Unlock()
			return nil, 0, false
		}
	}
	defer r.mu.Unlock()
	now := time.Now()
	var next time.Time
	for t := range r.members {
		switch {
		case !t.next.After(now):
			due = append(due, t)
		case next.IsZero() || t.next.Before(next):
			next = t.next
		}
	}
	return due, next.Sub(now), true
}

// send renews the leases of due with one call, bounded by the earliest of
// their stop points, and applies each outcome to its tenure.
func (r *renewer) send(due []*tenure) {
	// The batch's memory is reused from round to round (RenewBatch keeps
	// none of it): a process with many names would otherwise allocate
	// megabytes a round, and the collections that follow slow rounds down.
	// Only members: one dropped since due() picked it is not renewed
	// (see drop).
	settled := make(chan struct{})
	defer close(settled)
	r.mu.Lock()
	kept := due[:0]
	for _, t := range due {
		if _, member := r.members[t]; member {
			t.settled = settled
			kept = append(kept, t)
		}
	}
	due = kept
	r.inBatch = len(due)
	r.mu.Unlock()
	if len(due) == 0 {
		return
	}
	if cap(r.buf) < len(due) {
		r.buf = make([]Renewal, len(due))
	}
	batch := r.buf[:len(due)]
	defer clear(batch)
	var stopAt time.Time
	for i, t := range due {
		batch[i] = Renewal{Name: t.e.cfg.Name, Token: t.e.cand.Token, Term: t.term, TTL: t.e.cfg.TTL}
		if s := t.stopPoint(); i == 0 || s.Before(stopAt) {
			stopAt = s
		}
	}
	ctx, cancel := context.WithDeadline(r.base, stopAt)
	defer cancel()
	r.mu.Lock()
	r.cancelBatch = cancel
	if r.inBatch == 0 { // every tenure of the batch left it already
		cancel()
	}
	r.mu.Unlock()

	sent := time.Now()
	r.renew(ctx, batch)
	contact := wallclock.Now()

	r.mu.Lock()
	r.cancelBatch, r.inBatch = nil, 0
	waiting := make([]bool, len(due)) // not left by finish
	for i, t := range due {
		if t.settled == settled {
			t.settled = nil
			waiting[i] = true
		}
	}
	r.mu.Unlock()
	apply := func(from, to int) {
		for i := from; i < to; i++ {
			t := due[i]
			if !waiting[i] {
				continue
			}
			next, keep := t.renewed(sent, contact, batch[i], r.every)
			r.mu.Lock()
			if _, member := r.members[t]; member && keep {
				t.next = next
			} else {
				delete(r.members, t)
			}
			r.mu.Unlock()
		}
	}
	// Each outcome is applied on its own (its tenure's locks, and the
	// renewer's for a moment), so a large round is shared among the
	// machine's cores: the last deadline is extended sooner.
	workers := min(runtime.GOMAXPROCS(0), len(due)/minApplyPerWorker, maxApplyWorkers)
	if workers <= 1 {
		apply(0, len(due))
		return
	}
	var wg sync.WaitGroup
	per := (len(due) + workers - 1) / workers
	for from := per; from < len(due); from += per {
		wg.Go(func() { apply(from, min(from+per, len(due))) })
	}
	apply(0, per)
	wg.Wait()
}

// A round's outcomes are applied by up to maxApplyWorkers goroutines, each
// with at least minApplyPerWorker of them.
const (
	minApplyPerWorker = 1000
	maxApplyWorkers   = 4
)

// renewed applies the outcome of a renewal sent at sent and answered at
// contact (on the wall clock, for Status.LastContact): on success it
// extends the local deadline (unless leadership has already ended), and it
// returns when to renew next; keep is false after an outcome that ends the
// tenure, which is handed to the lead loop.
func (t *tenure) renewed(sent, contact time.Time, r Renewal, every time.Duration) (next time.Time, keep bool) {
	e := t.e
	if r.Err == nil {
		e.cfg.Metrics.StoreCall(e.cfg.Name, "renew", time.Since(sent), nil)
		t.extend(sent, contact, r.Lease)
		return nextRenewal(sent, every), true
	}
	e.recordCall("renew", sent, r.Err)
	switch {
	case errors.Is(r.Err, ErrLeaseLost), errors.Is(r.Err, ErrReadOnly), errors.Is(r.Err, ErrPermanent):
		select {
		case t.failed <- r.Err:
		default:
		}
		return time.Time{}, false
	default:
		t.mu.Lock()
		over := t.over
		if !over {
			t.lastErr = r.Err
		}
		left := time.Until(t.stopAt)
		t.mu.Unlock()
		if !over {
			e.log.Warn("renewal failed; retrying", slog.Uint64("term", t.term), slog.Any("error", r.Err),
				slog.Duration("left_before_stepping_down", left))
		}
		return time.Now().Add(every / 4), true
	}
}
