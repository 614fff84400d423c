package leader

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/leaderelect/leader/internal/wallclock"
)

// Errors returned by the Elector.
var (
	// ErrNotLeader is returned by Resign and RunIfLeader when this instance
	// does not lead at the moment, and by Check.
	ErrNotLeader = errors.New("leader: not the leader")

	// ErrAlreadyRunning is returned by Run while another call to Run on the
	// same Elector has not returned.
	ErrAlreadyRunning = errors.New("leader: Run already running")
)

// Status is a snapshot of what an Elector knows.
type Status struct {
	// Name is the election name.
	Name string `json:"name"`
	// ID is this instance's candidate ID.
	ID string `json:"id"`
	// IsLeader reports whether this instance leads now.
	IsLeader bool `json:"is_leader"`
	// Leader is the candidate ID of the leader as last observed, or "" when
	// there is none or it is not known.
	Leader string `json:"leader"`
	// Term is the fencing term of the observed leader's grant.
	Term uint64 `json:"term"`
	// AcquiredAt is when the observed leader was granted the lease, on the
	// store's clock. Times not known are zero (and left out of JSON).
	AcquiredAt time.Time `json:"acquired_at,omitzero"`
	// ExpiresAt is when the observed leader's lease runs out unless renewed,
	// on the store's clock, as last reported.
	ExpiresAt time.Time `json:"expires_at,omitzero"`
	// LastContact is when a store call last succeeded, on this host's clock;
	// zero before the first. Health checks can compare it with the TTL.
	LastContact time.Time `json:"last_contact,omitzero"`
	// StopAt, while this instance leads, is when it will stop leading
	// unless a renewal succeeds first: its local deadline minus StopGrace.
	// It is read on this process's monotonic clock: compare it only with
	// time.Now or time.Until in this process. Zero when not leading. A
	// supervisor of leader work can use it as a dead-man's switch.
	StopAt time.Time `json:"-"`
}

// Elector campaigns for one name on a Store, leads while it holds the lease,
// and campaigns again after each loss. See the package documentation for the
// state machine and the timing argument.
//
// The zero value is not usable; create Electors with New. An Elector's
// methods are safe for concurrent use.
type Elector struct {
	cfg   Config
	store Store
	cand  Candidate
	log   *slog.Logger

	resignCh chan resignRequest // Resign -> lead loop
	pubCh    chan Status        // latest status for OnNewLeader, capacity 1

	mu        sync.Mutex
	running   bool
	status    Status
	leaderCtx context.Context // non-nil while leading
	published leaderKey       // last observed leader given to OnNewLeader
}

// leaderKey identifies one observed leadership for change detection.
type leaderKey struct {
	id   string
	term uint64
}

// New returns an Elector for cfg on store, or a *ConfigError if cfg breaks a
// rule. Nothing starts until Run.
func New(store Store, cfg Config) (*Elector, error) {
	if store == nil {
		return nil, errors.New("leader: New: store is nil")
	}
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	token, err := newToken()
	if err != nil {
		return nil, fmt.Errorf("leader: New: making instance token: %w", err)
	}
	e := &Elector{
		cfg:      cfg,
		store:    store,
		cand:     Candidate{ID: cfg.ID, Token: token},
		log:      cfg.Logger.With(slog.String("election", cfg.Name), slog.String("id", cfg.ID)),
		resignCh: make(chan resignRequest),
		pubCh:    make(chan Status, 1),
	}
	e.status = Status{Name: cfg.Name, ID: cfg.ID}
	return e, nil
}

func newToken() (string, error) {
	var b [16]byte
	if _, err := crand.Read(b[:]); err != nil {
		return "", err
	}
	return hex.EncodeToString(b[:]), nil
}

// Config returns the Elector's configuration with its defaults filled in.
func (e *Elector) Config() Config { return e.cfg }

// IsLeader reports whether this instance leads now. It turns false before the
// leader context is cancelled.
func (e *Elector) IsLeader() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.status.IsLeader
}

// Status returns a snapshot of what the Elector knows.
func (e *Elector) Status() Status {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.status
}

// Check returns nil if this instance leads now and ErrNotLeader otherwise.
// Its signature matches the distributed-elector interfaces of job schedulers
// such as gocron (IsLeader(context.Context) error); see GocronElector.
func (e *Elector) Check(context.Context) error {
	if e.IsLeader() {
		return nil
	}
	return ErrNotLeader
}

// RunIfLeader calls fn only if this instance leads now, and returns
// ErrNotLeader otherwise. fn's context is cancelled when ctx ends or
// leadership is lost, whichever comes first, and carries the term (see
// TermFrom). RunIfLeader returns fn's error.
func (e *Elector) RunIfLeader(ctx context.Context, fn func(ctx context.Context) error) error {
	e.mu.Lock()
	lctx := e.leaderCtx
	e.mu.Unlock()
	if lctx == nil || lctx.Err() != nil {
		return ErrNotLeader
	}
	term, _ := TermFrom(lctx)
	fctx, cancel := context.WithCancelCause(withTerm(ctx, term))
	defer cancel(nil)
	stop := context.AfterFunc(lctx, func() { cancel(context.Cause(lctx)) })
	defer stop()
	return fn(fctx)
}

// Resign steps down now if this instance leads: IsLeader turns false, the
// leader context is cancelled and OnDemoted runs; then Resign returns. The
// lease is released, so that another instance takes over at once, as soon as
// OnElected has returned too; so Resign may be called from OnElected. The
// Elector keeps campaigning, but sits out for one RetryInterval first so that
// the others get the lease (as it does after every loss). Resign returns
// ErrNotLeader if this instance does not lead, and ctx.Err() if ctx ends
// first (stepping down then still completes in the background).
func (e *Elector) Resign(ctx context.Context) error {
	e.mu.Lock()
	lctx := e.leaderCtx
	e.mu.Unlock()
	if lctx == nil {
		return ErrNotLeader
	}
	req := resignRequest{leader: lctx, done: make(chan error, 1)}
	select {
	case e.resignCh <- req:
	case <-lctx.Done():
		return ErrNotLeader
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case err := <-req.done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// resignRequest asks the lead loop to step down from the leadership whose
// context is leader (and no later one); done receives the outcome.
type resignRequest struct {
	leader context.Context
	done   chan error
}

// Run campaigns, leads and campaigns again after each loss, until ctx ends.
// Then, if leading, it cancels the leader context, calls OnDemoted, waits for
// OnElected to return, lets a renewal in flight finish (for at most
// RenewInterval), releases the lease so another instance takes over at
// once, and returns nil. It returns ErrAlreadyRunning if called while another
// Run on this Elector is running.
func (e *Elector) Run(ctx context.Context) error {
	e.mu.Lock()
	if e.running {
		e.mu.Unlock()
		return ErrAlreadyRunning
	}
	e.running = true
	e.mu.Unlock()
	defer func() {
		e.mu.Lock()
		e.running = false
		e.mu.Unlock()
	}()

	var wg sync.WaitGroup
	defer wg.Wait()
	bgCtx, stopBg := context.WithCancel(ctx)
	defer stopBg()

	if e.cfg.OnNewLeader != nil {
		wg.Go(func() { e.publishLoop(bgCtx) })
	}
	// The watch ends when Run returns, after the release, not when ctx
	// does: a store may cut a watch's blocking statement short as it ends
	// (an advisory store's lock waiter, waiting on this leader's own mark,
	// at the cost of a cancel request and a new server process), and that
	// would run beside the release, on the server the successor waits for.
	watchCtx, stopWatch := context.WithCancel(context.WithoutCancel(ctx))
	defer stopWatch()
	var (
		wake <-chan struct{}
		err  error
	)
	if fw, ok := e.store.(FreeWatcher); ok {
		wake, err = fw.WatchFree(watchCtx, e.cfg.Name)
	} else {
		wake, err = e.store.Watch(watchCtx, e.cfg.Name)
	}
	if err != nil {
		e.log.Warn("store wake-ups unavailable; followers will wait for lease expiry", slog.Any("error", err))
		wake = nil
	}

	e.log.Info("campaigning", slog.Duration("ttl", e.cfg.TTL), slog.Duration("renew_interval", e.cfg.RenewInterval))
	var notBefore time.Time
	for {
		lease, sent, ok := e.follow(ctx, &wake, notBefore)
		if !ok {
			e.log.Info("stopped")
			return nil
		}
		// After any loss, sit out one RetryInterval: a healthy candidate,
		// woken by the release, gets the lease first, and an instance whose
		// renewals fail does not win it straight back.
		e.lead(ctx, lease, sent)
		notBefore = time.Now().Add(e.cfg.RetryInterval)
	}
}

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

// observe records a lease held by someone else (or by no one).
func (e *Elector) observe(l Lease) {
	e.mu.Lock()
	e.status.Leader = l.HolderID
	e.status.Term = l.Term
	e.status.AcquiredAt = l.AcquiredAt
	e.status.ExpiresAt = l.ExpiresAt
	if !l.Held() {
		e.status.Leader = ""
	}
	e.mu.Unlock()
	e.publish()
}

// tenure is one leadership of an Elector, from its grant to its loss.
type tenure struct {
	e       *Elector
	term    uint64
	lctx    context.Context // the leader context
	cancel  context.CancelCauseFunc
	stopped chan struct{} // closed once the stop point has ended leadership
	failed  chan error    // capacity 1: a renewal outcome that ends the tenure
	timer   *time.Timer   // fires at the stop point

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
		e.status.LastContact = contact
		e.mu.Unlock()
		return
	}
	t.deadline = sent.Add(e.cfg.TTL - e.cfg.DriftMargin)
	t.stopAt = t.deadline.Add(-e.cfg.StopGrace)
	t.timer.Reset(time.Until(t.stopAt))
	recovered := t.lastErr != nil
	t.lastErr = nil
	e.mu.Lock()
	e.status.LastContact = contact
	if e.leaderCtx == t.lctx {
		e.status.ExpiresAt = l.ExpiresAt
		e.status.StopAt = t.stopAt
	}
	e.mu.Unlock()
	t.mu.Unlock()
	if recovered {
		e.log.Info("renewed again after failures", slog.Uint64("term", t.term))
	}
}

// unreachable returns conn_lost or error, for a stop point reached after
// failed renewals.
func (t *tenure) unreachable() (LossReason, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.lastErr != nil && !errors.Is(t.lastErr, context.DeadlineExceeded) && !errors.Is(t.lastErr, ErrUnavailable) {
		return LossError, t.lastErr
	}
	return LossConnLost, t.lastErr
}

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
	e.cfg.Metrics.StatusChanged(e.cfg.Name, true)
	e.log.Info("elected", slog.Uint64("term", term), slog.Time("expires_at", lease.ExpiresAt))
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
			reason = stop(LossShutdown)
			break loop
		case req := <-e.resignCh:
			if req.leader != lctx {
				req.done <- ErrNotLeader // meant for a leadership already over
				continue
			}
			reason, resigned = stop(LossResigned), req.done
			break loop
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
			if errors.Is(err, ErrLeaseLost) {
				reason = stop(LossExpired)
				e.log.Error("lease lost: the store no longer has it held by this instance; stepped down",
					slog.Uint64("term", term), slog.Any("error", err))
			} else {
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

	// Leadership has ended: IsLeader is false and the leader context is
	// cancelled. Now OnDemoted runs, then OnElected is awaited; only then is
	// the lease released, so work never overlaps the next leader's after a
	// handover.
	e.cfg.Metrics.StatusChanged(e.cfg.Name, false)
	e.cfg.Metrics.Lost(e.cfg.Name, reason)
	e.log.Info("demoted", slog.Uint64("term", term), slog.String("reason", string(reason)))
	if e.cfg.OnDemoted != nil {
		e.cfg.OnDemoted()
	}
	if resigned != nil {
		// Resign returns now, not after the release below: the release
		// waits for OnElected, which may itself be the caller of Resign.
		resigned <- nil
	}
	e.awaitElected(electedDone, deadline)
	// Not ours to release, or the store refuses writes.
	releasing := !released && reason != LossExpired && reason != LossError
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
	if time.Now().After(deadline) && reason != LossExpired {
		e.log.Error("leader work stopped after the local deadline; another instance may have started before it ended",
			slog.Uint64("term", term))
	}

	switch {
	case !releasing:
		e.observe(Lease{Name: e.cfg.Name})
	default:
		if e.release(ctx, term) {
			e.observe(Lease{Name: e.cfg.Name, Term: term})
		}
	}
	return reason
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

func (e *Elector) recordCall(op string, start time.Time, err error) {
	e.cfg.Metrics.StoreCall(e.cfg.Name, op, time.Since(start), err)
	if err == nil {
		e.mu.Lock()
		e.status.LastContact = wallclock.Now()
		e.mu.Unlock()
	}
}

// publish hands the current status to the OnNewLeader goroutine if the
// observed leader changed. Only Run's goroutine calls it.
func (e *Elector) publish() {
	if e.cfg.OnNewLeader == nil {
		return
	}
	e.mu.Lock()
	st := e.status
	key := leaderKey{id: st.Leader, term: st.Term}
	if st.Leader == "" {
		key.term = 0
	}
	changed := key != e.published
	e.published = key
	e.mu.Unlock()
	if !changed {
		return
	}
	select {
	case <-e.pubCh: // drop the stale one; the reader gets the latest
	default:
	}
	e.pubCh <- st
}

func (e *Elector) publishLoop(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case st := <-e.pubCh:
			e.cfg.OnNewLeader(st)
		}
	}
}

type termKey struct{}

func withTerm(ctx context.Context, term uint64) context.Context {
	return context.WithValue(ctx, termKey{}, term)
}

// TermFrom returns the fencing term carried by a leader context (the ctx
// given to OnElected or to RunIfLeader's fn), and false for any other ctx.
// The term grows with every grant of the name; guard writes downstream with it
// (for example "UPDATE ... WHERE fencing_term <= $term") so that a deposed
// leader's late writes are refused.
func TermFrom(ctx context.Context) (uint64, bool) {
	t, ok := ctx.Value(termKey{}).(uint64)
	return t, ok
}
