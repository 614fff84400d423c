package leader

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"
)

// transferCall asks the lead loop to hand the leadership whose context is
// leader (and no later one) to the candidate whose ID is to ("" for the
// best); done receives the outcome once the lease has been released to
// the successor, or the call was refused.
type transferCall struct {
	leader context.Context
	to     string
	done   chan transferOutcome // capacity 1
}

// transferOutcome is the lead loop's answer to a transferCall.
type transferOutcome struct {
	term      uint64    // the leadership handed over
	successor Candidate // chosen
	err       error
}

// handoff is a handover decided on by the lead loop: to whom, why, and the
// Transfer call to answer, if it was one.
type handoff struct {
	to     Candidate
	reason GrantReason
	call   *transferCall
	// prepared is the handover as the store prepared it (see
	// HandoverPreparer), or nil.
	prepared PreparedHandover
}

// prepare has a store that is a HandoverPreparer make the successor of h
// wait for the lease of tenure t, which this instance still leads, and
// records the prepared handover in h, best effort: unprepared, the
// handover is made with ReleaseTo. It waits for the successor for
// prepareWait at most, and never past t's stop point. It reports whether
// this instance still leads afterwards: if leadership ended meanwhile (the
// stop point, or the store reported the lease lost), it aborts the
// preparation, and the caller goes on as for that loss.
func (e *Elector) prepare(ctx context.Context, ts Transferer, t *tenure, h *handoff) bool {
	hp, ok := ts.(HandoverPreparer)
	if !ok {
		return true
	}
	t.mu.Lock()
	left := time.Until(t.stopAt)
	t.mu.Unlock()
	if left <= 0 {
		return t.lctx.Err() == nil
	}
	start := time.Now()
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), min(e.cfg.RenewInterval, left))
	defer cancel()
	p, err := hp.PrepareHandover(pctx, e.cfg.Name, e.cand.Token, t.term, h.to, e.prepareWait())
	e.recordCall("prepare_handover", start, err)
	switch {
	case err != nil:
		e.log.Debug("preparing the handover failed; handing over without it", slog.String("successor", h.to.ID), slog.Any("error", err))
	case t.lctx.Err() != nil:
		p.Abort()
	default:
		h.prepared = p
	}
	return t.lctx.Err() == nil
}

// stage has a prepared handover that is a HandoverStager run its release
// now, before OnDemoted, best effort: if Stage fails, Commit releases as
// it would have (or finds the lease lost, and the lease runs out).
func (e *Elector) stage(ctx context.Context, h *handoff) {
	hs, ok := h.prepared.(HandoverStager)
	if !ok {
		return
	}
	start := time.Now()
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.cfg.RenewInterval)
	defer cancel()
	err := hs.Stage(sctx, h.reason, e.reserveFor())
	e.recordCall("stage_handover", start, err)
	if err != nil {
		e.log.Debug("staging the handover's release failed; committing without it", slog.String("successor", h.to.ID), slog.Any("error", err))
	}
}

// prepareWait is how long a handover's preparation waits for the
// successor to wait for the lease (see HandoverPreparer): a quarter of
// RenewInterval, at most 100 ms. A successor that campaigns answers within
// a round trip or two; one that was killed, or predates preparations,
// delays the handover by this much.
func (e *Elector) prepareWait() time.Duration {
	return min(e.cfg.RenewInterval/4, 100*time.Millisecond)
}

// enlistFor is how long a follower's entry among the candidates lasts (see
// EnlistFactor and follow).
func (e *Elector) enlistFor() time.Duration { return EnlistFactor * e.cfg.TTL }

// reserveFor is how long a lease handed over stays reserved for its
// successor: one RenewInterval. A successor that campaigns is woken by
// the release and takes it within a round trip or two; one that was
// killed (its entry among the candidates outlives it by up to
// enlistFor) leaves a lease that any candidate may take once this has
// passed, so a handover to it costs no more than this.
func (e *Elector) reserveFor() time.Duration { return e.cfg.RenewInterval }

// Transfer hands this instance's leadership over: to the candidate whose
// ID is to, or, when to is "", to the best candidate (the highest
// Config.Priority; among equals, any). The store must implement
// Transferer (every store of this module does). To ask whoever leads, from
// any process, use RequestTransfer.
//
// This instance steps down as for Resign (IsLeader turns false, the
// leader context is cancelled, OnDemoted runs and OnElected is awaited),
// then releases the lease reserved for the successor: the successor, woken
// by the release, takes it at once with the next term, while the other
// candidates wait. Transfer returns the lease as the successor holds it.
// If the successor does not take it within one RenewInterval (it stopped, or cannot
// reach the store), the reservation lapses and the lease is an ordinary
// released one that any candidate may take: Transfer then returns an error
// wrapping ErrTransferNotTaken. This instance campaigns again afterwards,
// but sits out for one RetryInterval first, as after every loss.
//
// Transfer returns ErrNotLeader if this instance does not lead, and an
// error wrapping ErrNoCandidate, having changed nothing, if no other
// candidate campaigns with the ID to (or at all). It waits for OnElected
// to return, so leader work that calls it must call it on a goroutine of
// its own, or pass the leader context (Transfer then returns its error
// once leadership has ended, and the handover completes when OnElected
// returns).
func (e *Elector) Transfer(ctx context.Context, to string) (Lease, error) {
	if _, ok := e.store.(Transferer); !ok {
		return Lease{}, fmt.Errorf("leader: transfer %q: the store (%T) cannot hand a lease over: %w", e.cfg.Name, e.store, errors.ErrUnsupported)
	}
	e.mu.Lock()
	lctx := e.leaderCtx
	e.mu.Unlock()
	if lctx == nil {
		return Lease{}, ErrNotLeader
	}
	// Watch first, so that the successor's grant wakes the wait below
	// rather than a poll.
	wctx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	wake, err := e.store.Watch(wctx, e.cfg.Name)
	if err != nil {
		wake = nil // wait by polling alone
	}
	call := transferCall{leader: lctx, to: to, done: make(chan transferOutcome, 1)}
	select {
	case e.transferCh <- call:
	case <-lctx.Done():
		return Lease{}, ErrNotLeader
	case <-ctx.Done():
		return Lease{}, ctx.Err()
	}
	var out transferOutcome
	select {
	case out = <-call.done:
	case <-ctx.Done():
		return Lease{}, ctx.Err()
	}
	if out.err != nil {
		return Lease{}, out.err
	}
	return awaitSuccessor(ctx, e.store, wake, e.cfg.Name, out.term, out.successor.ID, false)
}

// enlist records this instance among the candidates of its name, best
// effort: a candidate missing from the list is only never picked as a
// successor. It reports whether it did.
func (e *Elector) enlist(ctx context.Context, ts Transferer) bool {
	start := time.Now()
	cctx, cancel := context.WithTimeout(ctx, e.cfg.RenewInterval)
	defer cancel()
	err := ts.Enlist(cctx, e.cfg.Name, e.cand, e.enlistFor())
	e.recordCall("enlist", start, err)
	if err != nil && ctx.Err() == nil {
		e.log.Debug("enlisting as a candidate failed; this instance cannot be picked as a successor until it succeeds", slog.Any("error", err))
	}
	return err == nil
}

// withdraw removes this instance from the candidates of its name, best
// effort (its entry runs out anyway).
func (e *Elector) withdraw(ctx context.Context, ts Transferer) {
	start := time.Now()
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.cfg.RenewInterval)
	defer cancel()
	err := ts.Withdraw(cctx, e.cfg.Name, e.cand.Token)
	e.recordCall("withdraw", start, err)
	if err != nil {
		e.log.Debug("withdrawing from the candidates failed; the entry runs out by itself", slog.Any("error", err))
	}
}

// askToYield asks the leader of lease, whose priority is below this
// instance's, to hand over (it does once it has led for its MinTenure),
// unless a request is pending already.
func (e *Elector) askToYield(ctx context.Context, ts Transferer, lease Lease) {
	if !lease.Held() || e.cfg.Priority <= lease.Priority || lease.Transfer.Pending() {
		return
	}
	start := time.Now()
	cctx, cancel := context.WithTimeout(ctx, e.cfg.RenewInterval)
	defer cancel()
	_, err := ts.RequestTransfer(cctx, e.cfg.Name, TransferRequest{Reason: GrantPriority}, e.cfg.TTL)
	e.recordCall("request_transfer", start, err)
	switch {
	case err == nil:
		e.log.Info("asked the leader to hand over: this instance's priority is higher",
			slog.String("leader", lease.HolderID), slog.Int("leader_priority", lease.Priority), slog.Int("priority", e.cfg.Priority))
	case !errors.Is(err, ErrNoLeader) && ctx.Err() == nil:
		e.log.Debug("asking the leader to hand over failed", slog.Any("error", err))
	}
}

// successor picks the candidate to hand over to: the one whose ID is to,
// or the best one (with a priority above *above, if above is not nil).
func (e *Elector) successor(ctx context.Context, ts Transferer, to string, above *int) (Candidate, error) {
	start := time.Now()
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.cfg.RenewInterval)
	defer cancel()
	cands, err := ts.Candidates(cctx, e.cfg.Name)
	e.recordCall("candidates", start, err)
	if err != nil {
		return Candidate{}, fmt.Errorf("leader: transfer %q: listing candidates: %w", e.cfg.Name, err)
	}
	c, err := chooseSuccessor(cands, e.cfg.ID, e.cand.Token, to, above)
	if err != nil {
		return Candidate{}, fmt.Errorf("leader: transfer %q: %w", e.cfg.Name, err)
	}
	return c, nil
}

// consider decides on a request to hand over that a renewal of tenure t,
// led since elected, reported. It returns the handover to make, or nil to
// lead on: a request for a priority handover before MinTenure, or when no
// candidate's priority is above this instance's, waits (it lapses unless
// asked again); a request that no candidate fits is cleared, so that its
// requester learns at once.
func (e *Elector) consider(ctx context.Context, ts Transferer, t *tenure, req TransferRequest, elected time.Time) *handoff {
	if req.Reason == GrantPriority {
		if time.Since(elected) < e.cfg.MinTenure {
			return nil
		}
		to, err := e.successor(ctx, ts, "", &e.cfg.Priority)
		if err != nil {
			e.log.Debug("not handing over for priority", slog.Any("error", err))
			return nil
		}
		return &handoff{to: to, reason: GrantPriority}
	}
	to, err := e.successor(ctx, ts, req.To, nil)
	if err == nil {
		return &handoff{to: to, reason: GrantTransfer}
	}
	e.log.Warn("declining a request to hand over", slog.Uint64("term", t.term), slog.Any("error", err))
	if errors.Is(err, ErrNoCandidate) {
		start := time.Now()
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.cfg.RenewInterval)
		defer cancel()
		_, err := ts.RequestTransfer(cctx, e.cfg.Name, TransferRequest{}, 0)
		e.recordCall("request_transfer", start, err)
	}
	return nil
}

// releaseTo releases the lease of term reserved for h.to, for reserveFor,
// best effort: if it fails the lease simply runs out. It commits h's
// prepared handover if there is one (see HandoverPreparer). It answers
// h.call, if any.
func (e *Elector) releaseTo(ctx context.Context, ts Transferer, term uint64, h *handoff) bool {
	start := time.Now()
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.cfg.RenewInterval)
	defer cancel()
	var err error
	if h.prepared != nil {
		err = h.prepared.Commit(rctx, h.reason, e.reserveFor())
		if err != nil && !errors.Is(err, ErrLeaseLost) && rctx.Err() == nil {
			// Failed before its release was answered (a broken
			// connection, say): hand over as usual. The release is
			// judged on the token and term, so a release that did
			// commit makes this one fail, and nothing else.
			e.log.Debug("committing the prepared handover failed; handing over without it", slog.Any("error", err))
			err = ts.ReleaseTo(rctx, e.cfg.Name, e.cand.Token, term, h.to, h.reason, e.reserveFor())
		}
	} else {
		err = ts.ReleaseTo(rctx, e.cfg.Name, e.cand.Token, term, h.to, h.reason, e.reserveFor())
	}
	e.recordCall("release", start, err)
	if h.call != nil {
		out := transferOutcome{term: term, successor: h.to}
		if err != nil {
			out.err = fmt.Errorf("leader: transfer %q: handing term %d to %s: %w", e.cfg.Name, term, h.to.ID, err)
		}
		h.call.done <- out
	}
	if err != nil {
		e.log.Warn("handing over failed; the lease will run out by itself", slog.Uint64("term", term), slog.String("successor", h.to.ID), slog.Any("error", err))
		return false
	}
	e.log.Info("handed over", slog.Uint64("term", term), slog.String("successor", h.to.ID), slog.String("reason", string(h.reason)))
	return true
}
