package leader

import (
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"time"
)

// follow campaigns until this instance is granted the lease (ok true) or ctx
// ends (ok false). It tries at once, then at the expiry the store reported,
// or when the store signals a change, never before notBefore.
func (e *Elector) follow(ctx context.Context, wake *<-chan struct{}, notBefore time.Time) (lease Lease, sent time.Time, ok bool) {
	timer := time.NewTimer(time.Until(notBefore))
	defer timer.Stop()
	failures := 0
	for {
		select {
		case <-ctx.Done():
			return Lease{}, time.Time{}, false
		case _, open := <-*wake:
			if !open {
				*wake = nil
				continue
			}
			if time.Now().Before(notBefore) {
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
			return Lease{}, time.Time{}, false
		case err != nil:
			failures++
			level := slog.LevelWarn
			if failures > 1 {
				level = slog.LevelDebug // said once per outage
			}
			if errors.Is(err, ErrReadOnly) {
				e.log.Log(ctx, level, "store is read-only (for example a replica); cannot campaign", slog.Any("error", err))
			} else {
				e.log.Log(ctx, level, "acquire failed", slog.Any("error", err), slog.Int("failures", failures))
			}
			wait = e.cfg.RetryInterval + e.jitter()
		case granted:
			if ctx.Err() != nil {
				e.release(ctx, lease.Term)
				return Lease{}, time.Time{}, false
			}
			if time.Since(sent) >= e.cfg.TTL-e.cfg.DriftMargin-e.cfg.StopGrace {
				// Granted, but the answer came too late to lead safely.
				e.log.Warn("acquire answered too late to lead; releasing", slog.Duration("took", time.Since(sent)))
				e.release(ctx, lease.Term)
				wait = e.cfg.RetryInterval
				break
			}
			return lease, sent, true
		default:
			if failures > 0 {
				e.log.Info("store reachable again")
			}
			failures = 0
			e.observe(lease)
			if lease.Held() {
				wait = lease.Remaining + e.expiryLag() + e.jitter()
			} else {
				wait = e.cfg.RetryInterval + e.jitter() // lost a race for a free lease
			}
		}
		if w := time.Until(notBefore); w > wait {
			wait = w
		}
		timer.Reset(wait)
	}
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
