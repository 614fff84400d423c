package leader

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"
)

// errStopped is follow's error when ctx ended.
var errStopped = errors.New("leader: stopped")

// maxPermanentBackoff bounds the wait between a follower's attempts while
// the store refuses them with ErrPermanent (see retryWait).
const maxPermanentBackoff = time.Minute

// follow campaigns until this instance is granted the lease (err nil) or ctx
// ends (errStopped). It tries at once, then at the expiry the store
// reported, or when the store signals a change, never before notBefore.
// Before any store call of this Elector has succeeded, it gives up with an
// error wrapping ErrPermanent when the store refuses an attempt with one, or
// has answered every attempt for a TTL with ErrReadOnly.
func (e *Elector) follow(ctx context.Context, wake *<-chan struct{}, notBefore time.Time) (lease Lease, sent time.Time, err error) {
	timer := time.NewTimer(time.Until(notBefore))
	defer timer.Stop()
	failures := 0
	var readOnlySince time.Time // the first of an unbroken run of ErrReadOnly, before any contact
	// On a store that can hand leases over, a follower is among the
	// candidates, so that a leader can pick it as its successor. Each
	// attempt the store refuses enlists it (see Transferer), so it calls
	// Enlist only when its attempts are further apart than its entry can
	// bear: when it was last enlisted over 1.5 TTL ago, looked at every
	// TTL/2, so that its entry (EnlistFactor TTLs) never runs out. Until
	// an attempt has been answered without an error it does not enlist,
	// so that an Enlist that succeeds does not count as contact before
	// an Acquire that the store refuses for good (Run must then return
	// that refusal at once). After a tenure it enlists half a
	// RetryInterval in, while it sits out (the lease may be handed back
	// to it meanwhile), away from the handover it just made.
	ts, _ := e.store.(Transferer)
	var enlist *time.Timer
	var enlistC <-chan time.Time // nil unless ts is
	var enlistedAt time.Time     // by this campaign; zero before
	enlisting := ts != nil && e.contacted()
	if ts != nil {
		enlist = time.NewTimer(e.cfg.RetryInterval / 2)
		if !enlisting {
			enlist.Stop()
		}
		defer enlist.Stop()
		enlistC = enlist.C
	}
	for {
		select {
		case <-ctx.Done():
			return Lease{}, time.Time{}, errStopped
		case <-enlistC:
			if time.Since(enlistedAt) > e.cfg.TTL*3/2 && e.enlist(ctx, ts) {
				enlistedAt = time.Now()
			}
			enlist.Reset(e.cfg.TTL / 2)
			continue
		case _, open := <-*wake:
			if !open {
				*wake = nil
				continue
			}
			if time.Now().Before(notBefore) && !e.preparedForUs() && !e.reservedForUs(ctx) {
				continue // our own release; let the others take it
			}
			timer.Stop()
		case <-timer.C:
		}

		sent = time.Now()
		// The attempt is not cut short when ctx ends, only by its timeout:
		// a write cancelled on the client may still commit on the server,
		// granting the lease to an instance that has gone, and nobody would
		// lead until it ran out. Finished, a grant is released below.
		callCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.cfg.RenewInterval)
		lease, granted, err := e.store.Acquire(callCtx, e.cfg.Name, e.cand, e.cfg.TTL)
		cancel()
		e.recordCall("acquire", sent, err)

		var wait time.Duration
		switch {
		case err != nil && ctx.Err() != nil:
			return Lease{}, time.Time{}, errStopped
		case err != nil:
			failures++
			permanent := errors.Is(err, ErrPermanent)
			if !e.contacted() {
				if permanent {
					return Lease{}, time.Time{}, err
				}
				if !errors.Is(err, ErrReadOnly) {
					readOnlySince = time.Time{}
				} else if readOnlySince.IsZero() {
					readOnlySince = sent
				} else if time.Since(readOnlySince) >= e.cfg.TTL {
					return Lease{}, time.Time{}, fmt.Errorf("%w: the store has refused every write as read-only for %v, and no call has succeeded since Run started (a standby, or a read-only database or role?): give a connection string that reaches a writable primary (with PostgreSQL, target_session_attrs=read-write): %w",
						ErrPermanent, time.Since(readOnlySince).Round(time.Millisecond), err)
				}
			}
			level := slog.LevelWarn
			switch {
			case permanent:
				level = slog.LevelError // said at every attempt, which backs off
			case failures > 1:
				level = slog.LevelDebug // said once per outage
			}
			if errors.Is(err, ErrReadOnly) {
				e.log.Log(ctx, level, "store is read-only (for example a replica); cannot campaign", slog.Any("error", err))
			} else {
				e.log.Log(ctx, level, "acquire failed", slog.Any("error", err), slog.Int("failures", failures))
			}
			wait = e.retryWait(permanent, failures)
		case granted:
			if ctx.Err() != nil {
				e.release(ctx, lease.Term)
				return Lease{}, time.Time{}, errStopped
			}
			if time.Since(sent) >= e.cfg.TTL-e.cfg.DriftMargin-e.cfg.StopGrace {
				// Granted, but the answer came too late to lead safely.
				e.log.Warn("acquire answered too late to lead; releasing", slog.Duration("took", time.Since(sent)))
				e.release(ctx, lease.Term)
				wait = e.cfg.RetryInterval
				break
			}
			return lease, sent, nil
		default:
			if failures > 0 {
				e.log.Info("store reachable again")
			}
			failures = 0
			e.observe(lease)
			if ts != nil {
				enlistedAt = sent // the refused attempt enlisted
				if !enlisting {
					enlisting = true
					enlist.Reset(e.cfg.TTL / 2)
				}
			}
			switch {
			case lease.Held():
				wait = lease.Remaining + e.expiryLag() + e.jitter()
				if ts != nil {
					e.askToYield(ctx, ts, lease)
				}
			case lease.Reserved > 0:
				// Handed over to another candidate, which takes it
				// at once; if it does not, it is free once the
				// reservation has run out.
				wait = lease.Reserved + e.expiryLag() + e.jitter()
			default:
				wait = e.cfg.RetryInterval + e.jitter() // lost a race for a free lease
			}
		}
		if w := time.Until(notBefore); w > wait {
			wait = w
		}
		timer.Reset(wait)
	}
}

// preparedForUs reports whether the store says that a handover of the
// name was prepared for this instance (see PreparedForChecker).
func (e *Elector) preparedForUs() bool {
	pc, ok := e.store.(PreparedForChecker)
	return ok && pc.PreparedFor(e.cfg.Name, e.cand)
}

// reservedForUs reports whether name's lease is free and reserved for a
// candidate with this instance's ID: handed over to it (see
// Transferer.ReleaseTo), which it takes at once even while it sits out
// after a loss of its own; the store's Acquire then decides by token. It
// asks the store once, and says false if the store cannot tell.
func (e *Elector) reservedForUs(ctx context.Context) bool {
	if _, ok := e.store.(Transferer); !ok {
		return false
	}
	start := time.Now()
	cctx, cancel := context.WithTimeout(ctx, e.cfg.RenewInterval)
	defer cancel()
	l, err := e.store.Observe(cctx, e.cfg.Name)
	e.recordCall("observe", start, err)
	return err == nil && !l.Held() && l.Reserved > 0 && l.Successor == e.cfg.ID
}

// retryWait is how long a follower waits after its failures-th failed
// attempt in a row: RetryInterval, or, while the store refuses with
// ErrPermanent, RetryInterval doubled at each failure up to
// maxPermanentBackoff (never below RetryInterval), since a person must
// mend the cause first. Both with jitter.
func (e *Elector) retryWait(permanent bool, failures int) time.Duration {
	wait := e.cfg.RetryInterval
	if permanent {
		limit := max(maxPermanentBackoff, e.cfg.RetryInterval)
		for i := 1; i < failures && wait < limit; i++ {
			wait *= 2
		}
		wait = min(wait, limit)
	}
	return wait + e.jitter()
}

// expiryLag is how long after a reported expiry a follower tries. The
// leader's renewals fall on a grid whose period divides the TTL by default,
// so the expiry a follower learned is also when the leader renews: an
// attempt that reached the store just before that renewal would find the
// lease still held for an instant, and have to try again. Waiting a little
// longer than a renewal takes makes one attempt per TTL the rule.
func (e *Elector) expiryLag() time.Duration {
	return min(e.cfg.RenewInterval/10, 25*time.Millisecond)
}

// jitter spreads followers' attempts a little so they do not all hit the
// store at the same instant.
func (e *Elector) jitter() time.Duration {
	return time.Duration(rand.Int64N(int64(min(e.cfg.RetryInterval/10, 50*time.Millisecond)) + 1))
}
