package leader

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"
)

// tenure is one leadership of an Elector, from its grant to its loss.
type tenure struct {
	e       *Elector
	term    uint64
	lctx    context.Context // the leader context
	cancel  context.CancelCauseFunc
	stopped chan struct{} // closed once the stop point has ended leadership
	failed  chan error    // capacity 1: a renewal outcome that ends the tenure
	// requested, capacity 1, receives the requests to hand over that
	// renewals report (see Transferer).
	requested chan TransferRequest
	timer     *time.Timer // fires at the stop point

	mu       sync.Mutex
	deadline time.Time // the local deadline: the last renewal's sent+TTL-DriftMargin
	stopAt   time.Time // deadline-StopGrace
	lastErr  error     // of the renewals that failed since the last success
	over     bool      // the lead loop has stopped: the deadline no longer moves

	// Guarded by the mu of the renewer t belongs to.
	next    time.Time     // when to renew next
	settled chan struct{} // while a renewal is in flight: closed once it has finished
}

// end ends the tenure's leadership: IsLeader turns false, then the leader
// context is cancelled. It may run more than once and on any goroutine; it
// never blocks, logs or calls out, so nothing can delay it.
func (t *tenure) end(reason string) {
	e := t.e
	e.mu.Lock()
	if e.leaderCtx == t.lctx {
		e.status.IsLeader = false
		e.status.StopAt = time.Time{}
		e.leaderCtx = nil
	}
	e.mu.Unlock()
	t.cancel(fmt.Errorf("%w: leadership lost (%s)", ErrNotLeader, reason))
}

// stopPoint returns when leadership ends unless a renewal succeeds first.
func (t *tenure) stopPoint() time.Time {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.stopAt
}

// extend moves the local deadline after a renewal sent at sent succeeded,
// answered at contact (on the wall clock), unless leadership has ended:
// once the stop timer has fired (Stop reports false) or the lead loop has
// stopped, the store's answer comes too late.
func (t *tenure) extend(sent, contact time.Time, l Lease) {
	e := t.e
	t.mu.Lock()
	if t.over || !t.timer.Stop() {
		t.mu.Unlock()
		e.mu.Lock()
		e.contactLocked(contact)
		e.mu.Unlock()
		return
	}
	t.deadline = sent.Add(e.cfg.TTL - e.cfg.DriftMargin)
	t.stopAt = t.deadline.Add(-e.cfg.StopGrace)
	t.timer.Reset(time.Until(t.stopAt))
	recovered := t.lastErr != nil
	t.lastErr = nil
	e.mu.Lock()
	e.contactLocked(contact)
	if e.leaderCtx == t.lctx {
		e.status.ExpiresAt = l.ExpiresAt
		e.status.StopAt = t.stopAt
		e.status.Transfer = l.Transfer
	}
	e.mu.Unlock()
	t.mu.Unlock()
	if l.Transfer.Pending() {
		select {
		case t.requested <- l.Transfer:
		default: // the loop has one to consider already
		}
	}
	if recovered {
		e.log.Info("renewed again after failures", slog.Uint64("term", t.term))
	}
}

// unreachable returns conn_lost or error, for a stop point reached after
// failed renewals, and the error that says why: the last renewal's, or,
// when none failed, that none was answered in time.
func (t *tenure) unreachable() (LossReason, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	switch {
	case t.lastErr == nil:
		return LossConnLost, errNoAnswer
	case !errors.Is(t.lastErr, context.DeadlineExceeded) && !errors.Is(t.lastErr, ErrUnavailable):
		return LossError, t.lastErr
	}
	return LossConnLost, t.lastErr
}

// errNoAnswer is why a leader stepped down at its stop point when no
// renewal failed: none was answered before it.
var errNoAnswer = errors.New("leader: no renewal was answered before the stop point (the store is slow to answer, or its calls wait for a connection)")

// lead holds the lease granted at sent until it is lost, then steps down and
// returns why. It implements DESIGN.md invariants 1 and 5: the local deadline
// is sent+TTL-DriftMargin on the monotonic clock, every renewal is bounded by
// the time left before stopping, and at the stop point a timer of its own
// ends leadership, whatever the store, the logger or the metrics are doing.
// The renewals are made by a renewer (see join), which extends the
// deadline after each success and hands this loop the failures that end
// leadership.
func (e *Elector) lead(ctx context.Context, lease Lease, sent time.Time) LossReason {
	term := lease.Term
	t := &tenure{
		e:       e,
		term:    term,
		stopped: make(chan struct{}),
		failed:  make(chan error, 1),
		next:    nextRenewal(sent, e.cfg.RenewInterval),

		requested: make(chan TransferRequest, 1),
	}
	t.deadline = sent.Add(e.cfg.TTL - e.cfg.DriftMargin)
	t.stopAt = t.deadline.Add(-e.cfg.StopGrace)
	// The leader context is not a child of ctx: it is cancelled by end,
	// after IsLeader has turned false, with the reason as its cause.
	t.lctx, t.cancel = context.WithCancelCause(withTerm(context.WithoutCancel(ctx), term))
	lctx := t.lctx
	e.mu.Lock()
	e.status.IsLeader = true
	e.status.Leader = e.cfg.ID
	e.status.Term = term
	e.status.AcquiredAt = lease.AcquiredAt
	e.status.ExpiresAt = lease.ExpiresAt
	e.status.StopAt = t.stopAt
	e.status.Reason = lease.Reason
	e.status.Transfer = lease.Transfer
	e.status.Successor = ""
	e.leaderCtx = lctx
	e.mu.Unlock()
	// At the stop point leadership ends on the timer's own goroutine; the
	// loop below only learns of it through stopped.
	t.timer = time.AfterFunc(time.Until(t.stopAt), func() {
		t.end("no renewal before the local deadline")
		close(t.stopped)
	})
	defer func() {
		t.mu.Lock()
		t.timer.Stop()
		t.mu.Unlock()
	}()
	// A store that learns of a loss before the next renewal (see
	// LossNotifier) ends leadership the same way, on a goroutine of its
	// own; the loop learns of it through lost.
	var lost chan struct{}
	if ln, ok := e.store.(LossNotifier); ok {
		if ch := ln.Lost(e.cfg.Name, e.cand.Token, term); ch != nil {
			lost = make(chan struct{})
			leaderDone := lctx.Done() // closed by end on every way out
			go func() {
				select {
				case <-ch:
					t.end("the store reports the lease lost")
					close(lost)
				case <-leaderDone:
				}
			}()
		}
	}
	e.cfg.Metrics.Acquired(e.cfg.Name, term)
	if gm, ok := e.cfg.Metrics.(GrantMetrics); ok {
		gm.Granted(e.cfg.Name, term, lease.Reason)
	}
	e.cfg.Metrics.StatusChanged(e.cfg.Name, true)
	e.log.Info("elected", slog.Uint64("term", term), slog.Time("expires_at", lease.ExpiresAt), slog.String("reason", string(lease.Reason)))
	ts, _ := e.store.(Transferer)
	if lease.Transfer.Pending() {
		t.requested <- lease.Transfer
	}
	e.publish()

	electedDone := make(chan struct{})
	go func() {
		defer close(electedDone)
		if e.cfg.OnElected != nil {
			e.cfg.OnElected(lctx)
		}
	}()

	var (
		reason   LossReason
		resigned chan error // Resign's; answered once OnDemoted has returned
		released bool       // the store freed the lease itself: nothing to release
		handover *handoff   // to a successor, instead of a release
	)
	// stop ends leadership at once, then lets the loop log why.
	stop := func(r LossReason) LossReason {
		t.end(string(r))
		return r
	}
	r := e.join(ctx, t)
loop:
	for {
		select {
		case <-ctx.Done():
			if e.cfg.HandOverOnStop && ts != nil {
				if to, err := e.successor(ctx, ts, "", nil); err == nil {
					handover = &handoff{to: to, reason: GrantTransfer}
					if !e.prepare(ctx, ts, t, handover) {
						handover = nil // leadership ended meanwhile: nothing to hand over
					}
				} else {
					e.log.Info("no other candidate to hand over to; releasing", slog.Any("error", err))
				}
			}
			reason = stop(LossShutdown)
			break loop
		case req := <-e.resignCh:
			if req.leader != lctx {
				req.done <- ErrNotLeader // meant for a leadership already over
				continue
			}
			reason, resigned = stop(LossResigned), req.done
			break loop
		case call := <-e.transferCh:
			if call.leader != lctx || ts == nil {
				call.done <- transferOutcome{err: ErrNotLeader}
				continue
			}
			to, err := e.successor(ctx, ts, call.to, nil)
			if err != nil {
				call.done <- transferOutcome{err: err}
				continue
			}
			h := &handoff{to: to, reason: GrantTransfer, call: &call}
			if !e.prepare(ctx, ts, t, h) {
				// Leadership ended meanwhile: the loop learns why next.
				call.done <- transferOutcome{err: ErrNotLeader}
				continue
			}
			reason, handover = stop(LossTransferred), h
			break loop
		case req := <-t.requested:
			if ts == nil {
				continue
			}
			if h := e.consider(ctx, ts, t, req, sent); h != nil {
				if !e.prepare(ctx, ts, t, h) {
					continue // leadership ended meanwhile: the loop learns why next
				}
				reason, handover = stop(LossTransferred), h
				break loop
			}
		case <-lost:
			reason, released = LossConnLost, true
			e.log.Error("the store reports the lease lost (for example its session with the server ended); stepped down",
				slog.Uint64("term", term))
			break loop
		case <-t.stopped:
			var lastErr error
			reason, lastErr = t.unreachable()
			e.log.Error("could not renew before the local deadline; stepped down",
				slog.Uint64("term", term), slog.Any("error", lastErr))
			break loop
		case err := <-t.failed:
			switch {
			case errors.Is(err, ErrLeaseLost):
				reason = stop(LossExpired)
				e.log.Error("lease lost: the store no longer has it held by this instance; stepped down",
					slog.Uint64("term", term), slog.Any("error", err))
			case errors.Is(err, ErrPermanent):
				// Renewals cannot succeed until a person mends the
				// store's configuration: step down now rather than at
				// the deadline, and campaign again only after a backoff
				// (see Run), not at once to fail the same way.
				reason = stop(LossError)
				e.refused = true
				e.log.Error("the store refuses renewals for a reason that retrying will not mend; stepped down",
					slog.Uint64("term", term), slog.Any("error", err))
			default:
				reason = stop(LossError)
				e.log.Error("store is read-only (for example a replica or a database in recovery); stepped down",
					slog.Uint64("term", term), slog.Any("error", err))
			}
			break loop
		}
	}
	// No renewal starts from now on, and none in flight moves the deadline.
	r.drop(t)
	t.mu.Lock()
	t.over = true
	deadline := t.deadline
	t.mu.Unlock()
	// Nothing waits on the store's loss notice now: a store that watches
	// on the lease's own connection stops while OnDemoted runs, not at the
	// start of the release (see LossWatchStopper). Only before a release:
	// a lease not released is left as it is.
	if ls, ok := e.store.(LossWatchStopper); ok && !released && reason != LossExpired && reason != LossError {
		ls.StopLossWatch(e.cfg.Name, e.cand.Token, term)
	}

	// Leadership has ended: IsLeader is false and the leader context is
	// cancelled. Now OnDemoted runs, then OnElected is awaited; only then is
	// the lease released, so work never overlaps the next leader's after a
	// handover.
	e.cfg.Metrics.StatusChanged(e.cfg.Name, false)
	e.cfg.Metrics.Lost(e.cfg.Name, reason)
	e.log.Info("demoted", slog.Uint64("term", term), slog.String("reason", string(reason)))
	// Not ours to release, or the store refuses writes.
	releasing := !released && reason != LossExpired && reason != LossError
	// Staged only when no renewal of the lease is in flight (none starts
	// now): one would write the lease's row, which a staged release holds
	// locked until its commit, after that renewal is waited for below.
	if releasing && handover != nil && handover.prepared != nil && !r.inFlight(t) {
		e.stage(ctx, handover)
	}
	if e.cfg.OnDemoted != nil {
		e.cfg.OnDemoted()
	}
	if resigned != nil {
		// Resign returns now, not after the release below: the release
		// waits for OnElected, which may itself be the caller of Resign.
		resigned <- nil
	}
	e.awaitElected(electedDone, deadline)
	if time.Now().After(deadline) && reason != LossExpired {
		e.log.Error("leader work stopped after the local deadline; another instance may have started before it ended",
			slog.Uint64("term", term))
	}
	// A renewal in flight is let finish before the release: cancelled, it
	// may cut the store's connection, and the lease with it (the advisory
	// strategy's session), which turns a handover into a takeover that
	// waits out the store's grace. It may take as long as the release may,
	// and never past the deadline. Then it is left to finish on its own
	// (cancelled, unless other leases share its call): a store call that
	// ignores its context must not keep the Elector from campaigning again.
	var wait time.Duration
	if releasing {
		wait = min(e.cfg.RenewInterval, time.Until(deadline))
	}
	r.finish(t, wait)

	switch {
	case !releasing:
		if handover != nil && handover.prepared != nil {
			handover.prepared.Abort()
		}
		if handover != nil && handover.call != nil {
			handover.call.done <- transferOutcome{err: fmt.Errorf("leader: transfer %q: leadership ended (%s) before the handover: %w", e.cfg.Name, reason, ErrNotLeader)}
		}
		e.observe(Lease{Name: e.cfg.Name})
	case handover != nil:
		if e.releaseTo(ctx, ts, term, handover) {
			e.observe(Lease{Name: e.cfg.Name, Term: term, Successor: handover.to.ID, Reserved: e.reserveFor()})
		}
	default:
		if e.release(ctx, term) {
			e.observe(Lease{Name: e.cfg.Name, Term: term})
		}
	}
	return reason
}

// holdOff returns how long Run waits before campaigning again after a
// tenure: RetryInterval, or, after consecutive tenures that ended because
// the store refused renewals with ErrPermanent, RetryInterval doubled at
// each up to maxPermanentBackoff, so that a leader whose grants work and
// renewals do not (a missing privilege, say) does not step up and down at
// every RetryInterval. Only Run's goroutine calls it.
func (e *Elector) holdOff() time.Duration {
	if !e.refused {
		e.refusals = 0
		return e.cfg.RetryInterval
	}
	e.refused = false
	e.refusals++
	return e.retryWait(true, e.refusals)
}

// renewEpoch anchors the grid of renewal times that every Elector of the
// process shares (see nextRenewal).
var renewEpoch = time.Now()

// nextRenewal returns when to renew a lease last granted or renewed by a
// request sent at sent: the last point not after sent+every of a grid of
// period every shared by the whole process. It is after sent and at most
// every later, so a lease is renewed at least as often as it would be
// every interval from sent; and Electors with the same RenewInterval renew
// at the same moments from their second renewal on, so that a store can
// renew them all with one request (the PostgreSQL lease store does).
func nextRenewal(sent time.Time, every time.Duration) time.Time {
	due := sent.Add(every)
	return due.Add(-(due.Sub(renewEpoch) % every))
}

// awaitElected waits for the OnElected goroutine, warning while it overruns.
func (e *Elector) awaitElected(done <-chan struct{}, deadline time.Time) {
	warn := time.NewTicker(max(e.cfg.StopGrace, 100*time.Millisecond))
	defer warn.Stop()
	for {
		select {
		case <-done:
			return
		case <-warn.C:
			e.log.Warn("OnElected has not returned after its context was cancelled; waiting",
				slog.Duration("past_deadline", time.Since(deadline)))
		}
	}
}

// release hands the lease over, best effort: if it fails the lease simply
// runs out. It reports whether the store confirmed the release.
func (e *Elector) release(ctx context.Context, term uint64) bool {
	start := time.Now()
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.cfg.RenewInterval)
	defer cancel()
	err := e.store.Release(rctx, e.cfg.Name, e.cand.Token, term)
	e.recordCall("release", start, err)
	if err != nil {
		e.log.Warn("release failed; the lease will run out by itself", slog.Uint64("term", term), slog.Any("error", err))
		return false
	}
	e.log.Info("released", slog.Uint64("term", term))
	return true
}
