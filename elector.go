package leader

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
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
	// Problem is the last store error while it lasts, if it wraps
	// ErrPermanent (a misconfiguration that retrying alone will not mend:
	// see ErrPermanent); "" otherwise, and again after the next store call
	// that succeeds. leaderhttp's /healthz reports it.
	Problem string `json:"problem,omitempty"`
	// Reason says why the observed leader was granted the lease: how
	// leadership last moved (see GrantReason). Empty for a first grant,
	// and where the store does not record it.
	Reason GrantReason `json:"reason,omitempty"`
	// Transfer is a pending request that the observed leader hand over,
	// as last observed (see RequestTransfer); zero when there is none.
	Transfer TransferRequest `json:"transfer,omitzero"`
	// Successor is the candidate ID that a lease handed over is reserved
	// for until it takes it; "" otherwise.
	Successor string `json:"successor,omitempty"`
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

	resignCh   chan resignRequest // Resign -> lead loop
	transferCh chan transferCall  // Transfer -> lead loop
	pubCh      chan Status        // latest status for OnNewLeader, capacity 1

	mu        sync.Mutex
	running   bool
	status    Status
	leaderCtx context.Context // non-nil while leading
	published leaderKey       // last observed leader given to OnNewLeader

	// refused says that the last tenure ended because the store refused
	// its renewals with ErrPermanent, and refusals counts such tenures in
	// a row (see holdOff). Only Run's goroutine uses them.
	refused  bool
	refusals int
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
		cfg:        cfg,
		store:      store,
		cand:       Candidate{ID: cfg.ID, Token: token, Priority: cfg.Priority},
		log:        cfg.Logger.With(slog.String("election", cfg.Name), slog.String("id", cfg.ID)),
		resignCh:   make(chan resignRequest),
		transferCh: make(chan transferCall),
		pubCh:      make(chan Status, 1),
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
//
// Run returns an error wrapping ErrPermanent at once if the store refuses
// the first calls for a reason that retrying will not mend (a wrong
// password, an unknown database, tables never migrated, missing
// privileges, or a server read-only for a whole TTL) before any store call
// of this Elector has succeeded. After one has, such errors are logged at
// ERROR, shown in Status.Problem and retried with backoff (see
// ErrPermanent). Every other store error is retried.
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
	switch w := e.store.(type) {
	case HandoverWatcher:
		wake, err = w.WatchFreeFor(watchCtx, e.cfg.Name, e.cand)
	case FreeWatcher:
		wake, err = w.WatchFree(watchCtx, e.cfg.Name)
	default:
		wake, err = e.store.Watch(watchCtx, e.cfg.Name)
	}
	if err != nil {
		e.log.Warn("store wake-ups unavailable; followers will wait for lease expiry", slog.Any("error", err))
		wake = nil
	}

	if ts, ok := e.store.(Transferer); ok {
		// Leave the candidates at the end, so that nobody picks this
		// instance as a successor any longer.
		defer e.withdraw(ctx, ts)
	}
	e.log.Info("campaigning", slog.Duration("ttl", e.cfg.TTL), slog.Duration("renew_interval", e.cfg.RenewInterval))
	var notBefore time.Time
	for {
		lease, sent, err := e.follow(ctx, &wake, notBefore)
		if errors.Is(err, errStopped) {
			e.log.Info("stopped")
			return nil
		}
		if err != nil {
			e.log.Error("cannot campaign: the store is misconfigured", slog.Any("error", err))
			return err
		}
		// After any loss, sit out one RetryInterval: a healthy candidate,
		// woken by the release, gets the lease first, and an instance whose
		// renewals fail does not win it straight back.
		e.lead(ctx, lease, sent)
		notBefore = time.Now().Add(e.holdOff())
	}
}

// observe records a lease held by someone else (or by no one).
func (e *Elector) observe(l Lease) {
	e.mu.Lock()
	e.status.Leader = l.HolderID
	e.status.Term = l.Term
	e.status.AcquiredAt = l.AcquiredAt
	e.status.ExpiresAt = l.ExpiresAt
	e.status.Reason = l.Reason
	e.status.Transfer = l.Transfer
	e.status.Successor = l.Successor
	if !l.Held() {
		e.status.Leader = ""
	}
	e.mu.Unlock()
	e.publish()
}

func (e *Elector) recordCall(op string, start time.Time, err error) {
	e.cfg.Metrics.StoreCall(e.cfg.Name, op, time.Since(start), err)
	switch {
	case err == nil:
		e.mu.Lock()
		e.contactLocked(wallclock.Now())
		e.mu.Unlock()
	case errors.Is(err, ErrPermanent):
		e.mu.Lock()
		e.status.Problem = err.Error()
		e.mu.Unlock()
	}
}

// contactLocked records a store call that succeeded, answered at (on the
// wall clock): the store is in touch, and no longer refuses. e.mu is held.
func (e *Elector) contactLocked(at time.Time) {
	e.status.LastContact = at
	e.status.Problem = ""
}

// contacted reports whether a store call of this Elector has succeeded.
func (e *Elector) contacted() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return !e.status.LastContact.IsZero()
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
